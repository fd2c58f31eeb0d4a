"""Layout invariance (native, OmniPage, eager give the same attention), edge cases, and migration memory."""

import mlx.core as mx
import numpy as np
import pytest
from cache_stream import Stream, make_cache
from stream_oracle import run_session

from omnitide_mlx.cache import CacheError, OmniCache
from omnitide_mlx.core.page import AllocClass, MigrationPlanner, PageTable
from omnitide_mlx.core.pick import OmniPick, plan_from_mask
from omnitide_mlx.core.units import History, SpanKind, Unit, UnitKind
from omnitide_mlx.rope import RopeSpec

LAYOUTS = {
    "native": dict(placement="first_fit", planner=None),
    "omnipage": dict(placement="class_aware", planner="class_aware"),
    "eager": dict(placement="first_fit", planner="eager"),
}


def _layout_stream(name, seed, **kw):
    cfg = LAYOUTS[name]
    planner = MigrationPlanner(cfg["planner"]) if cfg["planner"] else None
    s = Stream(make_cache(placement=cfg["placement"]), q_heads=4, seed=seed, planner=planner)
    return run_session(s, OmniPick(high=200, low=140), units=18, rng_seed=seed, check_oracle=False, **kw)


@pytest.mark.parametrize("seed", range(3))
def test_layout_invariance(seed):
    """One retention plan sequence, three physical layouts: every prefill chunk and decode step attends equal
    (float32, ~1e-5), while the layouts really differ."""
    runs = {name: _layout_stream(name, seed, chunk=25 if seed == 2 else None) for name in LAYOUTS}
    base = runs["native"]
    steps = len(base.outputs)
    assert steps > 20 and base.evictions >= 3
    for name in ("omnipage", "eager"):
        s = runs[name]
        assert len(s.outputs) == steps
        err = max(float(np.abs(a - b).max()) for x, y in zip(base.outputs, s.outputs) for a, b in zip(x, y))
        assert err < 1e-5, (name, err)
        assert s.migrations >= 1
    st = {n: r.cache.layout_stats() for n, r in runs.items()}
    assert st["native"].retained_cells == st["omnipage"].retained_cells == st["eager"].retained_cells
    assert st["eager"].physical_span <= st["native"].physical_span
    assert st["eager"].active_subblocks < st["native"].active_subblocks
    decode_steps = [i for i, o in enumerate(base.outputs) if o[0].shape[2] == 1]
    assert decode_steps, "the stream must include decode steps"


# --- edge cases ---------------------------------------------------------------------------------------------

def _history_of(units):
    return History(units)


def test_all_holes_but_one_and_an_emptied_tile():
    """Evict everything but one token (the system prefix of one token): the next step attends to it and itself;
    the pages emptied by the eviction are skipped."""
    s = Stream(make_cache(), q_heads=2, seed=0)
    s.add_unit(UnitKind.SYSTEM, [(SpanKind.SYSTEM, 1)], AllocClass.MUST_KEEP)
    s.add_unit(UnitKind.MEDIA, [(SpanKind.BOUNDARY, 1), (SpanKind.IMAGE, 150), (SpanKind.BOUNDARY, 1)])
    s.add_unit(UnitKind.MEDIA, [(SpanKind.BOUNDARY, 1), (SpanKind.IMAGE, 40), (SpanKind.BOUNDARY, 1)])
    keep = np.zeros(s.history.total_tokens, bool)
    keep[0] = True
    keep[-42:] = True  # the last unit stays
    plan = plan_from_mask(s.history, keep)
    from omnitide_mlx.core.pick import apply_plan
    s.cache.evict(plan, s.history)
    s.history = apply_plan(s.history, plan)
    s.alive = [t for t, k in zip(s.alive, keep) if k]
    for j, t in enumerate(s.alive):
        s.pos[t] = s.history.positions()[:, j]
    assert s.cache.layout_stats().active_pages < s.cache.table.num_pages  # a page became empty
    # now drop the last unit too: a single retained token
    keep = np.zeros(s.history.total_tokens, bool)
    keep[0] = True
    plan = plan_from_mask(s.history, keep)
    s.cache.evict(plan, s.history)
    s.history = apply_plan(s.history, plan)
    s.alive = s.alive[:1]
    assert s.cache.layout_stats().retained_cells == 1
    s.add_reply(3)  # decode: one subblock with the system token plus the new ones
    s.add_unit(UnitKind.USER, [(SpanKind.TEXT, 30)])  # prefill
    err = max(float(np.abs(o - r).max()) for out, ref in zip(s.outputs, s.oracle) for o, r in zip(out, ref))
    assert err < 2e-5


def test_one_tile_and_capacity_growth_mid_stream():
    """The first step fits one tile; later steps grow the buffers a page at a time (grow_pages=1) while the
    stream keeps attending correctly; buffers track the table's capacity exactly."""
    s = Stream(make_cache(grow_pages=1), q_heads=4, seed=1)
    s.add_unit(UnitKind.SYSTEM, [(SpanKind.SYSTEM, 20)], AllocClass.MUST_KEEP)
    assert s.cache.capacity == 64 and s.cache.layout_stats().active_pages == 1
    caps = []
    rng = np.random.default_rng(0)
    for _ in range(6):
        s.add_unit(UnitKind.MEDIA, [(SpanKind.BOUNDARY, 1), (SpanKind.IMAGE, int(rng.integers(30, 90)))])
        caps.append(s.cache.capacity)
        assert s.cache.capacity == s.cache.table.capacity
    assert caps[-1] > caps[0]
    s.add_reply(4)
    err = max(float(np.abs(o - r).max()) for out, ref in zip(s.outputs, s.oracle) for o, r in zip(out, ref))
    assert err < 2e-5


def test_misuse_is_rejected():
    c = make_cache()
    with pytest.raises(CacheError, match="set_owner"):
        c.begin_step(3)
    c.set_owner(0, AllocClass.MUST_KEEP)
    with pytest.raises(CacheError, match="positive"):
        c.begin_step(0)
    with pytest.raises(CacheError, match="outside a step"):
        c[0].attend(mx.zeros((1, 4, 2, 64)), mx.zeros((1, 2, 2, 64)), mx.zeros((1, 2, 2, 64)), 1.0)
    c.begin_step(2)
    with pytest.raises(CacheError, match="while a step is open"):
        c.begin_step(1)
    with pytest.raises(CacheError, match="k / v must be"):
        c[0].attend(mx.zeros((1, 4, 2, 64)), mx.zeros((1, 2, 3, 64)), mx.zeros((1, 2, 3, 64)), 1.0)
    c[0].attend(mx.zeros((1, 4, 2, 64)), mx.zeros((1, 2, 2, 64)), mx.zeros((1, 2, 2, 64)), 1.0)
    with pytest.raises(CacheError, match="1 of 2 layers"):
        c.end_step()
    assert c.layout_stats().retained_cells == 0
    c.begin_step(3)  # a forward that fails half way gives its slots back
    c.abort_step()
    assert c.layout_stats().retained_cells == 0
    with pytest.raises(CacheError, match="without begin_step"):
        c.abort_step()
    with pytest.raises(CacheError, match="KV dtype"):
        OmniCache(1, 1, 64, RopeSpec(64, 1e4), mx.int32)
    with pytest.raises(CacheError, match="positive int"):
        OmniCache(0, 1, 64, RopeSpec(64, 1e4))
    with pytest.raises(CacheError, match="collect_scores"):
        make_cache().token_scores()


def test_evict_checks_the_history_and_a_stale_migration_plan():
    s = run_session(Stream(make_cache(placement="class_aware"), q_heads=2, seed=3), OmniPick(high=10**6, low=10**6),
                    units=3, reply_every=0, check_oracle=False)
    keep = np.ones(s.history.total_tokens, bool)
    keep[10:20] = False
    plan = plan_from_mask(s.history, keep)
    other = History([Unit.build(0, UnitKind.SYSTEM, [(SpanKind.SYSTEM, s.history[0].length)])])
    with pytest.raises(Exception, match="units|agree"):
        s.cache.evict(plan, other)
    stale = MigrationPlanner("eager").plan(s.cache.page_table)  # planned before the eviction
    s.cache.evict(plan, s.history)
    with pytest.raises(CacheError, match="different layout"):
        s.cache.migrate(stale)
    rejected = MigrationPlanner("native").plan(s.cache.page_table)
    with pytest.raises(CacheError, match="not accepted"):
        s.cache.migrate(rejected)


# --- migration memory ---------------------------------------------------------------------------------------

def _big_cache(capacity=16384, layers=2, heads=4, dim=128, dtype=mx.float16):
    """A cache filled through its saved-state path (no attention needed): entries in [0, 12000) and a tail of 96
    entries at the end, so an ordered-suffix plan moves only the tail."""
    table = PageTable(placement="first_fit", capacity=capacity)
    table.allocate(12000, uid=0, alloc_class=AllocClass.RECENT_CONTEXT)
    table.allocate(capacity - 12000, uid=1, alloc_class=AllocClass.RECENT_CONTEXT)
    table.free(np.arange(12000, capacity - 96))
    c = OmniCache(layers, heads, dim, RopeSpec(dim, 1e4), dtype, placement="first_fit")
    state = {}
    rng = np.random.default_rng(0)
    for i in range(layers):
        for name in ("keys", "values"):
            state[f"layers.{i}.{name}"] = mx.array(rng.standard_normal((1, heads, capacity, dim), np.float32)).astype(dtype)
    ts = table.state()
    for name in ("slots", "seq", "unit", "cls"):
        state[f"table.{name}"] = mx.array(np.asarray(ts[name], np.int32))
    meta = dict(c.meta_state, capacity=capacity, table={k: ts[k] for k in ("page_size", "subblock_size", "placement",
                                                                           "capacity", "next_seq", "partial")})
    big = OmniCache.from_state(state, meta)
    mx.eval([layer.keys for layer in big.layers], [layer.values for layer in big.layers])
    return big


def test_migration_memory_grows_with_rows_moved_not_with_the_cache():
    c = _big_cache()
    plan = MigrationPlanner("ordered_suffix").plan(c.page_table)
    assert plan.accepted and plan.src.size == 96
    buffer_bytes = c.layers[0].keys.nbytes  # 16 MB
    rows_bytes = 2 * plan.src.size * c.kv_heads * c.head_dim * c.dtype.size  # K + V of one layer
    before = {i: np.array(c.layers[i].keys[0, :, mx.array(plan.src[:4]), :]) for i in range(c.num_layers)}
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    c.migrate(plan)
    peak = mx.get_peak_memory() - base
    assert peak < 4 * rows_bytes + (256 << 10), (peak, rows_bytes)
    assert peak < buffer_bytes / 20
    for i, rows in before.items():  # the rows really moved
        np.testing.assert_array_equal(np.array(c.layers[i].keys[0, :, mx.array(plan.dst[:4]), :]), rows)
    assert c.migration_bytes(plan) == c.num_layers * rows_bytes


def test_the_memory_check_would_catch_a_full_copy():
    """Control: while another array still holds the buffer (here an evaluated slice view), the same gather, eval and
    scatter must copy the whole buffer, and the measurement sees it (reference/offline_assets_and_cpu.md, 4)."""
    c = _big_cache(layers=1)
    plan = MigrationPlanner("ordered_suffix").plan(c.page_table)
    keys = c.layers[0].keys
    view = keys[:, :, :16, :]
    mx.eval(view)
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    rows = keys[:, :, mx.array(plan.src.astype(np.int32)), :]
    mx.eval(rows)
    keys[:, :, mx.array(plan.dst.astype(np.int32)), :] = rows
    mx.eval(keys)
    assert mx.get_peak_memory() - base >= keys.nbytes
    del view


def test_migration_after_real_steps_stays_in_place():
    """After prefill and decode steps (attention took views of the buffers), a migration still updates the
    buffers in place: nothing from the steps keeps them alive."""
    s = Stream(make_cache(layers=2, kv_heads=4, head_dim=128, placement="class_aware"), q_heads=8, seed=1)
    policy = OmniPick(high=200, low=140)
    rng = np.random.default_rng(0)
    from stream_oracle import media_runs
    s.add_unit(UnitKind.SYSTEM, [(SpanKind.SYSTEM, 5)], AllocClass.MUST_KEEP, check_oracle=False)
    planner = MigrationPlanner("class_aware")
    for i in range(60):
        s.add_unit(UnitKind.MEDIA, media_runs(rng), check_oracle=False)
        if i % 4 == 3:
            s.add_reply(3, check_oracle=False)
        if s.maintain(policy) is None:
            continue
        plan = planner.plan(s.cache.page_table)
        if plan.accepted:
            break
    else:
        pytest.fail("no accepted migration in the stream")
    buffer_bytes = s.cache.layers[0].keys.nbytes
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    s.cache.migrate(plan)
    peak = mx.get_peak_memory() - base
    rows_bytes = 2 * plan.src.size * s.cache.kv_heads * s.cache.head_dim * 4
    assert peak < 2 * rows_bytes + (64 << 10) < buffer_bytes, (peak, rows_bytes, buffer_bytes)
