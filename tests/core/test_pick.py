"""Retention policies and plans: ARCHITECTURE invariants 1, 2 and 4, exact relabelling, the shift rule."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from unit_streams import build_unit, histories

from omnitide_mlx.core.page import PageTable
from omnitide_mlx.core.pick import (
    H2O,
    POLICIES,
    FullContext,
    OmniPick,
    OmniTide,
    RetentionError,
    RetentionPlan,
    StreamingLLM,
    TokenSliding,
    UnitFIFO,
    apply_plan,
    make_policy,
    plan_from_mask,
)
from omnitide_mlx.core.units import History, SpanKind, Unit, UnitKind

POLICY_NAMES = sorted(POLICIES)


def _make(name: str, low: int, high: int, knobs: dict) -> object:
    kw = dict(low=low, high=high)
    if name in ("omnipick", "omnitide", "eager"):
        kw.update(knobs)
    return make_policy(name, **kw)


knob_strategy = st.fixed_dictionaries({
    "recent_units": st.integers(1, 4),
    "image_sink": st.integers(0, 6),
    "audio_sink": st.integers(0, 4),
    "slice_sink": st.integers(0, 3),
    "text_budget": st.integers(0, 40),
})


def _scores(h: History, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random(h.total_tokens)


def _check_apply(h: History, plan: RetentionPlan) -> History:
    """apply_plan relabels exactly: kept tokens keep their span kind, order and (shifted) positions."""
    new = apply_plan(h, plan)
    kept_units = [u for u, up in zip(h, plan.units) if not up.dropped]
    assert [u.uid for u in new] == [u.uid for u in kept_units]
    assert new.total_tokens == plan.tokens_after
    shifts = plan.kept_token_shifts()
    assert np.array_equal(new.positions(), h.positions()[:, plan.keep_mask()] - shifts[None, :])
    for old, up, nu in zip(kept_units, [p for p in plan.units if not p.dropped], new):
        m = up.keep_mask()
        assert list(nu.token_kinds()) == list(old.token_kinds()[m])
        # one new span per old span with a kept token, same kind, same order
        survivors = [s.kind for s in old.spans if m[s.start:s.end].any()]
        assert [s.kind for s in nu.spans] == survivors
        assert nu.trimmed == (old.trimmed or bool(up.deleted))
    return new


def _kept_ranges_with_positions(h: History, plan: RetentionPlan):
    keep = plan.keep_mask()
    pos = h.positions()
    edges = np.flatnonzero(np.diff(np.concatenate([[0], keep.astype(int), [0]])))
    ranges = list(zip(edges[::2], edges[1::2]))
    shifts = plan.kept_token_shifts()
    out, k = [], 0
    for a, b in ranges:
        seg = pos[:, a:b]
        s = int(shifts[k])
        assert (shifts[k:k + b - a] == s).all(), "one shift per kept range"
        out.append((int(seg.min()), int(seg.max()), s))
        k += b - a
    return ranges, out


@settings(max_examples=200)
@given(h=histories(), name=st.sampled_from(POLICY_NAMES), knobs=knob_strategy,
       wm=st.tuples(st.floats(0.05, 1.0), st.floats(0.0, 0.5)), seed=st.integers(0, 2**31 - 1))
def test_policies_keep_invariants_1_2_and_relabel_exactly(h, name, knobs, wm, seed):
    total = h.total_tokens
    low = max(1, int(total * wm[0]))
    high = max(low, int(total * (wm[0] + wm[1])) - 1)
    policy = _make(name, low, high, knobs)
    plan = policy.plan(h, scores=_scores(h, seed) if policy.needs_scores else None)
    event(f"{name}: {'trim' if plan is not None else 'no trim'}")
    if plan is None:
        assert total <= high or plan_from_mask(h, policy.keep_mask(h, _scores(h, seed)), name).deleted_tokens == 0
        return
    assert total > high
    plan.validate(h)
    keep = plan.keep_mask()
    # invariant 1: the system prefix is never evicted
    assert keep[:h.system_tokens].all()
    stream = plan.units[1:] if h.system_unit is not None else plan.units
    kept_stream = [up for up in stream if not up.dropped]
    assert kept_stream, "a policy never empties the stream"
    if isinstance(policy, OmniPick):
        # the recent_units newest stay whole (kept whole or dropped whole); the newest is always kept
        for up in stream[-policy.recent_units:]:
            assert up.untouched or up.dropped
        assert stream[-1].untouched
        # invariant 2: at or under low after a trim unless one unit remains
        assert plan.tokens_after <= policy.low or len(kept_stream) == 1
    if isinstance(policy, UnitFIFO):
        assert all(up.untouched or up.dropped for up in stream)
        assert plan.tokens_after <= policy.low or len(kept_stream) == 1
    if isinstance(policy, (TokenSliding, H2O)):
        assert plan.tokens_after <= max(policy.low, h.system_tokens + 1)
    if isinstance(policy, StreamingLLM):
        assert plan.tokens_after <= max(policy.low, h.system_tokens + policy.sink + 1)
        assert keep[h.system_tokens:h.system_tokens + policy.sink].all()
    _check_apply(h, plan)


@given(h=histories(axes=1), mask_seed=st.integers(0, 2**31 - 1), p=st.floats(0.0, 1.0))
def test_1d_shift_equals_deleted_positions_before(h, mask_seed, p):
    keep = np.random.default_rng(mask_seed).random(h.total_tokens) >= p
    keep[:h.system_tokens] = True
    if not keep.any():
        keep[-1] = True
    plan = plan_from_mask(h, keep)
    deleted_before = np.cumsum(~keep)[keep]
    assert np.array_equal(plan.kept_token_shifts(), deleted_before)
    new = _check_apply(h, plan)
    # positions stay consecutive: the gaps are closed, nothing overlaps
    assert np.array_equal(new.positions()[0], np.arange(new.total_tokens))


@given(h=histories(axes=3), mask_seed=st.integers(0, 2**31 - 1), p=st.floats(0.0, 1.0))
def test_mrope_shift_closes_gaps_and_creates_no_overlap(h, mask_seed, p):
    keep = np.random.default_rng(mask_seed).random(h.total_tokens) >= p
    keep[:h.system_tokens] = True
    if not keep.any():
        keep[0] = True
    plan = plan_from_mask(h, keep)
    ranges, info = _kept_ranges_with_positions(h, plan)
    prev_shift = 0
    frontier = int(h.positions().min())  # where the history starts
    for r, (lo, hi, s) in enumerate(info):
        assert s >= prev_shift >= 0, "shifts never decrease"
        prev_shift = s
        # gap closed: the range starts no later than one past everything kept before it
        assert lo - s <= frontier
        if r == 0:
            assert lo - s == frontier and (s == 0 or ranges[0][0] > 0)
        for lo2, hi2, s2 in info[:r]:
            if hi2 < lo:  # disjoint before the plan -> still disjoint and in order after
                assert hi2 - s2 < lo - s
        frontier = max(frontier, hi - s + 1)
    new = _check_apply(h, plan)
    assert new.positions().min() >= 0


@settings(max_examples=40)
@given(h=histories(min_units=2), seed=st.integers(0, 2**31 - 1))
def test_repeated_trims_stay_consistent_with_the_page_table(h, seed):
    """Plans applied round after round keep the table and history in step (slot per retained token)."""
    rng = np.random.default_rng(seed)
    t = PageTable(8, 4, placement=str(rng.choice(["first_fit", "class_aware"])))
    units = list(h)
    cur = History([])
    policy = OmniTide(high=max(5, h.total_tokens // 3), low=max(1, h.total_tokens // 5), recent_units=1)
    for u in units:
        # re-base the unit to continue after the current history (positions as an adapter would give)
        u = build_like(u, cur.next_position())
        cur.append(u)
        t.allocate(u.length, u.uid)
        plan = policy.plan(cur)
        if plan is not None:
            freed = t.apply_retention(plan)
            assert freed.size == plan.deleted_tokens
            cur = apply_plan(cur, plan)
        t.check_history(cur)
        # the table's serial order is the history's logical order
        order = np.concatenate([t.slots_of_unit(x.uid) for x in cur])
        assert (np.diff(t.seq[order]) > 0).all()


def build_like(u: Unit, start: int) -> Unit:
    pos = u.positions - u.positions.min() + start
    return dataclasses.replace(u, positions=pos)


def test_omnipick_paper_example_keeps_boundaries_sinks_and_text_budget():
    h = History([Unit.build(0, UnitKind.SYSTEM, [(SpanKind.SYSTEM, 10)])])
    spec = ("media", (1, (4, 5), (3, 2, 6), 8, 0, 1))  # <b> image 20, source 3 + 2 slices of 6, audio 8, </b>
    for uid in range(1, 5):
        h.append(build_unit(uid, spec, h.next_position(), 1))
    h.append(build_unit(5, ("user", 12), h.next_position(), 1))
    h.append(build_unit(6, ("reply", 30), h.next_position(), 1))
    h.append(build_unit(7, spec, h.next_position(), 1))
    p = OmniPick(high=200, low=180, recent_units=2, image_sink=3, audio_sink=2, slice_sink=1, text_budget=20,
                 recent_count="all")  # figure 6 literally: the reply and the newest unit are the recent two
    plan = p.plan(h)
    assert plan is not None
    new = apply_plan(h, plan)
    older = [u for u in new if u.uid in (1, 2, 3, 4, 5)]
    for u in older[:4]:
        kinds = [(s.kind, s.length) for s in u.spans]
        assert kinds == [(SpanKind.BOUNDARY, 1), (SpanKind.IMAGE, 3), (SpanKind.IMAGE_SOURCE, 3),
                         (SpanKind.BOUNDARY, 1), (SpanKind.IMAGE_SLICE, 1), (SpanKind.BOUNDARY, 1),
                         (SpanKind.BOUNDARY, 1), (SpanKind.IMAGE_SLICE, 1), (SpanKind.BOUNDARY, 1),
                         (SpanKind.AUDIO, 2), (SpanKind.BOUNDARY, 1)]
        assert u.trimmed
    # the user question (12 text tokens) is older than the 2 recent units and fits the text budget whole
    q = new.unit(5)
    assert [(s.kind, s.length) for s in q.spans] == [(SpanKind.BOUNDARY, 3), (SpanKind.TEXT, 12),
                                                     (SpanKind.BOUNDARY, 2)]
    assert new.unit(6).length == 32 and new.unit(7).length == h.unit(7).length  # recent: whole
    assert plan.tokens_after == 10 + 4 * 16 + 17 + 32 + h.unit(7).length
    # a smaller text budget truncates the question to its prefix and drops nothing else
    plan2 = OmniPick(high=200, low=180, recent_units=2, image_sink=3, audio_sink=2, slice_sink=1,
                     text_budget=5, recent_count="all").plan(h)
    assert [(s.kind, s.length) for s in apply_plan(h, plan2).unit(5).spans][1] == (SpanKind.TEXT, 5)


def test_omnipick_drops_partial_units_before_complete_ones_and_stops_at_one_unit():
    h = History([Unit.build(0, UnitKind.SYSTEM, [(SpanKind.SYSTEM, 4)])])
    media = ("media", (1, (5, 5), None, 10, 0, 1))  # 37 tokens
    for uid in range(1, 4):
        h.append(build_unit(uid, media, h.next_position(), 1))
    h.append(build_unit(4, ("user", 5), h.next_position(), 1))  # complete after selection (text fits)
    h.append(build_unit(5, media, h.next_position(), 1))
    h.append(build_unit(6, media, h.next_position(), 1))
    p = OmniPick(high=100, low=4 + 37 + 37 + 10, recent_units=2, image_sink=2, audio_sink=1, text_budget=50)
    plan = p.plan(h)
    dropped = plan.dropped_uids()
    assert dropped == (1, 2, 3)  # the partial media units go first, oldest first; the user turn survives
    assert plan.tokens_after == 4 + 10 + 37 + 37
    # a target no set of units can reach: stops with only the newest unit left
    plan = OmniPick(high=50, low=5, recent_units=2).plan(h)
    assert plan.dropped_uids() == (1, 2, 3, 4, 5)
    assert plan.units[-1].untouched


def test_baselines_behave_as_described():
    h = History([Unit.build(0, UnitKind.SYSTEM, [(SpanKind.SYSTEM, 5)])])
    for uid in range(1, 6):
        h.append(build_unit(uid, ("media", (1, (3, 3), None, 4, 0, 1)), h.next_position(), 1))  # 15 each
    assert FullContext().plan(h) is None
    fifo = UnitFIFO(high=50, low=40).plan(h)
    assert fifo.dropped_uids() == (1, 2, 3) and fifo.tokens_after == 35
    tok = TokenSliding(high=50, low=40).plan(h)
    assert tok.tokens_after == 40 and tok.keep_mask()[-35:].all() and not tok.keep_mask()[5:45].any()
    sl = StreamingLLM(high=50, low=40, sink=2).plan(h)
    m = sl.keep_mask()
    assert m[:7].all() and not m[7:47].any() and m[47:].all() and sl.tokens_after == 40
    scores = np.zeros(h.total_tokens)
    scores[[10, 20, 30]] = [3.0, 2.0, 1.0]
    hh = H2O(high=50, low=40, recent=30).plan(h, scores=scores)
    m = hh.keep_mask()
    assert m[:5].all() and m[-30:].all() and m[[10, 20, 30]].all() and hh.tokens_after == 40
    assert np.flatnonzero(m[5:50]).tolist() == [0, 1, 5, 15, 25]  # 3 heavy hitters + 2 ties, oldest first


def test_same_input_same_plan():
    h = History([Unit.build(0, UnitKind.SYSTEM, [(SpanKind.SYSTEM, 5)], axes=3)])
    for uid in range(1, 9):
        h.append(build_unit(uid, ("media", (1, (3, 4), (2, 2, 3), 5, 2, 1)), h.next_position(), 3))
    for name in POLICY_NAMES:
        kw = {"scores": _scores(h, 3)} if name == "h2o" else {}
        a = make_policy(name, high=60, low=40).plan(h, **kw)
        b = make_policy(name, high=60, low=40).plan(h, **kw)
        assert (a is None and b is None) or a.to_json() == b.to_json()


def test_malformed_plans_and_configs_raise_clear_errors():
    h = History([Unit.build(0, UnitKind.SYSTEM, [(SpanKind.SYSTEM, 5)])])
    for uid in range(1, 4):
        h.append(build_unit(uid, ("media", (1, (3, 3), None, 4, 0, 1)), h.next_position(), 1))
    keep = np.ones(h.total_tokens, dtype=bool)
    keep[2] = False
    with pytest.raises(RetentionError, match="system-prefix"):
        plan_from_mask(h, keep)
    with pytest.raises(RetentionError, match="keep mask"):
        plan_from_mask(h, keep[:-1])
    keep[2] = True
    keep[10:20] = False
    plan = plan_from_mask(h, keep)
    bad = dataclasses.replace(plan, units=(plan.units[0], dataclasses.replace(plan.units[1], shifts=(99,)),
                                           *plan.units[2:]))
    with pytest.raises(RetentionError, match="shift rule"):
        apply_plan(h, bad)
    bad = dataclasses.replace(plan, units=plan.units[1:])
    with pytest.raises(RetentionError, match="covers"):
        apply_plan(h, bad)
    bad = dataclasses.replace(plan, units=(plan.units[0], dataclasses.replace(plan.units[1], uid=7),
                                           *plan.units[2:]))
    with pytest.raises(RetentionError, match="does not match"):
        apply_plan(h, bad)
    bad = dataclasses.replace(plan, units=(dataclasses.replace(plan.units[0], kept=((0, 3),), deleted=((3, 5),),
                                                               shifts=(0,)), *plan.units[1:]))
    with pytest.raises(RetentionError, match="system prefix"):
        apply_plan(h, bad)
    bad = dataclasses.replace(plan, units=(plan.units[0], dataclasses.replace(plan.units[1], kept=((0, 6),)),
                                           *plan.units[2:]))
    with pytest.raises(RetentionError, match="tile"):
        apply_plan(h, bad)
    with pytest.raises(RetentionError, match="low"):
        OmniPick(high=10, low=20)
    with pytest.raises(RetentionError, match="recent_units"):
        OmniPick(recent_units=0)
    with pytest.raises(RetentionError, match="image_sink"):
        OmniPick(image_sink=-1)
    with pytest.raises(RetentionError, match="layout"):
        OmniPick(layout="paged")
    with pytest.raises(RetentionError, match="unknown policy"):
        make_policy("lru")
    with pytest.raises(RetentionError, match="scores"):
        H2O(high=10, low=5).plan(h)
    with pytest.raises(RetentionError, match="scores for"):
        H2O(high=10, low=5).plan(h, scores=np.ones(3))
    with pytest.raises(RetentionError, match="policy 'fifo'"):
        make_policy("fifo", image_sink=3)


def test_make_policy_names_and_layouts():
    assert make_policy("omnitide").layout == "omnipage"
    assert make_policy("omnipick").layout == "native"
    assert make_policy("eager").layout == "eager" and isinstance(make_policy("eager"), OmniPick)
    assert make_policy("StreamingLLM").sink == 2
    assert make_policy("omnitide", high=3000, low=2000, image_sink=8).config()["image_sink"] == 8


def test_recent_units_count_media_units():
    """A question and its reply do not push the frames asked about out of the recent window (issue 12):
    with recent_count="media" the two newest media units stay whole right after every reply; counting every unit
    (the previous rule) leaves none whole after some replies on MiniCPM-o at the paper's units."""
    from omnitide_mlx.core.profiles import StreamSpec
    from omnitide_mlx.core.sim import Simulator
    from omnitide_mlx.core.units import UnitKind
    from omnitide_mlx.models.stream_units import resolve_profile

    prof = resolve_profile("minicpm-o-4.5", "paper")
    whole = {}
    for rule in ("media", "all"):
        pol = make_policy("omnipick", profile=prof, recent_count=rule)
        sim = Simulator(prof, pol, StreamSpec(300, question_every=30, seed=0), ("native",))
        after_reply = []
        for e in sim.stream.events():
            sim.step(e)
            if e.kind == "reply":
                newest = [u for u in sim.history if u.kind is UnitKind.MEDIA][-2:]
                after_reply.append(sum(not u.trimmed for u in newest))
        whole[rule] = after_reply
    assert min(whole["media"]) == 2
    assert min(whole["all"]) < 2
    with pytest.raises(RetentionError, match="recent_count"):
        make_policy("omnipick", recent_count="text")


# --- the leftover-budget rule (issue 12, item 4) --------------------------------------------------------------

@settings(max_examples=200)
@given(h=histories(), knobs=knob_strategy, wm=st.tuples(st.floats(0.05, 1.0), st.floats(0.0, 0.5)),
       order=st.permutations(["audio", "text", "image", "slice"]), n=st.integers(1, 4))
def test_leftover_keeps_a_superset_up_to_low_and_fills_kinds_in_order(h, knobs, wm, order, n):
    total = h.total_tokens
    low = max(1, int(total * wm[0]))
    high = max(low, int(total * (wm[0] + wm[1])) - 1)
    base = OmniPick(high=high, low=low, **knobs)
    spent = OmniPick(high=high, low=low, leftover="+".join(order[:n]), **knobs)
    p0, p1 = base.plan(h), spent.plan(h)
    if p0 is None:
        assert p1 is None or total <= high
        return
    k0 = p0.keep_mask()
    k1 = spent.keep_mask(h)
    assert (k1 >= k0).all(), "the leftover only adds tokens"
    if p0.tokens_after >= low:
        assert (k1 == k0).all(), "nothing is left over at or above low"
        return
    assert int(k0.sum()) <= int(k1.sum()) <= low
    extra = k1 & ~k0
    event("leftover spent" if extra.any() else "nothing of the named kinds to extend")
    kinds = np.concatenate([u.token_kinds() for u in h])
    isin = lambda names: np.array([k in {x for nm in names for x in named[nm]} for k in kinds], dtype=bool)  # noqa
    named = {"audio": (SpanKind.AUDIO,), "text": (SpanKind.TEXT, SpanKind.RESPONSE), "image": (SpanKind.IMAGE,),
             "slice": (SpanKind.IMAGE_SLICE,)}
    allowed = isin(order[:n])
    assert not (extra & ~allowed).any(), "only the named kinds get the leftover"
    # every span's kept part stays a prefix
    offsets = h.offsets()
    for i, u in enumerate(h):
        for s in u.spans:
            seg = k1[offsets[i] + s.start:offsets[i] + s.end]
            assert not (~seg[:-1] & seg[1:]).any()
    # a later kind gets tokens only once every older span of the earlier kinds is whole
    if int(k1.sum()) < low:
        return  # everything named was used up before the leftover
    for j, name in enumerate(order[:n]):
        later = isin(order[j + 1:n])
        if (extra & later).any():
            mine = isin([name])
            older_units = [i for i, up in enumerate(p0.units) if not up.untouched]
            for i in older_units:
                a, b = offsets[i], offsets[i] + h[i].length
                assert k1[a:b][mine[a:b]].all()
    _check_apply(h, plan_from_mask(h, k1, "omnipick"))


def test_leftover_gives_older_audio_first_newest_unit_first():
    """Three older units of [boundary 1, image 10, audio 8, text 4, boundary 1] and two recent ones: with audio_sink
    2 and text_budget 0 the §5.1 steps keep 1 + 4 + 2 + 0 + 1 = 8 tokens of each older unit; a low watermark 10
    above that goes to audio, newest older unit first (6 to unit 3, 4 to unit 2), none to text."""
    from omnitide_mlx.core.units import History, Unit

    spans = [(SpanKind.BOUNDARY, 1), (SpanKind.IMAGE, 10), (SpanKind.AUDIO, 8), (SpanKind.TEXT, 4),
             (SpanKind.BOUNDARY, 1)]
    h = History([Unit.build(0, UnitKind.SYSTEM, [(SpanKind.SYSTEM, 5)])])
    for uid in range(1, 6):
        h.append(Unit.build(uid, UnitKind.MEDIA, spans, start_position=h.next_position()))
    kw = dict(high=100, recent_units=2, image_sink=4, audio_sink=2, text_budget=0)
    low = 5 + 3 * 8 + 2 * 24 + 10
    base = OmniPick(low=low - 10, **kw).plan(h)
    assert base.tokens_after == low - 10
    plan = OmniPick(low=low, leftover="audio+text", **kw).plan(h)
    assert plan.tokens_after == low
    kept_audio = [int(up.keep_mask()[11:19].sum()) for up in plan.units[1:4]]
    assert kept_audio == [2, 6, 8]
    assert all(int(up.keep_mask()[19:23].sum()) == 0 for up in plan.units[1:4])
    assert OmniPick(low=low, leftover="audio+text", **kw).config()["leftover"] == "audio+text"


def test_leftover_values_are_checked():
    from omnitide_mlx.core.pick import parse_leftover
    from omnitide_mlx.eval.policies import parse_policy_spec

    assert parse_leftover("audio+text") == ("audio", "text") and parse_leftover("audio+") == ("audio",)
    assert parse_leftover("off") == () and parse_leftover(None) == ()
    for bad in ("audio+audio", "video"):
        with pytest.raises(RetentionError, match="leftover must name"):
            OmniPick(leftover=bad)
    assert parse_policy_spec("omnipick:leftover=audio+text,text_budget=64") == (
        "omnipick", (("leftover", "audio+text"), ("text_budget", 64)))
    with pytest.raises(ValueError, match="leftover"):
        parse_policy_spec("omnipick:leftover=video")


def test_policy_names_and_default_watermarks_have_one_definition():
    """core.pick's registry names the policies for the CLI and the stream benchmark, and its one default
    watermark pair is every policy constructor's default (a model family's record gives its own)."""
    import inspect

    from omnitide_mlx.bench.stream.names import ENGINE_POLICIES
    from omnitide_mlx.commands.options import LOW_RATIO, POLICIES as CLI_POLICIES
    from omnitide_mlx.core.pick import DEFAULT_HIGH, DEFAULT_LOW, POLICIES, POLICY_NAMES

    assert tuple(CLI_POLICIES) == ENGINE_POLICIES == POLICY_NAMES == tuple(POLICIES)
    assert LOW_RATIO == DEFAULT_LOW / DEFAULT_HIGH == 0.72
    for cls, _ in POLICIES.values():
        params = inspect.signature(cls.__init__).parameters
        assert (params["high"].default, params["low"].default) == (DEFAULT_HIGH, DEFAULT_LOW), cls
    with pytest.raises(RetentionError, match="ModelProfile"):
        make_policy("omnitide", profile="minicpm-o-4.5")
