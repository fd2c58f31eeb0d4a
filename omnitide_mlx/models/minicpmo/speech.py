"""Spoken output of MiniCPM-o 4.5: the TTS (``model.tts``, tts.py) plus StepAudio2's token2wav and its voices,
loaded on demand from the checkpoint folder, so a text-only user pays nothing for them.

The released folder keeps token2wav in ``assets/token2wav/`` (where the official ``init_tts`` looks for it):
``flow.yaml`` with ``flow.pt`` / ``hift.pt`` (the minicpmo-utils 1.0.6 layout the release ships; a 1.0.7 folder adds
``config.yaml`` and ``hift_original.pt``), read as ``.safetensors`` (``omnitide convert --token2wav DIR``) or as the
``.pt`` files with torch's tensors-only loader (stepaudio2/weights.py). A voice is a prompt prepared once (``voice.safetensors``: prompt
speech tokens, the prompt's 24 kHz mel, a CAMPPlus speaker embedding; see ``stepaudio2/token2wav.py`` for why it is
not computed from a wav here). ``speaker`` names one: ``None`` or ``"default"`` -> ``voice.safetensors``, ``NAME`` ->
``voices/NAME.safetensors``, or a path to a ``.safetensors`` voice file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..qwen2_5_omni.speech import SpeechUnavailable
from ..stepaudio2.token2wav import SAMPLE_RATE, Token2Wav, Voice
from .tts import MiniCPMTTS

TOKEN2WAV_DIR = Path("assets") / "token2wav"
DEFAULT_VOICE = "default"

# streaming_generate's fixed settings (modeling_minicpmo.py at 28b60cf): the LLM's text chunk, the silence tokens put
# before a reply's speech tokens, token2wav's window (25 fresh tokens + 3 of lookahead, the window moving by 25)
TEXT_CHUNK = 10
SILENCE_TOKEN = 4218
SILENCE_PREFIX = 3
T2W_CHUNK = 25


@dataclass
class MiniCPMSpeech:
    """The TTS, token2wav and the voices of one checkpoint."""

    tts: MiniCPMTTS
    token2wav: Token2Wav
    folder: Path  # the token2wav folder
    _voices: dict[str, Voice] = field(default_factory=dict, repr=False)

    sample_rate = SAMPLE_RATE
    default_speaker = DEFAULT_VOICE

    @property
    def speakers(self) -> list[str]:
        names = [DEFAULT_VOICE] if (self.folder / "voice.safetensors").is_file() else []
        return names + sorted(p.stem for p in (self.folder / "voices").glob("*.safetensors"))

    def voice(self, name: str | None) -> Voice:
        """The voice ``name`` names (see the module docstring); ``ValueError`` naming the voices there are."""
        name = DEFAULT_VOICE if name is None else str(name)
        if name in self._voices:
            return self._voices[name]
        if name.endswith(".safetensors") or "/" in name:
            path = Path(name).expanduser()
        elif name == DEFAULT_VOICE:
            path = self.folder / "voice.safetensors"
        else:
            path = self.folder / "voices" / f"{name}.safetensors"
        if not path.is_file():
            have = ", ".join(self.speakers) or "none"
            raise ValueError(f"unknown speaker {name!r}: no voice file {path} (voices in {self.folder}: {have}; a "
                             "speaker may also be the path of a voice .safetensors)")
        self._voices[name] = Voice.load(path)
        return self._voices[name]


def load_minicpm_speech(model, checkpoint: str | Path | None, token2wav_version: str | None = None) -> MiniCPMSpeech:
    """``model``'s TTS and the checkpoint's ``assets/token2wav``; ``SpeechUnavailable`` saying what is missing.
    ``token2wav_version`` ("1.0.6" / "1.0.7", None: detected from the files) picks how token2wav runs."""
    tts = model.require_tts()
    if checkpoint is None:
        raise SpeechUnavailable("the model was not loaded from a checkpoint folder: no token2wav to speak with")
    folder = Path(checkpoint) / TOKEN2WAV_DIR
    if not folder.is_dir():
        raise SpeechUnavailable(f"the checkpoint has a TTS but no token2wav folder ({folder}): "
                                "text only (MiniCPM-o ships it as assets/token2wav)")
    from ..stepaudio2.weights import torch_available

    if not (folder / "flow.safetensors").is_file() and (folder / "flow.pt").is_file() and not torch_available():
        raise SpeechUnavailable(f"{folder} holds flow.pt / hift.pt only and torch is not installed: install torch "
                                f"(the .pt files are read with weights_only=True) or convert them once with "
                                f"`omnitide convert --token2wav {folder}` where torch is")
    return MiniCPMSpeech(tts, Token2Wav.load(folder, version=token2wav_version), folder)
