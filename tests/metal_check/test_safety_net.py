"""The kernel safety net (kernels/selftest.py), tested by making the Metal path fail on purpose.

Here the Metal kernels run in the CPU emulator (msl.emulate) in place of ``mx.fast.metal_kernel``, and the process
is told it has a Metal GPU: the dispatcher then self-tests the vector kernel on first use exactly as on a Mac. A
kernel broken on purpose (a causal check removed, a type error, a wrong gather offset) must be caught once, warned
about once, and the reference must answer instead; a sound kernel must pass and be used.
"""

import warnings

import mlx.core as mx
import numpy as np
import pytest
from msl import emulate, find_clang

from omnitide_mlx.kernels import attention as attn
from omnitide_mlx.kernels import compact, dispatch, page_compact, page_compact_reference, plan_tiles, selftest
from omnitide_mlx.kernels import tile_skip_attention
from omnitide_mlx.kernels.selftest import KernelFallbackWarning

pytestmark = pytest.mark.skipif(find_clang() is None, reason="needs clang++ (scripts/setup.sh --dev)")

CAUSAL = "if (s < 0 || s > my_seq) continue;"


@pytest.fixture
def fake_mac(monkeypatch):
    """A process that believes it has a Metal GPU, whose Metal kernels run in the emulator; counts launches."""
    launches = []

    def run(spec):
        launches.append(spec["name"])
        return emulate(spec)[0]

    monkeypatch.delenv("OMNITIDE_KERNELS", raising=False)
    monkeypatch.setattr(dispatch, "metal_device", lambda: True)
    monkeypatch.setattr(attn, "run_metal_spec", run)
    monkeypatch.setattr(dispatch, "DEFAULT", dispatch.Dispatcher(calibrate=False))
    selftest.reset()
    yield launches
    selftest.reset()


def _break(monkeypatch, module, name, old, new):
    src = attn.metal_source(name)
    assert old in src
    monkeypatch.setattr(module, "metal_source", lambda n: src.replace(old, new) if n == name else attn.metal_source(n))


def _decode_call(seed=0):
    """Head dim 32: MLX has no fused kernel for it, so the vector kernel is the only Metal candidate."""
    rng = np.random.default_rng(seed)
    cap = 256
    seq = np.full(cap, -1)
    seq[rng.permutation(cap)[:150]] = np.arange(150)
    plan = plan_tiles(seq, [120], np.nonzero((seq.reshape(-1, 32) >= 0).any(axis=1))[0], 32)
    q = mx.array(rng.standard_normal((1, 4, 1, 32)).astype(np.float32))
    k = mx.array(rng.standard_normal((1, 2, cap, 32)).astype(np.float32))
    v = mx.array(rng.standard_normal((1, 2, cap, 32)).astype(np.float32))
    return q, k, v, plan


def test_a_sound_kernel_passes_its_self_test_and_runs(fake_mac):
    q, k, v, plan = _decode_call()
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelFallbackWarning)
        out = tile_skip_attention(q, k, v, scale=0.2, plan=plan)
    (result,) = selftest.results()
    assert result.ok and result.path == "vector" and result.max_error < 1e-5
    assert fake_mac == ["omnitide_tile_skip_attention"] * 2  # the self-test, then the call itself
    np.testing.assert_allclose(np.array(out), np.array(attn.reference_attention(q, k, v, plan, 0.2)), atol=1e-5)


def test_a_kernel_that_disagrees_warns_once_and_the_reference_answers(fake_mac, monkeypatch):
    _break(monkeypatch, attn, "tile_skip_attention", CAUSAL, "if (s < 0) continue;")
    q, k, v, plan = _decode_call()
    with pytest.warns(KernelFallbackWarning, match="'vector'.*max error"):
        out = tile_skip_attention(q, k, v, scale=0.2, plan=plan)
    assert fake_mac == ["omnitide_tile_skip_attention"]  # the self-test only
    np.testing.assert_allclose(np.array(out), np.array(attn.reference_attention(q, k, v, plan, 0.2)), atol=1e-6)
    q2, k2, v2, plan2 = _decode_call(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelFallbackWarning)  # once per process, not per call
        out2 = tile_skip_attention(q2, k2, v2, scale=0.2, plan=plan2)
    assert fake_mac == ["omnitide_tile_skip_attention"]
    np.testing.assert_allclose(np.array(out2), np.array(attn.reference_attention(q2, k2, v2, plan2, 0.2)),
                               atol=1e-6)
    assert not selftest.results()[0].ok


def test_a_kernel_that_does_not_compile_warns_and_the_reference_answers(fake_mac, monkeypatch):
    _break(monkeypatch, attn, "tile_skip_attention", "float d = 0.0f;", "half4 d = float4(0.0f);")
    q, k, v, plan = _decode_call()
    with pytest.warns(KernelFallbackWarning, match="RuntimeError"):
        out = tile_skip_attention(q, k, v, scale=0.2, plan=plan)
    np.testing.assert_allclose(np.array(out), np.array(attn.reference_attention(q, k, v, plan, 0.2)), atol=1e-6)
    assert selftest.results()[0].error


def test_forcing_the_kernel_skips_the_net_and_forcing_the_reference_never_launches(fake_mac, monkeypatch):
    _break(monkeypatch, attn, "tile_skip_attention", CAUSAL, "if (s < 0) continue;")
    q, k, v, plan = _decode_call()
    ref = np.array(attn.reference_attention(q, k, v, plan, 0.2))
    monkeypatch.setenv("OMNITIDE_KERNELS", "reference")
    np.testing.assert_allclose(np.array(tile_skip_attention(q, k, v, scale=0.2, plan=plan)), ref, atol=1e-6)
    assert fake_mac == []
    monkeypatch.setenv("OMNITIDE_KERNELS", "metal")  # the user insists: the (broken) kernel runs, untested
    out = np.array(tile_skip_attention(q, k, v, scale=0.2, plan=plan))
    assert fake_mac == ["omnitide_tile_skip_attention"] and not selftest.results()
    assert np.abs(out - ref).max() > 1e-2


def test_a_broken_page_compact_falls_back_to_the_reference_gather(fake_mac, monkeypatch):
    _break(monkeypatch, compact, "page_compact", "+ src[i]) * d + c;", "+ src[i] + 1) * d + c;")
    rng = np.random.default_rng(2)
    k = mx.array(rng.standard_normal((1, 2, 128, 32)).astype(np.float32))
    v = mx.array(rng.standard_normal((1, 2, 128, 32)).astype(np.float32))
    with pytest.warns(KernelFallbackWarning, match="'page_compact'"):
        kr, vr = page_compact(k, v, [5, 9, 100])
    k_ref, v_ref = page_compact_reference(k, v, [5, 9, 100])
    assert mx.array_equal(kr, k_ref) and mx.array_equal(vr, v_ref)


def test_a_sound_page_compact_passes_and_runs(fake_mac):
    rng = np.random.default_rng(3)
    k = mx.array(rng.standard_normal((1, 2, 128, 32)).astype(np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelFallbackWarning)
        kr, vr = page_compact(k, k, [5, 9, 100])
    assert fake_mac == ["omnitide_page_compact"] * 2 and selftest.results()[0].ok
    assert mx.array_equal(kr, page_compact_reference(k, k, [5, 9, 100])[0])
