"""Every public error class of the package derives from ``OmniTideError`` and keeps its builtin base.

The classes are discovered by importing every module of the package, so a new error class that forgets the base
fails here without anyone adding it to a list. Warnings (``RetentionWarning``, ...) are not errors."""

import functools
import importlib
import pkgutil

import pytest

import omnitide_mlx
from omnitide_mlx.errors import OmniTideError

# Modules whose optional dependency is missing here are skipped (reported); every other import must work.
OPTIONAL = {"torch", "transformers", "starlette", "uvicorn", "websockets", "gguf", "sounddevice", "matplotlib"}


@functools.cache
def _public_error_classes():
    found, skipped = {}, []
    for info in pkgutil.walk_packages(omnitide_mlx.__path__, "omnitide_mlx."):
        if info.name.rsplit(".", 1)[-1] == "__main__":
            continue
        try:
            module = importlib.import_module(info.name)
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] in OPTIONAL:
                skipped.append(info.name)
                continue
            raise
        for name, obj in vars(module).items():
            if (isinstance(obj, type) and issubclass(obj, BaseException)
                    and not issubclass(obj, Warning) and not name.startswith("_")
                    and obj.__module__.startswith("omnitide_mlx.")):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found, tuple(skipped)


def test_every_public_error_derives_from_the_base():
    found, skipped = _public_error_classes()
    # the ones the package had when the base came in; more may come, none may go unnoticed
    names = {k.rsplit(".", 1)[-1] for k in found}
    assert {"LayoutError", "UnitError", "MediaError", "SessionError", "RestoreError", "SamplingError",
            "CheckpointError", "SpeechUnavailable", "UsageError", "KernelPathError", "CacheError"} <= names
    missing = sorted(k for k, cls in found.items() if not issubclass(cls, OmniTideError))
    assert missing == [], f"public errors that do not derive from OmniTideError: {missing}"


@pytest.mark.parametrize("name, builtin", [("LayoutError", ValueError), ("SessionError", RuntimeError),
                                           ("RestoreError", ValueError), ("KernelPathError", RuntimeError),
                                           ("SamplingError", ValueError)])
def test_the_builtin_base_is_kept(name, builtin):
    found, _ = _public_error_classes()
    (cls,) = {c for k, c in found.items() if k.endswith("." + name)}
    assert issubclass(cls, builtin) and issubclass(cls, OmniTideError)


def test_the_base_is_exported_at_the_top():
    assert omnitide_mlx.OmniTideError is OmniTideError
    from omnitide_mlx.core.errors import OmniTideError as core_base

    assert core_base is OmniTideError
