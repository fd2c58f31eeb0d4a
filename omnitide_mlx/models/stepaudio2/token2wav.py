"""``Token2Wav``: StepAudio2 speech tokens (25/s) -> 24 kHz float32 audio in MLX, whole utterances or streamed.

Two official versions of ``stepaudio2.Token2wav`` (PyPI ``minicpmo-utils``) read two folder layouts, and this one
runs each folder the way its own version does (``version``: detected from the files, or given):

- **1.0.6** (``flow.yaml`` + ``flow`` + ``hift``; no ``config.yaml``): ``hift`` is the original non-causal HiFT.
  A stream is primed with the voice's prompt tokens plus three 4218 (silence) tokens; each chunk's mel is vocoded
  with the last 8 mel frames of the previous one and cross-faded over 3840 samples (``OverlapVocoder``); the
  conformer cache is trimmed packed (``trim_packed_conformer_cache``).
- **1.0.7** (``config.yaml`` + ``hift`` causal CosyVoice3 HiFT, ``hift_original`` for whole utterances): a stream is
  primed with the prompt tokens plus their first three; chunks go through the causal ``BoundedVocoder``; the
  conformer cache is unpacked, trimmed per rate and repacked (``trim_conformer_cache``).

The released ``openbmb/MiniCPM-o-4_5`` ships ``assets/token2wav`` with ``flow.yaml``, ``flow.pt`` and ``hift.pt``
only (the 1.0.6 layout: OpenBMB's own vLLM-Omni MiniCPM-o 4.5 code2wav stage lists exactly those three files and
loads ``hift.pt`` into the original ``HiFTGenerator`` with ``strict=True``), and the official demo code pins
``minicpmo-utils`` 1.0.6; so a folder without ``config.yaml`` is read as 1.0.6. Weights: ``NAME.safetensors``, or
the released ``NAME.pt`` where torch is installed (weights.py; ``torch.load(weights_only=True)`` only).

Streaming rules shared by both versions (``Token2wav.stream``):

- ``start_stream(voice)`` (``set_stream_cache``) primes the flow and resets the vocoder;
- ``push(tokens)`` takes the fresh tokens *followed by* ``pre_lookahead_len`` (3) lookahead tokens, which the next
  push sends again at its start (windows of 28 tokens every 25); a non-final push needs more than 3 tokens; after
  each chunk both attention caches are trimmed to the prompt plus 100 frames;
- ``push(tokens, last=True)`` sends the rest (no lookahead; the encoder pads it) and flushes the vocoder, an empty
  final push only flushes;
- the first push that yields audio, unless it is the final one, is preceded by 3840 samples (8 frames) of silence.

Audio comes back as float32 NumPy, unclipped (the official ``return_waveform=True``; its default clips and packs
int16). ``token2wav.set_stream_cache(voice)`` / ``token2wav.stream(tokens, last_chunk=...)`` mirror the official
method names on one current stream.

The voice prompt (``Voice``): prompt speech tokens, the prompt's 80-band mel at 24 kHz and a 192-value CAMPPlus
speaker embedding, read from ``voice.safetensors`` (keys ``prompt_tokens``, ``prompt_mel``, ``speaker_embedding``).
Computing them from a wav needs the S3 speech tokenizer (``speech_tokenizer_v2_25hz.onnx``) and CAMPPlus
(``campplus.onnx``), neither of which is ported: out of scope here, so a voice is prepared once with the official
code and saved.

Offline ``__call__`` runs the flow on the whole utterance and the original HiFT on all of its mel, as both versions
do. A 1.0.7 folder without ``hift_original`` (the tiny test folder) vocodes offline with the causal generator in one
pass instead; ``offline_vocoder`` says which ("original" or "causal").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..loading import CheckpointError
from .flow import (
    CausalMaskedDiffWithXvec, load_flow, trim_conformer_cache, trim_estimator_cache, trim_packed_conformer_cache,
)

SAMPLE_RATE = 24000
HOP_SAMPLES = 480
VOICE_KEYS = ("prompt_tokens", "prompt_mel", "speaker_embedding")
VERSIONS = ("1.0.6", "1.0.7")
SILENCE_TOKEN = 4218  # the s3tokenizer silence token 1.0.6 primes a stream with (three of them)


def detect_version(folder: str | Path) -> str:
    """The minicpmo-utils version a token2wav folder is laid out for: ``config.yaml`` (the causal vocoder's config)
    means 1.0.7, a folder with ``flow.yaml`` and without it 1.0.6."""
    folder = Path(folder)
    if not (folder / "flow.yaml").is_file():
        raise CheckpointError(f"{folder} has no flow.yaml: not a StepAudio2 token2wav folder")
    return "1.0.7" if (folder / "config.yaml").is_file() else "1.0.6"


@dataclass
class Voice:
    """A voice prompt: ``prompt_tokens`` (T,) int, ``prompt_mel`` (frames, 80) float32 at 24 kHz,
    ``speaker_embedding`` (192,) float32."""
    prompt_tokens: np.ndarray
    prompt_mel: np.ndarray
    speaker_embedding: np.ndarray

    def __post_init__(self):
        self.prompt_tokens = np.asarray(self.prompt_tokens).reshape(-1).astype(np.int64)
        self.prompt_mel = np.asarray(self.prompt_mel, dtype=np.float32)
        if self.prompt_mel.ndim == 3 and self.prompt_mel.shape[0] == 1:
            self.prompt_mel = self.prompt_mel[0]
        self.speaker_embedding = np.asarray(self.speaker_embedding, dtype=np.float32).reshape(-1)
        if self.prompt_tokens.size < 1:
            raise ValueError("a voice needs at least one prompt token")
        if self.prompt_mel.ndim != 2 or self.prompt_mel.shape[0] < 1:
            raise ValueError(f"prompt_mel must be (frames, mel bins), got {self.prompt_mel.shape}")

    @classmethod
    def load(cls, path: str | Path) -> "Voice":
        path = Path(path)
        if path.is_dir():
            path = path / "voice.safetensors"
        if not path.is_file():
            raise CheckpointError(f"no voice file at {path}")
        try:
            arrays = mx.load(str(path))
        except Exception as e:
            raise CheckpointError(f"{path} is not a readable safetensors file ({e})") from None
        missing = [k for k in VOICE_KEYS if k not in arrays]
        if missing:
            raise CheckpointError(f"{path} lacks {missing} (a voice holds {', '.join(VOICE_KEYS)})")
        return cls(*(np.asarray(arrays[k]) for k in VOICE_KEYS))

    def save(self, path: str | Path) -> None:
        from safetensors.numpy import save_file

        save_file({"prompt_tokens": self.prompt_tokens.astype(np.int32), "prompt_mel": self.prompt_mel,
                   "speaker_embedding": self.speaker_embedding}, str(path))


def _prompt(flow: CausalMaskedDiffWithXvec, voice: Voice) -> tuple[mx.array, mx.array, mx.array]:
    """Token2wav's prompt preparation: the mel padded (repeating its last frame) or cut to up_rate x tokens."""
    cfg = flow.cfg
    if voice.prompt_mel.shape[1] != cfg.output_size:
        raise ValueError(f"voice prompt_mel has {voice.prompt_mel.shape[1]} mel bins, the flow makes {cfg.output_size}")
    if voice.speaker_embedding.size != cfg.spk_embed_dim:
        raise ValueError(f"voice speaker_embedding has {voice.speaker_embedding.size} values, the flow expects "
                         f"{cfg.spk_embed_dim}")
    frames = voice.prompt_tokens.size * flow.up_rate
    mel = voice.prompt_mel[:frames]
    if mel.shape[0] < frames:
        mel = np.concatenate([mel, np.repeat(mel[-1:], frames - mel.shape[0], axis=0)])
    return (mx.array(voice.prompt_tokens.astype(np.int32))[None], mx.array(mel)[None],
            mx.array(voice.speaker_embedding)[None])


def priming_tokens(version: str, prompt_tokens: mx.array, flow: CausalMaskedDiffWithXvec) -> mx.array:
    """What ``set_stream_cache`` runs the flow on: the prompt tokens plus ``pre_lookahead_len`` (3) tokens of fake
    lookahead, three 4218 (silence) in 1.0.6, the prompt's first three in 1.0.7."""
    lookahead = flow.pre_lookahead_len
    if version == "1.0.6":
        if SILENCE_TOKEN >= flow.cfg.vocab_size:
            raise ValueError(f"1.0.6 primes a stream with {lookahead} silence tokens ({SILENCE_TOKEN}); this flow's "
                             f"vocabulary has {flow.cfg.vocab_size} tokens")
        return mx.concatenate([prompt_tokens, mx.full((1, lookahead), SILENCE_TOKEN, mx.int32)], axis=1)
    if prompt_tokens.shape[1] < lookahead:
        raise ValueError(f"the voice has {prompt_tokens.shape[1]} prompt tokens; the official setup appends its "
                         f"first {lookahead} as lookahead, so it needs at least {lookahead}")
    return mx.concatenate([prompt_tokens, prompt_tokens[:, :lookahead]], axis=1)


class Token2WavStream:
    """One streamed utterance: ``push(tokens, last=False) -> float32 samples``. Made by ``Token2Wav.start_stream``."""

    def __init__(self, owner: "Token2Wav", voice: Voice):
        from .vocoder import BoundedVocoder, OverlapVocoder

        self.owner = owner
        flow = owner.flow
        self.prompt_tokens, self.prompt_mel, self.spk = _prompt(flow, voice)
        fake = priming_tokens(owner.version, self.prompt_tokens, flow)
        self.vocoder = OverlapVocoder(owner.vocoder) if owner.version == "1.0.6" else BoundedVocoder(owner.vocoder)
        self.cache = flow.setup_cache(fake, self.prompt_mel, self.spk, owner.n_timesteps)
        self.first_chunk = True
        self.finished = False

    @property
    def prompt_frames(self) -> int:
        return self.prompt_mel.shape[1]

    def push(self, tokens, last: bool = False) -> np.ndarray:
        """Fresh tokens plus the 3 lookahead tokens (the final push: the remaining tokens, possibly none) -> the
        audio that became final, float32 (samples,)."""
        if self.finished:
            raise ValueError("this stream has had its final push; start a new stream for the next utterance")
        flow = self.owner.flow
        tokens = np.asarray(tokens.tolist() if isinstance(tokens, mx.array) else tokens, dtype=np.int64).reshape(-1)
        if not last and tokens.size <= flow.pre_lookahead_len:
            raise ValueError(f"a non-final push needs fresh tokens plus {flow.pre_lookahead_len} lookahead tokens "
                             f"(more than {flow.pre_lookahead_len}), got {tokens.size}")
        if tokens.size:
            mel, cache = flow.inference_chunk(tokens, self.spk, self.cache, last_chunk=last,
                                              n_timesteps=self.owner.n_timesteps)
            cache = trim_estimator_cache(cache, self.prompt_frames)
            if self.owner.version == "1.0.6":
                self.cache = trim_packed_conformer_cache(cache, self.prompt_frames)
            else:
                self.cache = trim_conformer_cache(cache, self.prompt_frames, flow.cfg.encoder.num_blocks)
        else:
            mel = mx.zeros((1, flow.cfg.output_size, 0))
        speech = self.vocoder.stream(mel, finalize=last)
        if last:
            self.finished = True
        out = np.asarray(speech, dtype=np.float32).reshape(-1)
        if not np.isfinite(out).all():
            raise RuntimeError("the vocoder returned non-finite audio")
        if self.owner.version == "1.0.6":  # OverlapVocoder puts the first chunk's silence in itself
            return out
        if out.size and self.first_chunk:
            self.first_chunk = False
            if not last:
                out = np.concatenate([np.zeros(self.vocoder.delay * self.vocoder.hop, dtype=np.float32), out])
        return out


class Token2Wav:
    """The flow and the causal vocoder of a token2wav folder. ``load(folder)``; ``start_stream(voice)``;
    ``__call__(tokens, voice)`` for a whole utterance."""

    sample_rate = SAMPLE_RATE

    def __init__(self, flow: CausalMaskedDiffWithXvec, vocoder, n_timesteps: int = 10, original_vocoder=None,
                 version: str = "1.0.7"):
        """``vocoder``: the causal CosyVoice3 HiFT (1.0.7) or the original HiFT (1.0.6, which then also vocodes
        whole utterances)."""
        if int(n_timesteps) < 1:
            raise ValueError("n_timesteps must be positive")
        if version not in VERSIONS:
            raise ValueError(f"unknown token2wav version {version!r} (one of {', '.join(VERSIONS)})")
        from .vocoder import HiFTGenerator

        if (version == "1.0.6") != isinstance(vocoder, HiFTGenerator):
            raise ValueError(f"token2wav {version} streams through the "
                             f"{'original' if version == '1.0.6' else 'causal'} HiFT, got {type(vocoder).__name__}")
        if version == "1.0.6" and original_vocoder is None:
            original_vocoder = vocoder
        self.version = version
        hop = vocoder.args.hop
        if flow.cfg.output_size != vocoder.args.in_channels or hop != HOP_SAMPLES:
            raise ValueError(f"the vocoder takes {vocoder.args.in_channels} mel bins at {hop} samples a frame; the "
                             f"flow makes {flow.cfg.output_size} (Token2wav needs 80 and 480)")
        self.flow, self.vocoder, self.n_timesteps = flow, vocoder, int(n_timesteps)
        self.original_vocoder = original_vocoder
        self._current: Token2WavStream | None = None

    @property
    def offline_vocoder(self) -> str:
        return "causal" if self.original_vocoder is None else "original"

    @classmethod
    def load(cls, folder: str | Path, n_timesteps: int = 10, version: str | None = None) -> "Token2Wav":
        """``version`` None: detected from the files (``detect_version``). "1.0.6" on a 1.0.7 folder streams
        through its ``hift_original``; "1.0.7" needs ``config.yaml``."""
        from .vocoder import load_causal_vocoder, load_original_vocoder
        from .weights import weight_file

        folder = Path(folder).expanduser()
        if not folder.is_dir():
            raise CheckpointError(f"no token2wav folder at {folder}")
        if version is not None and version not in VERSIONS:
            raise ValueError(f"unknown token2wav version {version!r} (one of {', '.join(VERSIONS)})")
        version = version or detect_version(folder)
        flow = load_flow(folder)
        has_original = weight_file(folder, "hift_original") is not None
        if version == "1.0.6":
            hift = load_original_vocoder(folder, stem="hift_original" if has_original else "hift")
            return cls(flow, hift, n_timesteps, version="1.0.6")
        original = load_original_vocoder(folder) if has_original else None
        return cls(flow, load_causal_vocoder(folder), n_timesteps, original, version="1.0.7")

    def start_stream(self, voice: Voice) -> Token2WavStream:
        return Token2WavStream(self, voice)

    def __call__(self, tokens, voice: Voice) -> np.ndarray:
        tokens = np.asarray(tokens.tolist() if isinstance(tokens, mx.array) else tokens, dtype=np.int64).reshape(-1)
        if tokens.size == 0:
            raise ValueError("offline synthesis needs at least one speech token")
        prompt_tokens, prompt_mel, spk = _prompt(self.flow, voice)
        mel = self.flow.inference(tokens, prompt_tokens, prompt_mel, spk, self.n_timesteps)
        if self.original_vocoder is not None:
            speech, _ = self.original_vocoder(mel)
        else:
            speech, _ = self.vocoder.inference(mel, finalize=True)
        return np.asarray(speech, dtype=np.float32).reshape(-1)

    # the official method names, on one current stream
    def set_stream_cache(self, voice: Voice) -> Token2WavStream:
        self._current = self.start_stream(voice)
        return self._current

    def stream(self, tokens, last_chunk: bool = False) -> np.ndarray:
        if self._current is None:
            raise ValueError("no stream is active: call set_stream_cache(voice) (or start_stream(voice)) first")
        return self._current.push(tokens, last=last_chunk)
