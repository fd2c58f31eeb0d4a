"""StepAudio2's Token2wav (MiniCPM-o 4.5's speech output, 24 kHz): flow mel model and the causal vocoder."""
