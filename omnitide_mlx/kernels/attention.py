"""Tile-skipping attention over a paged KV cache: one contract, a Metal kernel and an MLX-ops reference.

Contract (docs/design.md): ``q`` [1, Hq, T, D]; ``k_buf``, ``v_buf`` [1, Hkv, capacity, D] (float16, bfloat16 or
float32); ``slot_seq`` [capacity] int32, -1 for a free slot; ``q_seq`` [T] int32; ``tiles``: ids of the active tiles,
``tile`` consecutive slots each (64 on the prefill path, 32 on the decode path). Key slot ``j`` is visible to query
``i`` iff ``0 <= slot_seq[j] <= q_seq[i]``; Hq must be a multiple of Hkv (GQA). Only slots inside the listed tiles
are ever read, so a layout with fewer active tiles costs less. Scores and softmax are accumulated in float32; the
output has q's dtype. A query that sees no key gets zeros.

On an Apple GPU the Metal kernel in ``metal/tile_skip_attention.metal`` runs through ``mx.fast.metal_kernel``.
Everywhere else (and as the oracle) the reference below runs with MLX ops. What it does was chosen by measurement on
the CPU backend with OpenBLAS preloaded (docs/benchmarks.md): matmul-softmax-matmul with the query heads of a KV
head stacked as rows (GQA without repeating K) is 2-3.5x faster than ``mx.fast.scaled_dot_product_attention`` for
decode and as fast for prefill; a contiguous run of tiles is sliced, not copied; decode computes scores run by run
(no K/V copy; 1.3-1.7x faster than a gather at 40-80 runs) with the mask as an additive bias inside ``addmm``,
prefill gathers the active tiles; queries go in blocks that bound the score
matrix and skip the tiles no query of the block can see yet (causal skipping inside the new chunk).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from dataclasses import dataclass, field
from importlib import resources

import mlx.core as mx
import numpy as np

from ..core.tiles import NO_SEQ, AttentionError, OnStepTiles, StepTiles, plan_step_tiles
from .cpu_math import softmax_last

PREFILL_TILE = 64  # OmniPage page = llama.cpp Metal flash-attention KV tile
DECODE_TILE = 32  # OmniPage subblock = llama.cpp Metal vector-kernel KV block
_NO_SEQ = NO_SEQ  # key_seq of a free slot: visible to no query (core/tiles.py)
SCORE_BUDGET = 1 << 25  # float32 score elements per query block of the reference path (128 MB)
DECODE_MAX_RUNS = 128  # few query rows: up to this many runs are scored run by run instead of gathered
RUN_SCORES_MAX_ROWS = 128  # query rows (heads per KV head x queries) up to which run-by-run scoring beats a gather
RUN_CHUNK = 1024  # decode blocks score longer runs in pieces (OpenBLAS with 4-7 rows: 3-9 % faster, measured)
CHUNK_MAX_ROWS = 16  # query rows up to which runs are cut into RUN_CHUNK pieces (decode: the G heads of a KV head)
METAL_EMPTY = -1.0e30  # the kernel's log-sum-exp of an empty partial (finite: Metal runs with fast math)


@dataclass(frozen=True)
class TilePlan(OnStepTiles):
    """One step's tile plan for the MLX kernels, built once per step and shared by every layer: the
    framework-neutral :class:`~omnitide_mlx.core.tiles.StepTiles` (``step``; ``tile``, ``tiles``, ``tile_min``,
    ``n_tiles``, ``active_slots`` read through to it) plus the MLX arrays the kernels read."""

    step: StepTiles
    slot_seq: mx.array  # [capacity] int32, as given (the Metal kernel reads it)
    key_seq: mx.array  # [capacity] int32, free slots -> _NO_SEQ (one comparison masks holes and the future)
    q_seq: mx.array  # [T] int32
    tiles_mx: mx.array  # [n_tiles] int32
    cache: dict = field(default_factory=dict, compare=False, repr=False)  # per query block schedules

    @property
    def q_seq_np(self) -> np.ndarray:
        """[T] int64."""
        return self.step.q_seq

    @property
    def key_np(self) -> np.ndarray:
        """[capacity] int64, free slots -> _NO_SEQ."""
        return self.step.visible_key


def plan_tiles(slot_seq, q_seq, tiles, tile: int = PREFILL_TILE) -> TilePlan:
    """Validate the page-table side of the contract and precompute what every layer's call needs: the
    framework-neutral part is core/tiles.py's (shared with the torch path), the MLX arrays are added here."""
    if not isinstance(tile, (int, np.integer)) or tile < 8 or tile & (tile - 1):
        raise AttentionError(f"tile must be a power of two >= 8 ({PREFILL_TILE} prefill, {DECODE_TILE} decode), "
                             f"got {tile!r}")
    step = plan_step_tiles(np.asarray(slot_seq).reshape(-1), np.asarray(q_seq).reshape(-1), tile, tiles)
    return TilePlan(
        step=step,
        slot_seq=mx.array(step.key_seq.astype(np.int32)),
        key_seq=mx.array(step.visible_key.astype(np.int32)),
        q_seq=mx.array(step.q_seq.astype(np.int32)),
        tiles_mx=mx.array(step.tiles.astype(np.int32)),
    )


def _check_arrays(q: mx.array, k_buf: mx.array, v_buf: mx.array, plan: TilePlan) -> None:
    if q.ndim != 4 or q.shape[0] != 1:
        raise AttentionError(f"q must be [1, Hq, T, D], got {tuple(q.shape)}")
    if k_buf.ndim != 4 or k_buf.shape[0] != 1 or tuple(k_buf.shape) != tuple(v_buf.shape):
        raise AttentionError(f"k_buf and v_buf must both be [1, Hkv, capacity, D], got {tuple(k_buf.shape)} "
                             f"and {tuple(v_buf.shape)}")
    _, hq, t, d = q.shape
    _, hkv, cap, dk = k_buf.shape
    if dk != d:
        raise AttentionError(f"head_dim differs: q {d}, k {dk}")
    if hq % hkv:
        raise AttentionError(f"query heads {hq} are not a multiple of KV heads {hkv}")
    if cap != plan.capacity:
        raise AttentionError(f"buffers hold {cap} slots, slot_seq {plan.capacity}")
    if t != plan.q_seq_np.shape[0]:
        raise AttentionError(f"q has {t} tokens, q_seq {plan.q_seq_np.shape[0]}")
    for name, a in (("k_buf", k_buf), ("v_buf", v_buf)):
        if a.dtype not in (mx.float16, mx.bfloat16, mx.float32):
            raise AttentionError(f"{name} must be float16, bfloat16 or float32, got {a.dtype}")


def backend() -> str:
    """'metal' on an Apple GPU, else 'reference' (page_compact's choice); OMNITIDE_KERNELS=reference forces the
    reference, =vector (or metal) insists on Metal (kernels/dispatch.py)."""
    from .dispatch import KernelPathError, forced, metal_device

    f = forced()
    if f == "reference":
        return "reference"
    on_gpu = metal_device()
    if f == "vector" and not on_gpu:
        raise KernelPathError("OMNITIDE_KERNELS=vector (metal) but no Metal GPU is the default device")
    return "metal" if on_gpu else "reference"


def tile_skip_attention(q, k_buf, v_buf, slot_seq=None, q_seq=None, tiles=None, scale: float = 1.0,
                        tile: int = PREFILL_TILE, *, return_scores: bool = False, plan: TilePlan | None = None):
    """Attention of ``q`` over the active tiles of a paged cache (see the module docstring for the contract).

    ``plan`` (from ``plan_tiles``) replaces ``slot_seq`` / ``q_seq`` / ``tiles`` / ``tile`` when a caller attends
    several layers with one page table. With ``return_scores`` it also returns the attention each slot received,
    summed over query heads and queries, float32 [capacity] (H2O); that runs the reference path. Which path runs
    is kernels/dispatch.py's choice (reference off Metal; on Metal the vector kernel, gathered or dense fused
    attention by a calibrated cost model; OMNITIDE_KERNELS forces one).
    """
    if plan is None:
        if slot_seq is None or q_seq is None or tiles is None:
            raise AttentionError("pass slot_seq, q_seq and tiles, or a plan")
        plan = plan_tiles(slot_seq, q_seq, tiles, tile)
    _check_arrays(q, k_buf, v_buf, plan)
    from . import dispatch

    path = dispatch.choose(q, k_buf, plan, scale, return_scores=return_scores)
    if path == "reference":
        return reference_attention(q, k_buf, v_buf, plan, scale, return_scores=return_scores)
    return dispatch.run_path(path, q, k_buf, v_buf, plan, scale)


# --- reference (MLX ops) ------------------------------------------------------------------------------------------

def _runs(tiles: np.ndarray, tile: int) -> list[tuple[int, int]]:
    """Maximal runs of consecutive tile ids, as slot ranges ``[start, end)``."""
    if tiles.size == 0:
        return []
    breaks = np.nonzero(np.diff(tiles) != 1)[0] + 1
    return [(int(r[0]) * tile, (int(r[-1]) + 1) * tile) for r in np.split(tiles, breaks)]


def block_mask(blk: "_Block", q_seq: mx.array) -> mx.array:
    """[tb, n] float32, 0 where a query sees the key and -inf where not, to add to the block's scores: the same
    bits as ``where(visible, s, -inf)`` for finite scores, and 0.2 ms against 0.72 ms for a SmolLM2 unit's
    (1, 3, 3, 95, 576) scores (one pass over a [tb, n] operand broadcast, not a boolean select)."""
    if blk.mask is not None:
        return blk.mask
    return mx.where(blk.key_seq[None, :] <= q_seq[:, None], 0.0, -mx.inf)


def _softmax_rows(s: mx.array) -> mx.array:
    return softmax_last(s)  # mx.softmax(precise=True), with a vectorised exp on the CPU (kernels/cpu_math.py)


@dataclass(frozen=True)
class _Block:
    """How one query block reaches its keys; computed once per plan and reused by every layer."""

    mode: str  # "none" (no visible tile), "slice", "runs" or "gather"
    runs: tuple[tuple[int, int], ...]
    idx: mx.array | None  # gathered slots ("gather")
    key_seq: mx.array | None  # [n] serials of the selected slots (free -> _NO_SEQ)
    mask: mx.array | None  # [tb, n] float32 0 / -inf, added to the scores, when cached; None: per call or not needed
    needs_mask: bool  # False when every selected key is visible to every query of the block
    keep_rows: mx.array | None  # [tb] False for queries that see no key (None: every query sees one)
    bias: tuple[mx.array, ...] | None  # small blocks: per run, [g * tb, n_run] 0 / -inf, added inside addmm

    def slots(self) -> mx.array:
        """The selected slots in score order (for return_scores)."""
        if self.idx is not None:
            return self.idx
        return mx.concatenate([mx.arange(a, b) for a, b in self.runs])


MASK_CACHE_MAX = 1 << 20  # cache a block's mask or bias in the plan up to this many elements (4 MB)


def _schedule(plan: TilePlan, i0: int, i1: int, g: int) -> _Block:
    key = (i0, i1, g)
    cached = plan.cache.get(key)
    if cached is not None:
        return cached
    qs_np = plan.q_seq_np[i0:i1]
    sel = plan.tile_min <= qs_np.max()  # tiles some query of the block can see
    tiles = plan.tiles[sel]
    if tiles.size == 0:
        blk = _Block("none", (), None, None, None, False, None, None)
        plan.cache[key] = blk
        return blk
    runs = tuple(_runs(tiles, plan.tile))
    tb = i1 - i0
    few_rows = g * tb <= RUN_SCORES_MAX_ROWS
    if g * tb <= CHUNK_MAX_ROWS:
        runs = tuple((a, min(b, a + RUN_CHUNK)) for a0, b in runs for a in range(a0, b, RUN_CHUNK))
    if len(runs) == 1:
        mode, idx = "slice", None
    elif few_rows and len(runs) <= DECODE_MAX_RUNS:
        # decode-sized: score run by run (concatenating scores copies rows x keys floats, a gather 2 x keys x D)
        mode, idx = "runs", None
    else:
        mode = "gather"
        idx = mx.array((tiles[:, None] * plan.tile + np.arange(plan.tile)[None, :]).reshape(-1).astype(np.int32))
    slot_np = np.concatenate([np.arange(a, b) for a, b in runs])
    key_np = plan.key_np[slot_np]
    needs_mask = bool(key_np.max() > qs_np.min())  # a hole, or a key some query of the block may not see yet
    mask = bias = None
    if needs_mask and mode != "gather" and few_rows and g * tb * key_np.size <= MASK_CACHE_MAX:
        # decode-sized: the mask becomes an additive bias that addmm adds while it scales (two ops fewer per call)
        full = np.tile(np.where(key_np[None, :] <= qs_np[:, None], 0.0, -np.inf).astype(np.float32), (g, 1))
        bias, off = [], 0
        for a, b in runs:
            bias.append(mx.array(np.ascontiguousarray(full[:, off:off + b - a])))  # not a view of all of full
            off += b - a
        bias = tuple(bias)
    elif needs_mask and tb * key_np.size <= MASK_CACHE_MAX:
        mask = mx.array(np.where(key_np[None, :] <= qs_np[:, None], 0.0, -np.inf).astype(np.float32))
    empty = qs_np < plan.tile_min[sel].min()  # queries that see no key: softmax of -inf rows is NaN
    key_seq = plan.key_seq[runs[0][0]:runs[0][1]] if mode == "slice" else mx.array(key_np.astype(np.int32))
    blk = _Block(mode, runs, idx, key_seq, mask, needs_mask, mx.array(~empty) if empty.any() else None, bias)
    plan.cache[key] = blk
    return blk


def reference_attention(q: mx.array, k_buf: mx.array, v_buf: mx.array, plan: TilePlan, scale: float,
                        return_scores: bool = False):
    """The MLX-ops implementation of the contract (used off Metal, and the Metal kernel's oracle)."""
    _, hq, t, d = q.shape
    hkv = k_buf.shape[1]
    g = hq // hkv
    out_dtype = q.dtype
    scores = mx.zeros((plan.capacity,), mx.float32) if return_scores else None
    if plan.n_tiles == 0 or t == 0:
        out = mx.zeros(q.shape, out_dtype)
        return (out, scores) if return_scores else out
    block = max(1, SCORE_BUDGET // max(1, hq * plan.active_slots))
    outs = []
    for i0 in range(0, t, block):
        i1 = min(t, i0 + block)
        blk = _schedule(plan, i0, i1, g)
        qb = q[:, :, i0:i1, :] if block < t else q
        if outs:  # one query block after another: MLX would otherwise build every block's scores before any softmax
            qb = mx.depends(qb, outs[-1])
        o, p_sum = _attend_block(qb, k_buf, v_buf, blk, plan.q_seq[i0:i1], scale, g, return_scores)
        outs.append(o)
        if p_sum is not None:
            scores = scores.at[blk.slots()].add(p_sum)
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)
    out = out.astype(out_dtype)
    return (out, scores) if return_scores else out


def _f32(x: mx.array) -> mx.array:
    return x if x.dtype == mx.float32 else x.astype(mx.float32)


def _attend_block(q, k_buf, v_buf, blk: _Block, q_seq: mx.array, scale: float, g: int, return_scores: bool):
    """One query block; returns (output [1, Hq, tb, D] float32, attention per selected slot or None)."""
    _, hq, tb, d = q.shape
    hkv = k_buf.shape[1]
    if blk.mode == "none":
        return mx.zeros((1, hq, tb, d), mx.float32), None
    if blk.mode == "gather":
        keys, values = [_f32(k_buf[:, :, blk.idx, :])], [_f32(v_buf[:, :, blk.idx, :])]
    else:  # one view per run, no copy
        keys = [_f32(k_buf[:, :, a:b, :]) for a, b in blk.runs]
        values = [_f32(v_buf[:, :, a:b, :]) for a, b in blk.runs]
    if blk.bias is not None:  # scale and mask inside the score matmul
        qg = _f32(q).reshape(1, hkv, g * tb, d)  # rows (g, t): GQA without repeating K
        parts = [mx.addmm(bias, qg, kk.swapaxes(-1, -2), alpha=scale) for bias, kk in zip(blk.bias, keys)]
    else:
        qg = (_f32(q) * scale).reshape(1, hkv, g * tb, d)
        parts = [qg @ kk.swapaxes(-1, -2) for kk in keys]
    s = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
    n = s.shape[-1]
    if blk.needs_mask and blk.bias is None:
        s = s.reshape(1, hkv, g, tb, n) + block_mask(blk, q_seq)
    p = _softmax_rows(s)
    if blk.keep_rows is not None:
        p = mx.where(blk.keep_rows[:, None], p.reshape(1, hkv, g, tb, n), 0.0)
    p = p.reshape(1, hkv, g * tb, n)
    if len(values) == 1:
        o = p @ values[0]
    else:
        o, off = None, 0
        for vv in values:
            m = vv.shape[2]
            part = p[..., off:off + m] @ vv
            o = part if o is None else o + part
            off += m
    return o.reshape(1, hq, tb, d), (p.sum(axis=(0, 1, 2)) if return_scores else None)


# --- Metal --------------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def metal_source(name: str) -> str:
    """The text of ``<name>.metal`` from the repository's top-level ``metal/`` folder, which the package reaches as
    ``kernels/metal`` (a symlink in a checkout; copied into the wheel as package data, pyproject.toml)."""
    return resources.files(__package__).joinpath("metal", f"{name}.metal").read_text()


ATTENTION_BODY = """
    threadgroup float tg_o[NQ * NS * D];
    threadgroup float tg_ml[2 * NQ * NS];
    tile_skip_attention_impl<TQ, TKV, D, TILE, NQ, NS>(
        q, k, v, slot_seq, q_seq, tiles, dims, scale, o_part, lse_part, tg_o, tg_ml,
        threadgroup_position_in_grid, threadgroups_per_grid, simdgroup_index_in_threadgroup,
        thread_index_in_simdgroup);
"""


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def metal_attention_spec(q: mx.array, k_buf: mx.array, v_buf: mx.array, plan: TilePlan, scale: float, *,
                         rows_per_group: int | None = None, parts: int | None = None,
                         splits: int | None = None) -> dict:
    """Everything ``mx.fast.metal_kernel`` needs for one call: constructor and call arguments in one dict.

    The runtime path and the Linux checker (tests/metal_check) both build the kernel from this, so the checked
    source is exactly the one that runs. ``rows_per_group`` (NQ), ``parts`` (NS) and ``splits`` override the
    launch shape (tests use them to cover every merge path on small grids).
    """
    _, hq, t, d = q.shape
    hkv, cap = k_buf.shape[1], k_buf.shape[2]
    rows = (hq // hkv) * t
    nq = rows_per_group or min(8, _pow2_at_least(rows))
    ns = parts or max(1, 8 // nq)
    if nq * ns > 32:
        raise AttentionError(f"NQ * NS = {nq * ns} simdgroups exceed the 1024-thread threadgroup")
    row_blocks = -(-rows // nq)
    groups = hkv * row_blocks
    if splits is None:  # enough threadgroups to fill a GPU, while each simdgroup keeps >= 2 tiles to walk
        splits = 1
        while groups * splits < 128 and plan.n_tiles >= 4 * ns * splits and splits < 16:
            splits *= 2
    dims = mx.array([hq, t, cap, plan.n_tiles, hkv], dtype=mx.int32)
    return dict(
        name="omnitide_tile_skip_attention",
        input_names=["q", "k", "v", "slot_seq", "q_seq", "tiles", "dims", "scale"],
        output_names=["o_part", "lse_part"],
        source=ATTENTION_BODY,
        header=metal_source("tile_skip_attention"),
        inputs=[q, k_buf, v_buf, plan.slot_seq, plan.q_seq, plan.tiles_mx, dims,
                mx.array([scale], dtype=mx.float32)],
        output_shapes=[(splits, hq, t, d), (splits, hq, t)],
        output_dtypes=[mx.float32, mx.float32],
        template=[("TQ", q.dtype), ("TKV", k_buf.dtype), ("D", d), ("TILE", plan.tile), ("NQ", nq), ("NS", ns)],
        grid=(32 * nq * ns, groups, splits),
        threadgroup=(32 * nq * ns, 1, 1),
    )


def merge_partials(o_part: mx.array, lse_part: mx.array) -> mx.array:
    """Merge per-split (normalised output, log-sum-exp) partials: [S, Hq, T, D], [S, Hq, T] -> [1, Hq, T, D]."""
    if o_part.shape[0] == 1:
        return o_part
    m = lse_part.max(axis=0)
    w = mx.exp(lse_part - m)  # an empty split has lse METAL_EMPTY: weight 0 (or 1 with o = 0 if all are empty)
    return ((w[..., None] * o_part).sum(axis=0) / w.sum(axis=0)[..., None])[None]


_KERNEL_KEYS = ("name", "input_names", "output_names", "source", "header")


@functools.lru_cache(maxsize=None)
def _metal_kernel(name, input_names, output_names, source, header):
    return mx.fast.metal_kernel(name=name, input_names=list(input_names), output_names=list(output_names),
                                source=source, header=header)


_SPEC_RUNNER = None  # metal_runner(): where Metal specs run instead of mx.fast.metal_kernel (None: on the GPU)


@contextlib.contextmanager
def metal_runner(fn):
    """Run every Metal kernel call inside the block with ``fn(spec) -> outputs`` (``omnitide doctor`` runs the
    kernels in tests/metal_check's CPU emulator this way where there is no GPU)."""
    global _SPEC_RUNNER
    previous, _SPEC_RUNNER = _SPEC_RUNNER, fn
    try:
        yield
    finally:
        _SPEC_RUNNER = previous


def run_metal_spec(spec: dict) -> list[mx.array]:
    """Build (cached) and call the kernel a spec describes."""
    if _SPEC_RUNNER is not None:
        return _SPEC_RUNNER(spec)
    kernel = _metal_kernel(*(tuple(spec[k]) if isinstance(spec[k], list) else spec[k] for k in _KERNEL_KEYS))
    call = {k: v for k, v in spec.items() if k not in _KERNEL_KEYS}
    return kernel(**call)


def metal_attention(q: mx.array, k_buf: mx.array, v_buf: mx.array, plan: TilePlan, scale: float) -> mx.array:
    if plan.n_tiles == 0 or q.shape[2] == 0:
        return mx.zeros(q.shape, q.dtype)
    o_part, lse_part = run_metal_spec(metal_attention_spec(q, k_buf, v_buf, plan, scale))
    return merge_partials(o_part, lse_part).reshape(q.shape).astype(q.dtype)
