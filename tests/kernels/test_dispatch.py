"""The dispatcher's choices against the written cost model (kernels/cost.py), its calibration, and OMNITIDE_KERNELS.

Cases are the real layouts of the attention benchmark's checkpoints (OmniPick + OmniPage, both benchmark shapes),
priced for an Apple GPU: the dispatcher must take the model's cheapest path; a calibration (measured / predicted per
path) must be able to move the choice; off Metal the reference stays.
"""

import mlx.core as mx
import numpy as np
import pytest
from attention_oracle import rand, random_layout

from omnitide_mlx.bench.attention_predict import layout_cases
from omnitide_mlx.kernels import cost, dispatch, plan_tiles, tile_skip_attention
from omnitide_mlx.kernels.dispatch import Dispatcher, KernelPathError

SHAPES = ["qwen2.5-omni-7b", "minicpm-o-4.5"]


@pytest.fixture(autouse=True)
def _auto(monkeypatch):
    monkeypatch.delenv("OMNITIDE_KERNELS", raising=False)


def _call(rng, t, hq=4, hkv=2, d=64, cap=512, tile=64, dtype=mx.float32):
    seq, qs, tiles = random_layout(rng, cap, tile, 0.5, t)
    plan = plan_tiles(seq, qs, tiles, tile)
    q = mx.array(rand(rng, (1, hq, t, d))).astype(dtype)
    k = mx.array(rand(rng, (1, hkv, cap, d))).astype(dtype)
    return q, k, plan


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [mx.float16, mx.float32])
def test_metal_choice_is_the_cost_models_cheapest_at_every_checkpoint(shape, dtype):
    d = Dispatcher(metal=True, calibrate=False, self_test=False)
    seen = set()
    for c in layout_cases(shape, [4096, 16384, 65536], dtype_bytes=4 if dtype == mx.float32 else 2):
        q = mx.zeros((1, c.case.hq, c.case.t, c.case.d), dtype)
        k = mx.zeros((1, c.case.hkv, c.plan.capacity, c.case.d), dtype)
        got = d.choose(q, k, c.plan)
        want, est = cost.best(dispatch.case_of(q, k, c.plan), cost.PATHS)
        assert got == want, (c.label, est)
        seen.add((c.phase, got))
    # what the model says for these shapes: matrix units (fused over gathered tiles or over the compact span) for
    # prefill, never the vector kernel; for decode never a gather (it copies as many bytes as it then reads)
    assert {p for ph, p in seen if ph == "prefill"} <= {"gather", "dense"}
    assert {p for ph, p in seen if ph == "decode"} <= {"vector", "dense"}


def test_prefill_over_a_contiguous_history_goes_dense():
    """Every tile active, no holes: a gather would only copy; the model prefers the fused call in place."""
    keys, t = 8192, 512
    seq = np.arange(keys)
    plan = plan_tiles(seq, np.arange(keys - t, keys), np.arange(keys // 64), 64)
    q, k = mx.zeros((1, 28, t, 128), mx.float16), mx.zeros((1, 4, keys, 128), mx.float16)
    assert Dispatcher(metal=True, calibrate=False, self_test=False).choose(q, k, plan) == "dense"


def test_calibration_factors_move_the_choice():
    rng = np.random.default_rng(0)
    q, k, plan = _call(rng, 40)
    case = dispatch.case_of(q, k, plan)
    first, est = cost.best(case, cost.PATHS)
    second = sorted(est, key=est.get)[1]
    factors = {first: 100.0}
    assert cost.best(case, cost.PATHS, factors=factors)[0] == second


def test_off_metal_the_reference_stays():
    rng = np.random.default_rng(1)
    d = Dispatcher(metal=False)
    for t in (1, 40):
        q, k, plan = _call(rng, t)
        assert d.choose(q, k, plan) == "reference"
    assert dispatch.candidates(40, 2, 64, metal=False) == ("reference",)


def test_candidates_follow_what_mlx_and_our_kernel_support():
    assert dispatch.candidates(1, 7, 128, metal=True) == ("vector", "gather", "dense")
    assert dispatch.candidates(2333, 7, 128, metal=True) == ("vector", "gather", "dense")
    assert dispatch.candidates(8, 7, 128, metal=True) == ("vector",)  # sdpa_vector: queries x group <= 32
    assert dispatch.candidates(100, 4, 256, metal=True) == ("vector",)  # sdpa_full: no head dim 256 in MLX 0.32
    assert dispatch.candidates(100, 4, 80, metal=True) == ("gather", "dense")  # our kernel: multiples of 32
    assert dispatch.candidates(100, 4, 40, metal=True) == ("reference",)


def test_return_scores_always_runs_the_reference(monkeypatch):
    rng = np.random.default_rng(2)
    q, k, plan = _call(rng, 5)
    monkeypatch.setenv("OMNITIDE_KERNELS", "gather")
    assert Dispatcher(metal=True).choose(q, k, plan, return_scores=True) == "reference"


def test_omnitide_kernels_forces_and_rejects(monkeypatch):
    rng = np.random.default_rng(3)
    q, k, plan = _call(rng, 5)
    for name, want in (("reference", "reference"), ("gather", "gather"), ("dense", "dense"), ("metal", "vector"),
                       ("VECTOR", "vector")):
        monkeypatch.setenv("OMNITIDE_KERNELS", name)
        assert Dispatcher(metal=True).choose(q, k, plan) == want
    monkeypatch.setenv("OMNITIDE_KERNELS", "vector")
    with pytest.raises(KernelPathError, match="no Metal GPU"):
        Dispatcher(metal=False).choose(q, k, plan)
    with pytest.raises(KernelPathError, match="multiple of 32"):
        Dispatcher(metal=True).choose(mx.zeros((1, 4, 5, 48)), mx.zeros((1, 2, 512, 48)), plan)
    monkeypatch.setenv("OMNITIDE_KERNELS", "fast")
    with pytest.raises(KernelPathError, match="choose auto, reference, vector, gather, dense"):
        tile_skip_attention(q, k, k, scale=0.1, plan=plan)


def test_calibration_times_each_candidate_once_per_shape():
    """Real timings (here of the two fused paths, which run on the CPU too): one calibration per shape, reused by
    every later call of that shape; the choice is the calibrated model's cheapest."""
    d = Dispatcher(metal=False, paths=("gather", "dense"), calibrate=True)
    rng = np.random.default_rng(4)
    q, k, plan = _call(rng, 40, hq=4, hkv=2, d=64)
    got = d.choose(q, k, plan, 0.125)
    (cal,) = d.calibrations.values()
    assert set(cal.measured_ms) == {"gather", "dense"} and all(v > 0 for v in cal.measured_ms.values())
    assert got == cost.best(dispatch.case_of(q, k, plan), ("gather", "dense"), factors=cal.factors)[0]
    q2, k2, plan2 = _call(rng, 40, hq=4, hkv=2, d=64)
    d.choose(q2, k2, plan2, 0.125)
    assert list(d.calibrations.values()) == [cal]  # same shape: not timed again
    q3, k3, plan3 = _call(rng, 1, hq=4, hkv=2, d=64)
    d.choose(q3, k3, plan3, 0.125)
    assert len(d.calibrations) == 2  # decode is another shape


def test_the_choice_is_cached_in_the_plan_for_every_layer():
    d = Dispatcher(metal=True, calibrate=False, self_test=False)
    rng = np.random.default_rng(5)
    q, k, plan = _call(rng, 40)
    first = d.choose(q, k, plan)
    assert plan.cache[("path", id(d), 4, 40, 2, 64, mx.float32)] == first
    assert d.choose(q, k, plan) == first


def test_prefill_over_scattered_tiles_gathers():
    """A quarter of the tiles active across a long span: the dense call would multiply 4x the slots."""
    cap, t = 16384, 512
    seq = np.full(cap, -1)
    tiles = np.arange(0, cap // 64, 4)
    slots = (tiles[:, None] * 64 + np.arange(64)).reshape(-1)
    seq[slots] = np.arange(slots.size)
    plan = plan_tiles(seq, slots.size - t + np.arange(t), tiles, 64)
    q, k = mx.zeros((1, 28, t, 128), mx.float16), mx.zeros((1, 4, cap, 128), mx.float16)
    assert Dispatcher(metal=True, calibrate=False, self_test=False).choose(q, k, plan) == "gather"


def test_case_counts_match_brute_force():
    rng = np.random.default_rng(6)
    seq, qs, tiles = random_layout(rng, 1024, 64, 0.4, 37)
    tiles = tiles[1:]  # one active tile unlisted
    c = cost.make_case(seq, qs, tiles, 64, hq=4, hkv=2, d=64, dtype_bytes=2)
    listed = np.zeros(1024, bool)
    for ti in tiles:
        listed[ti * 64:(ti + 1) * 64] = True
    vis = listed & (seq >= 0)
    assert c.visible == sum(int((vis & (seq <= x)).sum()) for x in qs)
    assert c.listed_slots == tiles.size * 64
    mins = np.array([seq[ti * 64:(ti + 1) * 64][seq[ti * 64:(ti + 1) * 64] >= 0].min() for ti in tiles])
    assert c.active_slots == int((mins <= qs.max()).sum()) * 64
    seen = tiles[mins <= qs.max()]
    assert c.span == (seen[-1] + 1 - seen[0]) * 64
    assert c.gathered == 37 * c.active_slots and c.spanned == 37 * c.span  # one block of 37 queries


def test_vector_kernel_costs_several_times_a_matrix_unit_per_visited_key():
    """The issue's rough count, restated by the model: at the 7B shape a prefill pays 2.5-4x more per visited key
    on the vector kernel than in MLX's fused kernel on the matrix units."""
    c = cost.dense_case(8192, 2048, hq=28, hkv=4, d=128, dtype_bytes=2)
    vec, mma = cost.predict("vector", c), cost.predict("dense", c)
    per_key_vec = vec.compute_ms / c.visible
    per_key_mma = mma.compute_ms / c.spanned
    assert 2.5 < per_key_vec / per_key_mma < 4
