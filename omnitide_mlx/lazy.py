"""Lazy package attributes (PEP 562), shared by the package roots: ``omnitide_mlx`` (which must not import MLX
until a name is used) and ``omnitide_mlx.torch`` (which must not import torch until then)."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_getattr(package: str, table: dict[str, tuple[str, str]], namespace: dict[str, Any]
                 ) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``table[name] = (module, attribute)`` on first use and caches the
    value in ``namespace`` (the package's globals)."""

    def __getattr__(name: str) -> Any:
        if name in table:
            module, attr = table[name]
            value = getattr(importlib.import_module(module), attr)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
