"""Save / load through safetensors + JSON restores a cache exactly: same buffers, same page table, and the same
outputs (bit for bit) when both copies go on streaming, evicting and migrating."""

import copy

import mlx.core as mx
import numpy as np
import pytest
from cache_stream import Stream, make_cache
from stream_oracle import run_session

from omnitide_mlx.cache import CacheError, OmniCache
from omnitide_mlx.core.page import MigrationPlanner
from omnitide_mlx.core.pick import OmniPick


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
def test_save_load_round_trip(tmp_path, dtype):
    policy = OmniPick(high=200, low=140)
    s = Stream(make_cache(dtype=dtype, collect_scores=True), q_heads=4, seed=2,
               planner=MigrationPlanner("class_aware"))
    run_session(s, policy, units=10, check_oracle=False)
    path = tmp_path / "kv.safetensors"
    s.cache.save(path, metadata={"note": "test"})
    restored, meta = OmniCache.load(path, return_metadata=True)
    assert meta == {"note": "test"}
    c = s.cache
    assert restored.meta_state == c.meta_state
    assert restored.table.state() == c.table.state()
    assert restored.stats() == c.stats()
    for a, b in zip(c.layers, restored.layers):
        assert a.keys.dtype == b.keys.dtype == dtype
        assert mx.array_equal(a.keys, b.keys) and mx.array_equal(a.values, b.values)
    np.testing.assert_array_equal(restored.token_scores(s.history), c.token_scores(s.history))
    # both copies go on: more units, evictions (stochastic rounding streams continue), migrations
    twin = copy.copy(s)
    twin.cache = restored
    twin.outputs, twin.oracle = [], []
    twin.history, twin.alive, twin.pos = copy.deepcopy(s.history), list(s.alive), dict(s.pos)
    s.outputs = []
    rng_a, rng_b = np.random.default_rng(1), np.random.default_rng(1)
    from stream_oracle import media_runs
    from omnitide_mlx.core.units import UnitKind
    for _ in range(6):
        s.add_unit(UnitKind.MEDIA, media_runs(rng_a), check_oracle=False)
        twin.add_unit(UnitKind.MEDIA, media_runs(rng_b), check_oracle=False)
        s.maintain(policy)
        twin.maintain(policy)
    assert s.evictions > 0
    for x, y in zip(s.outputs, twin.outputs):
        for a, b in zip(x, y):
            np.testing.assert_array_equal(a, b)
    for a, b in zip(s.cache.layers, twin.cache.layers):
        assert mx.array_equal(a.keys, b.keys)


def test_load_rejects_foreign_or_broken_files(tmp_path):
    p = tmp_path / "other.safetensors"
    mx.save_safetensors(str(p), {"x": mx.zeros(3)})
    with pytest.raises(CacheError, match="no OmniCache"):
        OmniCache.load(p)
    c = make_cache()
    s = run_session(Stream(c, q_heads=4, seed=0), OmniPick(high=10**6, low=10**6), units=2, reply_every=0,
                    check_oracle=False)
    state = dict(s.cache.state)
    meta = s.cache.meta_state
    del state["layers.1.values"]
    with pytest.raises(CacheError, match="missing"):
        OmniCache.from_state(state, meta)
    state = dict(s.cache.state)
    state["layers.0.keys"] = state["layers.0.keys"][:, :, :64]
    with pytest.raises(CacheError, match="saved buffers"):
        OmniCache.from_state(state, meta)
    with pytest.raises(CacheError, match="format"):
        OmniCache.from_state(dict(s.cache.state), dict(meta, format="other"))
    state = dict(s.cache.state)
    state["table.seq"] = mx.zeros_like(state["table.seq"])  # repeated serials
    with pytest.raises(CacheError, match="page table"):
        OmniCache.from_state(state, meta)


def test_from_table_builds_a_cache_holding_another_table():
    """A cache from a page table and buffers (the stream benchmark installs a simulated layout this way): same
    configuration, that table, those buffers and scores, counters at zero; it goes on streaming like any cache."""
    policy = OmniPick(high=200, low=140)
    s = Stream(make_cache(collect_scores=True), q_heads=4, seed=3, planner=MigrationPlanner("class_aware"))
    run_session(s, policy, units=8, check_oracle=False)
    c = s.cache
    assert c.evictions > 0
    cap = c.table.capacity  # the buffers may hold more slots (grown ahead); the built cache holds the table's
    buffers = {k: v[:, :, :cap] for k, v in c.state.items() if k.startswith("layers.")}
    scores = np.arange(cap, dtype=np.float32)
    built = make_cache(collect_scores=True).from_table(c.table, buffers, scores)
    assert built.table.state() == c.table.state() and built.table is not c.table
    assert (built.evictions, built.moved_rows, built.rotated_rows) == (0, 0, 0)
    for a, b in zip(c.layers, built.layers):
        assert mx.array_equal(a.keys[:, :, :cap], b.keys) and mx.array_equal(a.values[:, :, :cap], b.values)
    np.testing.assert_array_equal(np.array(built.state["scores"]), scores)
    with pytest.raises(CacheError, match="needs scores"):
        make_cache(collect_scores=True).from_table(c.table, buffers)
    with pytest.raises(CacheError, match="layer 0"):
        make_cache().from_table(c.table, {k: v[:, :, :8] for k, v in buffers.items()})
