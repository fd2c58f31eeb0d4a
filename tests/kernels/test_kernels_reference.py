"""Every CPU-runnable path of tile_skip_attention (the MLX-ops reference, gathered and dense fused attention) and
page_compact against a float64 numpy statement of the contract."""

import mlx.core as mx
import numpy as np
import pytest
from attention_oracle import oracle_attention, rand, random_layout

from omnitide_mlx.kernels import (
    AttentionError,
    page_compact,
    plan_tiles,
    reference_attention,
    tile_skip_attention,
)
from omnitide_mlx.kernels import attention as attn
from omnitide_mlx.kernels import fused

CPU_PATHS = ["reference", "gather", "dense"]


@pytest.fixture(params=CPU_PATHS)
def path(request, monkeypatch):
    """Runs a test once per path, forced through OMNITIDE_KERNELS as a user would."""
    monkeypatch.setenv("OMNITIDE_KERNELS", request.param)
    return request.param


def _run(rng, hkv, g, d, tile, capacity, t, fill, scale=0.3, dtype=mx.float32, tiles=None, **kw):
    seq, qs, active = random_layout(rng, capacity, tile, fill, t)
    tiles = active if tiles is None else tiles
    q = rand(rng, (1, hkv * g, t, d))
    k = rand(rng, (1, hkv, capacity, d))
    v = rand(rng, (1, hkv, capacity, d))
    qm, km, vm = (mx.array(x).astype(dtype) for x in (q, k, v))
    out = tile_skip_attention(qm, km, vm, seq, qs, tiles, scale, tile, **kw)
    # the oracle sees the same (rounded) inputs
    ref = oracle_attention(np.array(qm.astype(mx.float32)), np.array(km.astype(mx.float32)),
                           np.array(vm.astype(mx.float32)), seq, qs, tiles, tile, scale)
    return out, ref


@pytest.mark.parametrize("seed", range(12))
def test_random_layouts_match_oracle(seed, path):
    rng = np.random.default_rng(seed)
    tile = (32, 64)[seed % 2]
    hkv, g = int(rng.integers(1, 3)), int(rng.integers(1, 5))
    t = (1, 1, 5, 37)[seed % 4]
    out, (ref, _) = _run(rng, hkv, g, 32 * int(rng.integers(1, 3)), tile, tile * int(rng.integers(2, 9)), t,
                         float(rng.uniform(0.05, 0.9)))
    assert out.dtype == mx.float32
    np.testing.assert_allclose(np.array(out), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", ["slice", "runs", "gather", "blocks"])
def test_every_reference_path(path, monkeypatch):
    """Each way the reference reaches the keys (one slice, per-run scores, gather, query blocks) is exact."""
    rng = np.random.default_rng(7)
    tile, capacity = 32, 512
    seq = np.full(capacity, -1)
    if path == "slice":  # everything in tiles 3..6
        seq[96:224] = rng.permutation(128)
    else:  # tiles 1, 4, 5, 9: three runs
        slots = np.concatenate([np.arange(32, 64), np.arange(128, 192), np.arange(288, 320)])
        keep = slots[rng.random(slots.size) < 0.7]
        seq[keep] = rng.permutation(keep.size)
    t = 1 if path in ("runs", "slice") else 40
    if path == "gather":
        monkeypatch.setattr(attn, "DECODE_MAX_RUNS", 0)
    if path == "blocks":
        monkeypatch.setattr(attn, "SCORE_BUDGET", 4 * 3 * 128)  # blocks of 3 queries
    qs = np.sort(rng.integers(0, seq.max() + 1, t))
    tiles = np.nonzero((seq.reshape(-1, tile) >= 0).any(axis=1))[0]
    q, k, v = rand(rng, (1, 4, t, 64)), rand(rng, (1, 2, capacity, 64)), rand(rng, (1, 2, capacity, 64))
    out, scores = tile_skip_attention(mx.array(q), mx.array(k), mx.array(v), seq, qs, tiles, 0.125, tile,
                                      return_scores=True)
    ref, ref_scores = oracle_attention(q, k, v, seq, qs, tiles, tile, 0.125)
    np.testing.assert_allclose(np.array(out), ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.array(scores), ref_scores, atol=1e-5)



@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the reference path's memory, as the CPU backend runs it")
def test_query_blocks_bound_the_score_memory(monkeypatch):
    """Query blocks run one after another, so a call's transient memory is a few blocks' scores, not most of the
    blocks' (unordered, MLX builds many blocks' score matrices before their softmaxes: measured 2.5 GB for a
    2,333-token chunk over 16K keys at 16 heads, against 0.7 GB ordered). And what the plan caches for small blocks
    (their additive masks) is the masks' own size: converting a numpy view copied all of the array it views."""
    monkeypatch.setattr(attn, "SCORE_BUDGET", 1 << 18)  # 1 MB of float32 scores per block: 8 queries here
    rng = np.random.default_rng(0)
    hq, hkv, d, t, capacity = 4, 2, 32, 512, 8192
    seq = np.arange(capacity)
    qs = np.arange(capacity - t, capacity)
    tiles = np.arange(capacity // 64)
    q = mx.array(rand(rng, (1, hq, t, d)))
    k, v = mx.array(rand(rng, (1, hkv, capacity, d))), mx.array(rand(rng, (1, hkv, capacity, d)))
    plan = plan_tiles(seq, qs, tiles)
    mx.eval(q, k, v)
    mx.clear_cache()

    def call() -> tuple[mx.array, int, int]:
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        out = reference_attention(q, k, v, plan, 0.2)
        mx.eval(out)
        return out, mx.get_peak_memory() - before, mx.get_active_memory() - before - out.nbytes

    _, _, plan_cache = call()  # the first call schedules the blocks and caches their masks in the plan
    out, transient, _ = call()
    bias_bytes = (hq // hkv) * t * capacity * 4  # every block's additive mask, (g x tb) x keys float32
    assert plan_cache < 1.25 * bias_bytes, (plan_cache, bias_bytes)
    all_scores = t * hq * capacity * 4  # 64 MB
    # ordered: 10 MB here (the CPU softmax holds about 6 score-sized intermediates per 1 MB block,
    # kernels/cpu_math.py); unordered, the same blocks peak at 34 MB
    assert transient < all_scores / 4, (transient, all_scores)
    ref, _ = oracle_attention(np.array(q), np.array(k), np.array(v), seq, qs, tiles, 64, 0.2)
    np.testing.assert_allclose(np.array(out), ref, atol=1e-5, rtol=1e-5)


def test_causal_inside_the_new_chunk_and_block_skipping(monkeypatch, path):
    """Prefill: query i of the chunk sees the chunk's keys up to itself; small query blocks skip future tiles."""
    monkeypatch.setattr(attn, "SCORE_BUDGET", 2 * 8 * 64 * 6)
    monkeypatch.setattr(fused, "FUSED_BLOCK_MAX", 16)
    rng = np.random.default_rng(3)
    capacity, tile, t = 640, 64, 200
    seq = np.full(capacity, -1)
    seq[:300] = np.arange(300)
    seq[320:520] = 300 + np.arange(t)  # the chunk, in its own pages
    qs = 300 + np.arange(t)
    tiles = np.nonzero((seq.reshape(-1, tile) >= 0).any(axis=1))[0]
    q, k, v = rand(rng, (1, 2, t, 32)), rand(rng, (1, 1, capacity, 32)), rand(rng, (1, 1, capacity, 32))
    out = tile_skip_attention(mx.array(q), mx.array(k), mx.array(v), seq, qs, tiles, 0.2, tile)
    np.testing.assert_allclose(np.array(out), oracle_attention(q, k, v, seq, qs, tiles, tile, 0.2)[0],
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_precision_kv_accumulates_in_float32(dtype, path):
    rng = np.random.default_rng(11)
    out, (ref, _) = _run(rng, 2, 3, 64, 64, 512, 6, 0.5, dtype=dtype)
    assert out.dtype == dtype
    eps = 2.0 ** -8 if dtype == mx.bfloat16 else 2.0 ** -11  # one rounding of the output
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), ref, atol=2 * eps, rtol=2 * eps)


@pytest.mark.parametrize("t", [1, 7])
def test_inactive_tiles_are_never_read(t, path):
    """Tiles left off the list are not read: NaN keys there (visible by seq) leave the output finite and equal to
    attention over the listed tiles only. The dense path reads the span between listed tiles (kernels/fused.py):
    there the unlisted tiles hold large finite values instead, which its mask must hide."""
    rng = np.random.default_rng(5)
    capacity, tile = 512, 32
    seq = np.arange(capacity)
    tiles = np.array([0, 3, 4, 9, 15])
    k, v = rand(rng, (1, 2, capacity, 64)), rand(rng, (1, 2, capacity, 64))
    off = np.ones(capacity // tile, bool)
    off[tiles] = False
    off = np.repeat(off, tile)
    k[:, :, off] = np.nan if path != "dense" else 1e4
    v[:, :, off] = np.nan if path != "dense" else 1e4
    q = rand(rng, (1, 4, t, 64))
    qs = capacity - t + np.arange(t)
    out = np.array(tile_skip_attention(mx.array(q), mx.array(k), mx.array(v), seq, qs, tiles, 0.125, tile))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, oracle_attention(q, np.nan_to_num(k), np.nan_to_num(v), seq, qs, tiles, tile,
                                                     0.125)[0], atol=1e-5, rtol=1e-5)


def test_edge_cases(path):
    rng = np.random.default_rng(2)
    q, k, v = mx.array(rand(rng, (1, 2, 3, 32))), mx.array(rand(rng, (1, 1, 128, 32))), mx.array(rand(rng, (1, 1, 128, 32)))
    seq = np.full(128, -1)
    # no active tile: zeros, and no attention anywhere
    assert not np.array(tile_skip_attention(q, k, v, seq, [0, 1, 2], [], 0.1, 64)).any()
    out, scores = tile_skip_attention(q, k, v, seq, [0, 1, 2], [], 0.1, 64, return_scores=True)
    assert not np.array(out).any() and not np.array(scores).any()
    # listed tiles that hold only free slots: zeros
    assert not np.array(tile_skip_attention(q, k, v, seq, [0, 1, 2], [0, 1], 0.1, 64)).any()
    # all holes but one: every query attends to that one key with weight 1
    seq[77] = 0
    out = tile_skip_attention(q, k, v, seq, [0, 1, 2], [1], 0.1, 64)
    np.testing.assert_allclose(np.array(out), np.broadcast_to(np.array(v)[0, 0, 77], (1, 2, 3, 32)), atol=1e-6)
    # a query that sees no key (its serial precedes every stored one) gets zeros, the others are unaffected
    seq[77] = 5
    out = np.array(tile_skip_attention(q, k, v, seq, [4, 5, 6], [1], 0.1, 64))
    assert not out[:, :, 0].any()
    np.testing.assert_allclose(out[:, :, 1:], np.broadcast_to(np.array(v)[0, 0, 77], (1, 2, 2, 32)), atol=1e-6)
    # one tile, decode
    seq[:] = -1
    seq[32:64] = np.arange(32)
    out = tile_skip_attention(q[:, :, :1], k, v, seq, [31], [1], 0.1, 32)
    np.testing.assert_allclose(np.array(out), oracle_attention(np.array(q[:, :, :1]), np.array(k), np.array(v), seq,
                                                               [31], [1], 32, 0.1)[0], atol=1e-6)


def test_scores_sum_to_one_per_query_and_head():
    rng = np.random.default_rng(9)
    seq, qs, tiles = random_layout(rng, 256, 32, 0.4, 5)
    q, k, v = mx.array(rand(rng, (1, 6, 5, 32))), mx.array(rand(rng, (1, 2, 256, 32))), mx.array(rand(rng, (1, 2, 256, 32)))
    _, scores = tile_skip_attention(q, k, v, seq, qs, tiles, 0.2, 32, return_scores=True)
    assert abs(float(scores.sum()) - 6 * 5) < 1e-4
    assert not np.array(scores)[seq < 0].any()


def test_bad_input_is_rejected():
    z = mx.zeros((1, 4, 2, 32))
    kv = mx.zeros((1, 2, 128, 32))
    seq = np.arange(128)
    with pytest.raises(AttentionError, match="tile must be"):
        plan_tiles(seq, [0, 1], [0], 48)
    with pytest.raises(AttentionError, match="multiple of the tile"):
        plan_tiles(np.arange(100), [0], [0], 64)
    with pytest.raises(AttentionError, match="tile ids must lie"):
        plan_tiles(seq, [0, 1], [2], 64)
    with pytest.raises(AttentionError, match="unique"):
        plan_tiles(seq, [0, 1], [1, 1], 64)
    with pytest.raises(AttentionError, match="multiple of KV heads"):
        tile_skip_attention(mx.zeros((1, 3, 2, 32)), kv, kv, seq, [0, 1], [0], 1.0)
    with pytest.raises(AttentionError, match=r"\[1, Hq, T, D\]"):
        tile_skip_attention(mx.zeros((2, 4, 2, 32)), kv, kv, seq, [0, 1], [0], 1.0)
    with pytest.raises(AttentionError, match="q_seq"):
        tile_skip_attention(z, kv, kv, seq, [0, 1, 2], [0], 1.0)
    with pytest.raises(AttentionError, match="slots"):
        tile_skip_attention(z, mx.zeros((1, 2, 64, 32)), mx.zeros((1, 2, 64, 32)), seq, [0, 1], [0], 1.0)
    with pytest.raises(AttentionError, match="float16, bfloat16 or float32"):
        tile_skip_attention(z, kv.astype(mx.int32), kv.astype(mx.int32), seq, [0, 1], [0], 1.0)
    with pytest.raises(AttentionError, match="plan"):
        tile_skip_attention(z, kv, kv)


def test_plan_is_shared_across_layers():
    rng = np.random.default_rng(4)
    seq, qs, tiles = random_layout(rng, 256, 64, 0.5, 3)
    plan = plan_tiles(seq, qs, tiles, 64)
    for _ in range(2):
        q, k, v = mx.array(rand(rng, (1, 2, 3, 32))), mx.array(rand(rng, (1, 1, 256, 32))), mx.array(rand(rng, (1, 1, 256, 32)))
        out = reference_attention(q, k, v, plan, 0.3)
        np.testing.assert_allclose(np.array(out), oracle_attention(np.array(q), np.array(k), np.array(v), seq, qs,
                                                                   tiles, 64, 0.3)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_page_compact_gathers_rows(dtype):
    rng = np.random.default_rng(1)
    k = mx.array(rand(rng, (1, 3, 192, 32))).astype(dtype)
    v = mx.array(rand(rng, (1, 3, 192, 32))).astype(dtype)
    src = np.array([150, 3, 64, 191])
    kr, vr = page_compact(k, v, src)
    assert kr.shape == (1, 3, 4, 32) and kr.dtype == dtype
    assert mx.array_equal(kr, k[:, :, mx.array(src), :]) and mx.array_equal(vr, v[:, :, mx.array(src), :])
    with pytest.raises(AttentionError, match="source slots"):
        page_compact(k, v, [192])


@pytest.mark.parametrize("block", [1, 3, 64])
def test_fused_paths_in_query_blocks_with_empty_tiles_and_gqa(block, path, monkeypatch):
    """Query blocks of every size (a block whose queries see nothing yet, one that sees part of the chunk), listed
    tiles that hold only holes, serials out of slot order (the gather path's scratch is ordered by serial), GQA 4:1."""
    monkeypatch.setattr(fused, "FUSED_BLOCK_MAX", block)
    rng = np.random.default_rng(block)
    capacity, tile, t = 512, 32, 9
    seq = np.full(capacity, -1)
    hist = rng.choice(np.arange(64, 384), 150, replace=False)
    seq[hist] = rng.permutation(150) + 2
    seq[448:448 + t] = 152 + np.arange(t)  # the chunk's own tile, after the history's
    qs = np.concatenate([[0, 1], 152 + np.arange(2, t)])  # two queries precede every stored serial
    tiles = np.concatenate([[0, 1], np.nonzero((seq.reshape(-1, tile) >= 0).any(axis=1))[0]])  # 0, 1: empty
    q, k, v = rand(rng, (1, 8, t, 64)), rand(rng, (1, 2, capacity, 64)), rand(rng, (1, 2, capacity, 64))
    out = np.array(tile_skip_attention(mx.array(q), mx.array(k), mx.array(v), seq, qs, tiles, 0.125, tile))
    np.testing.assert_allclose(out, oracle_attention(q, k, v, seq, qs, tiles, tile, 0.125)[0], atol=1e-5, rtol=1e-5)
    assert not out[:, :, :2].any()


@pytest.mark.parametrize("t", [50, 100])  # 3 heads x t query rows > RUN_SCORES_MAX_ROWS: no addmm bias
def test_the_mask_cached_or_built_per_call_is_the_select_it_replaces(t, monkeypatch):
    """The visibility mask is added as 0 / -inf (kernels/attention.py: block_mask): the same bits as selecting
    the scores with where(visible, s, -inf), whether the plan caches it or a large block builds it per call."""
    rng = np.random.default_rng(11)
    tile, capacity = 64, 512
    seq = np.full(capacity, -1)
    keep = np.flatnonzero(rng.random(capacity) < 0.6)  # holes in every tile
    seq[keep] = rng.permutation(keep.size)
    qs = np.sort(rng.integers(seq.max() - 3 * t, seq.max() + 1, t))  # some keys still in the queries' future
    tiles = np.nonzero((seq.reshape(-1, tile) >= 0).any(axis=1))[0]
    q, k, v = rand(rng, (1, 6, t, 64)), rand(rng, (1, 2, capacity, 64)), rand(rng, (1, 2, capacity, 64))
    outs = []
    for cache_max in (attn.MASK_CACHE_MAX, 0):
        monkeypatch.setattr(attn, "MASK_CACHE_MAX", cache_max)
        plan = attn.plan_tiles(seq, qs, tiles, tile)
        blk = attn._schedule(plan, 0, t, 3)
        assert blk.needs_mask and blk.bias is None and (blk.mask is None) == (cache_max == 0)
        s = mx.array(rand(rng, (1, 2, 3, t, blk.key_seq.shape[0])))
        visible = blk.key_seq[None, :] <= plan.q_seq[:, None]
        assert mx.array_equal(s + attn.block_mask(blk, plan.q_seq), mx.where(visible, s, -mx.inf)).item()
        outs.append(np.array(reference_attention(mx.array(q), mx.array(k), mx.array(v), plan, 0.125)))
    np.testing.assert_array_equal(outs[0], outs[1])
    ref, _ = oracle_attention(q, k, v, seq, qs, tiles, tile, 0.125)
    np.testing.assert_allclose(outs[0], ref, atol=1e-5, rtol=1e-5)
