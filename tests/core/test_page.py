"""PageTable and MigrationPlanner: slot accounting (ARCHITECTURE invariant 6) and the migration contract."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnitide_mlx.core.page import (
    AllocClass,
    LayoutError,
    MigrationPlan,
    MigrationPlanner,
    PageTable,
    check_move_order,
)

MODES = ("native", "class_aware", "ordered_suffix", "eager", "tail_fill")  # tail_fill: class_aware with it


def _planner(mode: str, gain: int = 1) -> MigrationPlanner:
    if mode == "tail_fill":
        return MigrationPlanner("class_aware", min_gain_pages=gain, tail_fill=True)
    return MigrationPlanner(mode, min_gain_pages=gain)


def _execute_sequential(payload: np.ndarray, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Apply moves one at a time in list order, poisoning each vacated slot, and fail on a poisoned read."""
    out = payload.copy()
    for s, d in zip(src.tolist(), dst.tolist()):
        assert out[s] >= 0, f"move reads slot {s} after it was vacated or overwritten"
        out[d] = out[s]
        if s != d:
            out[s] = -7  # poison: a later read of this slot is a bug unless it was rewritten
    return out


def _execute_gather_scatter(payload: np.ndarray, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    out = payload.copy()
    rows = out[src].copy()
    out[dst] = rows
    return out


def _check_accounting(t: PageTable) -> None:
    """Invariant 6: one slot per retained token, no slot shared, active tiles = pages holding an entry."""
    t.validate()
    occ = t.occupancy()
    s = t.stats()
    assert s.retained_cells == int(occ.sum()) == sum(t.unit_sizes().values())
    pages_with_entry = {int(x) // t.page_size for x in np.flatnonzero(occ)}
    assert set(t.active_pages().tolist()) == pages_with_entry
    assert s.active_pages == len(pages_with_entry)
    subs = {int(x) // t.subblock_size for x in np.flatnonzero(occ)}
    assert set(t.active_subblocks().tolist()) == subs and s.active_subblocks == len(subs)
    assert s.physical_span == (max(pages_with_entry) + 1) * t.page_size if pages_with_entry else s.physical_span == 0
    assert s.holes == s.physical_span - s.retained_cells
    seqs = t.seq[occ]
    assert np.unique(seqs).size == seqs.size


# a random workload: allocations of units (some must-keep), partial frees (retention), migrations
ops_strategy = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(1, 150), st.sampled_from(list(AllocClass))),
        st.tuples(st.just("trim"), st.floats(0.0, 1.0), st.integers(0, 2**31 - 1)),
        st.tuples(st.just("migrate"), st.sampled_from(MODES), st.integers(1, 3)),
    ),
    min_size=1,
    max_size=40,
)


def _trim(t: PageTable, frac: float, seed: int) -> None:
    """Delete a random subset of a random unit's entries through apply_retention (a duck-typed plan)."""
    sizes = t.unit_sizes()
    if not sizes:
        return
    rng = np.random.default_rng(seed)
    uid = sorted(sizes)[int(rng.integers(len(sizes)))]
    n = sizes[uid]
    keep = rng.random(n) >= frac
    deleted, i = [], 0
    while i < n:
        if not keep[i]:
            j = i
            while j < n and not keep[j]:
                j += 1
            deleted.append((i, j))
            i = j
        else:
            i += 1
    plan = SimpleNamespace(units=[SimpleNamespace(uid=uid, length=n, deleted=tuple(deleted),
                                                  dropped=not keep.any())])
    before = t.slots_of_unit(uid)
    freed = t.apply_retention(plan)
    assert sorted(freed.tolist()) == sorted(before[~keep].tolist())
    assert np.array_equal(t.slots_of_unit(uid), before[keep])
    if keep.any() and not keep.all():
        assert uid in t.partial_units()


@given(ops=ops_strategy, placement=st.sampled_from(["first_fit", "class_aware"]),
       geometry=st.sampled_from([(64, 32), (16, 8), (8, 8), (8, 2)]))
def test_random_workload_keeps_accounting_and_migration_contract(ops, placement, geometry):
    page, sub = geometry
    t = PageTable(page, sub, placement=placement)
    uid = 0
    for op in ops:
        if op[0] == "alloc":
            _, n, cls = op
            before_next = t.next_seq
            slots = t.allocate(n, uid, cls)
            assert slots.size == n and np.unique(slots).size == n
            assert np.array_equal(t.seq[slots], np.arange(before_next, before_next + n))
            assert (t.unit[slots] == uid).all() and (t.alloc_class[slots] == int(cls)).all()
            uid += 1
        elif op[0] == "trim":
            _trim(t, op[1], op[2])
        else:
            _, mode, gain = op
            plan = _planner(mode, gain).plan(t)
            assert plan.before == t.stats()
            if plan.src.size:
                check_move_order(plan.src, plan.dst, t.occupancy())
                payload = np.where(t.occupancy(), t.seq, -1)
                seqv = _execute_sequential(payload, plan.src, plan.dst)
                gsv = _execute_gather_scatter(payload, plan.src, plan.dst)
                moved_to = set(plan.dst.tolist())
                for s in set(plan.src.tolist()) - moved_to:
                    gsv[s] = -7
                assert np.array_equal(seqv, gsv), "sequential and gather-scatter execution disagree"
            if not plan.accepted:
                assert plan.moved == 0
                continue
            b, a = plan.before, plan.after
            if mode == "class_aware":
                assert a.active_pages < b.active_pages or a.active_subblocks < b.active_subblocks
                assert (plan.dst < plan.src).all()
            elif mode == "tail_fill":
                assert (a.active_pages < b.active_pages or a.active_subblocks < b.active_subblocks
                        or b.physical_span - a.physical_span >= gain * page)
                assert (plan.dst < plan.src).all()

            elif mode == "ordered_suffix":
                assert b.physical_span - a.physical_span >= gain * page
            elif mode == "eager":
                assert a.holes < page and a.physical_span == -(-a.retained_cells // page) * page
            members = {u: t.slots_of_unit(u).tolist() for u in t.unit_sizes()}
            seq_by_unit = {u: t.seq[t.slots_of_unit(u)].tolist() for u in members}
            partial = t.partial_units()
            t.apply_migration(plan)
            assert t.stats() == a
            assert t.partial_units() == partial
            # what is attended to does not change: same entries, same serials, same owners
            for u in members:
                assert t.seq[t.slots_of_unit(u)].tolist() == seq_by_unit[u]
            for p in plan.promote:
                sl = slice(p * page, (p + 1) * page)
                assert (t.alloc_class[sl] == AllocClass.SELECTED_HISTORY).all()
        _check_accounting(t)
        if placement == "class_aware" and all(o[0] != "migrate" or o[1] in ("class_aware", "native", "tail_fill")
                                              for o in ops):
            # OmniPage placement never mixes classes in a page
            counts = t.page_class_counts()
            assert ((counts > 0).sum(axis=1) <= 1).all()
    state = t.state()
    r = PageTable.from_state(state)
    assert r.state() == state
    assert np.array_equal(r.seq, t.seq) and np.array_equal(r.unit, t.unit) and np.array_equal(r.alloc_class, t.alloc_class)


def test_first_fit_reuses_the_lowest_holes_and_class_aware_keeps_classes_apart():
    for placement, expect in (("first_fit", [2, 3, 4]), ("class_aware", [8, 9, 10])):
        t = PageTable(8, 4, placement=placement)
        t.allocate(2, 0, AllocClass.MUST_KEEP)
        t.allocate(6, 1)
        t.free(t.slots_of_unit(1)[:3])
        assert t.allocate(3, 2).tolist() == expect, placement


def test_class_aware_new_entries_share_pages_of_their_own_class():
    t = PageTable(8, 4, placement="class_aware")
    t.allocate(3, 0, AllocClass.RECENT_CONTEXT)
    assert t.allocate(3, 1).tolist() == [3, 4, 5]
    t.free(t.slots_of_unit(0))
    assert t.allocate(4, 2).tolist() == [0, 1, 2, 6]


def test_capacity_grows_a_page_at_a_time_and_never_shrinks():
    t = PageTable(64, 32)
    t.allocate(65, 0)
    assert t.capacity == 128
    t.free(t.slots_of_unit(0))
    assert t.capacity == 128 and t.stats().physical_span == 0 and t.stats().active_pages == 0


def test_class_aware_packs_sinks_into_earlier_pages_and_promotes_full_pages():
    # unit 1 leaves 4-entry sinks in each of 4 pages; unit 2 is a whole recent unit after them
    t = PageTable(8, 4)
    t.allocate(32, 1)
    t.allocate(8, 2)
    keep = [0, 1, 2, 3]
    plan = SimpleNamespace(units=[SimpleNamespace(uid=1, length=32, dropped=False,
                                                  deleted=tuple((p * 8 + 4, p * 8 + 8) for p in range(4)))])
    t.apply_retention(plan)
    assert t.stats().active_pages == 5
    mp = MigrationPlanner("class_aware").plan(t)
    assert mp.accepted
    assert mp.after.active_pages == 3  # 16 sink entries in 2 pages + unit 2's page
    assert sorted(mp.dst.tolist()) == [4, 5, 6, 7, 12, 13, 14, 15]
    assert mp.promote == (0, 1)
    t.apply_migration(mp)
    assert (t.alloc_class[:16] == AllocClass.SELECTED_HISTORY).all()
    assert (t.alloc_class[32:40] == AllocClass.RECENT_CONTEXT).all()
    assert keep  # sinks stay in logical order
    assert (np.diff(t.seq[t.slots_of_unit(1)]) > 0).all()


def test_class_aware_rejects_moves_that_free_no_tile():
    t = PageTable(8, 8)
    t.allocate(16, 1)
    plan = SimpleNamespace(units=[SimpleNamespace(uid=1, length=16, dropped=False, deleted=((3, 8), (12, 16)))])
    t.apply_retention(plan)  # page 0: 3 entries, page 1: 4 entries -> 7 fit in one page
    mp = MigrationPlanner("class_aware").plan(t)
    assert mp.accepted and mp.after.active_pages == 1
    t2 = PageTable(8, 8)
    t2.allocate(16, 1)
    t2.apply_retention(SimpleNamespace(units=[SimpleNamespace(uid=1, length=16, dropped=False,
                                                              deleted=((1, 4), (9, 10)))]))
    # page 0 has 3 holes, page 1 has 7 entries: no tile can be emptied, so nothing moves
    mp2 = MigrationPlanner("class_aware").plan(t2)
    assert not mp2.accepted and mp2.moved == 0


def test_tail_fill_moves_the_newest_unit_into_the_hole_below_it():
    """Units of 16, 16 and 14 entries in pages 0-5; the middle one is trimmed to a 2-entry sink. Class-aware
    packing alone moves nothing (no free slot lies before the sink), tail fill moves the last unit down into the
    hole (the sink page's 6 free slots first, then the empty page): the span shrinks from 6 pages to 4, every
    page still holds one class."""
    t = PageTable(8, 4)
    for uid, n in ((1, 16), (2, 16), (3, 14)):
        t.allocate(n, uid)
    t.apply_retention(SimpleNamespace(units=[SimpleNamespace(uid=2, length=16, dropped=False, deleted=((2, 16),))]))
    assert t.stats().physical_span == 48 and t.stats().active_pages == 5
    assert not MigrationPlanner("class_aware").plan(t).accepted
    mp = MigrationPlanner("class_aware", tail_fill=True).plan(t)
    assert mp.accepted and mp.reason == "frees tiles"  # and shortens the span
    assert mp.after.physical_span == 32 and mp.after.active_pages == 4
    assert mp.src.tolist() == list(range(32, 46)) and mp.dst.tolist() == list(range(18, 32))
    assert not MigrationPlanner("class_aware", tail_fill=True, min_gain_pages=3).plan(t).accepted  # gains 2
    seqs = t.seq[t.slots_of_unit(3)].tolist()
    t.apply_migration(mp)
    assert t.seq[t.slots_of_unit(3)].tolist() == seqs
    counts = t.page_class_counts()
    assert ((counts > 0).sum(axis=1) <= 1).all()
    # packed now: nothing left to gain
    assert not MigrationPlanner("class_aware", tail_fill=True).plan(t).accepted


def test_ordered_suffix_takes_the_shortest_suffix_that_meets_the_threshold():
    t = PageTable(4, 4)
    t.allocate(16, 1)
    t.apply_retention(SimpleNamespace(units=[SimpleNamespace(uid=1, length=16, dropped=False,
                                                             deleted=((1, 5), (6, 12)))]))
    # entries at 0, 5, 12..15: span 16. The last 4 packed after slot 5 end at 9 (gain 1 page); the last 5
    # packed after slot 0 end at 5 (gain 2 pages)
    mp = MigrationPlanner("ordered_suffix", min_gain_pages=1).plan(t)
    assert mp.accepted
    assert mp.src.tolist() == [12, 13, 14, 15] and mp.dst.tolist() == [6, 7, 8, 9]
    mp2 = MigrationPlanner("ordered_suffix", min_gain_pages=2).plan(t)
    assert mp2.src.tolist() == [5, 12, 13, 14, 15] and mp2.dst.tolist() == [1, 2, 3, 4, 5]
    assert MigrationPlanner("ordered_suffix", min_gain_pages=3).plan(t).accepted is False


def test_bad_requests_raise_clear_errors():
    with pytest.raises(LayoutError, match="divide"):
        PageTable(64, 48)
    with pytest.raises(LayoutError, match="placement"):
        PageTable(placement="best_fit")
    with pytest.raises(LayoutError, match="mode"):
        MigrationPlanner("compact")
    t = PageTable(8, 4)
    s = t.allocate(4, 0)
    with pytest.raises(LayoutError, match="twice"):
        t.free([s[0], s[0]])
    t.free([s[0]])
    with pytest.raises(LayoutError, match="free"):
        t.free([s[0]])
    with pytest.raises(LayoutError, match="range"):
        t.free([99])
    with pytest.raises(LayoutError, match="allocate"):
        t.allocate(-1, 0)
    with pytest.raises(LayoutError, match="out of sync"):
        t.apply_retention(SimpleNamespace(units=[SimpleNamespace(uid=0, length=4, dropped=False,
                                                                 deleted=((0, 1),))]))
    native = MigrationPlanner("native").plan(t)
    with pytest.raises(LayoutError, match="not accepted"):
        t.apply_migration(native)
    occ = t.occupancy()
    with pytest.raises(LayoutError, match="before move"):
        check_move_order(np.array([1, 2]), np.array([2, 0]), occ)  # move 0 overwrites slot 2 before move 1 reads it
    check_move_order(np.array([2, 1]), np.array([0, 2]), occ)  # the other order is fine: 2 is vacated first
    with pytest.raises(LayoutError, match="moved twice"):
        check_move_order(np.array([1, 1]), np.array([0, 4]), occ)
    with pytest.raises(LayoutError, match="same destination"):
        check_move_order(np.array([1, 2]), np.array([0, 0]), occ)
    with pytest.raises(LayoutError, match="no move reads"):
        check_move_order(np.array([1]), np.array([3]), occ)
    with pytest.raises(LayoutError, match="are free"):
        check_move_order(np.array([0]), np.array([5]), occ)
    stale = MigrationPlan("eager", np.array([1]), np.array([0]), t.stats(), t.stats(), True)
    t.allocate(1, 5)
    with pytest.raises(LayoutError, match="different layout"):
        t.apply_migration(stale)
    with pytest.raises(LayoutError, match="bad page-table state"):
        PageTable.from_state({"page_size": 8})
    bad = t.state()
    bad["slots"] = bad["slots"][:-1]
    with pytest.raises(LayoutError, match="differ in length"):
        PageTable.from_state(bad)


def test_check_history_catches_a_desynchronised_table():
    t = PageTable(8, 4)
    t.allocate(3, 0)
    t.allocate(2, 1)
    t.check_history([SimpleNamespace(uid=0, length=3), SimpleNamespace(uid=1, length=2)])
    with pytest.raises(LayoutError, match="disagree"):
        t.check_history([SimpleNamespace(uid=0, length=3)])


@settings(max_examples=25)
@given(st.integers(0, 2**31 - 1))
def test_same_workload_same_layout(seed):
    def run():
        rng = np.random.default_rng(seed)
        t = PageTable(16, 8)
        for uid in range(12):
            t.allocate(int(rng.integers(1, 40)), uid)
            _trim(t, float(rng.random()), int(rng.integers(2**31)))
            p = MigrationPlanner("class_aware").plan(t)
            if p.accepted:
                t.apply_migration(p)
        return t.state()
    assert run() == run()
