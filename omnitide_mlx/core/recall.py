"""Recall's bookkeeping: which evicted units are stored, in what order, in how many bytes, and where a recalled unit
goes back into the history (pure Python + numpy; the tensors live with the backend, omnitide_mlx/recall.py).

When retention drops a unit whole, the engine can hand its K/V (the tokens the unit still had) to a bounded store
instead of losing it. The store is budgeted in bytes and forgets the oldest evictions first. When a question comes,
stored units are scored against its queries and the best ones are *readmitted* for the answer, then *released*.

Placement (:func:`readmit_history`): recalled units go right after the system prefix (the attention sinks), in
stream order, each moved as one block (one scalar shift on every axis: the shift rule's form, so M-RoPE keys are
re-rotated exactly); every unit after them moves up by the position span they take. A unit is recallable only if
it is older than every retained stream unit (``uid`` below theirs; OmniPick and FIFO drop the oldest first, so that
is every dropped unit in practice): the history's uids, the page table's serials and the positions then all stay in
stream order, and the unit is readmitted under its own uid and serials. Releasing is an ordinary retention plan
that drops the recalled units: the shift rule moves everything after them back down by exactly that span, so the
history's positions are those before the recall (tested in tests/core/test_recall.py).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .errors import OmniTideError
from .units import History, Unit, UnitKind


class RecallError(OmniTideError, ValueError):
    """Misuse of the recall store: a unit stored twice, a unit that cannot go back where asked, a bad state."""


@dataclass(frozen=True)
class StoredUnit:
    """One evicted unit in the store: the unit as it was when dropped (its spans, positions and stream time), the
    page-table serials its tokens had (token order) and the bytes its tensors take."""

    unit: Unit
    serials: np.ndarray
    nbytes: int

    @property
    def uid(self) -> int:
        return self.unit.uid

    @property
    def tokens(self) -> int:
        return self.unit.length

    def to_json(self) -> dict:
        return {"unit": self.unit.to_json(), "serials": np.asarray(self.serials).tolist(), "nbytes": self.nbytes}

    @classmethod
    def from_json(cls, d: dict) -> "StoredUnit":
        return cls(Unit.from_json(d["unit"]), np.asarray(d["serials"], dtype=np.int64), int(d["nbytes"]))


class RecallIndex:
    """The store's bookkeeping: stored units in eviction order under a byte budget.

    Invariants (:meth:`validate`): every uid once; ``total_bytes`` is the sum of the entries' bytes and never above
    ``budget``; each unit's serials are one per token, strictly increasing. :meth:`add` drops the oldest entries
    until the new one fits; an entry larger than the whole budget is not stored."""

    def __init__(self, budget: int):
        if not isinstance(budget, (int, np.integer)) or budget <= 0:
            raise RecallError(f"the recall budget must be a positive number of bytes, got {budget!r}")
        self.budget = int(budget)
        self._entries: OrderedDict[int, StoredUnit] = OrderedDict()
        self.total_bytes = 0
        self.dropped = 0  # entries forgotten to stay under the budget (or too large to store)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, uid: int) -> bool:
        return uid in self._entries

    def __iter__(self):
        return iter(self._entries.values())

    def get(self, uid: int) -> StoredUnit:
        return self._entries[uid]

    @property
    def tokens(self) -> int:
        return sum(e.tokens for e in self._entries.values())

    def add(self, entry: StoredUnit) -> list[int]:
        """Store ``entry``; returns the uids forgotten to make room (oldest first; ``entry.uid`` itself when it is
        larger than the budget, in which case nothing else is forgotten)."""
        if entry.uid in self._entries:
            raise RecallError(f"unit {entry.uid} is already stored")
        serials = np.asarray(entry.serials)
        if serials.shape != (entry.tokens,) or (serials.size > 1 and (np.diff(serials) <= 0).any()):
            raise RecallError(f"unit {entry.uid}: {serials.shape} serials for {entry.tokens} tokens, or not "
                              "increasing")
        if entry.unit.kind is UnitKind.SYSTEM:
            raise RecallError("the system prefix is never evicted, so never stored")
        if entry.nbytes > self.budget:
            self.dropped += 1
            return [entry.uid]
        gone = []
        while self.total_bytes + entry.nbytes > self.budget:
            uid, old = self._entries.popitem(last=False)
            self.total_bytes -= old.nbytes
            self.dropped += 1
            gone.append(uid)
        self._entries[entry.uid] = entry
        self.total_bytes += entry.nbytes
        return gone

    def candidates(self, history: History) -> list[StoredUnit]:
        """The stored units that can go back into ``history`` (older than its every stream unit, not in it), in
        stream order."""
        stream = history.stream_units
        limit = min((u.uid for u in stream), default=None)
        sys_uid = history.system_unit.uid if history.system_unit is not None else -1
        out = [e for e in self._entries.values()
               if e.uid > sys_uid and (limit is None or e.uid < limit)]
        return sorted(out, key=lambda e: e.uid)

    def validate(self) -> None:
        if sum(e.nbytes for e in self._entries.values()) != self.total_bytes:
            raise RecallError("total_bytes does not match the entries")
        if self.total_bytes > self.budget:
            raise RecallError(f"{self.total_bytes} bytes stored over the budget of {self.budget}")
        for uid, e in self._entries.items():
            if uid != e.uid:
                raise RecallError(f"entry under {uid} holds unit {e.uid}")

    def state(self) -> dict:
        return {"budget": self.budget, "dropped": self.dropped, "entries": [e.to_json() for e in self]}

    @classmethod
    def from_state(cls, d: dict) -> "RecallIndex":
        try:
            index = cls(int(d["budget"]))
            index.dropped = int(d["dropped"])
            for e in d["entries"]:
                entry = StoredUnit.from_json(e)
                if index.add(entry):
                    raise RecallError("the saved entries do not fit the saved budget")
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, RecallError):
                raise
            raise RecallError(f"bad recall state: {type(e).__name__}: {e}") from e
        return index


@dataclass(frozen=True)
class Readmission:
    """Where recalled units go: ``history`` with them in place after the system prefix, each unit's ``deltas``
    (the one shift added to all its positions, in ``units`` order), and ``shift``, what every unit after them
    moved up by (their keys re-rotate by it)."""

    history: History
    units: tuple[Unit, ...]
    deltas: tuple[int, ...]
    shift: int

    @property
    def tokens(self) -> int:
        return sum(u.length for u in self.units)


def readmit_history(history: History, units: list[Unit]) -> Readmission:
    """Place ``units`` (stored units older than every stream unit of ``history``) right after its system prefix,
    in stream order, one after another from the position after the prefix; move every later unit up by the span
    they take. Raises :class:`RecallError` for a unit that cannot go there."""
    units = sorted(units, key=lambda u: u.uid)
    sysu = history.system_unit
    stream = history.stream_units
    lo = sysu.uid if sysu is not None else -1
    hi = min((u.uid for u in stream), default=None)
    seen = {u.uid for u in history}
    for u in units:
        if u.uid in seen or u.uid <= lo or (hi is not None and u.uid >= hi):
            raise RecallError(f"unit {u.uid} cannot go back after the system prefix (uids {lo} < uid < {hi})")
        if len(history) and u.axes != history[0].axes:
            raise RecallError(f"unit {u.uid} has {u.axes} position axes, the history {history[0].axes}")
        if u.kind is UnitKind.SYSTEM:
            raise RecallError("a system unit cannot be recalled")
    if sysu is not None:
        frontier = sysu.max_position() + 1
    elif stream:
        frontier = int(min(int(u.positions.min()) for u in stream))
    else:
        frontier = 0
    placed, deltas = [], []
    for u in units:
        delta = frontier - int(u.positions.min())
        placed.append(Unit(uid=u.uid, kind=u.kind, spans=u.spans, positions=u.positions + delta, t=u.t,
                           label=u.label, trimmed=u.trimmed))
        deltas.append(delta)
        frontier = placed[-1].max_position() + 1
    first = min((int(u.positions.min()) for u in stream), default=frontier)
    shift = max(0, frontier - first) if placed else 0
    rest = [u if not shift else Unit(uid=u.uid, kind=u.kind, spans=u.spans, positions=u.positions + shift, t=u.t,
                                     label=u.label, trimmed=u.trimmed) for u in stream]
    out = History(([sysu] if sysu is not None else []) + placed + rest)
    return Readmission(out, tuple(placed), tuple(deltas), shift)


def release_mask(history: History, uids) -> np.ndarray:
    """The keep mask (logical order) of a plan that drops the units ``uids`` and keeps every other token."""
    uids = set(uids)
    return np.concatenate([np.full(u.length, u.uid not in uids, dtype=bool) for u in history]) if len(history) \
        else np.zeros(0, dtype=bool)


def pick_units(scores: np.ndarray, tokens: np.ndarray, limit: int) -> np.ndarray:
    """Indices of the best-scored units whose tokens fit in ``limit`` together (greedy by score, a unit that does
    not fit is skipped for a smaller one), ascending."""
    order = np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")
    chosen, used = [], 0
    for i in order:
        n = int(tokens[i])
        if used + n <= limit:
            chosen.append(int(i))
            used += n
    return np.array(sorted(chosen), dtype=np.int64)
