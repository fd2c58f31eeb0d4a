"""The CPU-only speed routes of the speech models (NumPy transcendentals, BigVGAN's NumPy anti-aliased Snake) stay
behind the backend check: with a GPU default device the same calls are plain MLX ops and never reach NumPy. (This
machine has no GPU: the default device is reported as the GPU while the ops still run on the CPU stream, which is
what the checks read.) The CPU routes' results are compared with the MLX ones as well."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from omnitide_mlx.models.qwen2_5_omni.token2wav import AntiAliasedSnake, BigVGAN, BigVGANConfig
from omnitide_mlx.models.stepaudio2 import cpu_math

NUMPY_ROUTES = ("sin", "cos", "exp", "tanh", "multiply", "asarray", "array")


def _gpu_default_without_numpy(m):
    """The default device reads as the GPU, and NumPy's routes raise if anything calls them."""
    def refuse(name):
        def f(*a, **k):
            raise AssertionError(f"np.{name} called on the GPU path")
        return f

    m.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    for name in NUMPY_ROUTES:
        m.setattr(np, name, refuse(name))


@pytest.fixture
def gpu_default(monkeypatch):
    _gpu_default_without_numpy(monkeypatch)


def _bigvgan():
    mx.random.seed(0)
    model = BigVGAN(BigVGANConfig(upsample_initial_channel=128))
    for act in (m for _, m in model.named_modules() if isinstance(m, AntiAliasedSnake)):
        act.alpha = mx.random.normal(act.alpha.shape) * 0.3
        act.beta = mx.random.normal(act.beta.shape) * 0.3
    mx.eval(model.parameters())
    return model, mx.random.normal((1, 12, 80))


def test_bigvgan_gpu_path_is_plain_mlx_and_equals_the_cpu_route(monkeypatch):
    model, mel = _bigvgan()
    cpu = model(mel)
    mx.eval(cpu)
    with monkeypatch.context() as m:
        _gpu_default_without_numpy(m)
        gpu = model(mel)
        mx.eval(gpu)
    assert cpu.shape == gpu.shape == (1, 12 * 240)
    assert float(mx.abs(cpu - gpu).max()) < 1e-5 * max(1.0, float(mx.abs(gpu).max()))


def test_anti_aliased_snake_routes_agree():
    mx.random.seed(1)
    act = AntiAliasedSnake(24)
    act.alpha, act.beta = mx.random.normal((24,)) * 0.5, mx.random.normal((24,)) * 0.5
    x = mx.random.normal((2, 37, 24)) * 3
    up = act._upsample(x)
    a, b = mx.exp(act.alpha), mx.exp(act.beta)
    mlx_route = act._downsample(up + (1.0 / (b + 1e-9)) * mx.sin(up * a) ** 2)
    assert act(x).shape == mlx_route.shape == x.shape
    assert float(mx.abs(act(x) - mlx_route).max()) < 1e-5


def test_stepaudio2_transcendentals_are_mlx_ops_on_the_gpu(gpu_default):
    x = mx.linspace(-4, 4, 1000)
    alpha = mx.ones((1000,))
    for fn in (cpu_math.sin, cpu_math.cos, cpu_math.exp, cpu_math.tanh, cpu_math.silu, cpu_math.gelu_tanh,
               cpu_math.mish):
        mx.eval(fn(x))
    mx.eval(cpu_math.snake(x, alpha))
