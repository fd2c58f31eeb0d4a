"""MiniCPM-o 4.5 full duplex on MLX: the official ``MiniCPMODuplex`` protocol, unit by unit.

Every second the session reads one **unit** (``streaming_prefill``) and decides from the logits of that unit's
last audio position (``streaming_generate``) whether to listen or to speak; a speaking unit decodes up to 19
text/control tokens, whose (token, final-norm hidden state) pairs become the TTS condition for 25 audio tokens,
which token2wav voices while the next unit arrives. Source: GitHub ``OpenBMB/MiniCPM-o-Demo``, ``MiniCPMO45/``
at commit 28b60cf, ``modeling_minicpmo.py`` (``MiniCPMODuplex``, lines 2303-3490) and ``utils.py``
(``StreamDecoder``, 1168-2200); docs/models/minicpmo.md "Full duplex" lists each rule with its lines.

The KV cache layout (``prepare`` once, then one unit a second)::

    prefix system prompt | reference-audio embeddings | suffix system prompt          <- preserve_length
    <unit> [<image> 64 </image> (<slice> 64 </slice>)*]* [audio x10] [text] <decision> [text / control]* </unit>

Positions are the cache length (``StreamDecoder.feed``). The official sliding windows (``DuplexWindowConfig``) are
off by default; the "basic" one is here (``BasicWindow``: whole units dropped oldest first, the kept keys re-rotated,
``StreamDecoder.enforce_window``) as the baseline; the "context" one (a cache rebuilt every 24 units with the
previous units' text) is not ported. Instead of a window, ``retention`` takes one of OmniTide's retention policies
(core/pick.py): the session keeps a ``History`` whose units keep their classes (the unit's decision as its label;
spans: boundary markers, image / slices, audio, user text, and the reply as ``response``), and a policy's plan is
applied to the cache (deleted rows cut, kept keys re-rotated by their shift).

Deviations (numerically invisible unless noted): the official code feeds each token of the prompts and each marker
/ embedding block of a unit in its own forward, here a unit is one forward (causal attention: the same logits up
to float rounding); ``prepare`` starts a fresh streaming Whisper cache (the official one keeps the previous
session's, a leftover of ``MiniCPMO.reset_session`` not being called); a unit whose audio cannot fill a chunk is
refused before anything is fed, its samples kept for the next unit (officially the unit is left open with no
decision); the model runs in the dtype it was loaded with (the official class casts to bfloat16; the parity tests
use float32).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import mlx.core as mx
import numpy as np

from ...core.pick import RetentionPolicy
from ...core.retention_plan import apply_plan, plan_from_mask
from ...core.units import History, SpanKind, Unit, UnitKind
from ..base import MediaError
from .audio import WhisperStreamCache
from .processor import SAMPLE_RATE, StreamingMel, to_pil

CHUNK_MS, FIRST_CHUNK_MS, CNN_REDUNDANCY_MS = 1000, 1035, 20  # MiniCPMODuplex.__init__ defaults
TTS_CHUNK_TOKENS = 25 + 1  # generate_chunk's max_new_token: the 26th token is drawn and dropped
T2W_CHUNK, SILENCE_TOKEN, SILENCE_PREFIX = 25, 4218, 3  # _generate_waveform_from_tokens / _reset_token2wav
T2W_SAMPLE_RATE = 24000

Draw = Callable[[np.ndarray], int]  # probabilities -> a token id (replaces the random draw, e.g. a replay)
OFFICIAL_ARGS = {"decode_mode": "mode", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
                 "listen_prob_scale": "listen_prob_scale", "listen_top_k": "listen_top_k",
                 "text_repetition_penalty": "repetition_penalty", "text_repetition_window_size": "repetition_window",
                 "max_new_speak_tokens_per_chunk": "max_new_speak_tokens_per_chunk"}  # streaming_generate's names


@dataclass
class DuplexDecoding:
    """``streaming_generate``'s arguments (its defaults) and ``StreamDecoder.decode``'s fixed length penalty."""

    mode: str = "sampling"  # or "greedy"
    temperature: float = 0.7
    top_k: int = 20
    top_p: float = 0.8
    repetition_penalty: float = 1.05
    repetition_window: int = 512
    length_penalty: float = 1.1  # decode()'s default; streaming_generate never passes it
    listen_prob_scale: float = 1.0
    listen_top_k: int | None = None
    max_new_speak_tokens_per_chunk: int = 20
    force_listen_count: int = 0  # MiniCPMODuplex kwarg: the first N units are forced to listen
    tts_temperature: float = 0.8
    tts_repetition_penalty: float = 1.05
    tts_greedy: bool = False  # argmax instead of the TTS's multinomial draw (parity tests)

    def __post_init__(self):
        if self.mode not in ("sampling", "greedy"):
            raise ValueError(f"mode must be 'sampling' or 'greedy' (got {self.mode!r})")
        if self.max_new_speak_tokens_per_chunk < 1:
            raise ValueError("max_new_speak_tokens_per_chunk must be >= 1")
        if self.mode == "sampling" and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (got {self.temperature})")
        if not self.tts_temperature > 0:
            raise ValueError(f"tts_temperature must be > 0 (got {self.tts_temperature})")


@dataclass(frozen=True)
class BasicWindow:
    """The official "basic" duplex window (``DuplexWindowConfig``, ``utils.py:883-904``, ``enforce_window``
    1434-1477): once the cache passes ``high`` tokens after a unit, whole units are dropped, oldest first, until it
    is at most ``low``; the prompt of ``prepare`` is never dropped. Defaults: ``MiniCPMODuplex``'s (2437-2451)."""

    high: int = 4000
    low: int = 3500

    def __post_init__(self):
        if not 0 < self.low <= self.high:
            raise ValueError(f"the window needs 0 < low <= high (got low {self.low}, high {self.high})")


@dataclass
class DuplexUnit:
    """What ``streaming_generate`` returns for one unit."""

    is_listen: bool
    text: str = ""
    end_of_turn: bool = False
    ids: list[int] = field(default_factory=list)  # every id fed after the unit's input, </unit> included
    text_ids: list[int] = field(default_factory=list)  # the ids whose (id, hidden) pairs went to the TTS
    tts_tokens: list[int] = field(default_factory=list)  # this unit's audio tokens (speaking units)
    audio: np.ndarray | None = None  # 24 kHz float32 when a token2wav is attached and audio became final
    kv_length: int = 0  # after the unit (and after the window's drops)
    dropped_units: int = 0  # units the window or the retention policy dropped after this one
    evicted_tokens: int = 0  # tokens they deleted
    step_logits: list[np.ndarray] = field(default_factory=list)  # the logits of each decode step (record=True)
    tts_condition: np.ndarray | None = None  # the TTS input [n, hidden] (record=True)

    @property
    def decision(self) -> str:
        return "listen" if self.is_listen else "speak"

    def to_dict(self) -> dict:
        """The official result's fields (``audio_waveform``: None without audio; the official listen answer is a
        second of 24 kHz silence)."""
        return {"is_listen": self.is_listen, "text": self.text, "end_of_turn": self.end_of_turn,
                "audio_waveform": self.audio, "n_tokens": len(self.text_ids),
                "n_tts_tokens": len(self.tts_tokens)}


# --- decoding (StreamDecoder.decode, utils.py:2087-2200) ----------------------------------------------------------

def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - np.max(x))
    return e / e.sum()


def top_k_top_p(logits: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """``utils.top_k_top_p_filtering`` (1142-1165): below the k-th value -> -inf; then the sorted tail past the
    cumulative probability ``top_p`` (the first token past it kept)."""
    x = logits.copy()
    if top_k > 0:
        kth = np.sort(x)[-min(top_k, x.size)]
        x[x < kth] = -np.inf
    if top_p > 0.0:
        order = np.argsort(-x, kind="stable")
        cum = np.cumsum(_softmax(x[order]))
        remove = cum > top_p
        remove[1:] = remove[:-1].copy()
        remove[0] = False
        x[order[remove]] = -np.inf
    return x


class Decoder:
    """The decision rule of one session: its repetition history spans every unit since ``prepare``."""

    def __init__(self, ids: dict[str, int], forbidden: list[int], rng: np.random.Generator,
                 draw: Draw | None = None):
        self.ids, self.rng, self._draw = ids, rng, draw
        self.forbidden = np.asarray(sorted(set(forbidden) | {ids["chunk_eos"]}), dtype=np.int64)
        self.history: list[int] = []  # StreamDecoder.generated_tokens

    def draw(self, probs: np.ndarray) -> int:
        if self._draw is not None:
            return int(self._draw(probs))
        return int(self.rng.choice(probs.size, p=probs))

    def __call__(self, logits: np.ndarray, c: DuplexDecoding) -> int:
        ids = self.ids
        x = logits.astype(np.float32).copy()
        # the raw pick first: a <|chunk_eos|> there ends the unit before any mask or penalty
        first = int(np.argmax(x)) if c.mode == "greedy" else self.draw(_softmax(x))
        if first == ids["chunk_eos"]:
            return first
        x[self.forbidden[self.forbidden < x.size]] = -np.inf
        if c.repetition_penalty != 1.0 and self.history:
            recent = np.unique(np.asarray(self.history[-c.repetition_window:], dtype=np.int64))
            recent = recent[recent < x.size]
            x[recent] = x[recent] / np.float32(c.repetition_penalty) if c.repetition_penalty > 1.0 \
                else x[recent] * np.float32(1.0 / c.repetition_penalty)
        if c.length_penalty != 1.0:
            t = ids["turn_eos"]
            x[t] = x[t] / np.float32(c.length_penalty) if x[t] > 0 else x[t] * np.float32(c.length_penalty)
        listen = ids["im_end"]  # StreamDecoder.listen_id is tokenizer.eos_token_id: <|im_end|>, not <|listen|>
        if c.listen_prob_scale != 1.0:
            x[listen] *= np.float32(c.listen_prob_scale)
        if c.listen_top_k is not None and int((x > x[listen]).sum()) < c.listen_top_k:
            return listen  # returned without entering the history, as officially
        if c.mode == "greedy":
            token = int(np.argmax(x))
        else:
            token = self.draw(_softmax(top_k_top_p(x / np.float32(c.temperature), c.top_k, c.top_p)))
        self.history.append(token)
        if len(self.history) > 2 * c.repetition_window:  # only the window is read: bounded for an hour-long session
            del self.history[:-c.repetition_window]
        return token


# --- the TTS chunk (MiniCPMTTS.generate_chunk, modeling_minicpmo.py:4564-4710) ------------------------------------

def tts_generate_chunk(tts, condition: mx.array, cache: list, text_start_pos: int, min_new_tokens: int,
                       cfg: DuplexDecoding, pick: Callable[[np.ndarray], int]) -> list[int]:
    """Up to 25 audio tokens for one unit's condition [1, n, hidden], appended to ``cache`` at positions from
    ``text_start_pos``. Per step: logits / temperature; from the second token on, the repetition penalty over this
    chunk's tokens (window 16, ``penalty ** count``); the eos masked before ``min_new_tokens``; softmax, draw. The
    token drawn at the last step (the 26th) or an eos is not returned (the eos is not fed either)."""
    eos = tts.args.eos_token_id
    out: list[int] = []
    n = condition.shape[1]
    for t in range(TTS_CHUNK_TOKENS):
        if t == 0:
            logits = tts.logits(condition, text_start_pos, cache)
        else:
            x = tts.emb_code[0](mx.array([out[-1]], dtype=mx.int32))[None]
            logits = tts.logits(x, text_start_pos + n + t - 1, cache)
        x = np.array(logits, dtype=np.float32) / np.float32(cfg.tts_temperature)
        if t > 0 and cfg.tts_repetition_penalty != 1.0:
            counts = np.bincount(np.asarray(out[-16:], dtype=np.int64), minlength=x.size)[: x.size]
            alpha = np.power(np.float32(cfg.tts_repetition_penalty), counts.astype(np.float32)).astype(np.float32)
            x = np.where(x < 0, x * alpha, x / alpha).astype(np.float32)
        if t < min_new_tokens:
            x[eos] = -np.inf
        token = pick(x)
        if token == eos or t == TTS_CHUNK_TOKENS - 1:
            break
        out.append(token)
    return out


# --- the session --------------------------------------------------------------------------------------------------

class DuplexSession:
    """One official duplex session (``MiniCPMODuplex``) on ``model`` (models.minicpmo.Model).

    ``speech``: a ``MiniCPMSpeech`` (speech.py) to voice the audio tokens through streaming token2wav, with
    ``speaker``; without it speaking units still produce their TTS tokens (when the model has a TTS) and the
    token2wav windows they would push (``t2w_windows``). ``draw`` replaces every random draw (LLM and TTS, in the
    official order) by a function of the probabilities, e.g. to replay a recorded run; ``seed`` seeds NumPy's.
    ``record=True`` keeps each decode step's logits in ``DuplexUnit.step_logits``. ``window``: the official basic
    window; ``retention``: an OmniTide retention policy (``core.pick.make_policy``) instead; neither: the cache
    grows, as with the official default "off".
    """

    def __init__(self, model, processor, decoding: DuplexDecoding | None = None, speech=None,
                 speaker: str | None = None, generate_audio: bool | None = None, seed: int | None = None,
                 draw: Draw | None = None, record: bool = False, window: BasicWindow | None = None,
                 retention: RetentionPolicy | None = None):
        if window is not None and retention is not None:
            raise ValueError("give the official window or a retention policy, not both")
        if retention is not None and retention.needs_scores:
            raise ValueError(f"the {retention.name} policy needs attention scores, which the duplex session does "
                             "not collect")
        self.model, self.processor, self.tok = model, processor, processor.tokenizer
        self.lm = model.language_model
        self.cfg = decoding or DuplexDecoding()
        self.generate_audio = (model.tts is not None) if generate_audio is None else generate_audio
        if self.generate_audio:
            model.require_tts()
        self.speech, self.voice = speech, (speech.voice(speaker) if speech is not None else None)
        self.rng = np.random.default_rng(seed)
        self._draw, self.record, self.window, self.retention = draw, record, window, retention
        self.rope = model.kv_spec().rope
        t = self.tok.token_id
        self.ids = {name: t(tok) for name, tok in [
            ("unit", "<unit>"), ("unit_end", "</unit>"), ("image", "<image>"), ("image_end", "</image>"),
            ("slice", "<slice>"), ("slice_end", "</slice>"), ("listen", "<|listen|>"), ("speak", "<|speak|>"),
            ("tts_bos", "<|tts_bos|>"), ("chunk_eos", "<|chunk_eos|>"), ("chunk_tts_eos", "<|chunk_tts_eos|>"),
            ("turn_eos", "<|turn_eos|>"), ("tts_pad", "<|tts_pad|>"), ("im_end", "<|im_end|>")]}
        self.chunk_terminators = {self.ids["listen"], self.ids["chunk_eos"], self.ids["chunk_tts_eos"]}
        self.forbidden = [self.ids["tts_pad"]] + list(self.tok.bad_token_ids)
        self.prepare()

    # --- state ----------------------------------------------------------------------------------------------------
    def _reset(self) -> None:
        """``_reset_streaming_state`` + ``StreamDecoder.reset`` + ``init_streaming_processor``."""
        self.cache = self.lm.make_cache()
        self.decoder = Decoder(self.ids, self.forbidden, self.rng, self._draw)
        self.preserve_length = 0
        self.unit_lengths: list[int] = []  # tokens of each unit still in the cache, oldest first
        self.history = History()  # the cache's units and their spans (retention plans work on it)
        self._unit_start: int | None = None
        self._unit_spans: list[tuple[SpanKind, int]] = []
        self.dropped_units = self.dropped_tokens = 0
        self.audio_chunk_idx = 0
        self.audio_buffer = np.zeros(0, dtype=np.float32)
        self.mel = StreamingMel(chunk_ms=CHUNK_MS, first_chunk_ms=FIRST_CHUNK_MS, cnn_redundancy_ms=CNN_REDUNDANCY_MS)
        self.audio_cache = WhisperStreamCache()
        self.whisper_resets = 0
        self.pending_logits: np.ndarray | None = None
        self.current_turn_ended = True
        self.units_generated = 0
        self.tts_cache, self.tts_text_start_pos = None, 0
        self.t2w_windows: list[tuple[list[int], bool]] = []  # every (tokens, last) token2wav push (record=True)
        self._reset_token2wav()

    def _reset_token2wav(self) -> None:
        self.t2w_buffer = [SILENCE_TOKEN] * SILENCE_PREFIX
        self.t2w_stream = self.speech.token2wav.start_stream(self.voice) if self.speech is not None else None

    @property
    def kv_length(self) -> int:
        return int(self.cache[0].offset)

    def _feed(self, embeds: mx.array, at: int | None = None) -> tuple[np.ndarray | None, mx.array]:
        """``StreamDecoder.feed``: embeddings [L, H] at positions ``cache length + arange(L)``; returns the logits
        at row ``at`` (float32 numpy, or None) and the final-norm hidden states [L, H]."""
        h = self.lm.hidden_states(embeds[None], cache=self.cache, positions=self.kv_length)[0]
        logits = None if at is None else np.array(self.lm.logits(h[at]).astype(mx.float32))
        mx.eval(h)
        return logits, h

    def _embed(self, ids) -> mx.array:
        return self.lm.embed_tokens(mx.array(np.asarray(ids, dtype=np.int32).reshape(-1)))

    # --- prepare (modeling_minicpmo.py:2561-2638) -----------------------------------------------------------------
    def prepare(self, prefix_system_prompt: str | None = None, suffix_system_prompt: str | None = None,
                ref_audio: np.ndarray | None = None) -> str:
        """Start the session: prefix, the reference audio's embeddings (offline encoder, 1 s chunk mask), suffix;
        ``preserve_length`` is the cache length after them when any was given. Returns the prompt text as the
        official call does (``[audio embedding]`` marking the reference audio)."""
        if ref_audio is not None:
            ref_audio = np.asarray(ref_audio)
            if ref_audio.ndim != 1 or ref_audio.size == 0 or not np.issubdtype(ref_audio.dtype, np.floating):
                raise MediaError(f"ref_audio must be non-empty float mono samples at {SAMPLE_RATE} Hz")
        self._reset()
        parts = []
        if prefix_system_prompt:
            parts.append(self._embed(self.tok.encode(prefix_system_prompt)))
        if ref_audio is not None:
            feats, lens = self.processor.audio_features([ref_audio.astype(np.float32)])
            emb = self.model.audio_embeddings(feats, lens, chunk_length=self.model.config.audio_chunk_length)
            parts.append(mx.concatenate(emb, axis=0).astype(self.lm.embed_tokens.weight.dtype))
        if suffix_system_prompt:
            parts.append(self._embed(self.tok.encode(suffix_system_prompt)))
        if parts:
            self._feed(mx.concatenate(parts, axis=0))
        if prefix_system_prompt or suffix_system_prompt or ref_audio is not None:
            self.preserve_length = self.kv_length
        if self.kv_length:
            self.history.append(Unit.build(0, UnitKind.SYSTEM, [(SpanKind.SYSTEM, self.kv_length)], label="system"))
        if not (prefix_system_prompt or suffix_system_prompt):
            return ""
        return (prefix_system_prompt or "") + ("[audio embedding]" if ref_audio is not None else "") \
            + (suffix_system_prompt or "")

    # --- streaming_prefill (modeling_minicpmo.py:2640-3011) -------------------------------------------------------
    def streaming_prefill(self, audio_waveform: np.ndarray | None = None, frame_list: list | None = None,
                          text_list: str | list[str] | None = None, max_slice_nums: int | list[int] = 1) -> str:
        """Feed one unit: ``<unit>``, each frame (``<image>`` 64 ``</image>`` + ``<slice>`` 64 ``</slice>`` per
        slice), 10 audio embeddings (no markers) from this call's audio plus what is buffered, then the text.
        The decision logits are those of the last audio position (of the last frame position in a unit without
        audio, of the last text token in a text-only unit). Returns the unit's mode: AUDIO / VISION / OMNI / TEXT.
        ``MediaError`` before anything is fed when the input is empty or malformed or the audio does not fill a
        chunk. The argument names are the official ones (frames: PIL images or HxWx3 uint8 arrays)."""
        frames = list(frame_list) if frame_list is not None else []
        audio = audio_waveform
        has_audio = audio is not None and len(audio) > 0
        texts = ([text_list] if isinstance(text_list, str) else list(text_list)) if text_list is not None else []
        text_ids = self.tok.encode("".join(texts)) if texts else []
        mode = "OMNI" if frames and has_audio else "VISION" if frames else "AUDIO" if has_audio else \
            "TEXT" if texts else None
        if mode is None:
            raise MediaError("a unit needs audio, frames or text")
        slices = [max_slice_nums] * len(frames) if isinstance(max_slice_nums, int) else list(max_slice_nums)
        if len(slices) != len(frames):
            raise ValueError(f"max_slice_nums has {len(slices)} entries for {len(frames)} frames")
        buffer = None
        if has_audio:
            buffer = self._check_audio(audio)
        # everything is checked: build the unit
        self.pending_logits = None
        runs = [self._embed([self.ids["unit"]])]
        spans = [(SpanKind.BOUNDARY, 1)]
        for frame, n in zip(frames, slices):
            image = self.processor.process_image(to_pil(frame), n)
            feats = self.model.vision_embeddings(image.slices, image.tgt_sizes)
            for k in range(feats.shape[0]):
                start, end = ("image", "image_end") if k == 0 else ("slice", "slice_end")
                runs += [self._embed([self.ids[start]]), feats[k].astype(runs[0].dtype), self._embed([self.ids[end]])]
                kind = SpanKind.IMAGE if feats.shape[0] == 1 else SpanKind.IMAGE_SOURCE if k == 0 \
                    else SpanKind.IMAGE_SLICE
                spans += [(SpanKind.BOUNDARY, 1), (kind, feats.shape[1]), (SpanKind.BOUNDARY, 1)]
        if has_audio:
            runs.append(self._audio_tokens(buffer).astype(runs[0].dtype))
            spans.append((SpanKind.AUDIO, runs[-1].shape[0]))
        decision_at = sum(r.shape[0] for r in runs) - 1
        if text_ids:
            runs.append(self._embed(text_ids))
            spans.append((SpanKind.TEXT, len(text_ids)))
            if mode == "TEXT":
                decision_at += len(text_ids)
        if self._unit_start is None:  # a unit prefilled twice before its decision stays one unit
            self._unit_start, self._unit_spans = self.kv_length, []
        self._unit_spans += spans
        self.pending_logits, _ = self._feed(mx.concatenate(runs, axis=0), at=decision_at)
        self.current_mode = mode
        if mode == "VISION":  # officially a frame-only unit counts as an audio chunk too
            self.audio_chunk_idx += 1
        return mode

    def _check_audio(self, audio) -> np.ndarray:
        """The audio buffer after this call's samples (left-padded with zeros to 1035 ms while no chunk has been
        taken), checked to hold the next chunk (16,480 samples first, 16,000 after)."""
        audio = np.asarray(audio)
        if audio.ndim != 1 or not np.issubdtype(audio.dtype, np.floating):
            raise MediaError(f"audio has shape {audio.shape} / dtype {audio.dtype}; expected float mono samples")
        if not np.isfinite(audio).all():
            raise MediaError("audio holds NaN or infinite samples")
        buffer = np.concatenate([self.audio_buffer, audio.astype(np.float32)])
        if self.audio_chunk_idx == 0:
            need = int(FIRST_CHUNK_MS * SAMPLE_RATE / 1000)
            if len(buffer) < need:
                buffer = np.concatenate([np.zeros(need - len(buffer), np.float32), buffer])
        if len(buffer) < self.mel.chunk_size():
            self.audio_buffer = buffer  # kept for the next unit, as the official buffer keeps it
            raise MediaError(f"audio not enough: the unit needs {self.mel.chunk_size()} buffered samples, "
                             f"{len(buffer)} are there (kept for the next unit); nothing was fed")
        return buffer

    def _audio_tokens(self, buffer: np.ndarray) -> mx.array:
        """The next chunk through the streaming mel (2 context frames a side) and the streaming Whisper (its cache
        restarts when cache + new frames would reach 1500, ``get_audio_embedding_streaming``); the first chunk
        consumes 16,480 samples, the others 16,000."""
        need = self.mel.chunk_size()
        mel = self.mel.process(buffer[:need])
        if mel.shape[1] == 0:
            raise MediaError("streaming audio processing returned no frames")
        before = self.audio_cache.length
        tokens, self.audio_cache = self.model.audio_embeddings_streaming(
            mel[None], self.audio_cache, prefix_extra_frames=0 if self.audio_chunk_idx == 0 else 2,
            suffix_extra_frames=2)
        if before and self.audio_cache.length < before:
            self.whisper_resets += 1
        consumed = need if self.audio_chunk_idx == 0 else int(CHUNK_MS * SAMPLE_RATE / 1000)
        self.audio_buffer = buffer[consumed:]
        self.audio_chunk_idx += 1
        return tokens

    # --- streaming_generate (modeling_minicpmo.py:3014-3268) ------------------------------------------------------
    def streaming_generate(self, **overrides) -> DuplexUnit:
        """Decide, decode the unit's reply, close it with ``</unit>``; a speaking unit's tokens go to the TTS and its
        audio tokens to token2wav. Without a pending decision (no unit prefilled) the answer is listen, nothing fed.
        ``overrides``: the official call's decoding arguments for this unit (``decode_mode``, ``temperature``,
        ``top_k``, ``top_p``, ``listen_prob_scale``, ``listen_top_k``, ``text_repetition_penalty``,
        ``text_repetition_window_size``, ``max_new_speak_tokens_per_chunk``)."""
        unknown = set(overrides) - set(OFFICIAL_ARGS)
        if unknown:
            raise TypeError(f"unknown streaming_generate arguments: {', '.join(sorted(unknown))}")
        cfg = replace(self.cfg, **{OFFICIAL_ARGS[k]: v for k, v in overrides.items()}) if overrides else self.cfg
        if self.pending_logits is None:
            return DuplexUnit(is_listen=True, kv_length=self.kv_length)
        logits, self.pending_logits = self.pending_logits, None
        force_listen = self.units_generated < cfg.force_listen_count
        self.units_generated += 1
        ids = self.ids
        unit = DuplexUnit(is_listen=False)
        pairs: list[tuple[int, mx.array]] = []  # (token, hidden) for the TTS: every fed token but the first
        steps = cfg.max_new_speak_tokens_per_chunk
        for j in range(steps):
            if j == steps - 1:  # the last step: <|chunk_eos|> is forced
                self._feed(self._embed([ids["chunk_eos"]]))
                unit.ids.append(ids["chunk_eos"])
                break
            if force_listen:
                token = ids["listen"]
            else:
                if self.record:
                    unit.step_logits.append(logits)
                token = self.decoder(logits, cfg)
                if token == ids["listen"] and not self.current_turn_ended:
                    token = ids["tts_bos"]  # no listening in the middle of a turn
            unit.ids.append(token)
            unit.is_listen = token == ids["listen"]
            if token in self.chunk_terminators:
                self._feed(self._embed([token]))
                break
            self.current_turn_ended = False
            logits, h = self._feed(self._embed([token]), at=0)
            unit.end_of_turn = token == ids["turn_eos"]  # the unit goes on after it (the next step decides)
            if unit.end_of_turn:
                self.current_turn_ended = True
            if j != 0:
                pairs.append((token, h))
        self._feed(self._embed([ids["unit_end"]]))
        unit.ids.append(ids["unit_end"])
        text_ids = unit.text_ids = [t for t, _ in pairs]
        unit.text = self.tok.decode(text_ids, skip_special_tokens=True) if text_ids else ""
        self._register_unit(unit)
        if self.window is not None:
            unit.dropped_units, unit.evicted_tokens = self._enforce_window()
        elif self.retention is not None:
            unit.dropped_units, unit.evicted_tokens = self._retain()
        unit.kv_length = self.kv_length
        if unit.is_listen:
            unit.text, unit.end_of_turn = "", False
            return unit
        if self.generate_audio:
            self._speak(unit, pairs)
        return unit

    def _register_unit(self, unit: DuplexUnit) -> None:
        """``register_unit_end``: the unit's length for the window, its spans for retention (the generated part:
        ``<|listen|>`` and ``</unit>`` are boundaries, a speaking unit's tokens are its ``response``)."""
        n = self.kv_length - self._unit_start
        self.unit_lengths.append(n)
        generated = unit.ids[:-1]
        spans = self._unit_spans + ([(SpanKind.BOUNDARY, len(generated) + 1)] if unit.is_listen else
                                    [(SpanKind.RESPONSE, len(generated)), (SpanKind.BOUNDARY, 1)])
        spans = [(k, m) for k, m in spans if m > 0]
        assert sum(m for _, m in spans) == n, (spans, n)
        self.history.append(Unit.build(self.history.next_uid(), UnitKind.MEDIA, spans, self._unit_start,
                                       t=float(self.units_generated - 1), label=unit.decision))
        self._unit_start, self._unit_spans = None, []

    def _retain(self) -> tuple[int, int]:
        """One retention plan on the history, applied to the cache: kept rows gathered, each kept key re-rotated
        by ``-shift`` (positions stay the cache length)."""
        plan = self.retention.plan(self.history)
        if plan is None:
            return 0, 0
        keep = np.flatnonzero(plan.keep_mask())
        shifts = plan.kept_token_shifts()
        idx = mx.array(keep.astype(np.int32))
        for c in self.cache:
            k = mx.take(c.keys[:, :, :c.offset], idx, axis=2)
            c.keys = self.rope.rotate_sequence(k, (-shifts).astype(np.int32)) if shifts.any() else k
            c.values = mx.take(c.values[:, :, :c.offset], idx, axis=2)
            c.offset = c.keys.shape[2]
        mx.eval([c.keys for c in self.cache] + [c.values for c in self.cache])
        self.history = apply_plan(self.history, plan)
        assert self.history.total_tokens == self.kv_length == self.history.next_position()
        self.unit_lengths = [u.length for u in self.history.stream_units]
        self.dropped_units += len(plan.dropped_uids())
        self.dropped_tokens += plan.deleted_tokens
        return len(plan.dropped_uids()), plan.deleted_tokens

    # --- the basic window (utils.py: enforce_window 1434-1477, drop_tokens_from_cache 1027-1139) ------------------
    def _enforce_window(self) -> tuple[int, int]:
        if self.kv_length <= self.window.high:
            return 0, 0
        dropped, before = 0, self.kv_length
        while self.kv_length > self.window.low and self.unit_lengths:
            self._drop(self.preserve_length, self.unit_lengths.pop(0))
            dropped += 1
        keep = np.zeros(self.history.total_tokens, dtype=bool)
        keep[:self.preserve_length] = True
        keep[self.history.total_tokens - sum(self.unit_lengths):] = True
        self.history = apply_plan(self.history, plan_from_mask(self.history, keep, "basic-window"))
        self.dropped_units += dropped
        return dropped, before - self.kv_length

    def _drop(self, start: int, n: int) -> None:
        """Delete cache rows ``[start, start + n)``; the keys after them move ``n`` positions back (one RoPE
        rotation by ``-n``; the official code un-rotates at the old positions and rotates at the new ones); values
        stay as they are."""
        for c in self.cache:
            k, v = c.keys[:, :, :c.offset], c.values[:, :, :c.offset]
            tail = k[:, :, start + n:]
            tail = self.rope.rotate_sequence(tail, np.full(tail.shape[2], -n, dtype=np.int32))
            c.keys = mx.concatenate([k[:, :, :start], tail], axis=2)
            c.values = mx.concatenate([v[:, :, :start], v[:, :, start + n:]], axis=2)
            c.offset = c.keys.shape[2]
        mx.eval([c.keys for c in self.cache] + [c.values for c in self.cache])
        self.dropped_tokens += n

    def _speak(self, unit: DuplexUnit, pairs: list[tuple[int, mx.array]]) -> None:
        """``_convert_results_to_tts_input`` + ``generate_chunk`` + ``_generate_waveform_from_tokens``."""
        tts = self.model.tts
        bos = tts.token_embedding(tts.args.audio_bos_token_id)
        if pairs:
            ids = mx.array([t for t, _ in pairs], dtype=mx.int32)
            proj = tts.projector_semantic(mx.concatenate([h for _, h in pairs], axis=0).astype(bos.dtype))
            proj = proj / mx.maximum(mx.sqrt(mx.sum(proj * proj, axis=-1, keepdims=True)), 1e-12)
            condition = mx.concatenate([(tts.emb_text(ids) + proj)[None], bos], axis=1)
        else:
            condition = bos
        if self.record:
            unit.tts_condition = np.array(condition[0])
        turn_start = self.tts_text_start_pos == 0
        min_new = 0 if (unit.end_of_turn or turn_start) else TTS_CHUNK_TOKENS
        if self.tts_cache is None:
            self.tts_cache = tts.make_cache()
        unit.tts_tokens = tts_generate_chunk(tts, condition, self.tts_cache, self.tts_text_start_pos, min_new,
                                             self.cfg, self._tts_pick)
        if unit.end_of_turn:
            self.tts_cache, self.tts_text_start_pos = None, 0
        else:
            self.tts_text_start_pos += condition.shape[1] + len(unit.tts_tokens)
        unit.audio = self._token2wav(unit.tts_tokens, last=unit.end_of_turn, force_flush=turn_start)
        if unit.end_of_turn:
            self._reset_token2wav()

    def _tts_pick(self, x: np.ndarray) -> int:
        if self.cfg.tts_greedy:
            return int(np.argmax(x))
        p = _softmax(x)
        return int(self._draw(p)) if self._draw is not None else int(self.rng.choice(p.size, p=p))

    def _token2wav(self, tokens: list[int], last: bool, force_flush: bool) -> np.ndarray | None:
        """The official window rule: windows of 25 fresh tokens + 3 of lookahead; at a turn's start (force_flush)
        any window of at least 8 tokens goes; at its end the rest goes as the last push. Audio shorter than 1 s is
        left-padded to 1 s except on the last push; None when no audio became final."""
        look = self.speech.token2wav.flow.pre_lookahead_len if self.speech is not None else 3
        self.t2w_buffer += list(tokens)
        pieces = []
        if force_flush:
            while len(self.t2w_buffer) >= look + 5:
                n = min(T2W_CHUNK + look, len(self.t2w_buffer))
                pieces.append(self._push(self.t2w_buffer[:n], False))
                self.t2w_buffer = self.t2w_buffer[min(T2W_CHUNK, n - look):]
        else:
            while len(self.t2w_buffer) >= T2W_CHUNK + look:
                pieces.append(self._push(self.t2w_buffer[:T2W_CHUNK + look], False))
                self.t2w_buffer = self.t2w_buffer[T2W_CHUNK:]
        if last and self.t2w_buffer:
            pieces.append(self._push(self.t2w_buffer, True))
            self.t2w_buffer = []
        if self.speech is None or not pieces:
            return None
        wav = np.concatenate(pieces)
        if wav.size == 0:
            return None
        if not last and wav.size < T2W_SAMPLE_RATE:
            wav = np.concatenate([np.zeros(T2W_SAMPLE_RATE - wav.size, np.float32), wav])
        return wav

    def _push(self, tokens: list[int], last: bool) -> np.ndarray:
        if self.record:
            self.t2w_windows.append((list(tokens), last))
        if self.t2w_stream is None:
            return np.zeros(0, np.float32)
        return self.t2w_stream.push(tokens, last=last)
