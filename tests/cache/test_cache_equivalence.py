"""After evictions, the cache's attention equals a float64 reference that keeps every token ever written, masks the
deleted ones and rotates each kept key at its shifted position (prefill chunks and decode steps)."""

import mlx.core as mx
import numpy as np
import pytest
from cache_stream import Stream, make_cache
from stream_oracle import run_session

from omnitide_mlx.core.page import MigrationPlanner
from omnitide_mlx.core.pick import H2O, OmniPick, TokenSliding

TOL = 2e-5  # float32 cache against the float64 oracle; values are O(1)


def _max_err(s: Stream) -> float:
    assert len(s.outputs) == len(s.oracle) > 0
    return max(float(np.abs(o - r).max()) for out, ref in zip(s.outputs, s.oracle) for o, r in zip(out, ref))


@pytest.mark.parametrize("seed", range(3))
def test_omnipick_stream_matches_oracle(seed):
    s = run_session(Stream(make_cache(), q_heads=4, seed=seed), OmniPick(high=200, low=140), units=20,
                    rng_seed=seed)
    assert s.evictions >= 3 and s.cache.rotated_rows > 0
    assert _max_err(s) < TOL


def test_token_sliding_cuts_units_and_still_matches():
    s = run_session(Stream(make_cache(kv_heads=1), q_heads=3, seed=5), TokenSliding(high=200, low=150), units=14)
    assert s.evictions >= 3
    assert _max_err(s) < TOL


def test_chunked_prefill_and_omnipage_migration_match():
    """Units prefilled in 9-token chunks (a unit spans steps) on the OmniPage layout with migrations; with tail
    fill, whole recent units move down into the holes below them as well."""
    moved = {}
    for tail_fill in (False, True):
        planner = MigrationPlanner("class_aware", tail_fill=tail_fill)
        s = Stream(make_cache(placement="class_aware"), q_heads=4, seed=3, planner=planner)
        run_session(s, OmniPick(high=200, low=140), units=16, chunk=9)
        assert s.migrations >= 1
        assert _max_err(s) < TOL, tail_fill
        moved[tail_fill] = s.cache.moved_rows
    assert moved[True] > moved[False]


def test_mrope_uniform_shift_is_exact():
    """M-RoPE keys (t, h, w sections; image tokens on a 2-D grid) re-rotated as one NeoX rotation by -shift equal
    M-RoPE at the shifted positions (the shift rule moves t, h and w together)."""
    s = run_session(Stream(make_cache(head_dim=128), q_heads=4, seed=2, sections=(16, 24, 24)),
                    OmniPick(high=200, low=140), units=14)
    assert s.evictions >= 2
    assert _max_err(s) < TOL


def test_h2o_scores_accumulate_per_kept_token():
    s = Stream(make_cache(collect_scores=True), q_heads=4, seed=4)
    run_session(s, H2O(high=260, low=170), units=4, reply_every=0)  # under the watermark: no eviction yet
    got = s.cache.token_scores(s.history)
    want = np.array([s.scores[t] for t in s.alive])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # an eviction keeps the survivors' scores and forgets the deleted tokens'
    s.maintain(H2O(high=100, low=60))
    got = s.cache.token_scores(s.history)
    np.testing.assert_allclose(got, np.array([s.scores[t] for t in s.alive]), rtol=1e-5, atol=1e-5)
    assert abs(got.sum() - s.cache.storage.scores.sum()) < 1e-3  # nothing left on freed slots


def test_h2o_policy_runs_on_cache_scores():
    s = run_session(Stream(make_cache(collect_scores=True, placement="first_fit"), q_heads=4, seed=6),
                    H2O(high=200, low=140), units=16)
    assert s.evictions >= 3
    assert _max_err(s) < TOL


def test_float16_cache_stays_close_to_oracle():
    s = run_session(Stream(make_cache(dtype=mx.float16), q_heads=4, seed=7), OmniPick(high=200, low=140),
                    units=14)
    assert s.evictions >= 2
    assert _max_err(s) < 1e-2  # half-precision K/V storage, float32 accumulation
