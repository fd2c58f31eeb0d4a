"""Recall's bookkeeping (core/recall.py): the store's byte budget and order, where recalled units go back in the
history and that releasing them restores it, and the page table's allocation under a recalled unit's own serials."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from unit_streams import histories

from omnitide_mlx.core.page import AllocClass, LayoutError, PageTable
from omnitide_mlx.core.recall import (
    RecallError,
    RecallIndex,
    StoredUnit,
    pick_units,
    readmit_history,
    release_mask,
)
from omnitide_mlx.core.retention_plan import apply_plan, plan_from_mask
from omnitide_mlx.core.units import SpanKind, Unit, UnitKind


def _entry(uid: int, tokens: int, nbytes: int) -> StoredUnit:
    unit = Unit.build(uid, UnitKind.MEDIA, [(SpanKind.AUDIO, tokens)], start_position=uid * 100)
    return StoredUnit(unit, np.arange(uid * 100, uid * 100 + tokens), nbytes)


@settings(max_examples=60, deadline=None)
@given(budget=st.integers(1, 500), sizes=st.lists(st.integers(1, 200), max_size=30))
def test_the_store_stays_under_budget_and_forgets_the_oldest_first(budget, sizes):
    index, model = RecallIndex(budget), []  # model: the entries a FIFO under the budget would hold
    for uid, size in enumerate(sizes, start=1):
        gone = index.add(_entry(uid, 3, size))
        if size > budget:
            assert gone == [uid]
        else:
            expect = []
            while sum(s for _, s in model) + size > budget:
                expect.append(model.pop(0)[0])
            model.append((uid, size))
            assert gone == expect
        index.validate()
        assert [e.uid for e in index] == [u for u, _ in model]
        assert index.total_bytes == sum(s for _, s in model) <= budget
    again = RecallIndex.from_state(index.state())
    assert again.state() == index.state()


def test_the_store_refuses_misuse():
    index = RecallIndex(100)
    index.add(_entry(1, 3, 10))
    with pytest.raises(RecallError, match="already stored"):
        index.add(_entry(1, 3, 10))
    with pytest.raises(RecallError, match="serials"):
        index.add(StoredUnit(_entry(2, 3, 10).unit, np.array([5, 4, 6]), 10))
    with pytest.raises(RecallError, match="positive number of bytes"):
        RecallIndex(0)
    with pytest.raises(RecallError, match="bad recall state"):
        RecallIndex.from_state({"budget": 10})


@settings(max_examples=80, deadline=None)
@given(h=histories(min_units=2, max_units=10), data=st.data())
def test_recalled_units_go_after_the_sinks_and_release_restores_the_history(h, data):
    """Evict the oldest stream units (and trim some of the rest), readmit any of the evicted ones: they sit right
    after the system prefix in stream order, every later unit moves up by one shift past them, nothing overlaps;
    the release plan (the shift rule) gives back exactly the history before the recall."""
    stream = h.stream_units
    k = data.draw(st.integers(1, len(stream) - 1))
    dropped = {u.uid for u in stream[:k]}
    keep = release_mask(h, dropped)
    offsets = h.offsets()
    for i, u in enumerate(h):  # partial trims of later units, as OmniPick makes them (their first token stays)
        if u.uid not in dropped and u.kind is not UnitKind.SYSTEM and u.length > 1:
            cut = data.draw(st.lists(st.integers(1, u.length - 1), max_size=3))
            keep[[offsets[i] + c for c in cut]] = False
    h2 = apply_plan(h, plan_from_mask(h, keep, "test"))
    chosen = data.draw(st.lists(st.sampled_from(stream[:k]), unique_by=lambda u: u.uid, max_size=k))
    re = readmit_history(h2, chosen)
    placed = list(re.units)
    assert [u.uid for u in placed] == sorted(u.uid for u in chosen)
    start = h2.system_unit.max_position() + 1 if h2.system_unit is not None else 0
    for u, orig in zip(placed, sorted(chosen, key=lambda u: u.uid)):
        assert int(u.positions.min()) == start  # one after another, from right after the prefix
        np.testing.assert_array_equal(u.positions - orig.positions, int(u.positions.min() - orig.positions.min()))
        start = u.max_position() + 1
    rest = [u for u in re.history.stream_units if u.uid not in {p.uid for p in placed}]
    for u, before in zip(rest, h2.stream_units):
        np.testing.assert_array_equal(u.positions, before.positions + re.shift)
    if placed and rest:
        assert max(u.max_position() for u in placed) < min(int(u.positions.min()) for u in rest)
    release = plan_from_mask(re.history, release_mask(re.history, [u.uid for u in placed]), "recall")
    assert apply_plan(re.history, release).to_json() == h2.to_json()


def test_a_unit_newer_than_a_retained_one_cannot_go_back():
    h = History_of(4)
    h2 = apply_plan(h, plan_from_mask(h, release_mask(h, [2]), "test"))  # unit 1 (older) is still retained
    with pytest.raises(RecallError, match="cannot go back"):
        readmit_history(h2, [h.unit(2)])
    with pytest.raises(RecallError, match="cannot go back"):
        readmit_history(h, [h.unit(1)])  # already in the history


def History_of(n: int):
    from omnitide_mlx.core.units import History

    h = History([Unit.build(0, UnitKind.SYSTEM, [(SpanKind.SYSTEM, 4)])])
    for uid in range(1, n + 1):
        h.append(Unit.build(uid, UnitKind.MEDIA, [(SpanKind.AUDIO, 5)], start_position=h.next_position()))
    return h


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 80), min_size=2, max_size=8), data=st.data(),
       placement=st.sampled_from(["class_aware", "first_fit"]))
def test_a_unit_readmitted_under_its_serials_keeps_the_logical_order(sizes, data, placement):
    t = PageTable(16, 8, placement=placement)
    serials = {}
    for uid, n in enumerate(sizes):
        slots = t.allocate(n, uid)
        serials[uid] = t.seq[slots].copy()
    gone = data.draw(st.lists(st.sampled_from(range(len(sizes))), unique=True, min_size=1))
    for uid in gone:
        t.free(t.slots_of_unit(uid))
    next_seq = t.next_seq
    back = data.draw(st.lists(st.sampled_from(gone), unique=True))
    for uid in back:
        t.allocate(sizes[uid], uid, AllocClass.SELECTED_HISTORY, serials=serials[uid])
    t.validate()
    assert t.next_seq == next_seq
    occ = np.flatnonzero(t.seq >= 0)
    owners = t.unit[occ[np.argsort(t.seq[occ])]]
    expect = np.concatenate([np.full(sizes[u], u) for u in range(len(sizes)) if u not in set(gone) - set(back)]
                            + [np.zeros(0, dtype=np.int64)])
    np.testing.assert_array_equal(owners, expect)  # seq order is stream order again
    for uid in back:  # its serials are in use again
        with pytest.raises(LayoutError, match="serials must be"):
            t.allocate(sizes[uid], uid, serials=serials[uid])


def test_serials_in_use_or_new_are_refused():
    t = PageTable(16, 8)
    slots = t.allocate(4, 0)
    a = t.seq[slots].copy()
    t.allocate(4, 1)
    with pytest.raises(LayoutError, match="serials"):
        t.allocate(4, 2, serials=a)  # in use
    with pytest.raises(LayoutError, match="serials"):
        t.allocate(2, 2, serials=np.array([8, 9]))  # not below next_seq
    t.free(t.slots_of_unit(0))
    with pytest.raises(LayoutError, match="serials"):
        t.allocate(4, 2, serials=a[::-1])  # not increasing


@given(scores=st.lists(st.floats(-10, 10), min_size=1, max_size=20), data=st.data(), limit=st.integers(0, 100))
def test_picked_units_fit_the_limit_best_first(scores, data, limit):
    tokens = np.array(data.draw(st.lists(st.integers(1, 40), min_size=len(scores), max_size=len(scores))))
    idx = pick_units(np.array(scores), tokens, limit)
    assert tokens[idx].sum() <= limit
    assert list(idx) == sorted(idx)
    best = int(np.argmax(scores))
    if tokens[best] <= limit:
        assert best in idx
