"""Model profiles: real shapes, retention defaults, the unit layout they stream, and a deterministic stream generator.

A profile is what the simulator and the benchmarks need to know about a model without loading it: its language
model's shape (``core/shapes.py``'s :class:`~.shapes.ModelShape`), the RoPE layout (1 axis or Qwen's 3-axis
TMRoPE), the protected system prefix, the chat framing around a question and a reply (:class:`ChatFraming`), the
per-model retention defaults, and the media unit it streams. Core holds no model's figures: each model folder's
record (``models/<family>/family.py``, gathered by ``models/family.py``) builds its profiles from this plain data,
and ``omnitide_mlx.models.family.get_profile(name)`` looks one up.

The media unit is not written here: the model's own layout code computes it for a media setting (frame size,
``max_pixels`` / ``max_slice_nums``, audio per unit) and hands it over as a plain
:class:`~.stream_units.StreamUnits` record (``models/stream_units.py``: ``resolve_profile(name, setting)``), so
the simulator, both benchmarks, the eval harness and the engine stream the same unit (tests/models/
test_stream_units.py builds it from real frames). Examples at ``--preset paper`` (paper table 1: a 1344x1344
frame and one second of audio a unit): Qwen2.5-Omni ``<|vision_bos|><|audio_bos|>`` video(2304) audio(25)
``<|audio_eos|><|vision_eos|>`` = 2333 tokens; MiniCPM-o 4.5 ``<unit><image>`` 64 ``</image>`` 9 x (``<slice>``
64 ``</slice>``) audio(10) ``</unit>`` = 672 tokens.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from typing import Any, Iterator

import numpy as np

from .errors import OmniTideError
from .pick import DEFAULT_HIGH, DEFAULT_LOW
from .shapes import ModelShape
from .stream_units import StreamUnits
from .units import SpanKind, Unit, UnitKind


class ProfileError(OmniTideError, ValueError):
    """An unknown profile name or a bad stream specification."""


@dataclass(frozen=True)
class ChatFraming:
    """The boundary tokens around a question and a reply, as token strings (each one token of the model's
    tokenizer; tests/models/test_family.py checks them against the real processors' ids).

    One split for the simulator, the benchmarks and the engine: the tokens that open the reply are fed with the
    question (the engine prefills them before it generates, so its reply unit is the generated tokens only), and
    the tokens that close the reply, up to and including the ones that reopen the user turn, belong to the reply.
    ``turn_open``: the tokens in front of the first media unit of a user turn (after the system prompt or a reply),
    as the engine's adapter feeds them (the KV budget check counts them)."""

    question_open: tuple[str, ...]
    question_close: tuple[str, ...]
    reply_close: tuple[str, ...]
    turn_open: tuple[str, ...] = ()

    def question_runs(self, n: int) -> list[tuple[SpanKind, int]]:
        """A question of ``n`` text tokens with its framing, as ``(kind, length)`` runs."""
        runs = [(SpanKind.BOUNDARY, len(self.question_open)), (SpanKind.TEXT, n),
                (SpanKind.BOUNDARY, len(self.question_close))]
        return [(k, m) for k, m in runs if m]

    def reply_runs(self, n: int) -> list[tuple[SpanKind, int]]:
        """A reply of ``n`` generated tokens with the tokens that close it."""
        return [(k, m) for k, m in ((SpanKind.RESPONSE, n), (SpanKind.BOUNDARY, len(self.reply_close))) if m]

    def question_tokens(self, n: int) -> int:
        return n + len(self.question_open) + len(self.question_close)

    def to_json(self) -> dict:
        return {"question_open": list(self.question_open), "question_close": list(self.question_close),
                "reply_close": list(self.reply_close), "turn_open": list(self.turn_open)}


# OmniPick knobs the paper leaves open (docs/simulator.md says why); a family's profiles start from these:
#   recent_units 2   -- figure 6 keeps the two newest units (u_n, u_{n+1}) whole
#   image_sink 4     -- a short prefix of an unsliced frame (StreamingLLM's 4 initial tokens, per image)
#   audio_sink 2     -- audio spans are short (10-25 tokens a second); 2 matches the paper's positional sink
#   slice_sink 2     -- 9 slices x 2 keeps the sliced image's per-slice sinks at 18 tokens, next to a 64-token source
#   text_budget 256  -- a few questions and short replies; text is cheap next to 700-2300 media tokens a second
PICK_DEFAULTS = {"recent_units": 2, "image_sink": 4, "audio_sink": 2, "slice_sink": 2, "text_budget": 256}


@dataclass(frozen=True)
class ModelProfile:
    """What the simulator and the benchmarks need to know about one model (no weights)."""

    name: str
    display: str
    rope_axes: int  # 1: plain RoPE; 3: M-RoPE / TMRoPE (t, h, w)
    shape: ModelShape  # the language model's shape (core/shapes.py)
    framing: ChatFraming  # the tokens around a question and a reply (the family record's)
    system_tokens: int = 40  # the protected prefix (system prompt + the opening of the user turn)
    kv_dtype_bytes: int = 2  # fp16 KV, as in the paper's runs
    high: int = DEFAULT_HIGH  # the watermarks (the family record's; core.pick's default when it gives none)
    low: int = DEFAULT_LOW
    pick: dict = field(default_factory=dict)  # OmniPick knobs for this model
    layout_kw: dict = field(default_factory=dict)  # model-side settings the unit layout needs (audio pooling, ...)
    units: StreamUnits | None = None  # the media unit at a setting (models/stream_units.py fills it in)
    aliases: tuple[str, ...] = ()  # other names ``get_profile`` accepts
    notes: str = ""

    # the shape's figures, read through (declared once, in the shape)
    family = property(lambda self: self.shape.family)  # the model family record's name: the unit layout's owner
    layers = property(lambda self: self.shape.layers)
    kv_heads = property(lambda self: self.shape.kv_heads)
    head_dim = property(lambda self: self.shape.head_dim)
    q_heads = property(lambda self: self.shape.q_heads)
    hidden = property(lambda self: self.shape.hidden)
    intermediate = property(lambda self: self.shape.intermediate)
    vocab = property(lambda self: self.shape.vocab)
    rope_theta = property(lambda self: self.shape.rope_theta)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer in the profile's KV dtype (``core.shapes.kv_bytes_per_token``)."""
        return self.shape.kv_bytes_per_token(self.kv_dtype_bytes)

    def with_shape(self, **changes) -> "ModelProfile":
        """This profile with some shape figures changed (a smaller head count for a quick benchmark, ...)."""
        return replace(self, shape=replace(self.shape, **changes))

    def with_units(self, units: StreamUnits) -> "ModelProfile":
        if units.family != self.family:
            raise ProfileError(f"{self.name}: a {units.family} unit layout does not fit a {self.family} profile")
        if units.axes != self.rope_axes:
            raise ProfileError(f"{self.name}: {units.axes}-axis unit positions for {self.rope_axes}-axis RoPE")
        return replace(self, units=units)

    @property
    def stream_units(self) -> StreamUnits:
        if self.units is None:
            raise ProfileError(f"profile {self.name!r} carries no unit layout: resolve it with "
                               "omnitide_mlx.models.stream_units.resolve_profile(name, setting)")
        return self.units

    @property
    def media_unit_tokens(self) -> int:
        return self.stream_units.tokens

    def tokens_by_kind(self) -> dict[str, int]:
        return self.stream_units.tokens_by_kind()

    def policy_kwargs(self, policy_cls: type) -> dict[str, Any]:
        """This model's defaults for the keyword arguments ``policy_cls`` accepts (watermarks, sinks, ...)."""
        wanted = {"high": self.high, "low": self.low, **self.pick}
        params = inspect.signature(policy_cls.__init__).parameters
        return {k: v for k, v in wanted.items() if k in params}

    # --- unit layouts -------------------------------------------------------------------------------------
    def system_unit(self, uid: int = 0) -> Unit:
        return Unit.build(uid, UnitKind.SYSTEM, [(SpanKind.SYSTEM, self.system_tokens)], axes=self.rope_axes,
                          label="system")

    def media_unit(self, uid: int, start: int, t: float | None = None) -> Unit:
        """One second of camera + microphone, positions starting at ``start``."""
        return self.stream_units.unit(uid, start, t)

    def question_unit(self, uid: int, start: int, n_text: int, t: float | None = None) -> Unit:
        return Unit.build(uid, UnitKind.USER, self.framing.question_runs(n_text), start_position=start,
                          axes=self.rope_axes, t=t, label="question")

    def reply_unit(self, uid: int, start: int, n_text: int, t: float | None = None) -> Unit:
        return Unit.build(uid, UnitKind.REPLY, self.framing.reply_runs(n_text), start_position=start,
                          axes=self.rope_axes, t=t, label="reply")

    def to_json(self) -> dict:
        return {"name": self.name, "display": self.display, "layers": self.layers, "kv_heads": self.kv_heads,
                "head_dim": self.head_dim, "q_heads": self.q_heads, "rope_axes": self.rope_axes,
                "media_unit_tokens": self.units.tokens if self.units else None,
                "units": self.units.to_json() if self.units else None,
                "system_tokens": self.system_tokens, "kv_bytes_per_token": self.kv_bytes_per_token,
                "high": self.high, "low": self.low, "pick": dict(self.pick)}


def require_profile(profile) -> ModelProfile:
    """``profile`` if it is a :class:`ModelProfile`; a name is looked up in the models' records, which core does
    not import: the caller resolves it (``omnitide_mlx.models.stream_units.resolve_profile(name, setting)``)."""
    if not isinstance(profile, ModelProfile):
        raise ProfileError(f"want a ModelProfile, got {profile!r}: resolve a profile name with "
                           "omnitide_mlx.models.stream_units.resolve_profile(name, setting)")
    return profile


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
