"""Drift: 200 evictions that each shift the same kept keys by one position, in float16 and bfloat16.

Each eviction rotates a kept key once, in float32, from its stored half-precision value, and rounds once back. With
round-to-nearest a one-position shift turns the low-frequency pairs by less than half an ulp, so the rounding undoes
the rotation every time and the error grows linearly with the number of shifts. The cache therefore rounds
stochastically (unbiased): the N roundings then add up like a random walk, about sqrt(N) * u relative (u = 2^-11 for
float16, 2^-8 for bfloat16).

Stated bound, checked here: after N = 200 shifting evictions every kept key is within 1.5 * sqrt(N) * u (relative L2)
of a fresh float32 rotation at its final position rounded once: 0.0104 for float16, 0.083 for bfloat16. Measured
(seed 9, 64 keys x 2 heads, head_dim 128): stochastic max 0.0053 / 0.036; round-to-nearest max 0.027 / 0.16 (above
the bound); un-rotate + re-rotate in half precision (what the MiniCPM-o reference code does) max 0.019 / 0.15.
"""

import math

import mlx.core as mx
import numpy as np
import pytest
from cache_stream import Stream, make_cache
from stream_oracle import rope64

from omnitide_mlx.core.page import AllocClass
from omnitide_mlx.core.pick import apply_plan, plan_from_mask
from omnitide_mlx.core.units import SpanKind, UnitKind

N = 200
U = {mx.float16: 2.0 ** -11, mx.bfloat16: 2.0 ** -8}


def _naive_shift(k: mx.array, pos: np.ndarray, shift: int, dtype) -> mx.array:
    """Un-rotate at ``pos`` then rotate at ``pos - shift``, every op and the cos / sin tables in ``dtype``."""
    d = k.shape[-1]
    inv = 10000.0 ** (-np.arange(0, d, 2) / d)

    def rot(x, p, sign):
        ang = np.asarray(p, np.float64)[:, None] * inv[None]
        c = mx.array(np.concatenate([np.cos(ang)] * 2, -1).astype(np.float32)).astype(dtype)
        s = mx.array(np.concatenate([np.sin(ang)] * 2, -1).astype(np.float32)).astype(dtype) * sign
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return x * c + mx.concatenate([-x2, x1], axis=-1) * s

    return rot(rot(k, pos, -1.0), pos - shift, 1.0)


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["float16", "bfloat16"])
def test_drift_after_200_evictions(dtype, rounding):
    s = Stream(make_cache(layers=1, kv_heads=2, head_dim=128, dtype=dtype, rounding=rounding), q_heads=2, seed=9)
    s.add_unit(UnitKind.SYSTEM, [(SpanKind.SYSTEM, 4)], AllocClass.MUST_KEEP, check_oracle=False)
    for _ in range(N):  # one-token units: each eviction drops the oldest and shifts everything after it by 1
        s.add_unit(UnitKind.MEDIA, [(SpanKind.AUDIO, 1)], check_oracle=False)
    tracked = s.add_unit(UnitKind.MEDIA, [(SpanKind.IMAGE, 64)], check_oracle=False)
    ids = s.alive[-64:]
    p0 = tracked.positions[0].copy()
    slots = s.cache.slots_of_unit(tracked.uid)
    naive = s.cache[0].keys[0][:, mx.array(slots.astype(np.int32)), :]  # [Hkv, 64, D] as first stored
    for e in range(N):
        keep = np.ones(s.history.total_tokens, bool)
        keep[4] = False  # the oldest one-token unit
        plan = plan_from_mask(s.history, keep)
        assert plan.kept_token_shifts()[-1] == 1
        s.cache.evict(plan, s.history)
        s.history = apply_plan(s.history, plan)
        naive = _naive_shift(naive, p0 - e, 1, dtype)
    assert s.cache.rotated_rows >= N * 64
    final = s.history.unit(tracked.uid).positions[0]
    np.testing.assert_array_equal(final, p0 - N)
    raw = np.stack([s.raw_k[t][0] for t in ids], axis=1)  # [Hkv, 64, D]
    fresh = np.array(mx.array(rope64(raw, final[None]).astype(np.float32)).astype(dtype).astype(mx.float32))
    got = np.array(s.cache[0].keys[0][:, mx.array(s.cache.slots_of_unit(tracked.uid).astype(np.int32)), :]
                   .astype(mx.float32))
    rel = np.linalg.norm(got - fresh, axis=-1) / np.linalg.norm(fresh, axis=-1)
    bound = 1.5 * math.sqrt(N) * U[dtype]
    naive_rel = np.linalg.norm(np.array(naive.astype(mx.float32)) - fresh, axis=-1) / np.linalg.norm(fresh, axis=-1)
    print(f"{dtype} {rounding}: max rel err {rel.max():.5f} (bound {bound:.5f}), mean {rel.mean():.5f}; "
          f"naive half-precision re-rotation max {naive_rel.max():.5f}")
    if rounding == "stochastic":
        assert rel.max() < bound
        assert naive_rel.mean() > 2 * rel.mean()
    else:  # why stochastic rounding is the default: round-to-nearest stagnates and leaves the bound
        assert rel.max() > bound


# --- the quantised twin ----------------------------------------------------------------------------------------------
# A quantised cache (kv_bits) holds a key as packed values, scales and biases. Re-quantising a kept key at every
# eviction ("requantize": dequantise to float32, rotate once, quantise once) re-draws its quantisation error each
# time, and the errors add up: measured (seed 9, 64 keys x 2 heads, head_dim 128, group 64) max relative error after
# N = 1 / 10 / 50 / 200 one-position shifts 0.009 / 0.034 / 0.11 / 0.37 at 8 bits and 0.14 / 0.45 / 1.2 / 3.6 at 4
# bits (a key quantised once: 0.007 / 0.11). The default ("deferred") never re-quantises: each slot accumulates its
# shift and attention rotates the dequantised key by it at read time (composed RoPE rotations are one rotation), so
# after any number of evictions a key carries exactly the error of its one quantisation: measured 0.0068 / 0.11.
# Stated bound, checked here: after N = 200 evictions every kept key, as attention reads it, is within 1.1 x the
# largest error of the same keys quantised once at their final positions (8 and 4 bits), against the float32 oracle.

@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rerotate", ["deferred", "requantize"])
def test_quantised_drift_after_200_evictions(bits, rerotate):
    from omnitide_mlx.kernels.quantized import dequantize_rows, quantize_rows

    gs = 64
    s = Stream(make_cache(layers=1, kv_heads=2, head_dim=128, dtype=mx.float16, kv_bits=bits, kv_group_size=gs,
                          kv_rerotate=rerotate), q_heads=2, seed=9)
    s.add_unit(UnitKind.SYSTEM, [(SpanKind.SYSTEM, 4)], AllocClass.MUST_KEEP, check_oracle=False)
    for _ in range(N):
        s.add_unit(UnitKind.MEDIA, [(SpanKind.AUDIO, 1)], check_oracle=False)
    tracked = s.add_unit(UnitKind.MEDIA, [(SpanKind.IMAGE, 64)], check_oracle=False)
    ids = s.alive[-64:]
    p0 = tracked.positions[0].copy()
    for _ in range(N):
        keep = np.ones(s.history.total_tokens, bool)
        keep[4] = False
        plan = plan_from_mask(s.history, keep)
        s.cache.evict(plan, s.history)
        s.history = apply_plan(s.history, plan)
    c = s.cache
    slots = c.slots_of_unit(tracked.uid)
    got = dequantize_rows([a[:, :, mx.array(slots.astype(np.int32))] for a in c[0].keys], gs, bits)[0]
    if rerotate == "deferred":  # what attention reads: the stored key rotated by its pending shift
        assert (c.storage.shift[slots] == N).all()
        got = c.rope.rotate_tokens(got.transpose(1, 0, 2), mx.array(-c.storage.shift[slots].astype(np.int32)))
        got = got.transpose(1, 0, 2)
    else:
        assert c.rotated_rows >= N * 64
    exact = rope64(np.stack([s.raw_k[t][0] for t in ids], axis=1), (p0 - N)[None])  # [Hkv, 64, D]
    once = dequantize_rows(quantize_rows(mx.array(exact.astype(np.float32)).astype(mx.float16), gs, bits), gs, bits)

    def rel(x):
        return np.linalg.norm(np.array(x) - exact, axis=-1) / np.linalg.norm(exact, axis=-1)

    bound = 1.1 * rel(once).max()
    print(f"{bits} bits {rerotate}: max rel err {rel(got).max():.4f} (bound {bound:.4f})")
    if rerotate == "deferred":
        assert rel(got).max() < bound
    else:  # why deferred is the default: re-quantising at every eviction leaves the bound far behind
        assert rel(got).max() > 3 * bound
