"""One layer's K/V buffers of an :class:`~omnitide_mlx.cache.OmniCache` and the step state every layer shares.

:class:`OmniLayerCache` is what a model's attention calls (``cache[i].attend(q, k, v, scale)``): it writes the
step's K/V into the slots the cache allocated (quantised when the cache holds ``kv_bits``) and runs tile-skipping
attention over the step's active tiles. The cache (cache.py) owns allocation, eviction, migration and persistence;
it grows and shrinks these buffers. :func:`stochastic_round` is the unbiased rounding the cache uses when
re-rotated keys return to a half-precision buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from .core.paged_cache import CacheError
from .kernels import TilePlan, tile_skip_attention
from .kernels.quantized import KeyShift, quantize_rows, quantized_tile_skip_attention

if TYPE_CHECKING:
    from .cache import OmniCache


def stochastic_round(y: mx.array, dtype, key: mx.array) -> mx.array:
    """Round float32 ``y`` to ``dtype`` (float16 / bfloat16) up or down with probabilities that make the result
    unbiased: E[result] = y. Neighbours come from the bit pattern (sign-magnitude: +1 moves away from zero)."""
    if dtype == mx.float32:
        return y
    near = y.astype(dtype)
    base = near.astype(mx.float32)
    rest = y - base
    bits = near.view(mx.uint16).astype(mx.int32)
    away = (rest > 0) == (bits < 0x8000)  # the remainder points away from zero
    other = mx.where(away, bits + 1, bits - 1)
    other = mx.where((bits & 0x7FFF) == 0, mx.where(rest < 0, 0x8001, 0x0001), other)  # from +-0: smallest subnormal
    other = other.astype(mx.uint16).view(dtype)
    gap = mx.abs(other.astype(mx.float32) - base)
    p = mx.where(gap > 0, mx.abs(rest) / mx.maximum(gap, 1e-38), 0.0)
    return mx.where(mx.random.uniform(shape=y.shape, key=key) < p, other, near)


def write_index(slots: np.ndarray) -> slice | mx.array:
    """A slice when the slots are consecutive (a cheaper update), else an index array."""
    if slots.size and np.all(np.diff(slots) == 1):
        return slice(int(slots[0]), int(slots[-1]) + 1)
    return mx.array(slots.astype(np.int32))


@dataclass
class CacheStep:
    """What every layer of one forward step shares: the new tokens' slots and the attention plan."""

    slots: np.ndarray
    write: slice | mx.array  # a slice when the slots are consecutive (cheaper update)
    plan: TilePlan
    tokens: int
    written: int = 0
    full_write: slice | mx.array | None = None  # rows of the full-precision buffers this step writes (kv_bits)
    full_seq: mx.array | None = None  # [F] int32 serial of every full-precision row (FREE_SEQ: unused)
    full_slots: mx.array | None = None  # slots of the used full-precision rows (return_scores)
    full_used: mx.array | None = None  # those rows
    shift: KeyShift | None = None  # kv_rerotate="deferred": keys still to be rotated at read time


class OmniLayerCache:
    """One layer's K/V buffers. ``attend`` writes this step's K/V into the step's slots, then runs tile-skipping
    attention over the active tiles."""

    def __init__(self, parent: "OmniCache", index: int):
        self._parent = parent
        self.index = index
        self.keys: mx.array | list[mx.array] | None = None  # quantised (kv_bits): [packed, scales, biases]
        self.values: mx.array | list[mx.array] | None = None
        self.full_keys: mx.array | None = None  # kv_bits with keep_sinks_full: [1, Hkv, F, D] must-keep rows
        self.full_values: mx.array | None = None

    def attend(self, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        """``q`` [1, Hq, T, D], ``k`` / ``v`` [1, Hkv, T, D] (RoPE already applied at the tokens' positions)."""
        p = self._parent
        step = p._step
        if step is None:
            raise CacheError("attend() outside a step: call cache.begin_step(T) first")
        want = (1, p.kv_heads, step.tokens, p.head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise CacheError(f"layer {self.index}: k / v must be {want}, got {tuple(k.shape)} / {tuple(v.shape)}")
        if q.ndim != 4 or q.shape[0] != 1 or q.shape[2] != step.tokens or q.shape[3] != p.head_dim:
            raise CacheError(f"layer {self.index}: q must be [1, Hq, {step.tokens}, {p.head_dim}], got "
                             f"{tuple(q.shape)}")
        if p.capture_queries is not None and self.index in p.capture_queries:
            p.captured[self.index] = q  # recall scores stored units against a question's queries
        if p.kv_bits:
            return self._attend_quantized(q, k, v, scale, step)
        self.keys[:, :, step.write, :] = k.astype(p.dtype)
        self.values[:, :, step.write, :] = v.astype(p.dtype)
        step.written += 1
        if p.collect_scores:
            out, scores = tile_skip_attention(q, self.keys, self.values, scale=scale, plan=step.plan,
                                              return_scores=True)
            p._step_scores = scores if p._step_scores is None else p._step_scores + scores
            return out
        return tile_skip_attention(q, self.keys, self.values, scale=scale, plan=step.plan)

    def _attend_quantized(self, q: mx.array, k: mx.array, v: mx.array, scale: float, step: CacheStep) -> mx.array:
        """Write the step's K/V quantised into its slots (or in full precision into its full rows), then attend
        over the quantised tiles and the full-precision rows in one softmax."""
        p = self._parent
        if step.full_write is not None:
            self.full_keys[:, :, step.full_write, :] = k.astype(p.dtype)
            self.full_values[:, :, step.full_write, :] = v.astype(p.dtype)
        else:
            for bufs, x in ((self.keys, k), (self.values, v)):
                for buf, part in zip(bufs, quantize_rows(x.astype(p.dtype), p.kv_group_size, p.kv_bits)):
                    buf[:, :, step.write, :] = part
        step.written += 1
        full = None if step.full_seq is None else (self.full_keys, self.full_values, step.full_seq)
        quant = dict(group_size=p.kv_group_size, bits=p.kv_bits, full=full, shift=step.shift)
        if not p.collect_scores:
            return quantized_tile_skip_attention(q, self.keys, self.values, step.plan, scale, **quant)
        out, scores, full_scores = quantized_tile_skip_attention(q, self.keys, self.values, step.plan, scale,
                                                                 return_scores=True, **quant)
        if full_scores is not None and step.full_slots is not None:
            scores = scores.at[step.full_slots].add(full_scores[step.full_used])
        p._step_scores = scores if p._step_scores is None else p._step_scores + scores
        return out

    @property
    def state(self) -> tuple:
        return self.keys, self.values

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        parts = [*self.keys, *self.values] if isinstance(self.keys, list) else [self.keys, self.values]
        if self.full_keys is not None:
            parts += [self.full_keys, self.full_values]
        return sum(a.nbytes for a in parts)

    def quant_zeros(self, slots: int) -> list[mx.array]:
        p = self._parent
        return [mx.zeros((1, p.kv_heads, slots, p.head_dim * p.kv_bits // 32), mx.uint32),
                mx.zeros((1, p.kv_heads, slots, p.head_dim // p.kv_group_size), p.dtype),
                mx.zeros((1, p.kv_heads, slots, p.head_dim // p.kv_group_size), p.dtype)]

    def grow(self, capacity: int) -> None:
        p = self._parent
        if p.kv_bits:
            if self.keys is None:
                self.keys, self.values = self.quant_zeros(capacity), self.quant_zeros(capacity)
                return
            extra = capacity - self.keys[0].shape[2]
            if extra > 0:
                self.keys = [mx.concatenate([a, z], axis=2) for a, z in zip(self.keys, self.quant_zeros(extra))]
                self.values = [mx.concatenate([a, z], axis=2) for a, z in zip(self.values, self.quant_zeros(extra))]
            return
        if self.keys is None:
            shape = (1, p.kv_heads, capacity, p.head_dim)
            self.keys, self.values = mx.zeros(shape, p.dtype), mx.zeros(shape, p.dtype)
            return
        extra = capacity - self.keys.shape[2]
        if extra > 0:
            pad = mx.zeros((1, p.kv_heads, extra, p.head_dim), p.dtype)
            self.keys = mx.concatenate([self.keys, pad], axis=2)
            self.values = mx.concatenate([self.values, pad], axis=2)
