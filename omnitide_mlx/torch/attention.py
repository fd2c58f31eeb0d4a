"""Attention over the active tiles of a paged KV buffer, in PyTorch (paper 6.1-6.2 on CUDA).

A step's queries (the new tokens) attend over K/V buffers ``[1, kv_heads, capacity, head_dim]`` whose slot ``j``
holds the entry of serial ``key_seq[j]`` (-1 = free): key ``j`` is visible to query ``i`` iff
``0 <= key_seq[j] <= q_seq[i]``. Where an entry lives does not change what is attended to, only how much of the
buffer a kernel walks. :func:`plan_step` computes once per step what every layer shares; three kernels implement
one contract:

- ``flex``: FlexAttention with a ``BlockMask`` built from the page table. One 64-slot page is one KV block
  (``BLOCK_SIZE = (128, 64)``); a query block lists only the pages holding an entry some query of the block can see,
  so empty pages (and pages entirely in the future) are never read: block-sparse skipping is tile skipping. Pages
  that are full and wholly visible to the block go in the "full" lists (no mask_mod evaluated). On CUDA it runs
  through ``torch.compile``; elsewhere eagerly (unfused: the CPU tests use it to check the block mask's
  semantics, not for speed). Eager flex applies only ``mask_mod``, so :func:`block_mask_visibility` checks the
  block lists themselves.
- ``sdpa``: ``scaled_dot_product_attention`` over the physical span ``[0, span)`` with a boolean visibility mask:
  what a span-traversing kernel (FlashAttention over a contiguous cache) does. Its cost follows the page-rounded
  span, which is why the ordered-suffix migration (which shortens the span) is the default layout for it.
- ``reference``: matmul / softmax / matmul in float32 over the gathered active pages, optionally returning the
  attention every slot received (summed over query heads and queries): H2O's scores. FlashAttention-style kernels
  do not expose them, so score-collecting caches use this one (as the paper evaluates H2O without FlashAttention).

Every kernel computes in the cache dtype (flex, sdpa: the query is cast to it, never the buffer) or float32
(reference), returns ``[1, Hq, T, D]`` in the query's dtype, handles GQA
(Hq a multiple of Hkv) without repeating K/V, and gives a query that sees no key zeros.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ..core.tiles import AttentionError, OnStepTiles, StepTiles, plan_step_tiles

KERNELS = ("flex", "sdpa", "reference")
FLEX_Q_BLOCK = 128  # query rows per FlexAttention block (its default sparse block size)


@dataclass
class StepPlan(OnStepTiles):
    """What every layer of one forward step shares: the framework-neutral
    :class:`~omnitide_mlx.core.tiles.StepTiles` (``step``, read through: ``tiles`` are the active pages, ``tile``
    the page size) plus the tensors."""

    step: StepTiles
    key_seq: torch.Tensor  # [capacity] int64 on the device: serial per slot, -1 free (new slots included)
    q_seq: torch.Tensor  # [T] int64: serials of the step's tokens
    _cache: dict = field(repr=False, default_factory=dict)  # per-kernel masks, built once per step

    @property
    def tokens(self) -> int:
        return int(self.step.q_seq.size)


def plan_step(key_seq: np.ndarray, q_seq: np.ndarray, page_size: int, device) -> StepPlan:
    """The step's visibility and active pages (the occupied ones). ``key_seq`` covers the whole buffer (a multiple
    of ``page_size``). The numpy part is core/tiles.py's, shared with the MLX path; the tensors are added here."""
    step = plan_step_tiles(key_seq, q_seq, page_size)
    if step.q_seq.size == 0:
        raise AttentionError("a step has at least one query")
    if step.n_tiles == 0:
        raise AttentionError("no slot is occupied: the step's own tokens must be in key_seq")
    return StepPlan(step=step, key_seq=torch.as_tensor(step.key_seq, device=device),
                    q_seq=torch.as_tensor(step.q_seq, device=device))


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StepPlan) -> None:
    if q.ndim != 4 or q.shape[0] != 1 or q.shape[2] != plan.tokens:
        raise AttentionError(f"q must be [1, Hq, {plan.tokens}, D], got {tuple(q.shape)}")
    if k.shape != v.shape or k.ndim != 4 or k.shape[2] != plan.key_seq.shape[0] or k.shape[3] != q.shape[3]:
        raise AttentionError(f"k / v must be [1, Hkv, {plan.key_seq.shape[0]}, {q.shape[3]}], got "
                             f"{tuple(k.shape)} / {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise AttentionError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads")


# --- the visibility, as a dense mask (oracle and sdpa) -------------------------------------------------------------
def visibility(plan: StepPlan, end: int | None = None) -> torch.Tensor:
    """Boolean ``[T, end]``: query ``i`` sees slot ``j``."""
    ks = plan.key_seq[: plan.key_seq.shape[0] if end is None else end]
    return (ks[None, :] >= 0) & (ks[None, :] <= plan.q_seq[:, None])


# --- flex: a BlockMask from the page table -----------------------------------------------------------------------
def block_lists(plan: StepPlan, q_block: int = FLEX_Q_BLOCK) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per query block, the pages it must read with the mask (partial) and without it (full), ascending.

    A page is listed when it holds an entry some query of the block can see (its smallest serial is at most the
    block's largest query serial); it is full when all its slots are occupied and all are visible to every query
    of the block (its largest serial is at most the block's smallest query serial).
    """
    P = plan.tile
    ks = plan.step.key_seq.reshape(-1, P)
    occ = ks >= 0
    big = np.iinfo(np.int64).max
    page_min = np.where(occ, ks, big).min(axis=1)
    page_max = np.where(occ, ks, -1).max(axis=1)
    page_full = occ.all(axis=1)
    partial, full = [], []
    qs = plan.step.q_seq
    for b0 in range(0, qs.size, q_block):
        block = qs[b0:b0 + q_block]
        seen = np.flatnonzero(page_min <= block.max())
        whole = page_full[seen] & (page_max[seen] <= block.min())
        partial.append(seen[~whole])
        full.append(seen[whole])
    return partial, full


def _lists_tensor(lists: list[np.ndarray], width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """BCSR block lists: counts ``[1, 1, Q blocks]`` and indices ``[1, 1, Q blocks, KV blocks]`` (the index
    rows span every KV block of the buffer, as BlockMask requires; entries past a row's count are unused)."""
    idx = np.zeros((len(lists), width), dtype=np.int32)
    for i, x in enumerate(lists):
        idx[i, : x.size] = x
    num = np.asarray([x.size for x in lists], dtype=np.int32)
    return (torch.as_tensor(num, device=device)[None, None], torch.as_tensor(idx, device=device)[None, None])


def block_mask(plan: StepPlan, q_block: int = FLEX_Q_BLOCK):
    """The step's FlexAttention ``BlockMask`` (built once per step, shared by every layer)."""
    if "block_mask" in plan._cache:
        return plan._cache["block_mask"]
    from torch.nn.attention.flex_attention import BlockMask

    device = plan.key_seq.device
    partial, full = block_lists(plan, q_block)
    n_pages = plan.key_seq.shape[0] // plan.tile
    kv_num, kv_idx = _lists_tensor(partial, n_pages, device)
    full_num, full_idx = _lists_tensor(full, n_pages, device)
    n_blocks = len(partial)
    # padded query rows (past T in the last block) get the largest serial: computed, then discarded by flex
    q_pad = torch.full((n_blocks * q_block,), int(plan.step.q_seq.max()), dtype=torch.int64, device=device)
    q_pad[: plan.tokens] = plan.q_seq
    key_seq = plan.key_seq

    def mask_mod(b, h, q_idx, kv_idx):
        s = key_seq[kv_idx]
        return (s >= 0) & (s <= q_pad[q_idx])

    bm = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(q_block, plan.tile),
                                  mask_mod=mask_mod, seq_lengths=(plan.tokens, key_seq.shape[0]))
    plan._cache["block_mask"] = bm
    return bm


def block_mask_visibility(plan: StepPlan, q_block: int = FLEX_Q_BLOCK) -> torch.Tensor:
    """What the block mask lets through, densely (``[T, capacity]`` bool): listed full pages whole, listed partial
    pages through the visibility rule, everything else masked. Equal to :func:`visibility` iff no visible entry
    sits in an unlisted page and every full page is wholly visible: the test of the block lists (eager flex ignores
    them)."""
    P = plan.tile
    vis = visibility(plan)
    out = torch.zeros_like(vis)
    partial, full = block_lists(plan, q_block)
    for b, (part, whole) in enumerate(zip(partial, full)):
        rows = slice(b * q_block, min(plan.tokens, (b + 1) * q_block))
        for p in part.tolist():
            out[rows, p * P:(p + 1) * P] = vis[rows, p * P:(p + 1) * P]
        for p in whole.tolist():
            out[rows, p * P:(p + 1) * P] = True
    return out


_COMPILED_FLEX = None


def _flex_fn(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return flex_attention
    global _COMPILED_FLEX
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=True)
    return _COMPILED_FLEX


def flex_attend(q, k, v, plan: StepPlan, scale: float, compiled: bool | None = None) -> torch.Tensor:
    """FlexAttention with the page table's BlockMask. ``compiled`` defaults to True on CUDA."""
    _check(q, k, v, plan)
    if compiled is None:
        compiled = q.is_cuda
    fn = _flex_fn(compiled)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        out = fn(q.to(k.dtype), k, v, block_mask=block_mask(plan), scale=scale, enable_gqa=True)
    return out.to(q.dtype)


# --- sdpa over the physical span -----------------------------------------------------------------------------------
def sdpa_span_attend(q, k, v, plan: StepPlan, scale: float) -> torch.Tensor:
    """``scaled_dot_product_attention`` over slots ``[0, span)`` with the visibility mask."""
    _check(q, k, v, plan)
    end = plan.span
    if "sdpa_mask" not in plan._cache:
        plan._cache["sdpa_mask"] = visibility(plan, end)
    mask = plan._cache["sdpa_mask"]
    out = F.scaled_dot_product_attention(q.to(k.dtype), k[:, :, :end], v[:, :, :end], attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    out = torch.where(mask.any(dim=1)[None, None, :, None], out, torch.zeros_like(out))
    return out.to(q.dtype)


# --- reference over the gathered active pages, with scores ---------------------------------------------------------
def active_slot_index(plan: StepPlan) -> torch.Tensor:
    """Slots of the active pages, ascending (int64 on the device)."""
    if "active_index" not in plan._cache:
        P = plan.tile
        idx = (plan.tiles[:, None] * P + np.arange(P)[None, :]).reshape(-1)
        plan._cache["active_index"] = torch.as_tensor(idx, device=plan.key_seq.device)
    return plan._cache["active_index"]


def reference_attend(q, k, v, plan: StepPlan, scale: float, return_scores: bool = False):
    """float32 attention over the active pages (gathered); with ``return_scores`` also the attention each slot
    received, ``[capacity]`` float32 (summed over query heads and queries)."""
    _check(q, k, v, plan)
    idx = active_slot_index(plan)
    _, hq, t, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    kk = k[0].index_select(1, idx).to(torch.float32)  # [Hkv, n, D]
    vv = v[0].index_select(1, idx).to(torch.float32)
    qq = q[0].to(torch.float32).reshape(hkv, g * t, d)  # the G query heads of a KV head stacked as rows
    s = torch.bmm(qq, kk.transpose(1, 2)) * scale  # [Hkv, G*T, n]
    ks = plan.key_seq.index_select(0, idx)
    vis = (ks[None, :] >= 0) & (ks[None, :] <= plan.q_seq[:, None])  # [T, n]
    vis_rows = vis.repeat(g, 1)[None]  # rows are (head in group, query) pairs
    s = s.masked_fill(~vis_rows, float("-inf"))
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)  # a query that sees nothing: zeros
    out = torch.bmm(p, vv).reshape(1, hq, t, d).to(q.dtype)
    if not return_scores:
        return out
    scores = torch.zeros(k.shape[2], dtype=torch.float32, device=k.device)
    scores.index_add_(0, idx, p.sum(dim=(0, 1)))
    return out, scores


def attend(kernel: str, q, k, v, plan: StepPlan, scale: float, *, return_scores: bool = False):
    """Dispatch by kernel name (``flex``, ``sdpa``, ``reference``); scores need the reference kernel."""
    if return_scores and kernel != "reference":
        raise AttentionError(f"the {kernel} kernel does not expose attention scores; use 'reference'")
    if kernel == "flex":
        return flex_attend(q, k, v, plan, scale)
    if kernel == "sdpa":
        return sdpa_span_attend(q, k, v, plan, scale)
    if kernel == "reference":
        return reference_attend(q, k, v, plan, scale, return_scores=return_scores)
    raise AttentionError(f"unknown attention kernel {kernel!r}; choose from {KERNELS}")
