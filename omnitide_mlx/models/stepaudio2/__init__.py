"""StepAudio2 token2wav in MLX: MiniCPM-o 4.5's speech decoder (speech tokens at 25/s -> 24 kHz audio), streaming.

The references are ``stepaudio2`` from the PyPI package ``minicpmo-utils`` 1.0.6 (the layout the released MiniCPM-o
4.5 ships: original HiFT, no ``config.yaml``) and 1.0.7 (causal CosyVoice3 HiFT + ``config.yaml``); a folder is run
the way its own version does (token2wav.py). MiniCPM-o calls ``Token2wav(model_dir, float16=..., n_timesteps=...)``,
``set_stream_cache(prompt_wav)`` and ``stream(tokens, last_chunk=...)``.

- :mod:`.config`: ``FlowConfig`` and friends, read from the official ``flow.yaml`` without executing its tags;
- :mod:`.flow`: the flow-matching mel model (conformer encoder + DiT CFM), offline and streaming with the official
  caches and Token2wav's cache trimming;
- :mod:`.vocoder`: the causal CosyVoice3 HiFT vocoder (1.0.7) and the original HiFT with 1.0.6's overlap stream;
- :mod:`.weights`: ``NAME.safetensors``, or the released ``NAME.pt`` through ``torch.load(weights_only=True)``;
- :mod:`.token2wav`: ``Token2Wav``, flow + vocoder, offline ``__call__`` and ``start_stream(voice).push(...)``;
- :mod:`.tiny`: a tiny token2wav folder in the released layout, for tests.

Why not mlx-audio: mlx-audio 0.6.2 has an MLX StepAudio2 token2wav (``mlx_audio.codec.models.stepaudio2``), but it is
offline only (no streaming caches in its encoder or DiT, no causal CosyVoice3 vocoder), its modules are hard-coded
to the released sizes, and it pulls transformers, sounddevice and miniaudio. The streaming flow is therefore ported
here from the official code (mlx-audio was read for facts on the weight layout only).

Weights: the release ships ``flow.pt`` / ``hift.pt`` (torch state dicts). They are read with torch's tensors-only
loader where torch is installed; ``omnitide convert --token2wav DIR`` writes ``.safetensors`` next to them once, so
that no torch is needed afterwards.
"""
