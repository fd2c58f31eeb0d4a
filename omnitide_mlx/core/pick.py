"""OmniPick and the baseline retention policies (paper section 5), as pure plans over unit records.

A policy looks at the :class:`~omnitide_mlx.core.units.History` and, once it is above the high watermark,
returns a :class:`RetentionPlan`: per unit, the kept and deleted token ranges, whether the unit is dropped, and
the position shift of every kept range. :func:`apply_plan` applies it to the unit records (span offsets and
lengths recomputed, labels kept, positions shifted); the cache applies the same plan to its slots
(``PageTable.apply_retention``) and re-rotates kept keys by ``-shift``.

Every policy keeps the system prefix: a plan that would delete any of it raises :class:`RetentionError`.

The shift rule (docs/design.md): kept tokens form maximal *kept ranges* in logical order; each gets one scalar
shift, applied to every position axis, with ``frontier`` = 1 + the largest new position of any kept token so far::

    s_{-1} = 0, frontier_0 = the smallest position of the history (0 in practice)
    s_r = s_{r-1} + max(0, (min_pos(r) - s_{r-1}) - frontier)

so the first kept range moves to where the history started (s_0 = 0 whenever the first token is kept, e.g. the
system prefix).

``positions="keep"`` (any policy; ``make_policy(..., positions="keep")``) is the other answer to what eviction does
to positions: every shift is 0, kept keys stay where they were written and the gaps stay (llama.cpp-omni's unit mode
does this). It exists to be measured against the shift (docs/quality.md); new tokens continue after the largest kept
position, so positions grow without bound over a long stream.
For 1-D RoPE this is the number of deleted positions before the token (paper 5.2); for M-RoPE it closes real
gaps and never creates an overlap, and a uniform shift of t, h and w is one exact re-rotation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .errors import OmniTideError
from .layout import LAYOUT_NAMES
from .units import History, Span, SpanKind, Unit, UnitError, UnitKind

POSITION_MODES = ("shift", "keep")  # close the gaps (one re-rotation per kept key) or keep the old positions


class RetentionError(OmniTideError, ValueError):
    """A malformed retention plan or policy configuration (e.g. one that would delete the system prefix)."""


Ranges = tuple[tuple[int, int], ...]


def _runs(mask: np.ndarray) -> Ranges:
    """Maximal ``[start, end)`` runs of True in a 1-D bool array."""
    if mask.size == 0:
        return ()
    m = np.concatenate([[False], mask.astype(bool), [False]])
    edges = np.flatnonzero(m[1:] != m[:-1])
    return tuple((int(a), int(b)) for a, b in zip(edges[::2], edges[1::2]))


@dataclass(frozen=True)
class UnitPlan:
    """What a plan does to one unit: unit-local ``kept`` and ``deleted`` ranges (together they tile
    ``[0, length)``), whether the unit disappears, and one position shift per kept range."""

    uid: int
    length: int
    kept: Ranges
    deleted: Ranges
    dropped: bool
    shifts: tuple[int, ...]

    @property
    def kept_tokens(self) -> int:
        return sum(b - a for a, b in self.kept)

    @property
    def untouched(self) -> bool:
        return not self.deleted

    def keep_mask(self) -> np.ndarray:
        m = np.zeros(self.length, dtype=bool)
        for a, b in self.kept:
            m[a:b] = True
        return m

    def to_json(self) -> dict:
        return {"uid": self.uid, "length": self.length, "kept": [list(r) for r in self.kept],
                "deleted": [list(r) for r in self.deleted], "dropped": self.dropped, "shifts": list(self.shifts)}


@dataclass(frozen=True)
class RetentionPlan:
    """One trim: a :class:`UnitPlan` per unit of the history, in order (untouched units included)."""

    policy: str
    tokens_before: int
    tokens_after: int
    units: tuple[UnitPlan, ...]
    positions: str = "shift"  # "keep": every shift is 0 (POSITION_MODES)

    def keep_mask(self) -> np.ndarray:
        """Bool over the logical sequence before the plan: True where the token is kept."""
        if not self.units:
            return np.zeros(0, dtype=bool)
        return np.concatenate([u.keep_mask() for u in self.units])

    def kept_token_shifts(self) -> np.ndarray:
        """The shift of every kept token, in logical order (the cache re-rotates its key by ``-shift``)."""
        parts = [np.full(b - a, s, dtype=np.int64) for u in self.units for (a, b), s in zip(u.kept, u.shifts)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def deleted_ranges(self) -> list[tuple[int, int]]:
        """Deleted tokens as global ``[start, end)`` ranges of the logical sequence before the plan."""
        return list(_runs(~self.keep_mask()))

    def dropped_uids(self) -> tuple[int, ...]:
        return tuple(u.uid for u in self.units if u.dropped)

    @property
    def deleted_tokens(self) -> int:
        return self.tokens_before - self.tokens_after

    def validate(self, history: History) -> None:
        """Raise :class:`RetentionError` unless this plan fits ``history`` and follows the shift rule."""
        if len(self.units) != len(history):
            raise RetentionError(f"plan covers {len(self.units)} units, the history has {len(history)}")
        for up, u in zip(self.units, history):
            if up.uid != u.uid:
                raise RetentionError(f"plan unit {up.uid} does not match history unit {u.uid} (order or ids)")
            if up.length != u.length:
                raise RetentionError(f"unit {u.uid}: plan says {up.length} tokens, the unit has {u.length}")
            cursor = 0
            for a, b in sorted(up.kept + up.deleted):
                if a != cursor or b <= a:
                    raise RetentionError(f"unit {u.uid}: kept and deleted ranges must tile [0, {u.length}) "
                                         f"without overlap; bad range [{a}, {b})")
                cursor = b
            if cursor != u.length:
                raise RetentionError(f"unit {u.uid}: ranges stop at {cursor} of {u.length}")
            if len(up.shifts) != len(up.kept):
                raise RetentionError(f"unit {u.uid}: {len(up.shifts)} shifts for {len(up.kept)} kept ranges")
            if up.dropped != (not up.kept):
                raise RetentionError(f"unit {u.uid}: 'dropped' must be set exactly when nothing is kept")
            if u.kind is UnitKind.SYSTEM and up.deleted:
                raise RetentionError(f"plan deletes tokens {list(up.deleted)} of the system prefix (unit {u.uid})")
        if self.tokens_before != history.total_tokens or self.tokens_after != sum(u.kept_tokens for u in self.units):
            raise RetentionError("plan token counts do not match its ranges")
        expect = plan_from_mask(history, self.keep_mask(), self.policy, self.positions)
        if tuple(u.shifts for u in expect.units) != tuple(u.shifts for u in self.units):
            raise RetentionError("plan shifts do not follow the shift rule" if self.positions == "shift"
                                 else "a positions='keep' plan must not shift anything")

    def to_json(self) -> dict:
        return {"policy": self.policy, "tokens_before": self.tokens_before, "tokens_after": self.tokens_after,
                "units": [u.to_json() for u in self.units]}


def range_shifts(positions: np.ndarray, ranges: Sequence[tuple[int, int]]) -> list[int]:
    """The shift rule over global kept ``ranges`` (in order) of a ``(axes, n)`` position array."""
    if not ranges:
        return []
    lo = np.append(positions.min(axis=0), 0)  # one spare element: a range may end at n
    hi = np.append(positions.max(axis=0), 0)
    bounds = np.empty(2 * len(ranges), dtype=np.int64)
    bounds[0::2] = [a for a, _ in ranges]
    bounds[1::2] = [b for _, b in ranges]
    rmin = np.minimum.reduceat(lo, bounds)[0::2]  # even entries reduce exactly over [start_r, end_r)
    rmax = np.maximum.reduceat(hi, bounds)[0::2]
    shifts: list[int] = []
    prev = 0
    frontier = int(positions.min())  # where the history starts (0 in practice)
    for r in range(len(ranges)):
        prev = prev + max(0, (int(rmin[r]) - prev) - frontier)
        shifts.append(prev)
        frontier = max(frontier, int(rmax[r]) - prev + 1)
    return shifts


def plan_from_mask(history: History, keep: np.ndarray, policy: str = "custom",
                   positions: str = "shift") -> RetentionPlan:
    """Build the plan that keeps exactly the tokens where ``keep`` is True (logical order), with shifts
    (``positions="shift"``, the shift rule) or without (``"keep"``: every shift 0, the gaps stay).

    Raises :class:`RetentionError` if ``keep`` has the wrong length or deletes any of the system prefix.
    """
    if positions not in POSITION_MODES:
        raise RetentionError(f"positions must be one of {POSITION_MODES}, got {positions!r}")
    keep = np.asarray(keep, dtype=bool).reshape(-1)
    total = history.total_tokens
    if keep.size != total:
        raise RetentionError(f"keep mask has {keep.size} entries for {total} tokens")
    sys_n = history.system_tokens
    if sys_n and not keep[:sys_n].all():
        bad = np.flatnonzero(~keep[:sys_n])
        raise RetentionError(f"plan would delete {bad.size} system-prefix tokens (first at {int(bad[0])}); "
                             "the system prefix is never evicted")
    ranges = _runs(keep)
    if positions == "keep":
        shifts = [0] * len(ranges)
    else:
        shifts = range_shifts(history.positions(), ranges) if ranges else []
    units: list[UnitPlan] = []
    r = 0  # index of the first global kept range that may reach into the current unit
    off = 0
    for u in history:
        end = off + u.length
        local = keep[off:end]
        kept = _runs(local)
        deleted = _runs(~local)
        us: list[int] = []
        for a, _ in kept:
            g = off + a
            while ranges[r][1] <= g:
                r += 1
            us.append(shifts[r])
        units.append(UnitPlan(u.uid, u.length, kept, deleted, not kept, tuple(us)))
        off = end
    return RetentionPlan(policy, total, int(keep.sum()), tuple(units), positions)


def apply_plan(history: History, plan: RetentionPlan) -> History:
    """A new History with the plan applied: dropped units gone, deleted tokens cut out of the others, every
    surviving span re-offset with its kind kept (pieces of one span merge into one span), positions shifted."""
    plan.validate(history)
    out: list[Unit] = []
    for up, u in zip(plan.units, history):
        if up.dropped:
            continue
        if up.untouched:
            if up.shifts[0]:
                out.append(Unit(uid=u.uid, kind=u.kind, spans=u.spans, positions=u.positions - up.shifts[0],
                                t=u.t, label=u.label, trimmed=u.trimmed))
            else:
                out.append(u)
            continue
        m = up.keep_mask()
        new_index = np.cumsum(m) - 1  # new offset of every kept token
        spans: list[Span] = []
        for s in u.spans:
            n = int(m[s.start:s.end].sum())
            if n:
                a = int(new_index[s.start:s.end][m[s.start:s.end]][0])
                spans.append(Span(s.kind, a, a + n))
        shift = np.zeros(u.length, dtype=np.int64)
        for (a, b), sh in zip(up.kept, up.shifts):
            shift[a:b] = sh
        positions = (u.positions - shift[None, :])[:, m]
        out.append(Unit(uid=u.uid, kind=u.kind, spans=tuple(spans), positions=positions, t=u.t, label=u.label,
                        trimmed=True))
    try:
        return History(out)
    except UnitError as e:  # pragma: no cover - plan.validate guards this
        raise RetentionError(f"applying the plan broke the history: {e}") from e


# --- policies ---------------------------------------------------------------------------------------------

class RetentionPolicy:
    """Interface: ``plan(history, scores=None) -> RetentionPlan | None`` (None: under the high watermark or
    nothing to delete). ``layout`` says how the cache lays out KV: native, omnipage or eager."""

    name = "policy"
    needs_scores = False
    positions = "shift"  # POSITION_MODES; make_policy(..., positions="keep") sets it on the instance

    def __init__(self, high: int = 2500, low: int = 1800, layout: str = "native"):
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

    def __init__(self, high: int = 2500, low: int = 1800, layout: str = "native"):
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

    def __init__(self, high: int = 2500, low: int = 1800, sink: int = 2, layout: str = "native"):
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

    def __init__(self, high: int = 2500, low: int = 1800, recent: int | None = None, layout: str = "native"):
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

    def __init__(self, high: int = 2500, low: int = 1800, recent_units: int = 2, image_sink: int = 4,
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

    def __init__(self, high: int = 2500, low: int = 1800, recent_units: int = 2, image_sink: int = 4,
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


def make_policy(name: str, profile: Any = None, **kw: Any) -> RetentionPolicy:
    """Build a policy by its CLI name (``full``, ``fifo``, ``token``, ``streamingllm``, ``h2o``, ``omnipick``,
    ``omnitide``, ``eager``). ``profile`` (a :class:`~omnitide_mlx.core.profiles.ModelProfile` or its name)
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
        from .profiles import get_profile

        prof = get_profile(profile) if isinstance(profile, str) else profile
        args.update(prof.policy_kwargs(cls))
    args.update(fixed)
    args.update(kw)
    try:
        policy = cls(**args)
    except TypeError as e:
        raise RetentionError(f"policy {name!r}: {e}") from e
    policy.positions = positions
    return policy
