"""Voice activity detection: the Silero VAD ported to MLX (``silero``) and the utterance detector on top of it
(``detector``) that decides when the user starts and stops speaking; ``echo`` keeps the reply's own voice, heard
through a loudspeaker, from starting an utterance. docs/benchmarks.md, "Voice activity detection", compares the
detector with ``webrtcvad-wheels`` and ``pymicro-vad``."""

from omnitide_mlx.vad.detector import SpeechEvent, UtteranceDetector, VADConfig
from omnitide_mlx.vad.silero import SileroVAD

__all__ = ["SileroVAD", "SpeechEvent", "UtteranceDetector", "VADConfig"]
