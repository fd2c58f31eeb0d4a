"""Retention plans: what a policy decides, as pure data over unit records (paper section 5).

A :class:`RetentionPlan` says, per unit, the kept and deleted token ranges, whether the unit is dropped, and
the position shift of every kept range. :func:`plan_from_mask` builds one from a keep mask over the history's
tokens; :func:`apply_plan` applies it to the unit records (span offsets and lengths recomputed, labels kept,
positions shifted); the cache applies the same plan to its slots (``PageTable.apply_retention``) and re-rotates
kept keys by ``-shift``. The policies that choose the mask live in core/pick.py.

Every plan keeps the system prefix: a plan that would delete any of it raises :class:`RetentionError`.

The shift rule (docs/design.md): kept tokens form maximal *kept ranges* in logical order; each gets one scalar
shift, applied to every position axis, with ``frontier`` = 1 + the largest new position of any kept token so far::

    s_{-1} = 0, frontier_0 = the smallest position of the history (0 in practice)
    s_r = s_{r-1} + max(0, (min_pos(r) - s_{r-1}) - frontier)

so the first kept range moves to where the history started (s_0 = 0 whenever the first token is kept, e.g. the
system prefix). For 1-D RoPE this is the number of deleted positions before the token (paper 5.2); for M-RoPE it
closes real gaps and never creates an overlap, and a uniform shift of t, h and w is one exact re-rotation.

``positions="keep"`` is the other answer to what eviction does to positions: every shift is 0, kept keys stay
where they were written and the gaps stay (llama.cpp-omni's unit mode does this).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .errors import OmniTideError
from .units import History, Span, Unit, UnitError, UnitKind

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
