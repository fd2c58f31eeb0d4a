"""The CPU softmax of the reference attention (kernels/cpu_math.py) against mx.softmax(precise=True)."""

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from omnitide_mlx.kernels import cpu_math  # noqa: E402
from omnitide_mlx.kernels.cpu_math import FAST_CHUNK, softmax_last  # noqa: E402


def _scores(rng, shape, spread=8.0):
    s = (rng.standard_normal(shape) * spread).astype(np.float32)
    flat = s.reshape(-1, shape[-1])
    flat[0, :] = -np.inf  # a query that sees no key
    flat[1, 3:] = -np.inf  # masked keys
    flat[2, : shape[-1] // 2] = -1e4  # far below the row maximum: exp under float32's smallest normal
    flat[3, :] = 0.0
    return s


@pytest.mark.parametrize("shape", [(1, 3, 7, 513), (1, 9, 100, 500), (1, 9, 300, 830), (2, 3, 4, 40000)])
def test_matches_mx_softmax_including_masked_and_empty_rows(shape):
    s = _scores(np.random.default_rng(sum(shape)), shape)
    got = np.array(softmax_last(mx.array(s)))
    ref = np.array(mx.softmax(mx.array(s), axis=-1, precise=True))
    assert got.shape == ref.shape
    flat_got, flat_ref = got.reshape(-1, shape[-1]), ref.reshape(-1, shape[-1])
    assert np.isnan(flat_got[0]).all() and np.isnan(flat_ref[0]).all()
    assert (flat_got[1, 3:] == 0).all() and (flat_got[2, : shape[-1] // 2] == 0).all()
    ok = ~np.isnan(ref)
    np.testing.assert_allclose(got[ok], ref[ok], rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(flat_got[1:].astype(np.float64).sum(axis=-1), 1.0, rtol=5e-5)  # float32 sums


def test_exp_is_within_two_ulps_over_its_range():
    a = -np.linspace(0, 87.0, 200_001, dtype=np.float32)
    got = np.array(cpu_math._exp_nonpositive(mx.array(a)))
    ref = np.exp(a.astype(np.float64))
    assert np.max(np.abs(got / ref - 1)) < 2.5e-7
    below = np.array(cpu_math._exp_nonpositive(mx.array(np.array([-88.8, -100.0, -1e30, -np.inf], np.float32))))
    assert (below == 0).all()


def test_chunked_and_whole_paths_agree(monkeypatch):
    s = mx.array(_scores(np.random.default_rng(5), (1, 4, 64, 1000)))
    whole = np.array(softmax_last(s))
    assert s.size <= FAST_CHUNK
    monkeypatch.setattr(cpu_math, "FAST_CHUNK", 3000)  # three rows a chunk: 86 chunks, the last one short
    pieces = []
    real = cpu_math._softmax_chunk
    monkeypatch.setattr(cpu_math, "_softmax_chunk", lambda x: pieces.append(x.shape[0]) or real(x))
    chunked = np.array(softmax_last(s))
    assert pieces == [3] * 85 + [1]
    np.testing.assert_array_equal(np.isnan(whole), np.isnan(chunked))
    np.testing.assert_allclose(np.nan_to_num(chunked), np.nan_to_num(whole), rtol=1e-7, atol=0)


def test_other_dtypes_and_vectors_use_mx_softmax(monkeypatch):
    calls = []
    real = mx.softmax
    monkeypatch.setattr(cpu_math.mx, "softmax", lambda *a, **k: calls.append(a[0].dtype) or real(*a, **k))
    softmax_last(mx.zeros((2, 8), mx.float16))
    softmax_last(mx.zeros((8,), mx.float32))
    softmax_last(mx.zeros((2, 8), mx.float32))
    assert calls == [mx.float16, mx.float32]


def test_silu_matches_nn_silu_over_its_range():
    import mlx.nn as nn

    x = np.concatenate([np.linspace(-100, 100, 100_001, dtype=np.float32), [0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0]])
    got = np.array(cpu_math.silu(mx.array(x)))
    ref = x.astype(np.float64) / (1 + np.exp(-x.astype(np.float64)))
    np.testing.assert_allclose(got, ref, rtol=5e-7, atol=1e-30)  # below x = -87.7 exp flushes to 0: |silu| < 1e-36
    np.testing.assert_allclose(got, np.array(nn.silu(mx.array(x))), rtol=5e-6, atol=1e-30)  # nn.silu: 3.5e-6 off at -40
    half = mx.array(x[:100].astype(np.float16))
    assert cpu_math.silu(half).dtype == mx.float16


def test_logsumexp_matches_mx_logsumexp_chunked_or_not(monkeypatch):
    rng = np.random.default_rng(2)
    s = (rng.standard_normal((7, 3, 5000)) * 6).astype(np.float32)
    s[0, 0, :] = -np.inf
    s[0, 1, 7:] = -np.inf
    ref = np.array(mx.logsumexp(mx.array(s), axis=-1))
    for chunk in (cpu_math.FAST_CHUNK, 12000):  # whole, and two rows a chunk
        monkeypatch.setattr(cpu_math, "FAST_CHUNK", chunk)
        got = np.array(cpu_math.logsumexp_last(mx.array(s)))
        assert got.shape == ref.shape == (7, 3) and got[0, 0] == -np.inf
        np.testing.assert_allclose(got[np.isfinite(ref)], ref[np.isfinite(ref)], rtol=1e-6, atol=1e-6)
    assert float(cpu_math.logsumexp_last(mx.array(np.zeros(4, np.float32)))) == pytest.approx(np.log(4))
