"""The kernel safety net: every non-reference path proves itself once per process before it runs.

On the first use of a path (``vector``: our Metal attention kernel; ``gather`` / ``dense``: MLX's fused attention
over our masks; ``page_compact``: our Metal gather) for a (dtype, head dim, tile) in a process, it is compiled and
run on a small random case (holes, an unlisted tile, GQA, a causal chunk and a query that sees nothing; a few
milliseconds) and compared with the MLX-ops reference. If it fails to compile, raises, or disagrees beyond the
dtype's tolerance, a ``KernelFallbackWarning`` says so once, the path is never used again in the process, and the
dispatcher takes the next candidate (the reference in the end). ``OMNITIDE_KERNELS`` still forces any path (a
forced path is not self-tested). ``omnitide doctor`` runs the same tests and reports them.
"""

from __future__ import annotations

import threading
import time
import traceback
import warnings
from dataclasses import asdict, dataclass

import mlx.core as mx
import numpy as np

TOLERANCE = {"float32": 2e-4, "float16": 4e-3, "bfloat16": 3e-2}  # max abs error vs the reference, unit-scale V


class KernelFallbackWarning(RuntimeWarning):
    """A kernel failed its self-test; the reference (or the next candidate) runs instead."""


@dataclass(frozen=True)
class SelfTest:
    """The outcome of one path's self-test."""

    path: str
    dtype: str
    head_dim: int
    tile: int
    ok: bool
    max_error: float | None
    tolerance: float
    ms: float
    error: str | None = None  # the exception (compile error, launch failure) when it did not run

    def to_json(self) -> dict:
        return asdict(self)


_results: dict[tuple, SelfTest] = {}
_lock = threading.Lock()


def _name(dtype) -> str:
    return str(dtype).split(".")[-1]


def small_case(dtype, d: int, tile: int, seed: int = 0):
    """A few-millisecond case: 1 KV head, 2 query heads, 4 tiles (one unlisted, holes in the others), a 3-token
    causal chunk whose first query precedes every stored serial (it sees nothing)."""
    from .attention import plan_tiles

    rng = np.random.default_rng(seed)
    cap = 4 * tile
    seq = np.full(cap, -1)
    t = 3
    n = cap // 2
    slots = rng.permutation(cap)
    seq[slots[:n]] = 1 + np.arange(n)
    seq[slots[n:n + t]] = n + 1 + np.arange(t)
    tiles = np.array([0, 2, 3])
    qs = n + 1 + np.arange(t)
    qs[0] = 0  # precedes every stored serial
    dt = getattr(mx, _name(dtype))
    q = mx.array(rng.standard_normal((1, 2, t, d)).astype(np.float32)).astype(dt)
    k = mx.array(rng.standard_normal((1, 1, cap, d)).astype(np.float32)).astype(dt)
    v = mx.array(rng.standard_normal((1, 1, cap, d)).astype(np.float32)).astype(dt)
    return q, k, v, plan_tiles(seq, qs, tiles, tile)


def float64_attention(q, k, v, plan, scale: float) -> np.ndarray:
    """The contract in float64 numpy (the reference's own check; tests/kernels has the full oracle)."""
    qn, kn, vn = (np.array(x.astype(mx.float32)).astype(np.float64) for x in (q, k, v))
    _, hq, t, _ = qn.shape
    g = hq // kn.shape[1]
    listed = np.zeros(plan.capacity, bool)
    for ti in plan.tiles:
        listed[ti * plan.tile:(ti + 1) * plan.tile] = True
    seq = np.array(plan.slot_seq).astype(np.int64)
    out = np.zeros_like(qn)
    for i, qs in enumerate(plan.q_seq_np):
        vis = listed & (seq >= 0) & (seq <= qs)
        if vis.any():
            for h in range(hq):
                sc = kn[0, h // g][vis] @ qn[0, h, i] * scale
                p = np.exp(sc - sc.max())
                out[0, h, i] = (p / p.sum()) @ vn[0, h // g][vis]
    return out


def run_self_test(path: str, dtype, d: int, tile: int) -> SelfTest:
    """Compile and run ``path`` on the small case and compare it with the reference (never raises)."""
    from .attention import reference_attention
    from .compact import page_compact_reference

    tol = TOLERANCE[_name(dtype)]
    t0 = time.perf_counter()
    err, max_err = None, None
    try:
        q, k, v, plan = small_case(dtype, d, tile or 64)  # page_compact (tile 0) only uses its K / V
        if path == "page_compact":
            from .compact import _metal_page_compact

            src = np.array([k.shape[2] - 1, 0, k.shape[2] // 2 + 1, 2])
            got = _metal_page_compact(k, v, src)
            want = page_compact_reference(k, v, src)
            max_err = max(float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max()) for a, b in zip(got, want))
        elif path == "reference":  # the reference itself, against float64 numpy
            got = reference_attention(q, k, v, plan, d ** -0.5)
            want = float64_attention(q, k, v, plan, d ** -0.5)
            max_err = float(np.abs(np.array(got.astype(mx.float32)).astype(np.float64) - want).max())
        else:
            from .dispatch import run_path

            got = run_path(path, q, k, v, plan, d ** -0.5)
            want = reference_attention(q, k, v, plan, d ** -0.5)
            if got.shape != want.shape or got.dtype != want.dtype:
                raise ValueError(f"output {got.shape} {got.dtype}, reference {want.shape} {want.dtype}")
            max_err = float(mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max())
        if not np.isfinite(max_err):
            max_err = float("inf")
    except Exception as e:  # noqa: BLE001 (any failure of a kernel means: do not use it)
        err = f"{type(e).__name__}: {e}".strip()[:2000]
        if not str(e):
            err += " " + traceback.format_exc(limit=2)[-500:]
    ok = err is None and max_err is not None and max_err <= (0.0 if path == "page_compact" else tol)
    return SelfTest(path, _name(dtype), d, tile, ok, max_err, tol, round((time.perf_counter() - t0) * 1e3, 2), err)


def passed(path: str, dtype, d: int, tile: int) -> bool:
    """Whether ``path`` may run for this dtype / head dim / tile; self-tests it on first use (then cached), warns
    once per failure."""
    key = (path, _name(dtype), d, tile)
    got = _results.get(key)
    if got is None:
        with _lock:
            got = _results.get(key)
            if got is None:
                got = run_self_test(path, dtype, d, tile)
                _results[key] = got
                if not got.ok:
                    why = got.error or f"max error {got.max_error:.3g} > tolerance {got.tolerance:g}"
                    warnings.warn(f"attention path {path!r} ({got.dtype}, head dim {d}, tile {tile}) failed its "
                                  f"self-test ({why}); using the next candidate (the reference path last). "
                                  "Please report it with the output of `omnitide doctor`.",
                                  KernelFallbackWarning, stacklevel=3)
    return got.ok


def results() -> list[SelfTest]:
    """Every self-test this process ran."""
    return list(_results.values())


def reset() -> None:
    """Forget every result (tests; a changed kernel source)."""
    with _lock:
        _results.clear()
