"""Tile-skipping attention over a quantised paged KV cache: the reference (MLX ops) of the quantised contract.

Contract: as ``tile_skip_attention`` (kernels/attention.py), except that K and V are each a triple ``(packed,
scales, biases)`` of MLX affine quantisation along the head dimension, one row per slot: ``packed`` [1, Hkv,
capacity, D * bits / 32] uint32, ``scales`` / ``biases`` [1, Hkv, capacity, D / group_size] (float16, bfloat16 or
float32); a key is ``packed_code * scale + bias`` per group (``mx.dequantize``). ``bits`` is 8 or 4, ``group_size`` 32,
64 or 128 (mlx-lm's ``--kv-bits`` / ``--kv-group-size``).

``full`` optionally adds a compact full-precision segment ``(k_full, v_full, full_seq)``: [1, Hkv, F, D] each and
[F] int32 serials (``FREE_SEQ`` for an unused row). Its keys join the same softmax as the quantised ones (one
normalisation; the cache keeps its must-keep class, the system prefix with the attention sinks, there when asked).
The quantised slots that those rows stand for must be free (-1) in the plan's ``slot_seq``.

``shift`` (a :class:`KeyShift`) optionally says that some stored keys are still to be rotated by ``-shift`` positions
(deferred re-rotation: a quantised cache does not re-quantise kept keys at every eviction, it accumulates each
slot's shift and rotates at read time, see cache.py). Runs of keys with a non-zero shift are dequantised to float32,
rotated once and multiplied in float32; the others go through ``mx.quantized_matmul``.

On an Apple GPU the Metal kernel ``metal/tile_skip_attention_q.metal`` runs when the call has no full-precision
segment, no pending key shift and no ``return_scores`` (otherwise the reference below).

The reference follows mlx-lm's quantised SDPA: scores and outputs through ``mx.quantized_matmul`` on the packed rows
(with float32 queries MLX computes them in float32: measured exact to 4e-6 against a float32 dequantisation), the
query heads of a KV head stacked as rows (GQA without repeating K). The tiles are reached as the fp reference
reaches them (one slice, run by run, or a gather of the active tiles: the packed rows, their scales and biases).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from .attention import SCORE_BUDGET, AttentionError, TilePlan, _Block, _schedule, _softmax_rows, backend, block_mask

KV_BITS = (4, 8)
KV_GROUP_SIZES = (32, 64, 128)
FREE_SEQ = np.iinfo(np.int32).max  # serial of an unused full-precision row: visible to no query

QTriple = tuple[mx.array, mx.array, mx.array]


@dataclass
class KeyShift:
    """Positions each stored key still has to move: ``shift`` [capacity] int64 (0: stored at its position), and
    ``rotate(x [n, Hkv, D] float32, offsets [n] int32) -> float32`` (the model's RoPE, e.g. RopeSpec.rotate_tokens).
    Built once per step and shared by every layer (which runs need rotating is cached)."""

    shift: np.ndarray
    rotate: Callable
    _offsets: mx.array | None = None
    _any: dict = field(default_factory=dict)

    @property
    def offsets(self) -> mx.array:
        if self._offsets is None:
            self._offsets = mx.array((-self.shift).astype(np.int32))
        return self._offsets

    def any_in(self, sel: slice | mx.array) -> bool:
        """Whether any key of a run (slice) or gather (index array) has a shift (cached per run / gather)."""
        key = (sel.start, sel.stop) if isinstance(sel, slice) else id(sel)
        hit = self._any.get(key)
        if hit is None:
            slots = sel if isinstance(sel, slice) else np.array(sel)
            hit = self._any[key] = bool(np.any(self.shift[slots]))
        return hit


def check_quant(bits, group_size, head_dim: int) -> None:
    """``bits`` 8 or 4 and ``group_size`` 32 / 64 / 128 dividing ``head_dim``; raises AttentionError otherwise."""
    if bits not in KV_BITS:
        raise AttentionError(f"kv_bits must be 8 or 4, got {bits!r}")
    if group_size not in KV_GROUP_SIZES:
        raise AttentionError(f"kv_group_size must be 32, 64 or 128, got {group_size!r}")
    if head_dim % group_size:
        raise AttentionError(f"kv_group_size {group_size} does not divide head_dim {head_dim}")


def quantize_rows(x: mx.array, group_size: int, bits: int, dtype=None) -> QTriple:
    """Quantise ``x`` [..., D] along its last axis; scales and biases in ``dtype`` (default: x's dtype)."""
    packed, scales, biases = mx.quantize(x, group_size=group_size, bits=bits)
    if dtype is not None and scales.dtype != dtype:
        scales, biases = scales.astype(dtype), biases.astype(dtype)
    return packed, scales, biases


def dequantize_rows(t: QTriple, group_size: int, bits: int) -> mx.array:
    """The float32 values a triple stands for (scales and biases widened first: no half-precision rounding)."""
    packed, scales, biases = t
    return mx.dequantize(packed, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group_size,
                         bits=bits)


def _check(q: mx.array, k: QTriple, v: QTriple, plan: TilePlan, group_size: int, bits: int, full) -> None:
    if q.ndim != 4 or q.shape[0] != 1:
        raise AttentionError(f"q must be [1, Hq, T, D], got {tuple(q.shape)}")
    _, hq, t, d = q.shape
    check_quant(bits, group_size, d)
    for name, (packed, scales, biases) in (("k", k), ("v", v)):
        want_p = (1, packed.shape[1], plan.capacity, d * bits // 32)
        want_s = (1, packed.shape[1], plan.capacity, d // group_size)
        if tuple(packed.shape) != want_p or packed.dtype != mx.uint32:
            raise AttentionError(f"{name}: packed rows must be uint32 {want_p}, got {packed.dtype} "
                                 f"{tuple(packed.shape)}")
        if tuple(scales.shape) != want_s or tuple(biases.shape) != want_s:
            raise AttentionError(f"{name}: scales / biases must be {want_s}, got {tuple(scales.shape)} / "
                                 f"{tuple(biases.shape)}")
    hkv = k[0].shape[1]
    if v[0].shape[1] != hkv or hq % hkv:
        raise AttentionError(f"query heads {hq} are not a multiple of KV heads {hkv}")
    if t != plan.q_seq_np.shape[0]:
        raise AttentionError(f"q has {t} tokens, q_seq {plan.q_seq_np.shape[0]}")
    if full is not None:
        fk, fv, fseq = full
        if fk.ndim != 4 or tuple(fk.shape) != tuple(fv.shape) or fk.shape[1] != hkv or fk.shape[3] != d:
            raise AttentionError(f"full-precision K / V must be [1, {hkv}, F, {d}], got {tuple(fk.shape)} / "
                                 f"{tuple(fv.shape)}")
        if tuple(fseq.shape) != (fk.shape[2],):
            raise AttentionError(f"full_seq must be [{fk.shape[2]}], got {tuple(fseq.shape)}")


def quantized_tile_skip_attention(q: mx.array, k: QTriple, v: QTriple, plan: TilePlan, scale: float, *,
                                  group_size: int, bits: int, full=None, shift: KeyShift | None = None,
                                  return_scores: bool = False):
    """Attention of ``q`` over the quantised active tiles (and the full-precision rows, if any); see the module
    docstring. With ``return_scores`` also returns the attention each slot received, float32 [capacity], and each
    full-precision row received, float32 [F] (None without ``full``)."""
    _check(q, k, v, plan, group_size, bits, full)
    _, hq, t, d = q.shape
    if not return_scores and full is None and shift is None and d % 32 == 0 and backend() == "metal":
        return metal_attention_q(q, k, v, plan, scale, group_size=group_size, bits=bits)
    hkv = k[0].shape[1]
    g = hq // hkv
    scores = mx.zeros((plan.capacity,), mx.float32) if return_scores else None
    full_scores = None
    if full is not None and return_scores:
        full_scores = mx.zeros((full[0].shape[2],), mx.float32)
    if t == 0 or (plan.n_tiles == 0 and full is None):
        out = mx.zeros(q.shape, q.dtype)
        return (out, scores, full_scores) if return_scores else out
    n_keys = plan.active_slots + (0 if full is None else full[0].shape[2])
    block = max(1, SCORE_BUDGET // max(1, hq * n_keys))
    outs = []
    for i0 in range(0, t, block):
        i1 = min(t, i0 + block)
        blk = _schedule(plan, i0, i1, g) if plan.n_tiles else None
        qb = q[:, :, i0:i1, :] if block < t else q
        if outs:  # one block after another (see reference_attention)
            qb = mx.depends(qb, outs[-1])
        o, p_q, p_f = _attend_block(qb, k, v, blk, plan.q_seq[i0:i1], scale, g, group_size, bits, full, shift,
                                    return_scores)
        outs.append(o)
        if p_q is not None:
            scores = scores.at[blk.slots()].add(p_q)
        if p_f is not None:
            full_scores = full_scores + p_f
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)
    out = out.astype(q.dtype)
    return (out, scores, full_scores) if return_scores else out


def _take(t: QTriple, a: int | None = None, b: int | None = None, idx: mx.array | None = None) -> QTriple:
    if idx is not None:
        return tuple(x[:, :, idx, :] for x in t)
    return tuple(x[:, :, a:b, :] for x in t)


def _keys_scores(qg, k: QTriple, sel, shift: KeyShift | None, group_size: int, bits: int) -> mx.array:
    """Scores of the stacked queries against one run (``sel`` a slice) or gather (``sel`` an index array) of keys."""
    kk = _take(k, idx=sel) if isinstance(sel, mx.array) else _take(k, sel.start, sel.stop)
    if shift is None or not shift.any_in(sel):
        return mx.quantized_matmul(qg, *kk, transpose=True, group_size=group_size, bits=bits)
    x = dequantize_rows(kk, group_size, bits)[0].transpose(1, 0, 2)  # [n, Hkv, D]
    off = shift.offsets[sel]
    x = shift.rotate(x, off).transpose(1, 0, 2)[None]
    return qg @ x.swapaxes(-1, -2)


def _attend_block(q, k: QTriple, v: QTriple, blk: _Block | None, q_seq: mx.array, scale: float, g: int,
                  group_size: int, bits: int, full, shift: KeyShift | None, return_scores: bool):
    """One query block: (output [1, Hq, tb, D] float32, attention per selected slot, per full row)."""
    _, hq, tb, d = q.shape
    hkv = k[0].shape[1]
    quant = dict(group_size=group_size, bits=bits)
    qg = (q.astype(mx.float32) * scale).reshape(1, hkv, g * tb, d)  # rows (g, t): GQA without repeating K
    if blk is None or blk.mode == "none":
        sels, values = [], []
    elif blk.mode == "gather":
        sels, values = [blk.idx], [_take(v, idx=blk.idx)]
    else:  # one view per run, no copy
        sels = [slice(a, b) for a, b in blk.runs]
        values = [_take(v, a, b) for a, b in blk.runs]
    parts = [_keys_scores(qg, k, sel, shift, group_size, bits) for sel in sels]
    if blk is not None and blk.bias is not None:
        parts = [s + bias for s, bias in zip(parts, blk.bias)]
    n_q = sum(s.shape[-1] for s in parts)
    if not parts and full is None:
        return mx.zeros((1, hq, tb, d), mx.float32), None, None
    if parts:
        s = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
        if blk.needs_mask and blk.bias is None:
            s = (s.reshape(1, hkv, g, tb, n_q) + block_mask(blk, q_seq)).reshape(1, hkv, g * tb, n_q)
    if full is not None:
        fk, fv, fseq = full
        sf = qg @ fk.astype(mx.float32).swapaxes(-1, -2)
        vis = fseq[None, :] <= q_seq[:, None]  # [tb, F]
        sf = mx.where(vis, sf.reshape(1, hkv, g, tb, -1), -mx.inf).reshape(1, hkv, g * tb, -1)
        s = mx.concatenate([s, sf], axis=-1) if parts else sf
    # a query that sees no key has an all -inf row: its softmax is NaN, zeroed below
    p = _softmax_rows(s)
    p = mx.where(mx.isnan(p), 0.0, p)
    o = None
    off = 0
    for vv in values:
        m = vv[0].shape[2]
        part = mx.quantized_matmul(p[..., off:off + m], *vv, transpose=False, **quant)
        o = part if o is None else o + part
        off += m
    if full is not None:
        part = p[..., n_q:] @ full[1].astype(mx.float32)
        o = part if o is None else o + part
    p_q = p_f = None
    if return_scores:
        if n_q:
            p_q = p[..., :n_q].sum(axis=(0, 1, 2))
        if full is not None:
            p_f = p[..., n_q:].sum(axis=(0, 1, 2))
    return o.reshape(1, hq, tb, d), p_q, p_f


# --- Metal ------------------------------------------------------------------------------------------------------

ATTENTION_Q_BODY = """
    threadgroup float tg_o[NQ * NS * D];
    threadgroup float tg_ml[2 * NQ * NS];
    tile_skip_attention_q_impl<TQ, TS, D, TILE, NQ, NS, BITS, GROUP>(
        q, k, k_scales, k_biases, v, v_scales, v_biases, slot_seq, q_seq, tiles, dims, scale, o_part, lse_part,
        tg_o, tg_ml, threadgroup_position_in_grid, threadgroups_per_grid, simdgroup_index_in_threadgroup,
        thread_index_in_simdgroup);
"""


def metal_attention_q_spec(q: mx.array, k: QTriple, v: QTriple, plan: TilePlan, scale: float, *, group_size: int,
                           bits: int, **launch) -> dict:
    """``mx.fast.metal_kernel`` arguments of the quantised tile-skip kernel (``metal/tile_skip_attention_q.metal``):
    the fp kernel's launch shape (``metal_attention_spec``, same ``launch`` overrides), packed K/V with their scales
    and biases as inputs. The runtime path and tests/metal_check both build the kernel from this."""
    from .attention import metal_attention_spec, metal_source

    _check(q, k, v, plan, group_size, bits, None)
    spec = metal_attention_spec(q, k[0], v[0], plan, scale, **launch)
    rest = spec["inputs"][3:]  # slot_seq, q_seq, tiles, dims, scale
    spec.update(
        name="omnitide_tile_skip_attention_q",
        input_names=["q", "k", "k_scales", "k_biases", "v", "v_scales", "v_biases", "slot_seq", "q_seq", "tiles",
                     "dims", "scale"],
        source=ATTENTION_Q_BODY,
        header=metal_source("tile_skip_attention_q"),
        inputs=[q, *k, *v, *rest],
        template=[("TQ", q.dtype), ("TS", k[1].dtype), ("D", q.shape[3]), ("TILE", plan.tile),
                  *[(n, val) for n, val in spec["template"] if n in ("NQ", "NS")], ("BITS", bits),
                  ("GROUP", group_size)],
    )
    return spec


def metal_attention_q(q: mx.array, k: QTriple, v: QTriple, plan: TilePlan, scale: float, *, group_size: int,
                      bits: int) -> mx.array:
    from .attention import merge_partials, run_metal_spec

    if plan.n_tiles == 0 or q.shape[2] == 0:
        return mx.zeros(q.shape, q.dtype)
    o_part, lse_part = run_metal_spec(metal_attention_q_spec(q, k, v, plan, scale, group_size=group_size,
                                                             bits=bits))
    return merge_partials(o_part, lse_part).reshape(q.shape).astype(q.dtype)
