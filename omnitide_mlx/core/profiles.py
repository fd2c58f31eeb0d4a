"""Model profiles: token rates (paper table 1), real KV shapes, unit layouts and a deterministic stream generator.

A profile is what the simulator and the benchmarks need to know about a model without loading it: how many LLM
tokens one second of camera + microphone becomes, how those tokens are laid out in a unit (boundary tokens and
typed spans, taken from the model references in ``shared/reference/``), the RoPE position layout (1 axis or
Qwen's 3-axis TMRoPE), the KV bytes per token, and the per-model retention defaults.

Unit layouts (one unit a second, a 1344x1344 frame and one second of audio, as in table 1):

- Qwen2.5-Omni (audio in video): ``<|vision_bos|><|audio_bos|>`` video(2304) audio(25) ``<|audio_eos|><|vision_eos|>``
  = 2333 tokens. TMRoPE: both bos tokens at ``p``; video at ``(p+1, p+1+row, p+1+col)`` on the 48x48 merged grid;
  audio at ``p+1+i`` on all axes; both eos tokens at max + 1 (``reference/qwen2_5_omni.md`` 4.3).
- MiniCPM-o 4.5 / 2.6 (duplex units): ``<unit>`` ``<image>`` source(64) ``</image>`` then 3 rows of 3 x
  (``<slice>`` 64 ``</slice>``) separated by a ``\\n`` token, audio (10 or 25), ``<|listen|>`` ``</unit>`` = 675
  (4.5) or 690 (2.6) tokens; plain 1-D RoPE (``reference/minicpm_o_4_5.md`` 1.6, 2.2).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from .units import Span, SpanKind, Unit, UnitKind


class ProfileError(ValueError):
    """An unknown profile name or a bad stream specification."""


@dataclass(frozen=True)
class ModelProfile:
    """What the simulator needs to know about one model (no weights)."""

    name: str
    display: str
    layers: int
    kv_heads: int
    head_dim: int
    rope_axes: int  # 1: plain RoPE; 3: M-RoPE / TMRoPE (t, h, w)
    family: str  # "qwen2_5_omni" or "minicpmo": selects the unit layout
    image_tokens: int  # LLM tokens of one 1344x1344 frame (table 1)
    audio_tokens_per_s: int
    slice_grid: tuple[int, int] = (0, 0)  # (rows, cols) of local slices; (0, 0) = unsliced
    slice_tokens: int = 0
    source_tokens: int = 0
    system_tokens: int = 40  # the protected prefix (system prompt + the opening of the user turn)
    kv_dtype_bytes: int = 2  # fp16 KV, as in the paper's runs
    high: int = 2500
    low: int = 1800
    pick: dict = field(default_factory=dict)  # OmniPick knobs for this model
    notes: str = ""

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer: 2 x layers x kv_heads x head_dim x bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_dtype_bytes

    @property
    def media_unit_tokens(self) -> int:
        return sum(n for _, n in self._media_pieces())

    def policy_kwargs(self, policy_cls: type) -> dict[str, Any]:
        """This model's defaults for the keyword arguments ``policy_cls`` accepts (watermarks, sinks, ...)."""
        wanted = {"high": self.high, "low": self.low, **self.pick}
        params = inspect.signature(policy_cls.__init__).parameters
        return {k: v for k, v in wanted.items() if k in params}

    # --- unit layouts -------------------------------------------------------------------------------------
    def _media_pieces(self) -> list[tuple[SpanKind, int]]:
        if self.family == "qwen2_5_omni":
            return [(SpanKind.BOUNDARY, 2), (SpanKind.IMAGE, self.image_tokens),
                    (SpanKind.AUDIO, self.audio_tokens_per_s), (SpanKind.BOUNDARY, 2)]
        rows, cols = self.slice_grid
        out = [(SpanKind.BOUNDARY, 2), (SpanKind.IMAGE_SOURCE, self.source_tokens), (SpanKind.BOUNDARY, 1)]
        for r in range(rows):
            if r:
                out.append((SpanKind.BOUNDARY, 1))  # "\n" between slice rows
            for _ in range(cols):
                out += [(SpanKind.BOUNDARY, 1), (SpanKind.IMAGE_SLICE, self.slice_tokens), (SpanKind.BOUNDARY, 1)]
        out += [(SpanKind.AUDIO, self.audio_tokens_per_s), (SpanKind.BOUNDARY, 2)]  # <|listen|> </unit>
        return _merge_adjacent_boundaries(out)

    def _question_pieces(self, n: int) -> list[tuple[SpanKind, int]]:
        if self.family == "qwen2_5_omni":  # text, then <|im_end|> \n <|im_start|> assistant \n
            return [(SpanKind.TEXT, n), (SpanKind.BOUNDARY, 5)]
        return [(SpanKind.BOUNDARY, 1), (SpanKind.TEXT, n), (SpanKind.BOUNDARY, 1)]  # <unit> text </unit>

    def _reply_pieces(self, n: int) -> list[tuple[SpanKind, int]]:
        if self.family == "qwen2_5_omni":  # reply, then <|im_end|> \n <|im_start|> user \n
            return [(SpanKind.RESPONSE, n), (SpanKind.BOUNDARY, 5)]
        return [(SpanKind.BOUNDARY, 2), (SpanKind.RESPONSE, n), (SpanKind.BOUNDARY, 2)]  # <unit><|speak|> .. </unit>

    def system_unit(self, uid: int = 0) -> Unit:
        return Unit.build(uid, UnitKind.SYSTEM, [(SpanKind.SYSTEM, self.system_tokens)], axes=self.rope_axes,
                          label="system")

    def media_unit(self, uid: int, start: int, t: float | None = None) -> Unit:
        """One second of camera + microphone, positions starting at ``start``."""
        pieces = self._media_pieces()
        spans = _spans(pieces)
        if self.rope_axes == 1:
            pos = np.arange(start, start + spans[-1].end, dtype=np.int64)[None, :]
        else:
            pos = self._tmrope_positions(start)
        return Unit(uid=uid, kind=UnitKind.MEDIA, spans=spans, positions=pos, t=t, label="av")

    def _tmrope_positions(self, p: int) -> np.ndarray:
        side = int(round(self.image_tokens ** 0.5))
        if side * side != self.image_tokens:
            raise ProfileError(f"{self.name}: TMRoPE layout needs a square merged grid, got {self.image_tokens}")
        st = p + 1
        rows, cols = np.divmod(np.arange(self.image_tokens, dtype=np.int64), side)
        video = np.stack([np.full(self.image_tokens, st), st + rows, st + cols])
        audio = np.broadcast_to(st + np.arange(self.audio_tokens_per_s, dtype=np.int64),
                                (3, self.audio_tokens_per_s))
        eos = max(int(video.max()), int(audio.max()) if audio.size else st) + 1
        return np.concatenate([np.full((3, 2), p), video, audio, np.full((3, 2), eos)], axis=1)

    def question_unit(self, uid: int, start: int, n_text: int, t: float | None = None) -> Unit:
        return Unit.build(uid, UnitKind.USER, self._question_pieces(n_text), start_position=start,
                          axes=self.rope_axes, t=t, label="question")

    def reply_unit(self, uid: int, start: int, n_text: int, t: float | None = None) -> Unit:
        return Unit.build(uid, UnitKind.REPLY, self._reply_pieces(n_text), start_position=start,
                          axes=self.rope_axes, t=t, label="reply")

    def to_json(self) -> dict:
        return {"name": self.name, "display": self.display, "layers": self.layers, "kv_heads": self.kv_heads,
                "head_dim": self.head_dim, "rope_axes": self.rope_axes, "image_tokens": self.image_tokens,
                "audio_tokens_per_s": self.audio_tokens_per_s, "media_unit_tokens": self.media_unit_tokens,
                "system_tokens": self.system_tokens, "kv_bytes_per_token": self.kv_bytes_per_token,
                "high": self.high, "low": self.low, "pick": dict(self.pick)}


def _merge_adjacent_boundaries(pieces: list[tuple[SpanKind, int]]) -> list[tuple[SpanKind, int]]:
    out: list[tuple[SpanKind, int]] = []
    for k, n in pieces:
        if out and k is SpanKind.BOUNDARY and out[-1][0] is SpanKind.BOUNDARY:
            out[-1] = (k, out[-1][1] + n)
        else:
            out.append((k, n))
    return out


def _spans(pieces: list[tuple[SpanKind, int]]) -> tuple[Span, ...]:
    out, cursor = [], 0
    for k, n in pieces:
        out.append(Span(k, cursor, cursor + n))
        cursor += n
    return tuple(out)


# OmniPick knobs the paper leaves open (docs/simulator.md says why):
#   recent_units 2   -- figure 6 keeps the two newest units (u_n, u_{n+1}) whole
#   image_sink 4     -- a short prefix of an unsliced frame (StreamingLLM's 4 initial tokens, per image)
#   audio_sink 2     -- audio spans are short (10-25 tokens a second); 2 matches the paper's positional sink
#   slice_sink 2     -- 9 slices x 2 keeps the sliced image's per-slice sinks at 18 tokens, next to a 64-token source
#   text_budget 256  -- a few questions and short replies; text is cheap next to 700-2300 media tokens a second
_PICK_DEFAULTS = {"recent_units": 2, "image_sink": 4, "audio_sink": 2, "slice_sink": 2, "text_budget": 256}

_QWEN_SYSTEM = 43  # <|im_start|>system\n + the default Qwen system prompt (37 BPE tokens) + <|im_end|>\n, then <|im_start|>user\n
_MINICPM_SYSTEM = 15  # <|im_start|>system\nYou are a helpful assistant.\n<|im_end|>\n (12) + <|im_start|>user\n (3)

PROFILES: dict[str, ModelProfile] = {
    "qwen2.5-omni-7b": ModelProfile(
        name="qwen2.5-omni-7b", display="Qwen2.5-Omni-7B", layers=28, kv_heads=4, head_dim=128, rope_axes=3,
        family="qwen2_5_omni", image_tokens=2304, audio_tokens_per_s=25, system_tokens=_QWEN_SYSTEM,
        pick=dict(_PICK_DEFAULTS), notes="Qwen2.5-7B LLM (hidden 3584, 28 heads / 4 KV heads)"),
    "qwen2.5-omni-3b": ModelProfile(
        name="qwen2.5-omni-3b", display="Qwen2.5-Omni-3B", layers=36, kv_heads=2, head_dim=128, rope_axes=3,
        family="qwen2_5_omni", image_tokens=2304, audio_tokens_per_s=25, system_tokens=_QWEN_SYSTEM,
        pick=dict(_PICK_DEFAULTS), notes="Qwen2.5-3B LLM (hidden 2048, 16 heads / 2 KV heads)"),
    "minicpm-o-4.5": ModelProfile(
        name="minicpm-o-4.5", display="MiniCPM-o 4.5", layers=36, kv_heads=8, head_dim=128, rope_axes=1,
        family="minicpmo", image_tokens=640, audio_tokens_per_s=10, slice_grid=(3, 3), slice_tokens=64,
        source_tokens=64, system_tokens=_MINICPM_SYSTEM, pick=dict(_PICK_DEFAULTS),
        notes="Qwen3-8B LLM; 640 image tokens = source + 3x3 slices of 64; Whisper + 5-frame pooling"),
    "minicpm-o-2.6": ModelProfile(
        name="minicpm-o-2.6", display="MiniCPM-o 2.6", layers=28, kv_heads=4, head_dim=128, rope_axes=1,
        family="minicpmo", image_tokens=640, audio_tokens_per_s=25, slice_grid=(3, 3), slice_tokens=64,
        source_tokens=64, system_tokens=_MINICPM_SYSTEM, pick=dict(_PICK_DEFAULTS),
        notes="Qwen2.5-7B LLM; 640 image tokens = source + 3x3 slices of 64; 25 audio tokens a second"),
}

_ALIASES = {"qwen7b": "qwen2.5-omni-7b", "qwen3b": "qwen2.5-omni-3b", "minicpm-o-4_5": "minicpm-o-4.5",
            "minicpmo45": "minicpm-o-4.5", "minicpm-o-2_6": "minicpm-o-2.6", "minicpmo26": "minicpm-o-2.6"}


def get_profile(name: str) -> ModelProfile:
    key = name.lower()
    key = _ALIASES.get(key, key)
    if key not in PROFILES:
        raise ProfileError(f"unknown profile {name!r}; choose one of {sorted(PROFILES)}")
    return PROFILES[key]


# --- the stream -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StreamEvent:
    """One unit of the stream: ``kind`` is media / question / reply; ``n_text`` for question and reply."""

    kind: str
    t: float
    n_text: int = 0


@dataclass(frozen=True)
class StreamSpec:
    """A unit a second for ``seconds`` seconds; every ``question_every`` seconds (0 = never) a question unit
    with ``question_tokens`` text tokens and a reply with ``reply_tokens`` (uniform ranges, inclusive), drawn
    from ``seed`` (same seed, same stream)."""

    seconds: int
    question_every: int = 30
    question_tokens: tuple[int, int] = (8, 40)
    reply_tokens: tuple[int, int] = (16, 96)
    seed: int = 0

    def __post_init__(self):
        if self.seconds < 0:
            raise ProfileError(f"seconds must be >= 0, got {self.seconds}")
        if self.question_every < 0:
            raise ProfileError(f"question_every must be >= 0, got {self.question_every}")
        for k in ("question_tokens", "reply_tokens"):
            lo, hi = getattr(self, k)
            if not 1 <= lo <= hi:
                raise ProfileError(f"{k} must be a range 1 <= lo <= hi, got {(lo, hi)}")

    def events(self) -> Iterator[StreamEvent]:
        rng = np.random.default_rng(self.seed)
        for s in range(self.seconds):
            yield StreamEvent("media", float(s))
            if self.question_every and (s + 1) % self.question_every == 0:
                yield StreamEvent("question", s + 0.5, int(rng.integers(self.question_tokens[0],
                                                                        self.question_tokens[1] + 1)))
                yield StreamEvent("reply", s + 0.75, int(rng.integers(self.reply_tokens[0],
                                                                      self.reply_tokens[1] + 1)))

    def to_json(self) -> dict:
        return {"seconds": self.seconds, "question_every": self.question_every,
                "question_tokens": list(self.question_tokens), "reply_tokens": list(self.reply_tokens),
                "seed": self.seed}


def build_unit(profile: ModelProfile, event: StreamEvent, uid: int, start: int) -> Unit:
    """The unit for ``event`` with positions starting at ``start`` (the history's next position)."""
    if event.kind == "media":
        return profile.media_unit(uid, start, event.t)
    if event.kind == "question":
        return profile.question_unit(uid, start, event.n_text, event.t)
    if event.kind == "reply":
        return profile.reply_unit(uid, start, event.n_text, event.t)
    raise ProfileError(f"unknown stream event kind {event.kind!r}")
