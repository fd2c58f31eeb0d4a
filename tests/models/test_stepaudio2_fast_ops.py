"""The token2wav speed paths against the MLX ops they replace: the unfolded (matmul) convolutions and transposed
convolutions of the vocoder, and the NumPy transcendentals of ``cpu_math`` (on the CPU device)."""

import math

import mlx.core as mx
import numpy as np
import pytest

from omnitide_mlx.models.stepaudio2 import cpu_math
from omnitide_mlx.models.stepaudio2.vocoder import conv1d, conv_transpose1d


def _close(a, b, rtol=2e-5):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape
    scale = max(1.0, float(np.abs(b).max()))
    np.testing.assert_allclose(a, b, rtol=0, atol=rtol * scale)


@pytest.mark.parametrize("k,d,pad", [(1, 1, 0), (3, 1, 1), (3, 3, 3), (7, 5, 15), (11, 1, 5), (2, 2, 0)])
def test_conv1d_matches_mlx(k, d, pad):
    rng = np.random.default_rng(k * 10 + d)
    x = mx.array(rng.standard_normal((2, 40, 12)).astype(np.float32))
    w = mx.array(rng.standard_normal((9, k, 12)).astype(np.float32))
    _close(conv1d(x, w, dilation=d, padding=pad), mx.conv1d(x, w, dilation=d, padding=pad))


def test_conv1d_float64_is_exact():
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((1, 30, 8)), rng.standard_normal((5, 3, 8))
    with mx.stream(mx.cpu):
        out = np.asarray(conv1d(mx.array(x, dtype=mx.float64), mx.array(w, dtype=mx.float64), dilation=2))
    ref = np.stack([sum(x[0, t + 2 * j] @ w[:, j].T for j in range(3)) for t in range(26)])[None]
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)


def test_conv1d_strided_passes_through():
    rng = np.random.default_rng(1)
    x = mx.array(rng.standard_normal((1, 33, 6)).astype(np.float32))
    w = mx.array(rng.standard_normal((4, 6, 6)).astype(np.float32))
    _close(conv1d(x, w, stride=3), mx.conv1d(x, w, stride=3))


@pytest.mark.parametrize("t,k,s", [(5, 16, 8), (9, 11, 5), (13, 7, 3), (4, 3, 2), (6, 2, 3), (7, 4, 4)])
def test_conv_transpose1d_matches_mlx(t, k, s):
    rng = np.random.default_rng(t + k + s)
    x = mx.array(rng.standard_normal((2, t, 10)).astype(np.float32))
    w = mx.array(rng.standard_normal((7, k, 10)).astype(np.float32))
    pad = max(0, (k - s) // 2)
    _close(conv_transpose1d(x, w, s, pad), mx.conv_transpose1d(x, w, stride=s, padding=pad))


@pytest.fixture
def values():
    rng = np.random.default_rng(2)
    return mx.array((rng.standard_normal((3, 17, 33)) * 6).astype(np.float32))


def test_transcendentals_match_mlx(values):
    assert mx.default_device() == mx.cpu
    for ours, ref in ((cpu_math.sin, mx.sin), (cpu_math.cos, mx.cos), (cpu_math.tanh, mx.tanh)):
        out = ours(values)
        assert out.dtype == mx.float32
        _close(out, ref(values), 1e-6)
    _close(cpu_math.exp(values / 4), mx.exp(values / 4), 1e-6)


def test_activations_match_the_formulas(values):
    x = values
    _close(cpu_math.gelu_tanh(x), 0.5 * x * (1 + mx.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))), 1e-6)
    mish = x * mx.tanh(mx.logaddexp(x, mx.zeros_like(x)))
    _close(cpu_math.mish(x), mish, 1e-6)
    big = mx.array([-100.0, -30.0, 0.0, 19.0, 25.0, 100.0, 1e30])
    np.testing.assert_allclose(np.asarray(cpu_math.mish(big)),
                               np.asarray(big * mx.tanh(mx.logaddexp(big, mx.zeros_like(big)))), rtol=2e-6, atol=1e-30)
    alpha = mx.array(np.linspace(0.2, 3, 33).astype(np.float32))
    _close(cpu_math.snake(x, alpha), x + (1.0 / (alpha + 1e-9)) * mx.square(mx.sin(x * alpha)), 1e-6)


def test_other_dtypes_use_mlx():
    x = mx.array([0.5, 1.5], dtype=mx.float16)
    assert cpu_math.sin(x).dtype == mx.float16
    assert cpu_math.gelu_tanh(x).dtype == mx.float16
