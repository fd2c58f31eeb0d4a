"""Selective migration (paper 6.2): plans that move retained entries between slots of a page table.

A :class:`MigrationPlanner` looks at a :class:`~omnitide_mlx.core.page_table.PageTable` after an eviction and
returns a :class:`MigrationPlan`, one source -> destination slot map shared by every layer; it never mutates the
table. The cache copies the K/V rows, then ``PageTable.apply_migration`` moves the metadata. Four modes:
``"native"`` (never move), ``"class_aware"`` (for tile-skipping kernels), ``"ordered_suffix"`` (for kernels that
traverse the span) and ``"eager"`` (pack everything after every eviction; the reference oracle).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .page_table import FREE, NUM_CLASSES, LayoutError, LayoutStats, PageTable, stats_from_occupancy

MIGRATION_MODES = ("native", "class_aware", "ordered_suffix", "eager")


@dataclass(frozen=True)
class MigrationPlan:
    """One source -> destination slot map shared by every layer (see :func:`check_move_order`).

    ``before`` / ``after`` are the layouts without and with the moves; ``promote`` lists pages whose entries
    become SELECTED_HISTORY once the moves are applied. Only an ``accepted`` plan may be applied.
    """

    mode: str
    src: np.ndarray
    dst: np.ndarray
    before: LayoutStats
    after: LayoutStats
    accepted: bool
    promote: tuple[int, ...] = ()
    reason: str = ""

    @property
    def moved(self) -> int:
        """Entries copied when the plan is applied (0 for a rejected plan)."""
        return int(self.src.size) if self.accepted else 0

    def to_json(self) -> dict:
        return {"mode": self.mode, "src": self.src.tolist(), "dst": self.dst.tolist(),
                "before": self.before.to_json(), "after": self.after.to_json(), "accepted": self.accepted,
                "promote": list(self.promote), "reason": self.reason}


@dataclass
class MigrationPlanner:
    """Plans entry moves after an eviction (paper 6.2). One planner per layout; ``plan`` never mutates the table.

    - ``"class_aware"``: candidates are the entries of partially evicted units that sit in pages not already
      full, scanned in physical order from the end (two-finger compaction); each goes to the lowest free slot
      before it in a page that is empty or holds only its class. Moves whose source subblock would not end empty are pruned (they cannot make any
      tile skippable) and the rest re-planned. Pages left full of candidate entries are promoted to
      SELECTED_HISTORY. Accepted iff active pages or active subblocks decrease. With ``tail_fill`` (our
      extension, docs/simulator.md) the plan then also empties the last pages into free slots below them, every
      entry of any class going to a page that holds only its class (or an empty one), when that shortens the
      span by at least ``min_gain_pages``; accepted then too (the paper's "or shorten the physical span by at
      least a configured amount").
    - ``"ordered_suffix"``: scanning back from the last entry, the shortest suffix (in physical order) whose
      order-preserving packing right after the preceding entry shrinks the page-rounded span by at least
      ``min_gain_pages``; moves entries of any class. Accepted iff such a suffix exists.
    - ``"eager"``: packs every entry into ``[0, retained)`` in physical order. Accepted iff anything moves.
    - ``"native"``: never moves.
    """

    mode: str = "class_aware"
    min_gain_pages: int = 1
    promote: bool = True
    tail_fill: bool = False  # class_aware: also move the last pages' entries down when that shortens the span
    max_rounds: int = 64  # class-aware prune/re-plan rounds (each round drops at least one candidate)
    _empty: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64), repr=False)

    def __post_init__(self):
        if self.mode not in MIGRATION_MODES:
            raise LayoutError(f"unknown migration mode {self.mode!r}; choose one of {MIGRATION_MODES}")
        if self.min_gain_pages < 1:
            raise LayoutError(f"min_gain_pages must be >= 1, got {self.min_gain_pages}")

    def plan(self, table: PageTable) -> MigrationPlan:
        before = table.stats()
        if self.mode == "native":
            return MigrationPlan("native", self._empty, self._empty, before, before, False, (),
                                 "the native layout never moves entries")
        occ = table.occupancy()
        if self.mode == "eager":
            src, dst = _eager_moves(occ)
            promote: tuple[int, ...] = ()
        elif self.mode == "ordered_suffix":
            src, dst = _ordered_suffix_moves(occ, table.page_size, self.min_gain_pages)
            promote = ()
        else:
            src, dst, promote = self._class_aware(table)
            if self.tail_fill:
                src, dst = _with_tail_fill(table, occ, src, dst, self.min_gain_pages)
        after = _stats_after(occ, src, dst, table.page_size, table.subblock_size)
        if src.size == 0:
            return MigrationPlan(self.mode, src, dst, before, after, False, (), "no move improves the layout")
        if self.mode == "class_aware":
            tiles = after.active_pages < before.active_pages or after.active_subblocks < before.active_subblocks
            span = before.physical_span - after.physical_span >= self.min_gain_pages * table.page_size
            ok = tiles or (self.tail_fill and span)
            reason = ("frees tiles" if tiles else "shortens the span" if ok
                      else "moves would leave as many active pages and subblocks")
        elif self.mode == "ordered_suffix":
            ok = before.physical_span - after.physical_span >= self.min_gain_pages * table.page_size
            reason = "shortens the span" if ok else "gain below threshold"
        else:
            ok, reason = True, "eager compaction"
        return MigrationPlan(self.mode, src, dst, before, after, ok, promote if ok and self.promote else (),
                             reason)

    # class-aware packing ---------------------------------------------------------------------------------
    def _class_aware(self, table: PageTable) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
        P, S = table.page_size, table.subblock_size
        occ = table.occupancy()
        partial = table.partial_units()
        if not partial:
            return self._empty, self._empty, ()
        page_full = occ.reshape(-1, P).all(axis=1)
        is_cand = np.isin(table.unit, np.fromiter(partial, dtype=np.int64)) & occ
        is_cand &= ~np.repeat(page_full, P)
        cand = np.flatnonzero(is_cand)
        free = np.flatnonzero(~occ)
        src = dst = self._empty
        for _ in range(self.max_rounds):
            if cand.size == 0 or free.size == 0:
                return self._empty, self._empty, ()
            src, dst = _pack_into_earlier(table, cand, free)
            if src.size == 0:
                return self._empty, self._empty, ()
            # prune moves whose source subblock keeps an entry after the plan: they free no tile
            occ_after = occ.copy()
            occ_after[src] = False
            occ_after[dst] = True
            sub_busy = occ_after.reshape(-1, S).any(axis=1)
            useless = sub_busy[src // S]
            if not useless.any():
                break
            keep_out = set(src[useless].tolist())
            # candidates that could not move at all also stay; drop both from the candidate list
            moved = set(src.tolist())
            cand = np.array([c for c in cand.tolist() if c in moved and c not in keep_out], dtype=np.int64)
        else:
            return self._empty, self._empty, ()
        promote: list[int] = []
        if self.promote and src.size:
            occ_after = occ.copy()
            occ_after[src] = False
            occ_after[dst] = True
            owner = table.unit.copy()
            owner[dst] = table.unit[src]
            owner[src[~np.isin(src, dst)]] = FREE
            for p in np.unique(dst // P).tolist():
                sl = slice(p * P, (p + 1) * P)
                if occ_after[sl].all() and np.isin(owner[sl], np.fromiter(partial, dtype=np.int64)).all():
                    promote.append(int(p))
        return src, dst, tuple(promote)


def _pack_into_earlier(table: PageTable, cand: np.ndarray, free: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two-finger packing: candidates from the last one backwards each take the lowest unused free slot before
    them whose page is empty or holds only the candidate's class; a class stops once its lowest usable hole
    is past its next candidate. Destinations are free slots only, so sources and destinations are disjoint.
    One cursor per class suffices: a page's eligibility only narrows as the plan fills it."""
    P = table.page_size
    class_counts = table.page_class_counts()
    taken = np.zeros(free.size, dtype=bool)
    cursor = [0] * NUM_CLASSES
    done = [False] * NUM_CLASSES
    src: list[int] = []
    dst: list[int] = []
    klass = table.alloc_class
    for c in cand[::-1].tolist():
        k = int(klass[c])
        if done[k]:
            continue
        i = cursor[k]
        while i < free.size and int(free[i]) < c:
            if not taken[i]:
                row = class_counts[int(free[i]) // P]
                if row.sum() == row[k]:
                    break
            i += 1
        cursor[k] = i
        if i >= free.size or int(free[i]) >= c:
            done[k] = True
            continue
        taken[i] = True
        f = int(free[i])
        class_counts[f // P, k] += 1  # sources are not subtracted: eligibility only narrows
        src.append(c)
        dst.append(f)
        cursor[k] = i + 1
    return np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)


def _with_tail_fill(table: PageTable, occ: np.ndarray, src: np.ndarray, dst: np.ndarray, min_gain_pages: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """The class-aware moves ``src -> dst`` followed by a tail fill planned on the layout they leave: the entries
    of the last pages go down into free slots, the fewest pages such that the span shrinks by at least
    ``min_gain_pages``, as many as fit. An entry both parts move goes straight to its last slot.

    Every move, class-aware or fill, goes to a lower slot, so listing the moves by source, ascending, lists the
    move that reads a slot before any move that writes it (check_move_order's contract)."""
    klass = table.alloc_class.astype(np.int64)
    occ_a = occ.copy()
    klass_a = np.where(occ, klass, FREE)
    if src.size:
        moved = klass_a[src]
        occ_a[src], klass_a[src] = False, FREE
        occ_a[dst], klass_a[dst] = True, moved
    fill_src, fill_dst = _tail_fill_moves(occ_a, klass_a, ~occ_a, table.page_size, min_gain_pages)
    if fill_src.size == 0:
        return src, dst
    final = dict(zip(src.tolist(), dst.tolist()))  # original slot -> slot it ends in
    came_from = dict(zip(dst.tolist(), src.tolist()))
    for a, b in zip(fill_src.tolist(), fill_dst.tolist()):
        final[came_from.get(a, a)] = b
    out_src = np.fromiter(final.keys(), dtype=np.int64, count=len(final))
    out_dst = np.fromiter(final.values(), dtype=np.int64, count=len(final))
    order = np.argsort(out_src, kind="stable")
    return out_src[order], out_dst[order]


def _tail_fill_moves(occ: np.ndarray, klass: np.ndarray, usable: np.ndarray, page_size: int, min_gain_pages: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Moves that empty pages ``k .. span - 1`` into ``usable`` slots of pages below ``k``, for the lowest ``k``
    that fits and gains at least ``min_gain_pages``. An entry of class ``c`` goes first to the free slots of pages
    holding only class ``c``, then to whole empty pages (lowest first), so the pages keep one class each and
    already-active pages are filled before new ones open."""
    P = page_size
    empty = np.zeros(0, dtype=np.int64)
    n_pages = occ.size // P
    if n_pages == 0:
        return empty, empty
    page_cls = np.where(occ, klass, NUM_CLASSES).reshape(n_pages, P)
    counts = np.stack([(page_cls == c).sum(axis=1) for c in range(NUM_CLASSES)], axis=1)  # [pages, classes]
    total = counts.sum(axis=1)
    active = np.flatnonzero(total)
    if active.size == 0:
        return empty, empty
    span = int(active[-1]) + 1
    free_pp = usable.reshape(n_pages, P).sum(axis=1)
    only = np.where(total > 0, np.argmax(counts, axis=1), -1)
    only[(total > 0) & (counts.max(axis=1) != total)] = -2  # mixed pages take no moved entry
    # for a cut k: entries of class c at pages >= k (up to the span) against what pages < k offer
    need = np.cumsum(counts[:span][::-1], axis=0)[::-1]  # need[k, c] = class-c entries in pages k .. span-1
    room = np.zeros((span + 1, NUM_CLASSES), dtype=np.int64)  # room[k, c]: free slots of c-only pages below k
    for c in range(NUM_CLASSES):
        room[1:, c] = np.cumsum(np.where(only[:span] == c, free_pp[:span], 0))
    whole = np.concatenate([[0], np.cumsum((total[:span] == 0) & (free_pp[:span] == P))])  # empty pages below k
    over = np.maximum(need - room[:span], 0)
    pages_needed = (-(-over // P)).sum(axis=1)
    fits = np.flatnonzero(pages_needed <= whole[:span])
    fits = fits[(span - fits >= min_gain_pages) & (fits > 0)]
    if fits.size == 0:
        return empty, empty
    k = int(fits[0])
    slots = np.arange(occ.size).reshape(n_pages, P)
    src_all = np.flatnonzero(occ[k * P:span * P]) + k * P
    spare = [int(p) for p in np.flatnonzero((total[:k] == 0) & (free_pp[:k] == P))]
    src: list[np.ndarray] = []
    dst: list[np.ndarray] = []
    for c in range(NUM_CLASSES):
        mine = src_all[klass[src_all] == c]
        if mine.size == 0:
            continue
        pages = np.flatnonzero(only[:k] == c)
        holes = slots[pages][usable.reshape(n_pages, P)[pages]] if pages.size else empty
        extra = -(-max(0, mine.size - holes.size) // P)
        taken, spare = spare[:extra], spare[extra:]
        target = np.concatenate([holes, *(slots[p] for p in taken)])[:mine.size]
        src.append(mine)
        dst.append(target)
    return np.concatenate(src), np.concatenate(dst)


def _eager_moves(occ: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    slots = np.flatnonzero(occ)
    target = np.arange(slots.size, dtype=np.int64)
    moving = slots != target
    return slots[moving].astype(np.int64), target[moving]


def _ordered_suffix_moves(occ: np.ndarray, page_size: int, min_gain_pages: int) -> tuple[np.ndarray, np.ndarray]:
    slots = np.flatnonzero(occ)
    m = slots.size
    if m == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    old_pages = int(slots[-1]) // page_size + 1
    # suffix = entries k..m-1, packed to start right after entry k-1 (slot -1 when k == 0)
    prev = np.concatenate([[-1], slots[:-1]])  # prev[k] = slot of entry k-1
    new_last = prev + (m - np.arange(m))  # last slot after packing suffix k
    gain = old_pages - (new_last // page_size + 1)
    ok = np.flatnonzero(gain >= min_gain_pages)
    if ok.size == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    k = int(ok[-1])  # the shortest qualifying suffix (scanning back from the end)
    target = prev[k] + 1 + np.arange(m - k, dtype=np.int64)
    moving = slots[k:] != target
    return slots[k:][moving].astype(np.int64), target[moving]


def _stats_after(occ: np.ndarray, src: np.ndarray, dst: np.ndarray, page_size: int, subblock_size: int
                 ) -> LayoutStats:
    if src.size == 0:
        return stats_from_occupancy(occ, page_size, subblock_size)
    o = occ.copy()
    o[src] = False
    o[dst] = True
    return stats_from_occupancy(o, page_size, subblock_size)
