"""The Metal kernels on a real Apple GPU against the MLX-ops reference (skipped where Metal is absent)."""

import mlx.core as mx
import numpy as np
import pytest

from omnitide_mlx.kernels import page_compact, page_compact_reference, plan_tiles, reference_attention
from omnitide_mlx.kernels.attention import metal_attention

pytestmark = [pytest.mark.metal,
              pytest.mark.skipif(not mx.metal.is_available(), reason="needs an Apple GPU with Metal")]

DTYPES = [mx.float32, mx.float16, mx.bfloat16]
TOL = {mx.float32: 2e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}


def _layout(rng, capacity, tile, t, fill):
    seq = np.full(capacity, -1)
    slots = rng.permutation(capacity)
    n = int(fill * (capacity - t))
    seq[slots[:n]] = np.arange(n)
    seq[slots[n:n + t]] = n + np.arange(t)
    tiles = np.nonzero((seq.reshape(-1, tile) >= 0).any(axis=1))[0]
    return seq, n + np.arange(t), tiles


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("shape", [(28, 4, 128, 1, 32, 4096, 0.3), (28, 4, 128, 700, 64, 4096, 0.5),
                                   (32, 8, 128, 1, 32, 1024, 0.9), (4, 2, 64, 37, 64, 512, 0.2)],
                         ids=["qwen7b-decode", "qwen7b-prefill", "qwen3-decode", "small-prefill"])
def test_tile_skip_attention_kernel(shape, dtype):
    hq, hkv, d, t, tile, capacity, fill = shape
    rng = np.random.default_rng(0)
    seq, qs, tiles = _layout(rng, capacity, tile, t, fill)
    plan = plan_tiles(seq, qs, tiles[::2] if t == 1 else tiles, tile)  # decode: skip every other active tile
    q = mx.array(rng.standard_normal((1, hq, t, d)).astype(np.float32)).astype(dtype)
    k = mx.array(rng.standard_normal((1, hkv, capacity, d)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((1, hkv, capacity, d)).astype(np.float32)).astype(dtype)
    out = metal_attention(q, k, v, plan, d ** -0.5)
    ref = reference_attention(q, k, v, plan, d ** -0.5)
    assert out.dtype == dtype
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), np.array(ref.astype(mx.float32)),
                               atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_page_compact_kernel(dtype):
    rng = np.random.default_rng(1)
    k = mx.array(rng.standard_normal((1, 4, 2048, 128)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((1, 4, 2048, 128)).astype(np.float32)).astype(dtype)
    src = rng.choice(2048, 300, replace=False)
    kr, vr = page_compact(k, v, src)
    k_ref, v_ref = page_compact_reference(k, v, src)
    assert mx.array_equal(kr, k_ref) and mx.array_equal(vr, v_ref)


@pytest.mark.parametrize("path", ["gather", "dense"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("shape", [(28, 4, 128, 1, 32, 4096, 0.3), (28, 4, 128, 700, 64, 4096, 0.5),
                                   (32, 8, 128, 3, 32, 1024, 0.9), (4, 2, 64, 37, 64, 512, 0.2)],
                         ids=["qwen7b-decode", "qwen7b-prefill", "qwen3-decode3", "small-prefill"])
def test_fused_paths_on_the_gpu(shape, dtype, path):
    """MLX's fused Metal attention over gathered active tiles / over the span, with our masks."""
    from omnitide_mlx.kernels.dispatch import run_path

    hq, hkv, d, t, tile, capacity, fill = shape
    rng = np.random.default_rng(0)
    seq, qs, tiles = _layout(rng, capacity, tile, t, fill)
    plan = plan_tiles(seq, qs, tiles[::2] if t == 1 else tiles, tile)
    q = mx.array(rng.standard_normal((1, hq, t, d)).astype(np.float32)).astype(dtype)
    k = mx.array(rng.standard_normal((1, hkv, capacity, d)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((1, hkv, capacity, d)).astype(np.float32)).astype(dtype)
    out = run_path(path, q, k, v, plan, d ** -0.5)
    ref = reference_attention(q, k, v, plan, d ** -0.5)
    assert out.dtype == dtype
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), np.array(ref.astype(mx.float32)),
                               atol=TOL[dtype], rtol=TOL[dtype])


def test_every_path_passes_its_self_test_and_the_dispatcher_calibrates():
    from omnitide_mlx.kernels import selftest
    from omnitide_mlx.kernels.dispatch import Dispatcher

    for path in ("vector", "gather", "dense", "page_compact"):
        for dtype in DTYPES:
            r = selftest.run_self_test(path, dtype, 128, 64)
            assert r.ok, r
    d = Dispatcher()
    rng = np.random.default_rng(3)
    seq, qs, tiles = _layout(rng, 4096, 64, 700, 0.5)
    q = mx.zeros((1, 28, 700, 128), mx.float16)
    k = mx.zeros((1, 4, 4096, 128), mx.float16)
    assert d.choose(q, k, plan_tiles(seq, qs, tiles, 64), 128 ** -0.5) in ("vector", "gather", "dense")
    (cal,) = d.calibrations.values()
    assert set(cal.measured_ms) == {"vector", "gather", "dense"}
