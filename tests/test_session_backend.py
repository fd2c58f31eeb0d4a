"""The backend protocol (backend.py): both backends implement every member with the protocol's parameters, and a
session is the engine composed with one (no private hooks to override)."""

import inspect

import pytest

from omnitide_mlx.backend import Backend
from omnitide_mlx.engine import StreamingSession
from omnitide_mlx.session import MlxBackend, OmniSession


def _members():
    return {k: v for k, v in vars(Backend).items() if inspect.isfunction(v) and not k.startswith("_")}


def _check(backend_cls, backend):
    assert isinstance(backend, Backend)
    assert isinstance(backend.name, str) and isinstance(backend.quantised_kv, bool)
    for name, proto in _members().items():
        got = inspect.signature(getattr(backend_cls, name))
        assert list(got.parameters) == list(inspect.signature(proto).parameters), name


def test_the_mlx_backend_implements_the_protocol():
    _check(MlxBackend, MlxBackend())
    assert len(_members()) >= 14


def test_the_torch_backend_implements_the_protocol():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from omnitide_mlx.torch.session import TorchBackend, TorchSession

    _check(TorchBackend, TorchBackend())
    assert not [k for k in vars(TorchSession) if k.startswith("_") and not k.startswith("__")]


def test_sessions_override_no_private_engine_method():
    parts = StreamingSession.__mro__[:-1]  # the engine and its parts (streaming/), object excluded
    engine = {k for c in parts for k in vars(c) if k.startswith("_") and not k.startswith("__")}
    assert len(engine) > 30 and engine & set(vars(OmniSession)) == set()
    seen = {}
    for c in parts:  # no part overrides another's method either
        for k, v in vars(c).items():
            if callable(v) and not k.startswith("__"):
                assert k not in seen, f"{k} in {seen.get(k)} and {c.__name__}"
                seen[k] = c.__name__


def test_a_session_built_with_a_backend(tiny_checkpoints):
    from omnitide_mlx.models import load

    s = StreamingSession(load(tiny_checkpoints["qwen"]), backend=MlxBackend(), policy="fifo", high=300, low=200)
    assert s.stats()["backend"] == "mlx" and s.history.total_tokens == s.cache.retained > 0
    with pytest.raises(ValueError, match="kv_bits must be 8 or 4"):
        StreamingSession("unused", backend=MlxBackend(), kv_bits=3)
