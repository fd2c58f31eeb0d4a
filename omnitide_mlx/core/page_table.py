"""The page table of OmniPage: where every retained KV entry lives (slot metadata, no tensors).

The cache keeps one K/V buffer per layer whose row ``i`` is slot ``i`` of this table, so one table (and one
migration plan, core/migration.py) serves every layer. Slots are grouped in fixed pages (64 by default: one
attention tile) split into subblocks (32: the decode kernel's tile). A page or subblock is *active* when it holds
any retained entry; kernels skip the rest.

Per slot the table records

- ``seq``: a serial that increases with every allocated token and never changes afterwards (-1 = free). It is
  the logical (causal) order of the entries: the attention mask shows key slot ``j`` to a query of serial ``q``
  iff ``0 <= seq[j] <= q``. Migration moves ``seq`` with the entry, so the mask does not care where entries live.
- ``unit``: the uid of the unit that owns the entry (-1 = free).
- ``alloc_class``: its :class:`AllocClass`, the placement group of paper figure 9 (-1 = free; saved as ``cls``).

Two placements: ``"first_fit"`` is what a plain KV cache does (llama.cpp's ``find_slot`` takes the lowest free
cells after ``seq_rm`` resets its head): new tokens fill any hole, so new content mixes with old retained spans.
``"class_aware"`` is OmniPage's: a new entry only goes to a page that is empty or holds entries of its own class.

:func:`check_move_order` is the executor contract every migration plan (core/migration.py) must meet before the
table or a cache applies it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import IntEnum
from typing import Any, Iterable, Mapping

import numpy as np

from .errors import OmniTideError

FREE = -1


class LayoutError(OmniTideError, ValueError):
    """A bad request to the page table: an unknown slot, a double free, an illegal migration plan, ..."""


class AllocClass(IntEnum):
    """Placement group of an entry (paper figure 9)."""

    MUST_KEEP = 0  # the protected system prefix
    SELECTED_HISTORY = 1  # spans retained from older units, packed into full pages
    RECENT_CONTEXT = 2  # new entries: recent units still retained in full


NUM_CLASSES = len(AllocClass)
PLACEMENTS = ("first_fit", "class_aware")


@dataclass(frozen=True)
class LayoutStats:
    """What a layout costs. ``physical_span`` is page-rounded: the slots a span-traversing kernel walks."""

    retained_cells: int  # occupied slots (one per retained token)
    physical_span: int  # (index of the last active page + 1) * page_size; 0 when empty
    active_pages: int  # pages holding any retained entry (tiles a tile-skipping kernel reads)
    active_subblocks: int  # subblocks holding any retained entry (the decode kernel's tiles)
    holes: int  # physical_span - retained_cells: free slots attention still walks over
    capacity: int  # slots backed by the buffer (grows a page at a time, never shrinks)

    def to_json(self) -> dict:
        return asdict(self)


def stats_from_occupancy(occ: np.ndarray, page_size: int, subblock_size: int) -> LayoutStats:
    cap = occ.shape[0]
    retained = int(occ.sum())
    if cap == 0:
        return LayoutStats(0, 0, 0, 0, 0, 0)
    per_page = occ.reshape(-1, page_size).any(axis=1)
    per_sub = occ.reshape(-1, subblock_size).any(axis=1)
    active = np.flatnonzero(per_page)
    span = int(active[-1] + 1) * page_size if active.size else 0
    return LayoutStats(retained, span, int(active.size), int(per_sub.sum()), span - retained, cap)


def _has_repeats(a: np.ndarray) -> bool:
    if a.size < 2:
        return False
    b = np.sort(a)
    return bool((b[1:] == b[:-1]).any())


def _value_counts(a: np.ndarray) -> tuple[list[int], list[int]]:
    """Distinct values and their counts (sort-based; faster here than np.unique's hash path)."""
    if a.size == 0:
        return [], []
    b = np.sort(a)
    starts = np.flatnonzero(np.concatenate([[True], b[1:] != b[:-1]]))
    counts = np.diff(np.concatenate([starts, [b.size]]))
    return b[starts].tolist(), counts.tolist()


def _count(class_counts: np.ndarray, slots: np.ndarray, klass: np.ndarray | int, page_size: int, sign: int) -> None:
    """class_counts[slot // page_size, class] += sign for every slot (a bincount: np.add.at is slow)."""
    idx = (slots // page_size) * NUM_CLASSES + klass
    counts = np.bincount(np.asarray(idx, dtype=np.int64).reshape(-1), minlength=class_counts.size)
    class_counts += sign * counts.reshape(class_counts.shape).astype(class_counts.dtype)


class PageTable:
    """Slot metadata of a paged KV buffer: occupancy, logical order, owner unit and class of every slot.

    Invariants (checked by :meth:`validate`): every occupied slot has a distinct ``seq`` below ``next_seq``, an
    owner and a class; free slots have none; the per-page and per-subblock counters match the slots.
    """

    def __init__(self, page_size: int = 64, subblock_size: int = 32, *, placement: str = "class_aware",
                 capacity: int = 0):
        if not isinstance(page_size, (int, np.integer)) or page_size <= 0:
            raise LayoutError(f"page_size must be a positive int, got {page_size!r}")
        if not isinstance(subblock_size, (int, np.integer)) or subblock_size <= 0 or page_size % subblock_size:
            raise LayoutError(f"subblock_size {subblock_size!r} must be positive and divide page_size {page_size}")
        if placement not in PLACEMENTS:
            raise LayoutError(f"unknown placement {placement!r}; choose one of {PLACEMENTS}")
        if capacity < 0 or capacity % page_size:
            raise LayoutError(f"capacity {capacity} must be a non-negative multiple of page_size {page_size}")
        self.page_size = int(page_size)
        self.subblock_size = int(subblock_size)
        self.placement = placement
        self._seq = np.full(0, FREE, dtype=np.int64)
        self._unit = np.full(0, FREE, dtype=np.int64)
        self._alloc_class = np.full(0, FREE, dtype=np.int8)
        self._class_counts = np.zeros((0, NUM_CLASSES), dtype=np.int32)  # entries of each class per page
        self._next_seq = 0
        self._partial: set[int] = set()  # units that lost tokens to a retention plan and still hold some
        self._unit_count: dict[int, int] = {}  # uid -> retained entries
        if capacity:
            self.grow(capacity // page_size)

    # --- shape ------------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return int(self._seq.shape[0])

    @property
    def num_pages(self) -> int:
        return self.capacity // self.page_size

    @property
    def next_seq(self) -> int:
        """The serial the next allocated token gets."""
        return self._next_seq

    @property
    def retained(self) -> int:
        return int(self._class_counts.sum())

    def grow(self, pages: int) -> None:
        """Add ``pages`` empty pages at the end (the cache grows its buffers to match)."""
        if pages < 0:
            raise LayoutError(f"cannot grow by {pages} pages")
        n = pages * self.page_size
        self._seq = np.concatenate([self._seq, np.full(n, FREE, dtype=np.int64)])
        self._unit = np.concatenate([self._unit, np.full(n, FREE, dtype=np.int64)])
        self._alloc_class = np.concatenate([self._alloc_class, np.full(n, FREE, dtype=np.int8)])
        self._class_counts = np.concatenate([self._class_counts, np.zeros((pages, NUM_CLASSES), dtype=np.int32)])

    def shrink(self, capacity: int) -> None:
        """Drop the empty pages at and after slot ``capacity`` (a page multiple): a cache that grew for one large
        input gives the memory back once that input is gone."""
        if capacity < 0 or capacity % self.page_size:
            raise LayoutError(f"capacity {capacity} must be a non-negative multiple of page_size {self.page_size}")
        if capacity >= self.capacity:
            return
        if (self._seq[capacity:] >= 0).any():
            raise LayoutError(f"cannot shrink to {capacity} slots: entries live beyond it")
        self._seq, self._unit = self._seq[:capacity], self._unit[:capacity]
        self._alloc_class = self._alloc_class[:capacity]
        self._class_counts = self._class_counts[: capacity // self.page_size]

    # --- read-only views --------------------------------------------------------------------------------
    @property
    def seq(self) -> np.ndarray:
        v = self._seq.view()
        v.flags.writeable = False
        return v

    @property
    def unit(self) -> np.ndarray:
        v = self._unit.view()
        v.flags.writeable = False
        return v

    @property
    def alloc_class(self) -> np.ndarray:
        v = self._alloc_class.view()
        v.flags.writeable = False
        return v

    cls = alloc_class  # the old name (the saved state's key is still "cls")

    def occupancy(self) -> np.ndarray:
        return self._seq >= 0

    def page_class_counts(self) -> np.ndarray:
        """A copy of the ``[num_pages, NUM_CLASSES]`` counters: entries of each class per page."""
        return self._class_counts.copy()

    def active_pages(self) -> np.ndarray:
        """Indices of pages holding any retained entry, ascending (the tiles attention reads)."""
        return np.flatnonzero(self._class_counts.sum(axis=1) > 0)

    def active_subblocks(self) -> np.ndarray:
        """Indices of subblocks (``slot // subblock_size``) holding any retained entry, ascending."""
        if self.capacity == 0:
            return np.zeros(0, dtype=np.int64)
        return np.flatnonzero(self.occupancy().reshape(-1, self.subblock_size).any(axis=1))

    def stats(self) -> LayoutStats:
        return stats_from_occupancy(self.occupancy(), self.page_size, self.subblock_size)

    def slots_of_unit(self, uid: int) -> np.ndarray:
        """The slots of unit ``uid`` in token (logical) order."""
        slots = np.flatnonzero(self._unit == uid)
        return slots[np.argsort(self._seq[slots], kind="stable")]

    def unit_sizes(self) -> dict[int, int]:
        """uid -> number of retained entries."""
        return dict(sorted(self._unit_count.items()))

    def partial_units(self) -> frozenset[int]:
        """Units that lost tokens to a retention plan and still hold entries (class-aware candidates)."""
        return frozenset(self._partial)

    # --- allocation ---------------------------------------------------------------------------------------
    def _eligible_free(self, alloc_class: AllocClass) -> np.ndarray:
        free = self._seq < 0
        if self.placement == "first_fit":
            return np.flatnonzero(free)
        counts = self._class_counts
        others = counts.sum(axis=1) - counts[:, int(alloc_class)]
        page_ok = others == 0  # empty, or holds only entries of this class
        return np.flatnonzero(free & np.repeat(page_ok, self.page_size))

    def free_slots_for(self, alloc_class: AllocClass | int, limit: int | None = None) -> int:
        """How many new entries of class ``alloc_class`` fit below slot ``limit`` (default: the current capacity)
        without moving anything: eligible free slots plus the pages the table would grow into (``limit`` a page
        multiple)."""
        limit = self.capacity if limit is None else int(limit)
        eligible = self._eligible_free(AllocClass(alloc_class))
        return int((eligible < limit).sum()) + max(0, limit - self.capacity)

    def allocate(self, n: int, uid: int, alloc_class: AllocClass | int = AllocClass.RECENT_CONTEXT,
                 serials: np.ndarray | None = None) -> np.ndarray:
        """Give ``n`` new tokens of unit ``uid`` a slot each; returns the slots in token order.

        The tokens get serials ``next_seq .. next_seq + n - 1`` in that order. Placement takes the lowest
        eligible free slots (see the module docstring) and grows the buffer a page at a time when short.
        ``serials``: a recalled unit's own (older) serials instead, increasing, below ``next_seq`` and unused
        (core/recall.py); ``next_seq`` is then unchanged.
        """
        if not isinstance(n, (int, np.integer)) or n < 0:
            raise LayoutError(f"cannot allocate {n!r} slots")
        if not isinstance(uid, (int, np.integer)) or uid < 0:
            raise LayoutError(f"owner uid must be a non-negative int, got {uid!r}")
        alloc_class = AllocClass(alloc_class)
        if serials is not None:
            serials = np.asarray(serials, dtype=np.int64).reshape(-1)
            if serials.size != n or (n and (serials.min() < 0 or serials.max() >= self._next_seq
                                            or (np.diff(serials) <= 0).any()
                                            or np.isin(serials, self._seq[self._seq >= 0]).any())):
                raise LayoutError(f"unit {uid}: serials must be {n} increasing, unused values below next_seq "
                                  f"{self._next_seq}")
            if int(uid) in self._unit_count:
                raise LayoutError(f"unit {uid} already holds entries")
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        slots = self._eligible_free(alloc_class)
        if slots.size < n:
            # new pages are empty, hence eligible for every class: grow just enough
            missing = n - slots.size
            first_new = self.capacity
            self.grow(-(-missing // self.page_size))
            slots = np.concatenate([slots, np.arange(first_new, first_new + missing, dtype=np.int64)])
        slots = slots[:n].astype(np.int64)
        self._seq[slots] = np.arange(self._next_seq, self._next_seq + n, dtype=np.int64) if serials is None \
            else serials
        self._unit[slots] = uid
        self._alloc_class[slots] = int(alloc_class)
        _count(self._class_counts, slots, int(alloc_class), self.page_size, +1)
        self._unit_count[int(uid)] = self._unit_count.get(int(uid), 0) + n
        if serials is None:
            self._next_seq += n
        return slots

    def _check_occupied(self, slots: np.ndarray, what: str) -> np.ndarray:
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        if slots.size == 0:
            return slots
        if slots.min() < 0 or slots.max() >= self.capacity:
            raise LayoutError(f"{what}: slot out of range [0, {self.capacity})")
        if _has_repeats(slots):
            raise LayoutError(f"{what}: a slot is listed twice")
        if (self._seq[slots] < 0).any():
            bad = slots[self._seq[slots] < 0][:5].tolist()
            raise LayoutError(f"{what}: slots {bad} are free")
        return slots

    def free(self, slots: Iterable[int] | np.ndarray) -> None:
        """Release occupied slots (their entries are gone; the slots may be reused)."""
        slots = self._check_occupied(np.asarray(list(slots) if not isinstance(slots, np.ndarray) else slots),
                                     "free")
        if slots.size == 0:
            return
        _count(self._class_counts, slots, self._alloc_class[slots].astype(np.int64), self.page_size, -1)
        for u, c in zip(*_value_counts(self._unit[slots])):
            left = self._unit_count[u] - c
            if left:
                self._unit_count[u] = left
            else:
                del self._unit_count[u]
                self._partial.discard(u)
        self._seq[slots] = FREE
        self._unit[slots] = FREE
        self._alloc_class[slots] = FREE

    def set_class(self, slots: np.ndarray, alloc_class: AllocClass | int) -> None:
        """Re-tag occupied slots (placement metadata only; the cache's tensors do not change)."""
        slots = self._check_occupied(slots, "set_class")
        alloc_class = AllocClass(alloc_class)
        _count(self._class_counts, slots, self._alloc_class[slots].astype(np.int64), self.page_size, -1)
        self._alloc_class[slots] = int(alloc_class)
        _count(self._class_counts, slots, int(alloc_class), self.page_size, +1)

    def apply_retention(self, plan: Any) -> np.ndarray:
        """Free the slots of the tokens a retention plan deletes; returns them (the cache drops those rows).

        ``plan`` is a :class:`~omnitide_mlx.core.pick.RetentionPlan` (any object with ``units`` whose items have
        ``uid``, ``length``, ``deleted`` unit-local ranges and ``dropped``). A unit's k-th token lives in its
        k-th slot in ``seq`` order, so the table must hold exactly ``length`` entries of every planned unit that
        loses tokens. Units that keep some tokens become class-aware migration candidates.
        """
        freed: list[np.ndarray] = []
        touched: list[tuple[int, bool]] = []
        for up in plan.units:
            if not up.deleted:
                continue
            slots = self.slots_of_unit(up.uid)
            if slots.size != up.length:
                raise LayoutError(f"unit {up.uid}: the table holds {slots.size} entries, the plan expects "
                                  f"{up.length}; cache and history are out of sync")
            for a, b in up.deleted:
                freed.append(slots[a:b])
            touched.append((up.uid, bool(up.dropped)))
        out = np.concatenate(freed) if freed else np.zeros(0, dtype=np.int64)
        self.free(out)
        for uid, dropped in touched:
            if dropped:
                self._partial.discard(uid)
            else:
                self._partial.add(uid)
        return out

    # --- migration ----------------------------------------------------------------------------------------
    def apply_migration(self, plan: "MigrationPlan") -> None:
        """Move entries' metadata as ``plan`` says (after the cache copied the K/V rows) and promote pages."""
        if not plan.accepted:
            raise LayoutError(f"migration plan ({plan.mode}) was not accepted: {plan.reason}")
        if plan.before != self.stats():
            raise LayoutError("migration plan was made for a different layout (plan it on this table, now)")
        check_move_order(plan.src, plan.dst, self.occupancy())
        src, dst = plan.src, plan.dst
        if src.size:
            seq, unit, klass = self._seq[src].copy(), self._unit[src].copy(), self._alloc_class[src].copy()
            _count(self._class_counts, src, klass.astype(np.int64), self.page_size, -1)
            self._seq[src] = FREE
            self._unit[src] = FREE
            self._alloc_class[src] = FREE
            self._seq[dst], self._unit[dst], self._alloc_class[dst] = seq, unit, klass
            _count(self._class_counts, dst, klass.astype(np.int64), self.page_size, +1)
        for p in plan.promote:
            sl = np.arange(p * self.page_size, (p + 1) * self.page_size)
            self.set_class(sl[self._seq[sl] >= 0], AllocClass.SELECTED_HISTORY)

    # --- checks and persistence ---------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise :class:`LayoutError` if an invariant is broken (slot accounting, counters, serials)."""
        occ = self._seq >= 0
        if not np.array_equal(occ, self._unit >= 0) or not np.array_equal(occ, self._alloc_class >= 0):
            raise LayoutError("a slot is half free: seq, unit and class disagree")
        seqs = self._seq[occ]
        if _has_repeats(seqs):
            raise LayoutError("two slots share a serial")
        if seqs.size and seqs.max() >= self._next_seq:
            raise LayoutError("a serial is not below next_seq")
        counts = np.zeros_like(self._class_counts)
        slots = np.flatnonzero(occ)
        _count(counts, slots, self._alloc_class[slots].astype(np.int64), self.page_size, +1)
        if not np.array_equal(counts, self._class_counts):
            raise LayoutError("per-page class counters do not match the slots")
        if self._unit_count != dict(zip(*_value_counts(self._unit[occ]))):
            raise LayoutError("per-unit entry counters do not match the slots")
        if not self._partial <= set(self.unit_sizes()):
            raise LayoutError("a partial unit holds no entries")

    def check_history(self, history: Any) -> None:
        """Raise unless the table holds exactly one entry per token of every unit of ``history``."""
        sizes = self.unit_sizes()
        want = {u.uid: u.length for u in history}
        if sizes != want:
            diff = sorted(set(sizes.items()) ^ set(want.items()))[:6]
            raise LayoutError(f"table and history disagree (uid, tokens): {diff}")

    def state(self) -> dict:
        """A JSON-able snapshot (save / restore)."""
        occ = np.flatnonzero(self._seq >= 0)
        return {
            "page_size": self.page_size,
            "subblock_size": self.subblock_size,
            "placement": self.placement,
            "capacity": self.capacity,
            "next_seq": self._next_seq,
            "slots": occ.tolist(),
            "seq": self._seq[occ].tolist(),
            "unit": self._unit[occ].tolist(),
            "cls": self._alloc_class[occ].astype(int).tolist(),
            "partial": sorted(self._partial),
        }

    @classmethod
    def from_state(cls, d: Mapping[str, Any]) -> "PageTable":
        try:
            t = cls(int(d["page_size"]), int(d["subblock_size"]), placement=d["placement"],
                    capacity=int(d["capacity"]))
            slots = np.asarray(d["slots"], dtype=np.int64)
            seq = np.asarray(d["seq"], dtype=np.int64)
            unit = np.asarray(d["unit"], dtype=np.int64)
            klass = np.asarray(d["cls"], dtype=np.int64)
            next_seq, partial = int(d["next_seq"]), {int(u) for u in d["partial"]}
        except (KeyError, TypeError, ValueError) as e:
            raise LayoutError(f"bad page-table state: {e}") from e
        if not (slots.shape == seq.shape == unit.shape == klass.shape):
            raise LayoutError("bad page-table state: slot, seq, unit and cls lists differ in length")
        if slots.size and (slots.min() < 0 or slots.max() >= t.capacity or _has_repeats(slots)):
            raise LayoutError("bad page-table state: slots out of range or repeated")
        if slots.size and (seq.min() < 0 or unit.min() < 0 or klass.min() < 0 or klass.max() >= NUM_CLASSES):
            raise LayoutError("bad page-table state: negative serial / owner or unknown class")
        t._seq[slots], t._unit[slots], t._alloc_class[slots] = seq, unit, klass
        _count(t._class_counts, slots, klass, t.page_size, +1)
        t._unit_count = dict(zip(*_value_counts(unit)))
        t._next_seq = next_seq
        t._partial = partial
        t.validate()
        return t

    def copy(self) -> "PageTable":
        t = PageTable(self.page_size, self.subblock_size, placement=self.placement)
        t._seq, t._unit, t._alloc_class = self._seq.copy(), self._unit.copy(), self._alloc_class.copy()
        t._class_counts = self._class_counts.copy()
        t._next_seq, t._partial = self._next_seq, set(self._partial)
        t._unit_count = dict(self._unit_count)
        return t

    def __repr__(self) -> str:
        s = self.stats()
        return (f"PageTable(page={self.page_size}, sub={self.subblock_size}, {self.placement}, "
                f"retained={s.retained_cells}, span={s.physical_span}, pages={s.active_pages}, cap={s.capacity})")


def check_move_order(src: np.ndarray, dst: np.ndarray, occupied: np.ndarray) -> None:
    """The executor contract of a migration plan; raises :class:`LayoutError` when broken.

    - ``src`` and ``dst`` are int arrays of equal length; sources are distinct occupied slots, destinations
      distinct in-range slots, and no move is a no-op (``src[i] != dst[i]``).
    - Every destination is free before the plan or is the source of an *earlier* move in the list
      (``dst[i] == src[j]`` only for ``j < i``). Hence no move reads a slot an earlier move has written (each
      entry moves once), and applying the moves one by one in list order is correct. A gather of all sources
      followed by a scatter to all destinations (the cache's way) is correct too, since destinations are
      distinct; slots that are a source and no destination end up free.
    """
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    if src.shape != dst.shape or src.ndim != 1:
        raise LayoutError(f"migration: src {src.shape} and dst {dst.shape} must be equal-length 1-D arrays")
    if src.size == 0:
        return
    cap = occupied.shape[0]
    if min(src.min(), dst.min()) < 0 or max(src.max(), dst.max()) >= cap:
        raise LayoutError(f"migration: slot out of range [0, {cap})")
    if _has_repeats(src):
        raise LayoutError("migration: an entry is moved twice (repeated source)")
    if _has_repeats(dst):
        raise LayoutError("migration: two moves write the same destination")
    if (src == dst).any():
        raise LayoutError("migration: a move onto its own slot")
    if not occupied[src].all():
        raise LayoutError(f"migration: sources {src[~occupied[src]][:5].tolist()} are free")
    index_of_src = np.full(cap, -1, dtype=np.int64)
    index_of_src[src] = np.arange(src.size)
    j = index_of_src[dst]  # which move reads each destination (-1: none)
    clobber = (j < 0) & occupied[dst]
    if clobber.any():
        raise LayoutError(f"migration: destination {int(dst[clobber][0])} holds an entry that no move reads")
    late = j >= np.arange(dst.size)
    if late.any():
        i = int(np.flatnonzero(late)[0])
        raise LayoutError(f"migration: move {i} writes slot {int(dst[i])} before move {int(j[i])} reads it")


