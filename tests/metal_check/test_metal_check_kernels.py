"""Every Metal kernel of the package, checked without Metal: the exact source MLX generates is type-checked with
clang against a stand-in Metal header, then run on the CPU (one fiber per GPU thread) and compared with the MLX-ops
reference, for float16, bfloat16 and float32 K/V. Grids stay small: the emulator swaps contexts per thread."""

import mlx.core as mx
import numpy as np
import pytest
from msl import clang_check, emulate, find_clang, generated_source

from omnitide_mlx.kernels import (
    merge_partials,
    metal_attention_spec,
    page_compact_reference,
    page_compact_spec,
    plan_tiles,
    reference_attention,
)

pytestmark = pytest.mark.skipif(find_clang() is None, reason="needs clang++ (scripts/setup.sh --dev)")

DTYPES = [mx.float32, mx.float16, mx.bfloat16]


def _layout(rng, capacity, tile, t, fill=0.5):
    """History in random slots with holes, then a chunk of ``t`` new tokens; a few tiles left off the list."""
    seq = np.full(capacity, -1)
    slots = rng.permutation(capacity)
    n = int(fill * capacity)
    seq[slots[:n]] = np.arange(n)
    seq[slots[n:n + t]] = n + np.arange(t)
    tiles = np.nonzero((seq.reshape(-1, tile) >= 0).any(axis=1))[0]
    return seq, n + np.arange(t), tiles


def _case(seed, dtype, hkv, g, t, d, tile, capacity, drop_tile=False):
    rng = np.random.default_rng(seed)
    seq, qs, tiles = _layout(rng, capacity, tile, t)
    if drop_tile:  # an active tile that is not listed must not be read: poison it
        tiles = tiles[1:]
    q = mx.array(rng.standard_normal((1, hkv * g, t, d)).astype(np.float32)).astype(dtype)
    k = rng.standard_normal((1, hkv, capacity, d)).astype(np.float32)
    v = rng.standard_normal((1, hkv, capacity, d)).astype(np.float32)
    k32, v32 = k.copy(), v.copy()
    if drop_tile:
        first = int(np.nonzero((seq.reshape(-1, tile) >= 0).any(axis=1))[0][0])
        k[:, :, first * tile:(first + 1) * tile] = np.nan
        v[:, :, first * tile:(first + 1) * tile] = np.nan
    k, v = mx.array(k).astype(dtype), mx.array(v).astype(dtype)
    plan = plan_tiles(seq, qs, tiles, tile)
    # the oracle: the reference on the same rounded values, in float32
    ref = reference_attention(q.astype(mx.float32), mx.array(k32).astype(dtype).astype(mx.float32),
                              mx.array(v32).astype(dtype).astype(mx.float32), plan, d ** -0.5)
    return q, k, v, plan, ref


def _emulated_attention(spec):
    src = generated_source(spec)
    ok, diags = clang_check(src)
    assert ok, diags
    (o_part, lse_part), warnings = emulate(spec, src)
    assert not warnings, warnings
    return merge_partials(o_part, lse_part)


LAUNCHES = [
    # (name, hkv, g, t, d, tile, capacity, launch overrides)
    ("decode", 2, 3, 1, 64, 32, 256, {}),
    ("decode-parts-splits", 1, 2, 1, 64, 32, 256, dict(parts=4, splits=2)),
    ("prefill", 1, 2, 5, 64, 64, 256, {}),
    ("prefill-partial-rows", 2, 1, 3, 32, 64, 192, dict(rows_per_group=2, parts=2, splits=3)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("launch", LAUNCHES, ids=lambda x: x[0])
def test_tile_skip_attention_kernel_matches_reference(launch, dtype):
    _, hkv, g, t, d, tile, capacity, over = launch
    q, k, v, plan, ref = _case(len(launch[0]), dtype, hkv, g, t, d, tile, capacity)
    out = _emulated_attention(metal_attention_spec(q, k, v, plan, d ** -0.5, **over))
    np.testing.assert_allclose(np.array(out.reshape(ref.shape)), np.array(ref), atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_kernel_never_reads_an_unlisted_tile(dtype):
    q, k, v, plan, ref = _case(3, dtype, 1, 2, 2, 32, 32, 192, drop_tile=True)
    out = np.array(_emulated_attention(metal_attention_spec(q, k, v, plan, 32 ** -0.5, splits=2)))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out.reshape(ref.shape), np.array(ref), atol=2e-6, rtol=2e-5)


def test_kernel_with_a_query_that_sees_nothing_writes_zeros():
    seq = np.full(128, -1)
    seq[70] = 5
    plan = plan_tiles(seq, [4, 5], [2], 32)
    rng = np.random.default_rng(0)
    q = mx.array(rng.standard_normal((1, 2, 2, 32)).astype(np.float32))
    k = mx.array(rng.standard_normal((1, 1, 128, 32)).astype(np.float32))
    out = np.array(_emulated_attention(metal_attention_spec(q, k, k, plan, 0.2, parts=2, splits=2)))
    assert not out[..., 0, :].any()
    np.testing.assert_allclose(out[0, :, 1], np.broadcast_to(np.array(k)[0, 0, 70], (2, 32)), atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_page_compact_kernel_matches_reference(dtype):
    rng = np.random.default_rng(1)
    k = mx.array(rng.standard_normal((1, 2, 128, 32)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((1, 2, 128, 32)).astype(np.float32)).astype(dtype)
    src = [127, 0, 64, 65, 3]
    spec = page_compact_spec(k, v, src)
    code = generated_source(spec)
    ok, diags = clang_check(code)
    assert ok, diags
    (k_rows, v_rows), warnings = emulate(spec, code)
    assert not warnings
    k_ref, v_ref = page_compact_reference(k, v, src)
    assert k_rows.dtype == dtype and mx.array_equal(k_rows, k_ref) and mx.array_equal(v_rows, v_ref)


# --- the checker itself can fail ----------------------------------------------------------------------------------

def test_checker_reports_a_type_error():
    q, k, v, plan, _ = _case(0, mx.float16, 1, 2, 1, 32, 32, 64)
    spec = metal_attention_spec(q, k, v, plan, 0.2)
    spec["header"] = spec["header"].replace("float d = 0.0f;", "half4 d = float4(0.0f);")
    ok, diags = clang_check(generated_source(spec))
    assert not ok and "error" in diags


def test_emulator_catches_a_broken_causal_check():
    q, k, v, plan, ref = _case(1, mx.float32, 1, 2, 4, 32, 64, 128)
    spec = metal_attention_spec(q, k, v, plan, 32 ** -0.5)
    spec["header"] = spec["header"].replace("if (s < 0 || s > my_seq) continue;", "if (s < 0) continue;")
    (o_part, lse_part), _ = emulate(spec)
    assert np.abs(np.array(merge_partials(o_part, lse_part)).reshape(ref.shape) - np.array(ref)).max() > 1e-2


# --- the quantised variant (kv_bits) -------------------------------------------------------------------------------
Q_LAUNCHES = [  # (name, bits, group, scales dtype, hkv, g, t, d, tile, capacity, launch overrides)
    ("decode-4bit", 4, 32, mx.float16, 2, 3, 1, 64, 32, 256, {}),
    ("decode-8bit-parts-splits", 8, 64, mx.bfloat16, 1, 2, 1, 64, 32, 256, dict(parts=4, splits=2)),
    ("prefill-4bit-g128", 4, 128, mx.bfloat16, 1, 2, 5, 128, 64, 192, {}),
    ("prefill-8bit-partial-rows", 8, 32, mx.float16, 2, 1, 3, 32, 64, 192, dict(rows_per_group=2, parts=2,
                                                                               splits=3)),
]


@pytest.mark.parametrize("launch", Q_LAUNCHES, ids=lambda x: x[0])
def test_quantised_kernel_matches_reference(launch):
    """Packed values, scales and biases read in the kernel: the emulated kernel matches the quantised MLX reference
    (which tests/kernels checks against the float64 oracle)."""
    from omnitide_mlx.kernels.quantized import metal_attention_q_spec, quantize_rows, quantized_tile_skip_attention

    name, bits, gs, scales, hkv, g, t, d, tile, capacity, over = launch
    rng = np.random.default_rng(len(name))
    seq, qs, tiles = _layout(rng, capacity, tile, t)
    plan = plan_tiles(seq, qs, tiles, tile)
    q = mx.array(rng.standard_normal((1, hkv * g, t, d)).astype(np.float32)).astype(scales)
    k = quantize_rows(mx.array(rng.standard_normal((1, hkv, capacity, d)).astype(np.float32)).astype(scales), gs, bits)
    v = quantize_rows(mx.array(rng.standard_normal((1, hkv, capacity, d)).astype(np.float32)).astype(scales), gs, bits)
    ref = quantized_tile_skip_attention(q.astype(mx.float32), k, v, plan, d ** -0.5, group_size=gs, bits=bits)
    out = _emulated_attention(metal_attention_q_spec(q, k, v, plan, d ** -0.5, group_size=gs, bits=bits, **over))
    np.testing.assert_allclose(np.array(out.reshape(ref.shape)), np.array(ref), atol=5e-6, rtol=5e-5)


def test_quantised_kernel_checker_catches_a_wrong_unpacking():
    from omnitide_mlx.kernels.quantized import metal_attention_q_spec, quantize_rows, quantized_tile_skip_attention

    rng = np.random.default_rng(0)
    seq, qs, tiles = _layout(rng, 128, 32, 1)
    plan = plan_tiles(seq, qs, tiles, 32)
    q = mx.array(rng.standard_normal((1, 2, 1, 32)).astype(np.float32))
    k = quantize_rows(mx.array(rng.standard_normal((1, 1, 128, 32)).astype(np.float32)), 32, 4)
    ref = quantized_tile_skip_attention(q, k, k, plan, 0.2, group_size=32, bits=4)
    spec = metal_attention_q_spec(q, k, k, plan, 0.2, group_size=32, bits=4)
    spec["header"] = spec["header"].replace("(c % PER_WORD) * BITS", "(PER_WORD - 1 - c % PER_WORD) * BITS")
    (o_part, lse_part), _ = emulate(spec)
    assert np.abs(np.array(merge_partials(o_part, lse_part)).reshape(ref.shape) - np.array(ref)).max() > 1e-2
