"""The fast BLAS for MLX's CPU backend on Linux, loaded by ``import omnitide_mlx`` before MLX is imported.

The mlx-cpu wheel links a reference BLAS (mlx_cpu.libs/libblas-*.so): float32 matmul at the 3B shape ran 22x
slower with it (``omnitide bench stream``, 45.8 s against 2.0 s per 32K update run; docs/benchmarks.md). Loading
the system's OpenBLAS with RTLD_GLOBAL first puts its ``sgemm_`` / ``cblas_*`` ahead of the wheel's in the symbol
lookup when MLX's library loads, which is what ``LD_PRELOAD`` (scripts/blas_env.sh) did, without a re-exec and
for any program that imports omnitide_mlx before MLX. macOS (Accelerate) is left alone; ``OMNITIDE_BLAS=reference``
turns it off. This module imports nothing but the standard library.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys

_CANDIDATES = ("/usr/lib/*-linux-gnu/openblas-pthread/libblas.so.3", "/usr/lib/openblas-pthread/libblas.so.3",
               "/usr/lib*/libopenblas.so.0", "/usr/lib/*-linux-gnu/libopenblas.so.0")

_state = {"loaded": None, "error": None, "mlx_first": False}


def find_openblas() -> str | None:
    """The system OpenBLAS (Debian's alternatives path first, as scripts/blas_env.sh looks), or None."""
    for pattern in _CANDIDATES:
        for path in sorted(glob.glob(pattern)):
            if os.path.exists(path):
                return path
    return None


def preload() -> None:
    """Load OpenBLAS into the global symbol scope when MLX is not imported yet (Linux only; once)."""
    if not sys.platform.startswith("linux") or _state["loaded"] or os.environ.get("OMNITIDE_BLAS") == "reference":
        return
    if "mlx.core" in sys.modules:  # too late: MLX already bound its BLAS
        _state["mlx_first"] = True
        return
    path = find_openblas()
    if path is None:
        return
    try:
        ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
        _state["loaded"] = path
    except OSError as e:
        _state["error"] = str(e)


def _mapped_blas() -> list[str]:
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            paths = {line.split()[-1] for line in f if "blas" in line.lower() and "/" in line}
    except OSError:
        return []
    return sorted(paths)


def blas_info() -> dict:
    """Which BLAS MLX's CPU backend uses here, and why: ``in_use`` in words, ``loaded`` (the OpenBLAS this module
    loaded, or None), ``mapped`` (the BLAS libraries in this process)."""
    if sys.platform == "darwin":
        return {"in_use": "Accelerate (macOS)", "loaded": None, "mapped": []}
    mapped = _mapped_blas()
    preloaded = os.environ.get("LD_PRELOAD", "")
    if _state["loaded"]:
        in_use = f"OpenBLAS ({_state['loaded']}, loaded by omnitide_mlx before MLX)"
    elif "blas" in preloaded.lower():
        in_use = f"OpenBLAS (LD_PRELOAD={preloaded})"
    elif os.environ.get("OMNITIDE_BLAS") == "reference":
        in_use = "reference BLAS of the mlx-cpu wheel (OMNITIDE_BLAS=reference)"
    elif _state["mlx_first"]:
        in_use = ("reference BLAS of the mlx-cpu wheel: MLX was imported before omnitide_mlx (import omnitide_mlx "
                  "first, or source scripts/blas_env.sh)")
    elif _state["error"]:
        in_use = f"reference BLAS of the mlx-cpu wheel (loading OpenBLAS failed: {_state['error']})"
    else:
        in_use = ("reference BLAS of the mlx-cpu wheel (no OpenBLAS here: apt-get install libopenblas0-pthread, "
                  "20x faster float32 matmul)")
    return {"in_use": in_use, "loaded": _state["loaded"], "mapped": mapped}
