"""OmniCache: the KV cache of a streaming session, in tile-aligned pages (OmniPage) with unit-aware eviction.

Every layer (cache_layer.py: :class:`OmniLayerCache`) keeps one K and one V buffer
``[1, kv_heads, capacity, head_dim]``; row ``i`` of every buffer is slot ``i`` of one shared
:class:`~omnitide_mlx.core.page.PageTable`, which decides where each new token goes, which pages are active, and
how entries move. Models call the cache like an mlx-lm cache, except that attention goes
through it so the kernel sees the page table (docs/design.md)::

    cache.set_owner(uid, AllocClass.RECENT_CONTEXT)   # who the next tokens belong to
    cache.begin_step(T)                                # T slots allocated, the step's active tiles computed
    out = cache[i].attend(q, k, v, scale)              # per layer: write k, v, then tile-skip attention
    cache.end_step()

After the model, the session trims: ``cache.evict(plan, history)`` frees the deleted tokens' slots and re-rotates
every kept key once by its shift, in float32 (never un-rotate then re-rotate in half precision), rounding back to a
half-precision cache stochastically: with round-to-nearest, a small shift's change of a low-frequency pair is below
half an ulp and is lost every time, so a key shifted often drifts linearly (measured: tests/cache/test_cache_drift.py);
unbiased rounding turns that into a random walk that grows like the square root of the number of shifts;
``cache.migrate(migration_plan)`` moves entries with a gather into scratch, an ``mx.eval``, and an in-place scatter.

Keys are stored rotated at the positions their tokens had when written, shifted by every eviction since. The cache
stores no positions: the History does. A cache's tokens in ``seq`` order are the history's tokens in logical order.
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np

from .cache_layer import CacheStep, OmniLayerCache, stochastic_round, write_index
from .core.page import AllocClass
from .core.paged_cache import CACHE_FORMAT, CacheError, PagedKVCache
from .kernels import DECODE_TILE, PREFILL_TILE, AttentionError, page_compact, plan_tiles
from .kernels.quantized import (
    FREE_SEQ,
    KeyShift,
    check_quant,
    dequantize_rows,
    quantize_rows,
)
from .rope import RopeSpec

__all__ = ["CACHE_FORMAT", "DECODE_MAX_TOKENS", "CacheError", "OmniCache", "OmniLayerCache", "stochastic_round"]

KV_REROTATE = ("deferred", "requantize")
DECODE_MAX_TOKENS = 19  # steps of fewer than 20 tokens take the decode path (32-slot subblocks), as llama.cpp does


class OmniCache(PagedKVCache):
    """Per-layer paged K/V buffers with one shared page table (see the module docstring for the protocol); the
    bookkeeping is :class:`~omnitide_mlx.core.paged_cache.PagedKVCache`'s, shared with the torch cache.

    ``placement``: ``"class_aware"`` (OmniPage: new tokens never share a page with another class) or
    ``"first_fit"`` (a plain cache: new tokens fill any hole). ``grow_pages``: buffers grow by at least this many
    pages at a time, so a growing cache copies its buffers rarely (mlx-lm grows by 256 slots). With
    ``collect_scores`` every attention also accumulates the attention each slot receives (for H2O). ``rounding``:
    how re-rotated keys return to a half-precision cache ("stochastic", seeded by ``seed`` and the eviction count,
    or "nearest" for comparison).

    ``kv_bits`` (8 or 4; None: float K/V) holds K and V quantised per slot row along the head dimension (MLX affine
    quantisation in groups of ``kv_group_size``: packed values, scales and biases in the same slots, pages and
    subblocks); attention runs on the packed rows (kernels/quantized.py). ``keep_sinks_full`` keeps the must-keep
    class (the system prefix, which holds the stream's first tokens, the attention sinks) in full precision, in
    compact per-layer buffers of their own. ``kv_rerotate``: how eviction moves quantised kept keys. "deferred"
    (default): each slot accumulates its shift and attention rotates the dequantised key at read time, so a key is
    quantised once, when written; "requantize": dequantise to float32, rotate once, quantise once per eviction
    (the quantisation noise then accumulates: measured in tests/cache/test_cache_drift.py).
    """

    DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
    STATE_NAME = "OmniCache"
    QUANTISED_KV = True

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, rope: RopeSpec | None = None,
                 dtype=mx.float16, *, page_size: int = PREFILL_TILE, subblock_size: int = DECODE_TILE,
                 placement: str = "class_aware", grow_pages: int = 4, collect_scores: bool = False,
                 rounding: str = "stochastic", seed: int = 0, kv_bits: int | None = None, kv_group_size: int = 64,
                 keep_sinks_full: bool = False, kv_rerotate: str = "deferred"):
        super().__init__(num_layers, kv_heads, head_dim, rope, dtype, page_size=page_size,
                         subblock_size=subblock_size, placement=placement, grow_pages=grow_pages,
                         collect_scores=collect_scores, rounding=rounding, seed=seed)
        if kv_bits is not None:
            try:
                check_quant(kv_bits, kv_group_size, self.head_dim)
            except AttentionError as e:
                raise CacheError(str(e)) from None
        elif keep_sinks_full:
            raise CacheError("keep_sinks_full keeps the sinks in full precision in a quantised cache: set kv_bits")
        if kv_rerotate not in KV_REROTATE:
            raise CacheError(f"kv_rerotate must be 'deferred' or 'requantize', got {kv_rerotate!r}")
        self.kv_rerotate = kv_rerotate
        self._shift = np.zeros(0, dtype=np.int64)  # kv_bits, deferred: per slot, positions its key is still to move
        self.kv_bits = None if kv_bits is None else int(kv_bits)
        self.kv_group_size = int(kv_group_size)
        self.keep_sinks_full = bool(keep_sinks_full)
        self._full_slot = np.zeros(0, dtype=np.int64)  # keep_sinks_full: slot held by each full row (-1 unused)
        self._full_row = np.zeros(0, dtype=np.int64)  # per slot: its full row (-1: quantised or free)
        self.layers = [OmniLayerCache(self, i) for i in range(self.num_layers)]
        self._step: CacheStep | None = None
        self._scores = np.zeros(0, dtype=np.float32)  # accumulated attention per slot (collect_scores)
        self._step_scores: mx.array | None = None

    @classmethod
    def for_spec(cls, spec, dtype=mx.float16, **kw) -> "OmniCache":
        """A cache for a model's ``KVSpec`` (models/base.py)."""
        return cls(spec.num_layers, spec.kv_heads, spec.head_dim, spec.rope, dtype, **kw)

    # --- mlx-lm style access ----------------------------------------------------------------------------------
    def __getitem__(self, i: int) -> OmniLayerCache:
        return self.layers[i]

    def __len__(self) -> int:
        return self.num_layers

    def __iter__(self):
        return iter(self.layers)

    # --- one forward step (set_owner: PagedKVCache) -------------------------------------------------------------
    def begin_step(self, tokens: int) -> np.ndarray:
        """Allocate ``tokens`` slots for the owner and plan this step's attention; returns the slots."""
        if self._step is not None:
            raise CacheError("begin_step() while a step is open: call end_step() first")
        if self._owner is None:
            raise CacheError("begin_step() before set_owner(uid, alloc_class)")
        slots = self._allocate_step(tokens)
        decode = tokens <= DECODE_MAX_TOKENS
        tiles = self.table.active_subblocks() if decode else self.table.active_pages()
        tile = self.table.subblock_size if decode else self.table.page_size
        slot_seq = self._slot_seq()
        full_write = None
        if self.keep_sinks_full:
            if self._owner[1] == AllocClass.MUST_KEEP:
                full_write = write_index(self._take_full_rows(slots))
            slot_seq = np.where(self._full_row[: slot_seq.shape[0]] >= 0, -1, slot_seq)  # not in the quantised rows
        plan = plan_tiles(slot_seq, self.table.seq[slots], tiles, tile)
        self._step = CacheStep(slots=slots, write=write_index(slots), plan=plan, tokens=int(tokens),
                           full_write=full_write)
        if self._shift.size:
            self._shift[slots] = 0  # new keys are written at their positions
            if self._shift.any():
                self._step.shift = KeyShift(self._shift[: self._capacity].copy(), self.rope.rotate_tokens)
        if self.keep_sinks_full and (self._full_slot >= 0).any():
            used = np.flatnonzero(self._full_slot >= 0)
            fseq = np.full(self._full_slot.shape[0], FREE_SEQ, dtype=np.int64)
            fseq[used] = self.table.seq[self._full_slot[used]]
            self._step.full_seq = mx.array(fseq.astype(np.int32))
            self._step.full_used = mx.array(used.astype(np.int32))
            self._step.full_slots = mx.array(self._full_slot[used].astype(np.int32))
        self._step_scores = None
        return slots

    def end_step(self) -> None:
        """Close the step. Every layer must have attended once; otherwise the step is aborted and this raises."""
        step = self._step
        if step is None:
            raise CacheError("end_step() without begin_step()")
        if step.written != self.num_layers:
            self.abort_step()
            raise CacheError(f"{step.written} of {self.num_layers} layers attended in this step: the step's slots "
                             "were given back")
        self._step = None
        if self.collect_scores and self._step_scores is not None:
            self._scores[: self._capacity] += np.array(self._step_scores, dtype=np.float32)
            self._step_scores = None

    def abort_step(self) -> None:
        """Give back the open step's slots (a forward that failed half way); the cache is as before the step."""
        step = self._step
        if step is None:
            raise CacheError("abort_step() without begin_step()")
        self._step = None
        self._step_scores = None
        self._release_full_rows(step.slots)
        self.table.free(step.slots)

    # --- full-precision rows of the must-keep class (kv_bits with keep_sinks_full) -----------------------------
    def _take_full_rows(self, slots: np.ndarray) -> np.ndarray:
        """Assign a full-precision row to each slot, growing the full buffers by whole pages when needed."""
        free = np.flatnonzero(self._full_slot < 0)
        if free.size < slots.size:
            old = self._full_slot.shape[0]
            page = self.table.page_size
            new = -(-(old + slots.size - free.size) // page) * page
            self._full_slot = np.concatenate([self._full_slot, np.full(new - old, -1, dtype=np.int64)])
            shape = (1, self.kv_heads, new - old, self.head_dim)
            for layer in self.layers:
                if layer.full_keys is None:
                    layer.full_keys, layer.full_values = mx.zeros(shape, self.dtype), mx.zeros(shape, self.dtype)
                else:
                    layer.full_keys = mx.concatenate([layer.full_keys, mx.zeros(shape, self.dtype)], axis=2)
                    layer.full_values = mx.concatenate([layer.full_values, mx.zeros(shape, self.dtype)], axis=2)
            free = np.flatnonzero(self._full_slot < 0)
        rows = free[: slots.size]
        self._full_slot[rows] = slots
        self._full_row[slots] = rows
        return rows

    def _release_full_rows(self, slots: np.ndarray) -> None:
        if not self.keep_sinks_full or slots.size == 0:
            return
        rows = self._full_row[slots]
        self._full_slot[rows[rows >= 0]] = -1
        self._full_row[slots] = -1

    def _grow_buffers(self, capacity: int) -> None:
        for layer in self.layers:
            layer._grow(capacity)
        self._scores = np.concatenate([self._scores, np.zeros(capacity - self._capacity, dtype=np.float32)])
        self._full_row = np.concatenate([self._full_row, np.full(capacity - self._capacity, -1, dtype=np.int64)])
        if self.kv_bits and self.kv_rerotate == "deferred":
            self._shift = np.concatenate([self._shift, np.zeros(capacity - self._capacity, dtype=np.int64)])

    def _shrink_buffers(self, capacity: int) -> None:
        for layer in self.layers:
            if layer.keys is None:
                continue
            if isinstance(layer.keys, list):  # quantised: packed rows, scales and biases shrink together
                layer.keys = [mx.contiguous(a[:, :, :capacity]) for a in layer.keys]
                layer.values = [mx.contiguous(a[:, :, :capacity]) for a in layer.values]
            else:
                layer.keys = mx.contiguous(layer.keys[:, :, :capacity])  # a copy: the old buffers are freed
                layer.values = mx.contiguous(layer.values[:, :, :capacity])
            mx.eval(layer.keys, layer.values)
        self._scores = self._scores[:capacity].copy()
        # per-slot maps (the slots given back are free: no full-precision row, no pending shift)
        self._full_row = self._full_row[:capacity].copy()
        if self._shift.size:
            self._shift = self._shift[:capacity].copy()

    # --- eviction (evict: PagedKVCache) -------------------------------------------------------------------------
    def _rerotate(self, slots: np.ndarray, shifts: np.ndarray) -> None:
        """Rotate the keys at ``slots`` by ``-shifts`` (one rotation per key, float32, one rounding back)."""
        if self.kv_bits:
            self._rerotate_quantized(slots, shifts)
            return
        idx = mx.array(slots.astype(np.int32))
        offsets = mx.array((-shifts).astype(np.int32))
        for layer in self.layers:
            layer.keys = self._rerotate_float(layer.keys, idx, offsets, layer.index)

    def _rerotate_float(self, buf: mx.array, idx: mx.array, offsets: mx.array, layer: int) -> mx.array:
        rows = buf[:, :, idx, :][0].transpose(1, 0, 2)  # [n, Hkv, D]
        rot = self.rope.rotate_tokens(rows, offsets)
        if self.rounding == "stochastic":
            rot = stochastic_round(rot, self.dtype, mx.random.key(self._rounding_seed(layer)))
        rot = rot.astype(self.dtype).transpose(1, 0, 2)[None]
        mx.eval(rot)  # evaluated before the scatter: the buffer is then updated in place, not copied
        buf[:, :, idx, :] = rot
        mx.eval(buf)
        return buf

    def _rerotate_quantized(self, slots: np.ndarray, shifts: np.ndarray) -> None:
        """Quantised keys: dequantise to float32, rotate once, quantise once (scales and biases in the cache's
        dtype). Full-precision must-keep rows take the float path."""
        rows = self._full_row[slots] if self.keep_sinks_full else np.full(slots.size, -1)
        quant, full = rows < 0, rows >= 0
        gs, bits = self.kv_group_size, self.kv_bits
        if self.kv_rerotate == "deferred":  # rotated at read time, from the values quantised once when written
            np.add.at(self._shift, slots[quant], shifts[quant])
            quant = np.zeros_like(quant)
        for layer in self.layers:
            if quant.any():
                idx = mx.array(slots[quant].astype(np.int32))
                offsets = mx.array((-shifts[quant]).astype(np.int32))
                x = dequantize_rows([a[:, :, idx, :] for a in layer.keys], gs, bits)[0].transpose(1, 0, 2)
                rot = self.rope.rotate_tokens(x, offsets).transpose(1, 0, 2)[None]
                parts = quantize_rows(rot, gs, bits, self.dtype)
                mx.eval(parts)  # evaluated before the scatter: the buffers are updated in place
                for buf, part in zip(layer.keys, parts):
                    buf[:, :, idx, :] = part
                mx.eval(layer.keys)
            if full.any():
                layer.full_keys = self._rerotate_float(layer.full_keys, mx.array(rows[full].astype(np.int32)),
                                                       mx.array((-shifts[full]).astype(np.int32)), layer.index)

    def evict(self, plan, history=None) -> np.ndarray:
        freed = super().evict(plan, history)
        self._release_full_rows(freed)
        return freed

    def _zero_scores(self, slots: np.ndarray) -> None:
        self._scores[slots] = 0.0

    # --- migration (migrate: PagedKVCache) --------------------------------------------------------------------
    def _move_rows(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Per layer: gather the moved rows into scratch, evaluate them, scatter them into the cache's own buffers
        in place (evaluating the gather first is what keeps MLX from copying the whole buffer)."""
        dst_idx = mx.array(dst.astype(np.int32))
        for layer in self.layers:
            # quantised: packed rows, scales and biases each move like a float buffer
            pairs = zip(layer.keys, layer.values) if self.kv_bits else [(layer.keys, layer.values)]
            for keys, values in pairs:
                k_rows, v_rows = page_compact(keys, values, src)
                mx.eval(k_rows, v_rows)
                keys[:, :, dst_idx, :] = k_rows
                values[:, :, dst_idx, :] = v_rows
                del k_rows, v_rows
                mx.eval(keys, values)
        if self._shift.size:
            moved = self._shift[src].copy()
            self._shift[src] = 0
            self._shift[dst] = moved
        if self.keep_sinks_full:  # full-precision rows stay where they are; they now stand for the new slots
            rows = self._full_row[src].copy()
            self._full_row[src] = -1
            self._full_row[dst] = rows
            self._full_slot[rows[rows >= 0]] = dst[rows >= 0]
        if self.collect_scores:
            moved = self._scores[src].copy()
            self._scores[src] = 0.0
            self._scores[dst] = moved

    def _scores_at(self, slots: np.ndarray) -> np.ndarray:
        return self._scores[slots].copy()

    # --- persistence (safetensors + JSON, like mlx-lm prompt caches; state / meta_state: PagedKVCache) ---------
    @property
    def dtype_bytes(self) -> int:
        return self.dtype.size

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token across all layers; quantised: packed values plus scales and biases."""
        if not self.kv_bits:
            return super().bytes_per_token
        row = self.head_dim * self.kv_bits // 8 + 2 * (self.head_dim // self.kv_group_size) * self.dtype_bytes
        return 2 * self.num_layers * self.kv_heads * row

    QUANT_PARTS = ("", ".scales", ".biases")  # saved names of a quantised buffer's packed rows, scales, biases

    def _buffer_arrays(self) -> dict:
        if not self.kv_bits:
            return super()._buffer_arrays()
        arrays = {}
        for layer in self.layers:
            if layer.keys is None:
                continue
            for kind in ("keys", "values"):
                for suffix, a in zip(self.QUANT_PARTS, getattr(layer, kind)):
                    arrays[f"layers.{layer.index}.{kind}{suffix}"] = a
            if layer.full_keys is not None:
                arrays[f"layers.{layer.index}.full_keys"] = layer.full_keys
                arrays[f"layers.{layer.index}.full_values"] = layer.full_values
        if self._full_slot.size:
            arrays["full_slots"] = mx.array(self._full_slot.astype(np.int32))
        if self._shift.size:
            arrays["key_shifts"] = mx.array(self._shift.astype(np.int32))
        return arrays

    @property
    def meta_state(self) -> dict:
        meta = super().meta_state
        if self.kv_bits:
            meta["kv_quant"] = {"bits": self.kv_bits, "group_size": self.kv_group_size,
                                "keep_sinks_full": self.keep_sinks_full, "rerotate": self.kv_rerotate}
        return meta

    def _array(self, a: np.ndarray) -> mx.array:
        return mx.array(a)

    def _to_numpy(self, a: mx.array) -> np.ndarray:
        return np.array(a)

    def _scores_state(self) -> mx.array:
        return mx.array(self._scores)

    @classmethod
    def _from_meta(cls, meta: dict) -> "OmniCache":
        tm = meta["table"]
        return cls(meta["num_layers"], meta["kv_heads"], meta["head_dim"],
                   RopeSpec.from_json(meta["rope"]) if meta["rope"] else None, cls.DTYPES[meta["dtype"]],
                   page_size=tm["page_size"], subblock_size=tm["subblock_size"], placement=tm["placement"],
                   grow_pages=meta["grow_pages"], collect_scores=meta["collect_scores"],
                   rounding=meta["rounding"], seed=meta["seed"], **_quant_options(meta))

    def _load_buffers(self, arrays: dict[str, mx.array], capacity: int) -> None:
        if self.kv_bits:
            self._load_quantized(arrays, capacity)
            return
        for layer in self.layers:
            layer.keys = arrays[f"layers.{layer.index}.keys"]
            layer.values = arrays[f"layers.{layer.index}.values"]
            self._check_saved_buffers(layer.index, layer.keys, layer.values, capacity)

    def _load_quantized(self, arrays: dict[str, mx.array], capacity: int) -> None:
        want = self.layers[0]._quant_zeros(capacity)
        for layer in self.layers:
            for kind in ("keys", "values"):
                parts = [arrays[f"layers.{layer.index}.{kind}{suffix}"] for suffix in self.QUANT_PARTS]
                for part, ref in zip(parts, want):
                    if tuple(part.shape) != tuple(ref.shape) or part.dtype != ref.dtype:
                        raise CacheError(f"layer {layer.index}: saved quantised {kind} are {part.dtype} "
                                         f"{tuple(part.shape)}, expected {ref.dtype} {tuple(ref.shape)}")
                setattr(layer, kind, parts)
        self._full_row = np.full(capacity, -1, dtype=np.int64)
        if self.kv_rerotate == "deferred":
            self._shift = np.array(arrays["key_shifts"], dtype=np.int64)
            if self._shift.shape != (capacity,):
                raise CacheError(f"saved key shifts cover {self._shift.shape[0]} slots, the buffers {capacity}")
        if self.keep_sinks_full and "full_slots" in arrays:
            self._full_slot = np.array(arrays["full_slots"], dtype=np.int64)
            n = self._full_slot.shape[0]
            used = np.flatnonzero(self._full_slot >= 0)
            if used.size and self._full_slot[used].max() >= capacity:
                raise CacheError(f"saved full-precision rows point past the {capacity} slots")
            self._full_row[self._full_slot[used]] = used
            for layer in self.layers:
                layer.full_keys = arrays[f"layers.{layer.index}.full_keys"]
                layer.full_values = arrays[f"layers.{layer.index}.full_values"]
                want_f = (1, self.kv_heads, n, self.head_dim)
                for a in (layer.full_keys, layer.full_values):
                    if tuple(a.shape) != want_f or a.dtype != self.dtype:
                        raise CacheError(f"layer {layer.index}: saved full-precision rows are {a.dtype} "
                                         f"{tuple(a.shape)}, expected {self.dtype} {want_f}")

    def _load_scores(self, arrays: dict[str, mx.array], capacity: int) -> None:
        self._scores = (np.array(arrays["scores"], dtype=np.float32) if self.collect_scores
                        else np.zeros(capacity, dtype=np.float32))

    def save(self, path: str | os.PathLike, metadata: dict | None = None) -> None:
        """Write the cache to one safetensors file: arrays as tensors, configuration as JSON metadata."""
        mx.save_safetensors(str(path), self.state, self._file_metadata(metadata))

    @classmethod
    def load(cls, path: str | os.PathLike, return_metadata: bool = False):
        """Restore a cache written by :meth:`save` (and the user metadata when asked)."""
        arrays, meta = mx.load(str(path), return_metadata=True)
        return cls._from_file(path, arrays, meta, return_metadata)


def _quant_options(meta: dict) -> dict:
    """OmniCache keyword arguments of a saved cache's quantisation (none for a float cache)."""
    q = meta.get("kv_quant")
    if not q:
        return {}
    return {"kv_bits": q["bits"], "kv_group_size": q["group_size"], "keep_sinks_full": q["keep_sinks_full"],
            "kv_rerotate": q["rerotate"]}
