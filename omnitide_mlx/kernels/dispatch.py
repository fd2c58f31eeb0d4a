"""Which attention path runs a call: per phase and shape, by the cost model, calibrated once per process on a Mac.

Paths: ``reference`` (MLX ops, kernels/attention.py), ``vector`` (our Metal kernel), ``gather`` and ``dense``
(MLX's fused attention over gathered active tiles or over the span, kernels/fused.py). Rules, in order:

1. ``return_scores`` (H2O) needs the per-slot attention: ``reference``.
2. ``OMNITIDE_KERNELS`` forces a path: ``reference``, ``vector`` (``metal`` is its old name), ``gather`` or
   ``dense``; ``auto`` (default) chooses. ``gather`` and ``dense`` run anywhere (off Metal MLX's fused call falls back
   to ops); ``vector`` needs a Metal GPU and a head dim that is a multiple of 32. A forced path skips the self-test.
3. Off Metal: ``reference`` (on the CPU it is the fastest formulation measured, docs/benchmarks.md).
4. On Metal the candidates are ``vector`` (head dim a multiple of 32) and ``gather`` / ``dense`` where MLX 0.32 has a
   fused kernel for the shape (``fused_supported``); each must pass its self-test (kernels/selftest.py) on first
   use. The first call of a shape (phase, heads, head dim, dtype, tile) times every candidate on a small case of
   that shape and keeps measured / predicted per path; every call then takes the cheapest calibrated prediction
   (kernels/cost.py) for its own layout. The choice is cached in the step's plan, so the layers of a step share it.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..errors import OmniTideError
from . import cost

PATHS = ("reference", "vector", "gather", "dense")
ENV = "OMNITIDE_KERNELS"
_ALIASES = {"metal": "vector"}
CALIBRATION_REPS = 3


class KernelPathError(OmniTideError, RuntimeError):
    """A forced path that cannot run here (bad OMNITIDE_KERNELS value, no Metal, unsupported head dim)."""


def forced() -> str | None:
    """The path OMNITIDE_KERNELS forces, or None for ``auto``."""
    raw = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if raw == "auto":
        return None
    name = _ALIASES.get(raw, raw)
    if name not in PATHS:
        raise KernelPathError(f"{ENV}={raw!r}: choose auto, " + ", ".join(PATHS) + " (metal = vector)")
    return name


def metal_device() -> bool:
    """True when MLX's default device is an Apple GPU (the Metal paths can run)."""
    return mx.metal.is_available() and mx.default_device() == mx.gpu


def fused_supported(t: int, g: int, d: int) -> bool:
    """Whether MLX (0.32) runs its fused Metal attention for this shape (else it falls back to unfused ops):
    ``sdpa_full`` for more than 8 queries at head dims 64/72/80/96/128, ``sdpa_vector`` for up to 8 queries with
    queries x heads-per-KV-head <= 32 at head dims 64/96/128/256."""
    if t > 8:
        return d in (64, 72, 80, 96, 128)
    return d in (64, 96, 128, 256) and t * g <= 32


def candidates(t: int, g: int, d: int, metal: bool) -> tuple[str, ...]:
    """The paths the dispatcher may choose for a shape (before self-tests)."""
    if not metal:
        return ("reference",)
    out = []
    if d % 32 == 0:
        out.append("vector")
    if fused_supported(t, g, d):
        out += ["gather", "dense"]
    return tuple(out) or ("reference",)


def shape_key(q: mx.array, k_buf: mx.array, tile: int) -> tuple:
    """What a calibration is cached by: phase, query heads, KV heads, head dim, dtype, tile."""
    _, hq, t, d = q.shape
    return ("decode" if t <= 8 else "prefill", hq, k_buf.shape[1], d, str(k_buf.dtype).split(".")[-1], tile)


def _dtype_bytes(dtype) -> int:
    return 4 if dtype == mx.float32 else 2


def case_of(q: mx.array, k_buf: mx.array, plan) -> cost.Case:
    """The cost model's view of a call (cached in the plan: every layer of a step shares it)."""
    _, hq, _, d = q.shape
    key = ("case", hq, k_buf.shape[1], d, k_buf.dtype)
    got = plan.cache.get(key)
    if got is None:
        got = cost.make_case(plan.key_np, plan.q_seq_np, plan.tiles, plan.tile, hq=hq, hkv=k_buf.shape[1], d=d,
                             dtype_bytes=_dtype_bytes(k_buf.dtype))
        plan.cache[key] = got
    return got


def run_path(path: str, q, k_buf, v_buf, plan, scale: float) -> mx.array:
    """Run one path (no checks: the caller validated the contract)."""
    from . import attention, fused

    if path == "reference":
        return attention.reference_attention(q, k_buf, v_buf, plan, scale)
    if path == "vector":
        return attention.metal_attention(q, k_buf, v_buf, plan, scale)
    if path == "gather":
        return fused.gather_attention(q, k_buf, v_buf, plan, scale)
    if path == "dense":
        return fused.dense_attention(q, k_buf, v_buf, plan, scale)
    raise KernelPathError(f"unknown path {path!r}")


def calibration_case(key: tuple, seed: int = 0, queries: int = 256):
    """A small random call of a shape: 2,048 slots (a quarter of the tiles unlisted, holes in the rest),
    ``queries`` queries for prefill or 1 for decode. Returns (q, k, v, plan)."""
    from .attention import plan_tiles

    phase, hq, hkv, d, dtype, tile = key
    rng = np.random.default_rng(seed)
    cap = 2048
    t = queries if phase == "prefill" else 1
    seq = np.full(cap, -1)
    slots = rng.permutation(cap - t)
    n_hist = int(0.6 * (cap - t))
    seq[np.sort(slots[:n_hist])] = np.arange(n_hist)
    seq[cap - t:] = n_hist + np.arange(t)
    tiles = np.arange(cap // tile)
    tiles = tiles[(np.arange(tiles.size) % 4 != 1) | (tiles >= (cap - t) // tile)]
    dt = getattr(mx, dtype)
    q = mx.array(rng.standard_normal((1, hq, t, d)).astype(np.float32)).astype(dt)
    k = mx.array(rng.standard_normal((1, hkv, cap, d)).astype(np.float32)).astype(dt)
    v = mx.array(rng.standard_normal((1, hkv, cap, d)).astype(np.float32)).astype(dt)
    return q, k, v, plan_tiles(seq, n_hist + np.arange(t), tiles, tile)


def time_path(path: str, q, k, v, plan, scale: float, reps: int = CALIBRATION_REPS) -> float:
    """Median milliseconds of one path on one call (after a warm-up that also compiles it)."""
    mx.eval(q, k, v)
    mx.eval(run_path(path, q, k, v, plan, scale))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(run_path(path, q, k, v, plan, scale))
        mx.synchronize()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


@dataclass
class Calibration:
    """Measured / predicted milliseconds per path for one shape (factor 1: the model is taken as it is)."""

    key: tuple
    measured_ms: dict
    predicted_ms: dict
    factors: dict = field(init=False)

    def __post_init__(self):
        self.factors = {p: self.measured_ms[p] / max(self.predicted_ms[p], 1e-6) for p in self.measured_ms}


@dataclass
class Dispatcher:
    """Chooses a path per call. ``metal`` None: ask MLX; ``calibrate``: time candidates once per shape (only
    where they can run fast: on Metal, or when ``paths`` names them explicitly); ``paths`` overrides the candidate
    set (tests, the benchmarks); ``self_test``: each candidate passes kernels/selftest.py before it runs;
    ``machine`` is the cost model's GPU."""

    metal: bool | None = None
    calibrate: bool = True
    paths: tuple[str, ...] | None = None
    self_test: bool = True
    machine: cost.Machine = cost.DEFAULT_MACHINE
    calibrations: dict = field(default_factory=dict)

    def _metal(self) -> bool:
        return metal_device() if self.metal is None else self.metal

    def candidates(self, q, k_buf, plan) -> tuple[str, ...]:
        _, hq, t, d = q.shape
        cands = self.paths or candidates(t, hq // k_buf.shape[1], d, self._metal())
        if not self.self_test:
            return cands
        from . import selftest

        ok = tuple(p for p in cands if p == "reference" or selftest.passed(p, k_buf.dtype, d, plan.tile))
        return ok or ("reference",)

    def calibration(self, key: tuple, paths: tuple[str, ...], scale: float) -> Calibration:
        got = self.calibrations.get((key, paths))
        if got is None:
            q, k, v, plan = calibration_case(key)
            case = case_of(q, k, plan)
            measured = {p: time_path(p, q, k, v, plan, scale) for p in paths}
            predicted = {p: cost.predict(p, case, self.machine).ms for p in paths}
            got = Calibration(key, measured, predicted)
            self.calibrations[(key, paths)] = got
        return got

    def choose(self, q, k_buf, plan, scale: float = 1.0, *, return_scores: bool = False) -> str:
        if return_scores:
            return "reference"
        f = forced()
        if f is not None:
            return self._check_forced(f, q)
        ck = ("path", id(self), q.shape[1], q.shape[2], k_buf.shape[1], q.shape[3], k_buf.dtype)
        got = plan.cache.get(ck)
        if got is not None:
            return got
        cands = self.candidates(q, k_buf, plan)
        priced = tuple(p for p in cands if p != "reference")
        if len(priced) == 0:
            choice = "reference"
        elif len(priced) == 1:
            choice = priced[0]
        else:
            factors = None
            if self.calibrate:
                factors = self.calibration(shape_key(q, k_buf, plan.tile), priced, scale).factors
            choice, _ = cost.best(case_of(q, k_buf, plan), priced, self.machine, factors)
        plan.cache[ck] = choice
        return choice

    def _check_forced(self, path: str, q) -> str:
        if path == "vector":
            if not self._metal():
                raise KernelPathError(f"{ENV}=vector (metal) but no Metal GPU is the default device")
            if q.shape[-1] % 32:
                raise KernelPathError(f"{ENV}=vector: the Metal kernel needs a head dim that is a multiple of 32, "
                                      f"got {q.shape[-1]}")
        return path


DEFAULT = Dispatcher()


def choose(q, k_buf, plan, scale: float = 1.0, *, return_scores: bool = False) -> str:
    """The process-wide dispatcher's choice (see the module docstring)."""
    return DEFAULT.choose(q, k_buf, plan, scale, return_scores=return_scores)
