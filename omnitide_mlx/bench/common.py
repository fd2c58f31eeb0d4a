"""What every benchmark shares: timing after ``mx.eval`` with medians, and a record of the machine and versions.

Absolute times drift with load on a shared machine, so benchmarks compare configurations side by side in one
process and report medians and ratios; the load average before and after a run goes into its JSON.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx


@dataclass(frozen=True)
class Timing:
    """Wall-clock median / min / max, and the median process CPU time (all threads of this process): on a shared
    machine CPU time stays close to the work done while wall time also counts waiting for the cores."""

    median_ms: float
    min_ms: float
    max_ms: float
    reps: int
    cpu_median_ms: float | None = None

    def to_json(self) -> dict:
        out = {"median_ms": round(self.median_ms, 4), "min_ms": round(self.min_ms, 4),
               "max_ms": round(self.max_ms, 4), "reps": self.reps}
        if self.cpu_median_ms is not None:
            out["cpu_median_ms"] = round(self.cpu_median_ms, 4)
        return out


def time_call(fn: Callable[[], object], reps: int | None = None, max_reps: int = 7) -> Timing:
    """Median wall time of ``fn`` with its result evaluated. The first call is a warm-up unless it alone takes over
    8 s (then it is the only sample); without ``reps``: 7 samples under 0.5 s a call, 3 under 8 s, else 1."""
    def once() -> float:
        t0 = time.perf_counter()
        mx.eval(fn())
        return (time.perf_counter() - t0) * 1000

    first = once()
    if reps is None:
        reps = 1 if first > 8000 else 3 if first > 500 else max_reps
        if first > 8000:
            return Timing(first, first, first, 1)
    samples = [once() for _ in range(reps)]
    return Timing(statistics.median(samples), min(samples), max(samples), len(samples))


FLUSH_BYTES = 128 << 20  # read before every timed call: larger than the CPU's last-level cache


def cache_flusher(nbytes: int = FLUSH_BYTES) -> Callable[[], None]:
    """A function that streams ``nbytes`` through the caches, so the next call starts cold. In a model, the K/V of
    one layer's attention has long left the caches (other layers' weights and K/V passed through) by its next call;
    timing every configuration cold also keeps the call that ran just before from favouring one."""
    scratch = mx.ones((nbytes // 4,), mx.float32)
    tiny = mx.ones((64,), mx.float32)
    mx.eval(scratch, tiny)

    def flush() -> None:
        mx.eval(scratch.sum())
        for _ in range(4):  # re-warm MLX's own dispatch path (code, allocator): a model runs ops in between too
            mx.eval(tiny * 2 + 1)

    return flush


def time_interleaved(fns: dict[str, Callable[[], object]], reps: int | None = None,
                     flush: Callable[[], None] | None = None) -> dict[str, Timing]:
    """Time several calls side by side: one warm-up each, then rounds that call each (still short of samples) once
    in turn (the order rotating every round), so that a load change on a shared machine, or the cache state a
    previous call leaves, hits every configuration alike. Samples per call: ``reps``,
    else 7 when its warm-up took under 0.5 s, 3 under 8 s, else 2 (the warm-up itself being one of them). With
    ``flush`` (see cache_flusher), it runs before every call, outside the timing."""
    def once(fn) -> tuple[float, float]:
        if flush is not None:
            flush()
        c0, t0 = time.process_time(), time.perf_counter()
        mx.eval(fn())
        return (time.perf_counter() - t0) * 1000, (time.process_time() - c0) * 1000

    first = {name: once(fn) for name, fn in fns.items()}
    need, samples = {}, {}
    for name, (wall, _) in first.items():
        long = wall > 8000
        need[name] = reps if reps is not None else 2 if long else 3 if wall > 500 else 7
        samples[name] = [first[name]] if long and reps is None else []
    names = list(fns)
    turn = 0
    while any(len(samples[n]) < need[n] for n in names):
        # rotate the order every round: no configuration always runs right after the one that flushed the caches
        for name in names[turn % len(names):] + names[:turn % len(names)]:
            if len(samples[name]) < need[name]:
                samples[name].append(once(fns[name]))
        turn += 1
    out = {}
    for name, v in samples.items():
        wall = [w for w, _ in v]
        out[name] = Timing(statistics.median(wall), min(wall), max(wall), len(v),
                           statistics.median(c for _, c in v))
    return out


def _git_commit() -> str | None:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                           timeout=5)
        return r.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _blas_in_use() -> str:
    from ..blas import blas_info

    return blas_info()["in_use"]


def versions() -> dict:
    """Library versions, the machine, the MLX device, and whether OpenBLAS is preloaded (scripts/blas_env.sh)."""
    import numpy

    from .. import __version__

    return {
        "omnitide_mlx": __version__,
        "git": _git_commit(),
        "mlx": mx.__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "device": str(mx.default_device()),
        "metal": bool(mx.metal.is_available()),
        "blas_preload": os.environ.get("LD_PRELOAD", ""),
        "blas": _blas_in_use(),
    }


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None
