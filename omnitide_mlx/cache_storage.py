"""MlxKVStorage: the tensor half of an :class:`~omnitide_mlx.cache.OmniCache` (core/kv_storage.py: ``KVStorage``).

It grows, shrinks, re-rotates, moves, saves and loads the rows of every layer's buffers (cache_layer.py:
:class:`OmniLayerCache`, float or quantised), and keeps the per-slot state that lives beside them: the H2O scores,
the full-precision rows of the must-keep class (``keep_sinks_full``) and, with ``kv_rerotate="deferred"``, the
shift each quantised key is still to be rotated by at read time. The cache (core/paged_cache.py) decides which
slots; this module only does the work, in MLX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from .cache_layer import stochastic_round
from .core.paged_cache import CacheError, check_saved_buffers
from .core.shapes import kv_bytes_per_token
from .kernels import page_compact
from .kernels.quantized import dequantize_rows, quantize_rows

if TYPE_CHECKING:
    from .cache import OmniCache

QUANT_PARTS = ("", ".scales", ".biases")  # saved names of a quantised buffer's packed rows, scales, biases


def rotate_rows(rope, x: mx.array, offsets: np.ndarray) -> mx.array:
    """Rotate ``x`` ``[L, Hkv, n, D]`` (float32) by ``offsets`` ``[n]`` positions per token, in float32."""
    n_layers, heads, n, d = x.shape
    flat = x.transpose(2, 0, 1, 3).reshape(n, n_layers * heads, d)
    y = rope.rotate_tokens(flat, mx.array(np.asarray(offsets, dtype=np.int32)))
    return y.reshape(n, n_layers, heads, d).transpose(1, 2, 0, 3)


class MlxKVStorage:
    """The buffers of one OmniCache (its ``layers``) and their per-slot state, as numpy arrays over the slots:
    ``scores`` (accumulated attention, float32), ``full_row`` (each slot's full-precision row, -1: none),
    ``full_slot`` (each full-precision row's slot, -1: unused) and ``shift`` (deferred re-rotation; empty unless
    the cache holds quantised keys re-rotated at read time)."""

    def __init__(self, cache: "OmniCache"):
        self.cache = cache
        self.scores = np.zeros(0, dtype=np.float32)
        self.full_row = np.zeros(0, dtype=np.int64)
        self.full_slot = np.zeros(0, dtype=np.int64)
        self.shift = np.zeros(0, dtype=np.int64)

    @property
    def _deferred(self) -> bool:
        return bool(self.cache.kv_bits) and self.cache.kv_rerotate == "deferred"

    # --- size ---------------------------------------------------------------------------------------------------
    @property
    def dtype_bytes(self) -> int:
        return self.cache.dtype.size

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token across all layers; quantised: packed values plus scales and biases."""
        c = self.cache
        return kv_bytes_per_token(c.num_layers, c.kv_heads, c.head_dim, self.dtype_bytes, c.kv_bits, c.kv_group_size)

    def grow(self, old: int, new: int) -> None:
        for layer in self.cache.layers:
            layer.grow(new)
        extra = new - old
        self.scores = np.concatenate([self.scores, np.zeros(extra, dtype=np.float32)])
        self.full_row = np.concatenate([self.full_row, np.full(extra, -1, dtype=np.int64)])
        if self._deferred:
            self.shift = np.concatenate([self.shift, np.zeros(extra, dtype=np.int64)])

    def shrink(self, capacity: int) -> None:
        for layer in self.cache.layers:
            if layer.keys is None:
                continue
            if isinstance(layer.keys, list):  # quantised: packed rows, scales and biases shrink together
                layer.keys = [mx.contiguous(a[:, :, :capacity]) for a in layer.keys]
                layer.values = [mx.contiguous(a[:, :, :capacity]) for a in layer.values]
            else:
                layer.keys = mx.contiguous(layer.keys[:, :, :capacity])  # a copy: the old buffers are freed
                layer.values = mx.contiguous(layer.values[:, :, :capacity])
            mx.eval(layer.keys, layer.values)
        self.scores = self.scores[:capacity].copy()
        # per-slot maps (the slots given back are free: no full-precision row, no pending shift)
        self.full_row = self.full_row[:capacity].copy()
        if self.shift.size:
            self.shift = self.shift[:capacity].copy()

    # --- full-precision rows of the must-keep class (kv_bits with keep_sinks_full) -----------------------------
    def take_full_rows(self, slots: np.ndarray) -> np.ndarray:
        """Assign a full-precision row to each slot, growing the full buffers by whole pages when needed."""
        c = self.cache
        free = np.flatnonzero(self.full_slot < 0)
        if free.size < slots.size:
            old = self.full_slot.shape[0]
            page = c.table.page_size
            new = -(-(old + slots.size - free.size) // page) * page
            self.full_slot = np.concatenate([self.full_slot, np.full(new - old, -1, dtype=np.int64)])
            shape = (1, c.kv_heads, new - old, c.head_dim)
            for layer in c.layers:
                if layer.full_keys is None:
                    layer.full_keys, layer.full_values = mx.zeros(shape, c.dtype), mx.zeros(shape, c.dtype)
                else:
                    layer.full_keys = mx.concatenate([layer.full_keys, mx.zeros(shape, c.dtype)], axis=2)
                    layer.full_values = mx.concatenate([layer.full_values, mx.zeros(shape, c.dtype)], axis=2)
            free = np.flatnonzero(self.full_slot < 0)
        rows = free[: slots.size]
        self.full_slot[rows] = slots
        self.full_row[slots] = rows
        return rows

    def release_full_rows(self, slots: np.ndarray) -> None:
        if not self.cache.keep_sinks_full or slots.size == 0:
            return
        rows = self.full_row[slots]
        self.full_slot[rows[rows >= 0]] = -1
        self.full_row[slots] = -1

    # --- eviction -----------------------------------------------------------------------------------------------
    def rerotate(self, slots: np.ndarray, shifts: np.ndarray, seeds: list[int]) -> None:
        """Rotate the keys at ``slots`` by ``-shifts`` (one rotation per key, float32, one rounding back)."""
        if self.cache.kv_bits:
            self._rerotate_quantized(slots, shifts, seeds)
            return
        idx = mx.array(slots.astype(np.int32))
        offsets = mx.array((-shifts).astype(np.int32))
        for layer in self.cache.layers:
            layer.keys = self._rerotate_float(layer.keys, idx, offsets, seeds[layer.index])

    def _rerotate_float(self, buf: mx.array, idx: mx.array, offsets: mx.array, seed: int) -> mx.array:
        c = self.cache
        rows = buf[:, :, idx, :][0].transpose(1, 0, 2)  # [n, Hkv, D]
        rot = c.rope.rotate_tokens(rows, offsets)
        if c.rounding == "stochastic":
            rot = stochastic_round(rot, c.dtype, mx.random.key(seed))
        rot = rot.astype(c.dtype).transpose(1, 0, 2)[None]
        mx.eval(rot)  # evaluated before the scatter: the buffer is then updated in place, not copied
        buf[:, :, idx, :] = rot
        mx.eval(buf)
        return buf

    def _rerotate_quantized(self, slots: np.ndarray, shifts: np.ndarray, seeds: list[int]) -> None:
        """Quantised keys: dequantise to float32, rotate once, quantise once (scales and biases in the cache's
        dtype). Full-precision must-keep rows take the float path."""
        c = self.cache
        rows = self.full_row[slots] if c.keep_sinks_full else np.full(slots.size, -1)
        quant, full = rows < 0, rows >= 0
        gs, bits = c.kv_group_size, c.kv_bits
        if c.kv_rerotate == "deferred":  # rotated at read time, from the values quantised once when written
            np.add.at(self.shift, slots[quant], shifts[quant])
            quant = np.zeros_like(quant)
        for layer in c.layers:
            if quant.any():
                idx = mx.array(slots[quant].astype(np.int32))
                offsets = mx.array((-shifts[quant]).astype(np.int32))
                x = dequantize_rows([a[:, :, idx, :] for a in layer.keys], gs, bits)[0].transpose(1, 0, 2)
                rot = c.rope.rotate_tokens(x, offsets).transpose(1, 0, 2)[None]
                parts = quantize_rows(rot, gs, bits, c.dtype)
                mx.eval(parts)  # evaluated before the scatter: the buffers are updated in place
                for buf, part in zip(layer.keys, parts):
                    buf[:, :, idx, :] = part
                mx.eval(layer.keys)
            if full.any():
                layer.full_keys = self._rerotate_float(layer.full_keys, mx.array(rows[full].astype(np.int32)),
                                                       mx.array((-shifts[full]).astype(np.int32)),
                                                       seeds[layer.index])

    # --- recall (omnitide_mlx/recall.py): an evicted unit's rows out, a recalled unit's rows back in -----------
    def read_rows(self, slots: np.ndarray) -> tuple[mx.array, mx.array]:
        """Every layer's K and V at ``slots``, float32 ``[L, Hkv, n, D]``; keys as rotated at their tokens' current
        positions (a pending deferred shift applied)."""
        c = self.cache
        if c.keep_sinks_full and (self.full_row[slots] >= 0).any():
            raise CacheError("full-precision rows belong to the system prefix, which is never evicted")
        idx = mx.array(slots.astype(np.int32))
        ks, vs = [], []
        for layer in c.layers:
            if c.kv_bits:
                ks.append(dequantize_rows([a[:, :, idx, :] for a in layer.keys], c.kv_group_size, c.kv_bits)[0])
                vs.append(dequantize_rows([a[:, :, idx, :] for a in layer.values], c.kv_group_size, c.kv_bits)[0])
            else:
                ks.append(layer.keys[:, :, idx, :][0].astype(mx.float32))
                vs.append(layer.values[:, :, idx, :][0].astype(mx.float32))
        keys, values = mx.stack(ks), mx.stack(vs)
        if self.shift.size and self.shift[slots].any():
            keys = rotate_rows(c.rope, keys, -self.shift[slots])
        return keys, values

    def write_rows(self, slots: np.ndarray, keys: mx.array, values: mx.array) -> None:
        """Write float ``keys`` / ``values`` ``[L, Hkv, n, D]`` (keys rotated at the tokens' positions) into
        ``slots`` of every layer, cast or quantised as the cache holds them; the slots have no pending shift and no
        score."""
        c = self.cache
        idx = mx.array(slots.astype(np.int32))
        for layer in c.layers:
            k, v = keys[layer.index][None].astype(c.dtype), values[layer.index][None].astype(c.dtype)
            if c.kv_bits:
                for bufs, x in ((layer.keys, k), (layer.values, v)):
                    for buf, part in zip(bufs, quantize_rows(x, c.kv_group_size, c.kv_bits)):
                        buf[:, :, idx, :] = part
            else:
                layer.keys[:, :, idx, :] = k
                layer.values[:, :, idx, :] = v
            mx.eval(layer.keys, layer.values)
        if self.shift.size:
            self.shift[slots] = 0
        if self.scores.size:
            self.scores[slots] = 0.0

    def release(self, slots: np.ndarray) -> None:
        if self.cache.collect_scores:
            self.scores[slots] = 0.0
        self.release_full_rows(slots)

    # --- migration ----------------------------------------------------------------------------------------------
    def move_rows(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Per layer: gather the moved rows into scratch, evaluate them, scatter them into the cache's own buffers
        in place (evaluating the gather first is what keeps MLX from copying the whole buffer)."""
        c = self.cache
        dst_idx = mx.array(dst.astype(np.int32))
        for layer in c.layers:
            # quantised: packed rows, scales and biases each move like a float buffer
            pairs = zip(layer.keys, layer.values) if c.kv_bits else [(layer.keys, layer.values)]
            for keys, values in pairs:
                k_rows, v_rows = page_compact(keys, values, src)
                mx.eval(k_rows, v_rows)
                keys[:, :, dst_idx, :] = k_rows
                values[:, :, dst_idx, :] = v_rows
                del k_rows, v_rows
                mx.eval(keys, values)
        if self.shift.size:
            moved = self.shift[src].copy()
            self.shift[src] = 0
            self.shift[dst] = moved
        if c.keep_sinks_full:  # full-precision rows stay where they are; they now stand for the new slots
            rows = self.full_row[src].copy()
            self.full_row[src] = -1
            self.full_row[dst] = rows
            self.full_slot[rows[rows >= 0]] = dst[rows >= 0]
        if c.collect_scores:
            moved = self.scores[src].copy()
            self.scores[src] = 0.0
            self.scores[dst] = moved

    def scores_at(self, slots: np.ndarray) -> np.ndarray:
        return self.scores[slots].copy()

    # --- persistence (the saved names: core/paged_cache.py) -----------------------------------------------------
    def to_array(self, a: np.ndarray) -> mx.array:
        return mx.array(a)

    def to_numpy(self, a: mx.array) -> np.ndarray:
        return np.array(a)

    def scores_state(self) -> mx.array:
        return mx.array(self.scores)

    def buffer_arrays(self) -> dict:
        arrays = {}
        for layer in self.cache.layers:
            if layer.keys is None:
                continue
            if not self.cache.kv_bits:
                arrays[f"layers.{layer.index}.keys"] = layer.keys
                arrays[f"layers.{layer.index}.values"] = layer.values
                continue
            for kind in ("keys", "values"):
                for suffix, a in zip(QUANT_PARTS, getattr(layer, kind)):
                    arrays[f"layers.{layer.index}.{kind}{suffix}"] = a
            if layer.full_keys is not None:
                arrays[f"layers.{layer.index}.full_keys"] = layer.full_keys
                arrays[f"layers.{layer.index}.full_values"] = layer.full_values
        if self.full_slot.size:
            arrays["full_slots"] = mx.array(self.full_slot.astype(np.int32))
        if self.shift.size:
            arrays["key_shifts"] = mx.array(self.shift.astype(np.int32))
        return arrays

    def load_buffers(self, arrays: dict[str, mx.array], capacity: int) -> None:
        c = self.cache
        if c.kv_bits:
            self._load_quantized(arrays, capacity)
            return
        for layer in c.layers:
            layer.keys = arrays[f"layers.{layer.index}.keys"]
            layer.values = arrays[f"layers.{layer.index}.values"]
            check_saved_buffers(layer.index, layer.keys, layer.values, (1, c.kv_heads, capacity, c.head_dim),
                                c.dtype)

    def _load_quantized(self, arrays: dict[str, mx.array], capacity: int) -> None:
        c = self.cache
        want = c.layers[0].quant_zeros(capacity)
        for layer in c.layers:
            for kind in ("keys", "values"):
                parts = [arrays[f"layers.{layer.index}.{kind}{suffix}"] for suffix in QUANT_PARTS]
                for part, ref in zip(parts, want):
                    if tuple(part.shape) != tuple(ref.shape) or part.dtype != ref.dtype:
                        raise CacheError(f"layer {layer.index}: saved quantised {kind} are {part.dtype} "
                                         f"{tuple(part.shape)}, expected {ref.dtype} {tuple(ref.shape)}")
                setattr(layer, kind, parts)
        self.full_row = np.full(capacity, -1, dtype=np.int64)
        if c.kv_rerotate == "deferred":
            self.shift = np.array(arrays["key_shifts"], dtype=np.int64)
            if self.shift.shape != (capacity,):
                raise CacheError(f"saved key shifts cover {self.shift.shape[0]} slots, the buffers {capacity}")
        if c.keep_sinks_full and "full_slots" in arrays:
            self.full_slot = np.array(arrays["full_slots"], dtype=np.int64)
            n = self.full_slot.shape[0]
            used = np.flatnonzero(self.full_slot >= 0)
            if used.size and self.full_slot[used].max() >= capacity:
                raise CacheError(f"saved full-precision rows point past the {capacity} slots")
            self.full_row[self.full_slot[used]] = used
            for layer in c.layers:
                layer.full_keys = arrays[f"layers.{layer.index}.full_keys"]
                layer.full_values = arrays[f"layers.{layer.index}.full_values"]
                want_f = (1, c.kv_heads, n, c.head_dim)
                for a in (layer.full_keys, layer.full_values):
                    if tuple(a.shape) != want_f or a.dtype != c.dtype:
                        raise CacheError(f"layer {layer.index}: saved full-precision rows are {a.dtype} "
                                         f"{tuple(a.shape)}, expected {c.dtype} {want_f}")

    def load_scores(self, arrays: dict[str, mx.array], capacity: int) -> None:
        self.scores = (np.array(arrays["scores"], dtype=np.float32) if self.cache.collect_scores
                       else np.zeros(capacity, dtype=np.float32))
