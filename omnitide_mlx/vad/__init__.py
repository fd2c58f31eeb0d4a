"""Voice activity detection: the Silero VAD ported to MLX (``silero``) and the utterance detector on top of it
(``detector``) that decides when the user starts and stops speaking. docs/benchmarks.md, "Voice activity
detection", compares it with the WebRTC and microWakeWord detectors."""

from omnitide_mlx.vad.detector import SpeechEvent, UtteranceDetector, VADConfig
from omnitide_mlx.vad.silero import SileroVAD

__all__ = ["SileroVAD", "SpeechEvent", "UtteranceDetector", "VADConfig"]
