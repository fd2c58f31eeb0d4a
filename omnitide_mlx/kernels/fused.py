"""Tile-skipping attention through MLX's fused attention (``mx.fast.scaled_dot_product_attention``).

Two paths with the tile_skip_attention contract (kernels/attention.py), chosen by kernels/dispatch.py:

- ``gather``: the active tiles' K/V are copied once per call into a contiguous scratch buffer (its bytes grow with
  the active slots only), ordered by the smallest serial each tile holds; so the tiles a query block can see are a
  prefix of the scratch, sliced without a copy (causal skipping inside the chunk). Each block calls the fused
  kernel with a boolean mask for holes and for the causal part of the chunk. On an Apple GPU that kernel (MLX
  0.32: ``sdpa_full`` for more than 8 queries, head dims 64/72/80/96/128; ``sdpa_vector`` for up to 8 queries
  with queries x heads-per-KV-head <= 32, head dims 64/96/128/256) multiplies tiles on the simdgroup matrix units;
  the cost model (kernels/cost.py) says why this beats the vector kernel for prefill.
- ``dense``: no copy; each block calls the fused kernel over the span of slots from the first listed tile to the
  last one its queries can see, the mask also hiding unlisted tiles. It reads (and multiplies) every slot of that
  span, so it only pays when the span is mostly active. Unlike the other paths it reads unlisted slots inside the
  span: they must hold finite values (OmniCache's buffers are zero-initialised and only ever get K/V rows).

A mask is boolean (MLX masks a False with the dtype's lowest finite value, so a fully masked row would average V:
queries that see no key are zeroed afterwards, as the contract asks). Masks are cached in the plan, so every layer
of a step reuses them. Off Metal the fused call falls back to MLX ops; there the inputs go in as float32 (scores and
softmax in float32, as the contract asks; the fallback would otherwise multiply in float16 / bfloat16).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .attention import _NO_SEQ, SCORE_BUDGET, TilePlan

FUSED_BLOCK_MAX = 512  # queries per fused call: blocks let earlier queries skip the chunk's later tiles
MASK_CACHE_MAX = 1 << 24  # cache a block's boolean mask in the plan up to this many elements (16 MB)


@dataclass(frozen=True)
class _Scratch:
    """The gather path's per-plan schedule: which slots are copied, in which order."""

    idx: mx.array | None  # [n] slots copied into the scratch (None: the active tiles are one ascending run)
    start: int  # the run's first slot when idx is None
    key_np: np.ndarray  # [n] serials in scratch order (free -> _NO_SEQ)
    key: mx.array
    mins: np.ndarray  # per scratch tile: smallest serial (ascending)


def _on_metal() -> bool:
    return mx.default_device() == mx.gpu and mx.metal.is_available()


def _scratch(plan: TilePlan) -> _Scratch:
    got = plan.cache.get("gather")
    if got is not None:
        return got
    keep = plan.tile_min < _NO_SEQ  # tiles holding only free slots are never visible: not copied
    order = np.argsort(plan.tile_min[keep], kind="stable")
    tiles = plan.tiles[keep][order]
    mins = plan.tile_min[keep][order]
    slots = (tiles[:, None] * plan.tile + np.arange(plan.tile)[None, :]).reshape(-1)
    run = tiles.size > 0 and bool(np.all(np.diff(tiles) == 1))
    key_np = plan.key_np[slots]
    sc = _Scratch(None if run else mx.array(slots.astype(np.int32)), int(slots[0]) if run else 0, key_np,
                  mx.array(key_np.astype(np.int32)), mins)
    plan.cache["gather"] = sc
    return sc


def _listed_key(plan: TilePlan) -> tuple[np.ndarray, mx.array]:
    """Per slot: its serial when its tile is listed, else _NO_SEQ (the dense path's mask hides unlisted tiles)."""
    got = plan.cache.get("dense")
    if got is not None:
        return got
    listed = np.zeros(plan.capacity // plan.tile, bool)
    listed[plan.tiles] = True
    key_np = np.where(np.repeat(listed, plan.tile), plan.key_np, _NO_SEQ)
    got = (key_np, mx.array(key_np.astype(np.int32)))
    plan.cache["dense"] = got
    return got


def _block_size(hq: int, keys: int) -> int:
    """Queries per fused call: at most FUSED_BLOCK_MAX, and off Metal (where the fallback materialises the scores)
    a score matrix under SCORE_BUDGET elements, as on the reference path."""
    return max(1, min(FUSED_BLOCK_MAX, SCORE_BUDGET // max(1, hq * keys)))


def _mask(plan: TilePlan, tag: str, i0: int, i1: int, key_np: np.ndarray, key: mx.array) -> mx.array | None:
    """[tb, n] visibility of keys ``key`` to queries i0:i1, or None when every key is visible to every query."""
    qs = plan.q_seq_np[i0:i1]
    if key_np.size == 0 or key_np.max() <= qs.min():
        return None
    ck = (tag, i0, i1, key_np.size)
    got = plan.cache.get(ck)
    if got is not None:
        return got
    m = key[None, :] <= plan.q_seq[i0:i1, None]
    if (i1 - i0) * key_np.size <= MASK_CACHE_MAX:
        plan.cache[ck] = m
    return m


def _sdpa(q, k, v, scale, mask, metal: bool) -> mx.array:
    if not metal:  # the MLX-ops fallback: multiply in float32
        q, k, v = (x if x.dtype == mx.float32 else x.astype(mx.float32) for x in (q, k, v))
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def _finish(outs: list[mx.array], q: mx.array, plan: TilePlan, first_seq: int) -> mx.array:
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)
    empty = plan.q_seq_np < first_seq
    if empty.any():  # queries that see no key get zeros
        out = mx.where(mx.array(~empty)[:, None], out, 0.0)
    return out.astype(q.dtype)


def gather_attention(q: mx.array, k_buf: mx.array, v_buf: mx.array, plan: TilePlan, scale: float) -> mx.array:
    """The matrix-unit prefill path: active tiles gathered into scratch, fused attention per query block."""
    _, hq, t, _ = q.shape
    sc = _scratch(plan) if plan.n_tiles else None
    if sc is None or sc.mins.size == 0 or t == 0:
        return mx.zeros(q.shape, q.dtype)
    metal = _on_metal()
    if sc.idx is None:
        n_all = sc.key_np.size
        kg, vg = k_buf[:, :, sc.start:sc.start + n_all], v_buf[:, :, sc.start:sc.start + n_all]
    else:
        kg, vg = k_buf[:, :, sc.idx, :], v_buf[:, :, sc.idx, :]
    block = _block_size(hq, sc.key_np.size)
    outs = []
    for i0 in range(0, t, block):
        i1 = min(t, i0 + block)
        n = int(np.searchsorted(sc.mins, plan.q_seq_np[i0:i1].max(), side="right")) * plan.tile
        qb = q[:, :, i0:i1] if block < t else q
        if n == 0:
            outs.append(mx.zeros(qb.shape, q.dtype))
            continue
        if outs:  # one block after another (bounded transient memory, as on the reference path)
            qb = mx.depends(qb, outs[-1])
        mask = _mask(plan, "gather", i0, i1, sc.key_np[:n], sc.key[:n])
        outs.append(_sdpa(qb, kg[:, :, :n], vg[:, :, :n], scale, mask, metal))
    return _finish(outs, q, plan, int(sc.mins[0]))


def dense_attention(q: mx.array, k_buf: mx.array, v_buf: mx.array, plan: TilePlan, scale: float) -> mx.array:
    """Fused attention over the span of listed tiles, no copy; holes, unlisted tiles and the future masked."""
    _, hq, t, _ = q.shape
    visible = plan.tile_min < _NO_SEQ
    if not visible.any() or t == 0:
        return mx.zeros(q.shape, q.dtype)
    key_np, key = _listed_key(plan)
    metal = _on_metal()
    tiles, mins = plan.tiles[visible], plan.tile_min[visible]
    lo = int(tiles[0]) * plan.tile
    block = _block_size(hq, (int(tiles[-1]) + 1) * plan.tile - lo)
    outs = []
    for i0 in range(0, t, block):
        i1 = min(t, i0 + block)
        seen = tiles[mins <= plan.q_seq_np[i0:i1].max()]
        qb = q[:, :, i0:i1] if block < t else q
        if seen.size == 0:
            outs.append(mx.zeros(qb.shape, q.dtype))
            continue
        if outs:
            qb = mx.depends(qb, outs[-1])
        hi = (int(seen[-1]) + 1) * plan.tile
        mask = _mask(plan, "dense", i0, i1, key_np[lo:hi], key[lo:hi])
        outs.append(_sdpa(qb, k_buf[:, :, lo:hi], v_buf[:, :, lo:hi], scale, mask, metal))
    return _finish(outs, q, plan, int(mins.min()))
