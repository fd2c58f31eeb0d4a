"""The quantised reference (kernels/quantized.py) against the float64 statement of the contract on the values the
packed rows stand for (dequantised in float32), on random paged layouts, every way of reaching the tiles, with and
without a full-precision segment."""

import mlx.core as mx
import numpy as np
import pytest
from attention_oracle import oracle_attention, rand, random_layout

from omnitide_mlx.kernels import AttentionError, plan_tiles
from omnitide_mlx.kernels import attention as attn
from omnitide_mlx.kernels.quantized import (
    FREE_SEQ,
    dequantize_rows,
    quantize_rows,
    quantized_tile_skip_attention,
)


def _quantised(rng, shape, gs, bits, dtype=mx.float16):
    t = quantize_rows(mx.array(rand(rng, shape)).astype(dtype), gs, bits)
    return t, np.array(dequantize_rows(t, gs, bits))


@pytest.mark.parametrize("seed", range(8))
def test_random_layouts_match_oracle(seed):
    rng = np.random.default_rng(seed)
    bits, gs = (4, 8)[seed % 2], (32, 64)[(seed // 2) % 2]
    tile = (32, 64)[(seed // 4) % 2]
    hkv, g = int(rng.integers(1, 3)), int(rng.integers(1, 5))
    d = 64 * int(rng.integers(1, 3))
    t = (1, 5, 1, 37)[seed % 4]
    capacity = tile * int(rng.integers(2, 7))
    seq, qs, tiles = random_layout(rng, capacity, tile, float(rng.uniform(0.1, 0.9)), t)
    q = rand(rng, (1, hkv * g, t, d))
    k, k_deq = _quantised(rng, (1, hkv, capacity, d), gs, bits)
    v, v_deq = _quantised(rng, (1, hkv, capacity, d), gs, bits)
    plan = plan_tiles(seq, qs, tiles, tile)
    out, scores, full_scores = quantized_tile_skip_attention(mx.array(q), k, v, plan, 0.2, group_size=gs, bits=bits,
                                                             return_scores=True)
    ref, ref_scores = oracle_attention(q, k_deq, v_deq, seq, qs, tiles, tile, 0.2)
    assert full_scores is None and out.dtype == mx.float32
    np.testing.assert_allclose(np.array(out), ref, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(np.array(scores), ref_scores, atol=2e-5)


@pytest.mark.parametrize("path", ["slice", "runs", "gather", "blocks"])
def test_every_path_with_a_full_precision_segment(path, monkeypatch):
    """Quantised runs (one slice, run by run, gathered, in query blocks) and full-precision rows share one softmax:
    the same as the oracle over all keys, the full rows appended as a tile of their own."""
    rng = np.random.default_rng(3)
    tile, capacity, d, gs, bits = 32, 256, 64, 32, 8
    seq = np.full(capacity, -1)
    if path == "slice":
        seq[64:160] = 8 + rng.permutation(96)
    else:  # tiles 1, 3, 4, 7
        slots = np.concatenate([np.arange(32, 64), np.arange(96, 160), np.arange(224, 256)])
        keep = slots[rng.random(slots.size) < 0.7]
        seq[keep] = 8 + rng.permutation(keep.size)
    if path == "gather":
        monkeypatch.setattr(attn, "DECODE_MAX_RUNS", 0)
    if path == "blocks":
        monkeypatch.setattr(attn, "SCORE_BUDGET", 4 * 3 * 320)
    t = 1 if path in ("slice", "runs") else 20
    qs = np.sort(rng.integers(0, seq.max() + 1, t))
    tiles = np.nonzero((seq.reshape(-1, tile) >= 0).any(axis=1))[0]
    # 8 full-precision rows in a buffer of 12 (4 unused): serials 0..7, the stream's first tokens
    fseq = np.full(12, FREE_SEQ)
    fseq[[0, 2, 3, 5, 6, 8, 9, 11]] = np.arange(8)
    fk, fv = rand(rng, (1, 2, 12, d)), rand(rng, (1, 2, 12, d))
    q = rand(rng, (1, 4, t, d))
    k, k_deq = _quantised(rng, (1, 2, capacity, d), gs, bits)
    v, v_deq = _quantised(rng, (1, 2, capacity, d), gs, bits)
    full = (mx.array(fk).astype(mx.float16), mx.array(fv).astype(mx.float16), mx.array(fseq.astype(np.int32)))
    plan = plan_tiles(seq, qs, tiles, tile)
    out, scores, full_scores = quantized_tile_skip_attention(mx.array(q), k, v, plan, 0.125, group_size=gs,
                                                             bits=bits, full=full, return_scores=True)
    # oracle: the full rows become one more tile (capacity + 32 slots)
    pad = np.full(tile, -1)
    pad[:12] = np.where(fseq == FREE_SEQ, -1, fseq)
    fk16, fv16 = (np.array(a.astype(mx.float32)) for a in full[:2])
    zeros = np.zeros((1, 2, tile - 12, d))
    k_all = np.concatenate([k_deq, fk16, zeros], axis=2)
    v_all = np.concatenate([v_deq, fv16, zeros], axis=2)
    seq_all = np.concatenate([seq, pad])
    ref, ref_scores = oracle_attention(q, k_all, v_all, seq_all, qs, np.append(tiles, capacity // tile), tile, 0.125)
    np.testing.assert_allclose(np.array(out), ref, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(np.array(scores), ref_scores[:capacity], atol=2e-5)
    np.testing.assert_allclose(np.array(full_scores), ref_scores[capacity:capacity + 12], atol=2e-5)


def test_only_full_rows_and_queries_that_see_nothing():
    """No quantised tile at all (a system prompt in full precision attending itself), and a query that sees no key:
    zeros, not NaN."""
    rng = np.random.default_rng(0)
    seq = np.full(64, -1)
    plan = plan_tiles(seq, [0, 1, 2], [], 32)
    k, _ = _quantised(rng, (1, 1, 64, 32), 32, 4)
    fk = rand(rng, (1, 1, 4, 32))
    fseq = np.array([1, 2, FREE_SEQ, 0], np.int32)
    full = (mx.array(fk), mx.array(fk), mx.array(fseq))
    q = rand(rng, (1, 2, 3, 32))
    out = np.array(quantized_tile_skip_attention(mx.array(q), k, k, plan, 0.3, group_size=32, bits=4, full=full))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[0, :, 0], np.broadcast_to(fk[0, 0, 3], (2, 32)), atol=1e-6)  # sees serial 0 only
    plan = plan_tiles(np.full(64, -1), [0], [], 32)
    out = quantized_tile_skip_attention(mx.array(q[:, :, :1]), k, k, plan, 0.3, group_size=32, bits=4)
    assert not np.array(out).any()


def test_bad_input_is_rejected():
    rng = np.random.default_rng(0)
    plan = plan_tiles(np.arange(64), [63], [0, 1], 32)
    k, _ = _quantised(rng, (1, 1, 64, 64), 32, 4)
    q = mx.array(rand(rng, (1, 2, 1, 64)))
    with pytest.raises(AttentionError, match="kv_bits"):
        quantized_tile_skip_attention(q, k, k, plan, 1.0, group_size=32, bits=3)
    with pytest.raises(AttentionError, match="kv_group_size"):
        quantized_tile_skip_attention(q, k, k, plan, 1.0, group_size=16, bits=4)
    with pytest.raises(AttentionError, match="packed rows"):
        quantized_tile_skip_attention(q, k, k, plan, 1.0, group_size=32, bits=8)
    with pytest.raises(AttentionError, match="scales"):
        quantized_tile_skip_attention(q, k, k, plan, 1.0, group_size=64, bits=4)
    with pytest.raises(AttentionError, match="q has"):
        quantized_tile_skip_attention(mx.array(rand(rng, (1, 2, 2, 64))), k, k, plan, 1.0, group_size=32, bits=4)


@pytest.mark.parametrize("path", ["runs", "gather"])
def test_deferred_key_shifts_are_rotated_at_read(path, monkeypatch):
    """Keys stored with a pending shift (KeyShift) attend as if rotated by -shift: the oracle rotates the dequantised
    keys in float64. Runs without a shift keep the quantised matmul."""
    from stream_oracle import rope64

    from omnitide_mlx.kernels.quantized import KeyShift
    from omnitide_mlx.rope import RopeSpec

    if path == "gather":
        monkeypatch.setattr(attn, "DECODE_MAX_RUNS", 0)
    rng = np.random.default_rng(11)
    tile, capacity, d, gs, bits = 32, 256, 64, 64, 8
    seq, qs, tiles = random_layout(rng, capacity, tile, 0.6, 3)
    shift = np.zeros(capacity, np.int64)
    shift[:96] = rng.integers(0, 500, 96)  # tiles 0-2 shifted, the rest not
    q = rand(rng, (1, 4, 3, d))
    k, k_deq = _quantised(rng, (1, 2, capacity, d), gs, bits)
    v, v_deq = _quantised(rng, (1, 2, capacity, d), gs, bits)
    rope = RopeSpec(d, 10000.0)
    ks = KeyShift(shift, rope.rotate_tokens)
    out = quantized_tile_skip_attention(mx.array(q), k, v, plan_tiles(seq, qs, tiles, tile), 0.125, group_size=gs,
                                        bits=bits, shift=ks)
    k_rot = rope64(k_deq[0].astype(np.float64), -shift[None, :])[None]  # [1, Hkv, capacity, D]
    ref, _ = oracle_attention(q, k_rot, v_deq, seq, qs, tiles, tile, 0.125)
    np.testing.assert_allclose(np.array(out), ref, atol=5e-5, rtol=1e-4)
    wrong, _ = oracle_attention(q, k_deq, v_deq, seq, qs, tiles, tile, 0.125)
    assert np.abs(np.array(out) - wrong).max() > 1e-2  # the shift really matters
