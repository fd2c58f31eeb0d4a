"""OmniPick and the baseline retention policies (paper section 5), as pure plans over unit records.

A policy looks at the :class:`~omnitide_mlx.core.units.History` and, once it is above the high watermark,
returns a :class:`~omnitide_mlx.core.retention_plan.RetentionPlan` (core/retention_plan.py: the plan data, the
shift rule, ``plan_from_mask`` and ``apply_plan``, re-exported here). Every policy keeps the system prefix.

``positions="keep"`` (any policy; ``make_policy(..., positions="keep")``) keeps old positions instead of shifting:
it exists to be measured against the shift (docs/quality.md); new tokens continue after the largest kept
position, so positions grow without bound over a long stream.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .layout import LAYOUT_NAMES
from .retention_plan import (
    POSITION_MODES,
    RetentionError,
    RetentionPlan,
    UnitPlan,
    apply_plan,
    plan_from_mask,
    range_shifts,
)
from .units import History, SpanKind, Unit, UnitKind

__all__ = ["DEFAULT_HIGH", "DEFAULT_LOW", "H2O", "POLICIES", "POLICY_NAMES", "POSITION_MODES", "FullContext",
           "OmniPick", "OmniTide", "RetentionError", "RetentionPlan", "RetentionPolicy", "StreamingLLM",
           "TokenSliding", "UnitFIFO", "UnitPlan", "apply_plan", "make_policy", "parse_leftover", "plan_from_mask",
           "range_shifts"]


# --- policies ---------------------------------------------------------------------------------------------

# The watermarks of a model with no family defaults (tiny test models, a text model): the paper's default setting
# (figure 14 reports 2500/1800 as the default; each model family's record carries its own best setting).
DEFAULT_HIGH, DEFAULT_LOW = 2500, 1800

class RetentionPolicy:
    """Interface: ``plan(history, scores=None) -> RetentionPlan | None`` (None: under the high watermark or
    nothing to delete). ``layout`` says how the cache lays out KV: native, omnipage or eager."""

    name = "policy"
    needs_scores = False
    positions = "shift"  # POSITION_MODES; make_policy(..., positions="keep") sets it on the instance

    def __init__(self, high: int = DEFAULT_HIGH, low: int = DEFAULT_LOW, layout: str = "native"):
        if not (isinstance(high, (int, np.integer)) and isinstance(low, (int, np.integer))):
            raise RetentionError(f"watermarks must be ints, got high={high!r}, low={low!r}")
        if not 0 < low <= high:
            raise RetentionError(f"need 0 < low <= high, got low={low}, high={high}")
        if layout not in LAYOUT_NAMES:
            raise RetentionError(f"unknown layout {layout!r}; choose one of {LAYOUT_NAMES}")
        self.high = int(high)
        self.low = int(low)
        self.layout = layout

    def plan(self, history: History, scores: np.ndarray | None = None) -> RetentionPlan | None:
        if history.total_tokens <= self.high or not history.stream_units:
            return None
        keep = self.keep_mask(history, scores)
        plan = plan_from_mask(history, keep, self.name, self.positions)
        return plan if plan.deleted_tokens else None

    def keep_mask(self, history: History, scores: np.ndarray | None = None) -> np.ndarray:
        raise NotImplementedError

    def config(self) -> dict:
        cfg = {"name": self.name, "high": self.high, "low": self.low, "layout": self.layout}
        if self.positions != "shift":
            cfg["positions"] = self.positions
        return cfg

    def __repr__(self) -> str:
        try:
            cfg = self.config()
        except AttributeError:  # a half-built policy (its constructor raised)
            return f"<{type(self).__name__} (invalid)>"
        args = ", ".join(f"{k}={v!r}" for k, v in cfg.items() if k != "name")
        return f"{type(self).__name__}({args})"


class FullContext(RetentionPolicy):
    """No-slide: retains the complete history."""

    name = "full"

    def __init__(self, high: int = DEFAULT_HIGH, low: int = DEFAULT_LOW, layout: str = "native"):
        super().__init__(high, low, layout)

    def plan(self, history: History, scores: np.ndarray | None = None) -> RetentionPlan | None:
        return None

    def keep_mask(self, history, scores=None):
        return np.ones(history.total_tokens, dtype=bool)


class UnitFIFO(RetentionPolicy):
    """Unit-level FIFO ("basic"): drops the oldest whole units until at or under ``low`` or one unit remains."""

    name = "fifo"

    def keep_mask(self, history, scores=None):
        keep = np.ones(history.total_tokens, dtype=bool)
        offsets = history.offsets()
        stream = [(i, u) for i, u in enumerate(history) if u.kind is not UnitKind.SYSTEM]
        total = history.total_tokens
        for n_dropped, (i, u) in enumerate(stream):
            if total <= self.low or len(stream) - n_dropped <= 1:
                break
            keep[offsets[i]:offsets[i] + u.length] = False
            total -= u.length
        return keep


def _stream_budget(history: History, low: int) -> int:
    return max(1, low - history.system_tokens)


class TokenSliding(RetentionPolicy):
    """Token-level sliding ("token-basic"): the system prefix plus the newest tokens, regardless of boundaries."""

    name = "token"

    def keep_mask(self, history, scores=None):
        keep = np.zeros(history.total_tokens, dtype=bool)
        sys_n = history.system_tokens
        keep[:sys_n] = True
        keep[max(sys_n, history.total_tokens - _stream_budget(history, self.low)):] = True
        return keep


class StreamingLLM(RetentionPolicy):
    """StreamingLLM: the system prefix, a positional sink of the first ``sink`` stream tokens (2, as in the
    paper's evaluation) and the newest tokens."""

    name = "streamingllm"

    def __init__(self, high: int = DEFAULT_HIGH, low: int = DEFAULT_LOW, sink: int = 2, layout: str = "native"):
        super().__init__(high, low, layout)
        if sink < 0:
            raise RetentionError(f"sink must be >= 0, got {sink}")
        self.sink = int(sink)

    def keep_mask(self, history, scores=None):
        total, sys_n = history.total_tokens, history.system_tokens
        keep = np.zeros(total, dtype=bool)
        keep[:sys_n + self.sink] = True
        recent = max(1, _stream_budget(history, self.low) - self.sink)
        keep[max(sys_n, total - recent):] = True
        return keep

    def config(self):
        return {**super().config(), "sink": self.sink}


class H2O(RetentionPolicy):
    """H2O: the system prefix, the ``recent`` newest tokens and the heavy hitters (highest accumulated attention
    ``scores``, one per token of the logical sequence, handed in by the runtime) up to ``low`` in total.
    ``recent`` defaults to half the stream budget (H2O's even heavy/recent split)."""

    name = "h2o"
    needs_scores = True

    def __init__(self, high: int = DEFAULT_HIGH, low: int = DEFAULT_LOW, recent: int | None = None,
                 layout: str = "native"):
        super().__init__(high, low, layout)
        if recent is not None and recent < 0:
            raise RetentionError(f"recent must be >= 0, got {recent}")
        self.recent = recent

    def keep_mask(self, history, scores=None):
        total, sys_n = history.total_tokens, history.system_tokens
        if scores is None:
            raise RetentionError("H2O needs accumulated attention scores (one per token of the history)")
        scores = np.asarray(scores, dtype=np.float64).reshape(-1)
        if scores.size != total:
            raise RetentionError(f"H2O got {scores.size} scores for {total} tokens")
        if not np.isfinite(scores).all():
            raise RetentionError("H2O scores must be finite")
        budget = _stream_budget(history, self.low)
        recent = min(budget, self.recent if self.recent is not None else budget // 2)
        keep = np.zeros(total, dtype=bool)
        keep[:sys_n] = True
        start_recent = max(sys_n, total - recent)
        keep[start_recent:] = True
        heavy = budget - (total - start_recent)
        if heavy > 0 and start_recent > sys_n:
            older = np.arange(sys_n, start_recent)
            order = np.argsort(-scores[sys_n:start_recent], kind="stable")  # ties: older first
            keep[older[order[:heavy]]] = True
        return keep

    def config(self):
        return {**super().config(), "recent": self.recent}


RECENT_COUNTS = ("media", "all")
LEFTOVER_KINDS = {"audio": (SpanKind.AUDIO,), "text": (SpanKind.TEXT, SpanKind.RESPONSE),
                  "image": (SpanKind.IMAGE,), "slice": (SpanKind.IMAGE_SLICE,)}


def parse_leftover(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """``"audio+text"`` (or a sequence) -> ``("audio", "text")``: the order in which OmniPick hands the budget left
    under the low watermark to older units' spans. Empty, None or "off": no leftover allocation."""
    if value is None:
        return ()
    parts = value.replace(",", "+").split("+") if isinstance(value, str) else list(value)
    parts = [p.strip().lower() for p in parts if p.strip()]
    if parts in ([], ["off"]):
        return ()
    bad = [p for p in parts if p not in LEFTOVER_KINDS]
    if bad or len(set(parts)) != len(parts):
        raise RetentionError(f"leftover must name each of {', '.join(LEFTOVER_KINDS)} at most once, joined by '+' "
                             f"(e.g. audio+text), or 'off'; got {value!r}")
    return tuple(parts)


class OmniPick(RetentionPolicy):
    """OmniPick (paper 5.1). Triggered above ``high``, trims toward ``low``:

    1. keeps the system prefix and the ``recent_units`` newest stream units whole; ``recent_count="media"`` (the
       default) counts media units only, and the question and reply units after the oldest of them stay whole
       with them, so a question and its reply never push the frames asked about out of the window (the paper's
       unit is a time chunk holding its text; here question and reply are units of their own). ``"all"`` counts
       every stream unit (measured in docs/simulator.md: on MiniCPM-o at the paper's units, "all" leaves no whole
       frame after some replies, "media" always two);
    2. from every older unit, oldest to newest: all boundary tokens, the first ``image_sink`` tokens of each
       image span, the first ``audio_sink`` of each audio span, the whole source image and the first
       ``slice_sink`` tokens of each slice of a sliced image; text and earlier replies oldest to newest within
       one shared ``text_budget`` (a span that does not fit keeps the prefix the budget still allows);
    3. if still above ``low``, drops units oldest first, partially retained ones before complete ones, until at
       or under ``low`` or one stream unit remains (the newest is never dropped; recent units go whole or not
       at all).

    ``leftover`` (off by default) is the paper's leftover-budget rule (sections 1 and 5: the budget that remains goes
    to audio, text and other tokens by modality importance): when steps 1-2 leave the history under ``low``, the
    difference extends older units' spans of the named kinds, in the order given (``"audio+text"``: every older
    audio span first, then text), newest unit first within a kind, each span's kept part staying a prefix. It is
    off by default because every committed figure uses the section 5.1 steps; docs/simulator.md measures it.
    """

    name = "omnipick"

    def __init__(self, high: int = DEFAULT_HIGH, low: int = DEFAULT_LOW, recent_units: int = 2, image_sink: int = 4,
                 audio_sink: int = 2, slice_sink: int = 2, text_budget: int = 256, layout: str = "native",
                 recent_count: str = "media", leftover: str | Sequence[str] | None = None):
        super().__init__(high, low, layout)
        self.leftover = parse_leftover(leftover)
        if recent_count not in RECENT_COUNTS:
            raise RetentionError(f"recent_count must be one of {RECENT_COUNTS}, got {recent_count!r}")
        self.recent_count = recent_count
        for k, v in (("image_sink", image_sink), ("audio_sink", audio_sink), ("slice_sink", slice_sink),
                     ("text_budget", text_budget)):
            if not isinstance(v, (int, np.integer)) or v < 0:
                raise RetentionError(f"{k} must be an int >= 0, got {v!r}")
        if not isinstance(recent_units, (int, np.integer)) or recent_units < 1:
            raise RetentionError(f"recent_units must be an int >= 1, got {recent_units!r}")
        self.recent_units = int(recent_units)
        self.image_sink = int(image_sink)
        self.audio_sink = int(audio_sink)
        self.slice_sink = int(slice_sink)
        self.text_budget = int(text_budget)

    def _select_older(self, u: Unit, text_left: int) -> tuple[np.ndarray, int]:
        m = np.zeros(u.length, dtype=bool)
        for s in u.spans:
            k = s.kind
            if k in (SpanKind.BOUNDARY, SpanKind.IMAGE_SOURCE, SpanKind.SYSTEM):
                n = s.length
            elif k is SpanKind.IMAGE:
                n = self.image_sink
            elif k is SpanKind.IMAGE_SLICE:
                n = self.slice_sink
            elif k is SpanKind.AUDIO:
                n = self.audio_sink
            else:  # TEXT, RESPONSE: the shared text budget, oldest first
                n = min(s.length, text_left)
                text_left -= n
            m[s.start:s.start + min(n, s.length)] = True
        return m, text_left

    def keep_mask(self, history, scores=None):
        keep = np.zeros(history.total_tokens, dtype=bool)
        offsets = history.offsets()
        stream = [i for i, u in enumerate(history) if u.kind is not UnitKind.SYSTEM]
        if history.system_unit is not None:
            keep[:history.system_tokens] = True
        n_old = max(0, len(stream) - self.recent_units)
        if self.recent_count == "media":  # the newest recent_units media units, and the text units after them
            media = [j for j, i in enumerate(stream) if history[i].kind is UnitKind.MEDIA]
            if len(media) >= self.recent_units:
                n_old = media[-self.recent_units]
        text_left = self.text_budget
        partial: list[int] = []
        complete: list[int] = []
        for j, i in enumerate(stream):
            u, off = history[i], offsets[i]
            if j < n_old:
                m, text_left = self._select_older(u, text_left)
                keep[off:off + u.length] = m
                (partial if (u.trimmed or not m.all()) else complete).append(i)
            else:
                keep[off:off + u.length] = True
                complete.append(i)
        total = int(keep.sum())
        if self.leftover and total < self.low:
            self._spend_leftover(history, keep, offsets, stream[:n_old], self.low - total)
            return keep  # at or under low: step 3 has nothing to do
        remaining = len(stream)
        for i in partial + complete:  # each list is oldest first
            if total <= self.low or remaining <= 1:
                break
            u, off = history[i], offsets[i]
            total -= int(keep[off:off + u.length].sum())
            keep[off:off + u.length] = False
            remaining -= 1
        return keep

    def _spend_leftover(self, history: History, keep: np.ndarray, offsets, older: list[int], spare: int) -> None:
        """Extend the kept prefix of older units' spans, kind by kind in ``leftover`` order, newest unit first,
        until ``spare`` tokens are used."""
        for name in self.leftover:
            kinds = LEFTOVER_KINDS[name]
            for i in reversed(older):
                u, off = history[i], offsets[i]
                for s in u.spans:
                    if s.kind not in kinds:
                        continue
                    a, b = off + s.start, off + s.end
                    have = int(keep[a:b].sum())  # a prefix (step 2 keeps prefixes)
                    add = min(spare, s.length - have)
                    keep[a + have:a + have + add] = True
                    spare -= add
                    if not spare:
                        return

    def config(self):
        cfg = {**super().config(), "recent_units": self.recent_units, "image_sink": self.image_sink,
               "audio_sink": self.audio_sink, "slice_sink": self.slice_sink, "text_budget": self.text_budget,
               "recent_count": self.recent_count}
        if self.leftover:
            cfg["leftover"] = "+".join(self.leftover)
        return cfg


class OmniTide(OmniPick):
    """OmniPick retention with the OmniPage layout (paged KV, class-aware placement, selective migration)."""

    name = "omnitide"

    def __init__(self, high: int = DEFAULT_HIGH, low: int = DEFAULT_LOW, recent_units: int = 2, image_sink: int = 4,
                 audio_sink: int = 2, slice_sink: int = 2, text_budget: int = 256, layout: str = "omnipage",
                 recent_count: str = "media", leftover: str | Sequence[str] | None = None):
        super().__init__(high, low, recent_units, image_sink, audio_sink, slice_sink, text_budget, layout,
                         recent_count, leftover)


POLICIES: dict[str, tuple[type[RetentionPolicy], dict[str, Any]]] = {
    "full": (FullContext, {}),
    "fifo": (UnitFIFO, {}),
    "token": (TokenSliding, {}),
    "streamingllm": (StreamingLLM, {}),
    "h2o": (H2O, {}),
    "omnipick": (OmniPick, {"layout": "native"}),
    "omnitide": (OmniTide, {"layout": "omnipage"}),
    "eager": (OmniPick, {"layout": "eager"}),
}
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)  # the CLI's --policy choices and the stream benchmark's engine rows


def make_policy(name: str, profile: Any = None, **kw: Any) -> RetentionPolicy:
    """Build a policy by its CLI name (``full``, ``fifo``, ``token``, ``streamingllm``, ``h2o``, ``omnipick``,
    ``omnitide``, ``eager``). ``profile`` (a :class:`~omnitide_mlx.core.profiles.ModelProfile`)
    supplies per-model defaults (watermarks, sink lengths, text budget); explicit keywords win.
    ``positions="keep"`` makes the policy keep old positions (gaps) instead of shifting (``POSITION_MODES``)."""
    positions = kw.pop("positions", "shift")
    if positions not in POSITION_MODES:
        raise RetentionError(f"positions must be one of {POSITION_MODES}, got {positions!r}")
    key = name.lower().replace("-", "").replace("_", "")
    if key not in POLICIES:
        raise RetentionError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}")
    cls, fixed = POLICIES[key]
    args: dict[str, Any] = {}
    if profile is not None:
        if not hasattr(profile, "policy_kwargs"):
            raise RetentionError(f"profile must be a ModelProfile (omnitide_mlx.models.family.get_profile(name)), "
                                 f"got {profile!r}")
        args.update(profile.policy_kwargs(cls))
    args.update(fixed)
    args.update(kw)
    try:
        policy = cls(**args)
    except TypeError as e:
        raise RetentionError(f"policy {name!r}: {e}") from e
    policy.positions = positions
    return policy
