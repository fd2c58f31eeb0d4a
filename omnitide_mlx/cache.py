"""OmniCache: the KV cache of a streaming session, in tile-aligned pages (OmniPage) with unit-aware eviction.

Every layer keeps one K and one V buffer ``[1, kv_heads, capacity, head_dim]``; row ``i`` of every buffer is slot
``i`` of one shared :class:`~omnitide_mlx.core.page.PageTable`, which decides where each new token goes, which
pages are active, and how entries move. Models call the cache like an mlx-lm cache, except that attention goes
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
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .core.paged_cache import CACHE_FORMAT, CacheError, PagedKVCache
from .kernels import DECODE_TILE, PREFILL_TILE, TilePlan, page_compact, plan_tiles, tile_skip_attention
from .rope import RopeSpec

__all__ = ["CACHE_FORMAT", "DECODE_MAX_TOKENS", "CacheError", "OmniCache", "OmniLayerCache", "stochastic_round"]

DECODE_MAX_TOKENS = 19  # steps of fewer than 20 tokens take the decode path (32-slot subblocks), as llama.cpp does

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


@dataclass
class _Step:
    """What every layer of one forward step shares: the new tokens' slots and the attention plan."""

    slots: np.ndarray
    write: slice | mx.array  # a slice when the slots are consecutive (cheaper update)
    plan: TilePlan
    tokens: int
    written: int = 0


class OmniLayerCache:
    """One layer's K/V buffers. ``attend`` writes this step's K/V into the step's slots, then runs tile-skipping
    attention over the active tiles."""

    def __init__(self, parent: "OmniCache", index: int):
        self._parent = parent
        self.index = index
        self.keys: mx.array | None = None
        self.values: mx.array | None = None

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
        self.keys[:, :, step.write, :] = k.astype(p.dtype)
        self.values[:, :, step.write, :] = v.astype(p.dtype)
        step.written += 1
        if p.collect_scores:
            out, scores = tile_skip_attention(q, self.keys, self.values, scale=scale, plan=step.plan,
                                              return_scores=True)
            p._step_scores = scores if p._step_scores is None else p._step_scores + scores
            return out
        return tile_skip_attention(q, self.keys, self.values, scale=scale, plan=step.plan)

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        return self.keys, self.values

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def _grow(self, capacity: int) -> None:
        p = self._parent
        if self.keys is None:
            shape = (1, p.kv_heads, capacity, p.head_dim)
            self.keys, self.values = mx.zeros(shape, p.dtype), mx.zeros(shape, p.dtype)
            return
        extra = capacity - self.keys.shape[2]
        if extra > 0:
            pad = mx.zeros((1, p.kv_heads, extra, p.head_dim), p.dtype)
            self.keys = mx.concatenate([self.keys, pad], axis=2)
            self.values = mx.concatenate([self.values, pad], axis=2)


class OmniCache(PagedKVCache):
    """Per-layer paged K/V buffers with one shared page table (see the module docstring for the protocol); the
    bookkeeping is :class:`~omnitide_mlx.core.paged_cache.PagedKVCache`'s, shared with the torch cache.

    ``placement``: ``"class_aware"`` (OmniPage: new tokens never share a page with another class) or
    ``"first_fit"`` (a plain cache: new tokens fill any hole). ``grow_pages``: buffers grow by at least this many
    pages at a time, so a growing cache copies its buffers rarely (mlx-lm grows by 256 slots). With
    ``collect_scores`` every attention also accumulates the attention each slot receives (for H2O). ``rounding``:
    how re-rotated keys return to a half-precision cache ("stochastic", seeded by ``seed`` and the eviction count,
    or "nearest" for comparison).
    """

    DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
    STATE_NAME = "OmniCache"

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, rope: RopeSpec | None = None,
                 dtype=mx.float16, *, page_size: int = PREFILL_TILE, subblock_size: int = DECODE_TILE,
                 placement: str = "class_aware", grow_pages: int = 4, collect_scores: bool = False,
                 rounding: str = "stochastic", seed: int = 0):
        super().__init__(num_layers, kv_heads, head_dim, rope, dtype, page_size=page_size,
                         subblock_size=subblock_size, placement=placement, grow_pages=grow_pages,
                         collect_scores=collect_scores, rounding=rounding, seed=seed)
        self.layers = [OmniLayerCache(self, i) for i in range(self.num_layers)]
        self._step: _Step | None = None
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
        plan = plan_tiles(self._slot_seq(), self.table.seq[slots], tiles, tile)
        contiguous = bool(np.all(np.diff(slots) == 1))
        write = slice(int(slots[0]), int(slots[-1]) + 1) if contiguous else mx.array(slots.astype(np.int32))
        self._step = _Step(slots=slots, write=write, plan=plan, tokens=int(tokens))
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
        self.table.free(step.slots)

    def _grow_buffers(self, capacity: int) -> None:
        for layer in self.layers:
            layer._grow(capacity)
        self._scores = np.concatenate([self._scores, np.zeros(capacity - self._capacity, dtype=np.float32)])

    def _shrink_buffers(self, capacity: int) -> None:
        for layer in self.layers:
            if layer.keys is not None:
                layer.keys = mx.contiguous(layer.keys[:, :, :capacity])  # a copy: the old buffers are freed
                layer.values = mx.contiguous(layer.values[:, :, :capacity])
                mx.eval(layer.keys, layer.values)
        self._scores = self._scores[:capacity].copy()

    # --- eviction (evict: PagedKVCache) -------------------------------------------------------------------------
    def _rerotate(self, slots: np.ndarray, shifts: np.ndarray) -> None:
        """Rotate the keys at ``slots`` by ``-shifts`` (one rotation per key, float32, one rounding back)."""
        idx = mx.array(slots.astype(np.int32))
        offsets = mx.array((-shifts).astype(np.int32))
        for layer in self.layers:
            rows = layer.keys[:, :, idx, :][0].transpose(1, 0, 2)  # [n, Hkv, D]
            rot = self.rope.rotate_tokens(rows, offsets)
            if self.rounding == "stochastic":
                rot = stochastic_round(rot, self.dtype, mx.random.key(self._rounding_seed(layer.index)))
            rot = rot.astype(self.dtype).transpose(1, 0, 2)[None]
            mx.eval(rot)  # evaluated before the scatter: the buffer is then updated in place, not copied
            layer.keys[:, :, idx, :] = rot
            mx.eval(layer.keys)

    def _zero_scores(self, slots: np.ndarray) -> None:
        self._scores[slots] = 0.0

    # --- migration (migrate: PagedKVCache) --------------------------------------------------------------------
    def _move_rows(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Per layer: gather the moved rows into scratch, evaluate them, scatter them into the cache's own buffers
        in place (evaluating the gather first is what keeps MLX from copying the whole buffer)."""
        dst_idx = mx.array(dst.astype(np.int32))
        for layer in self.layers:
            k_rows, v_rows = page_compact(layer.keys, layer.values, src)
            mx.eval(k_rows, v_rows)
            layer.keys[:, :, dst_idx, :] = k_rows
            layer.values[:, :, dst_idx, :] = v_rows
            del k_rows, v_rows
            mx.eval(layer.keys, layer.values)
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
                   rounding=meta["rounding"], seed=meta["seed"])

    def _load_buffers(self, arrays: dict[str, mx.array], capacity: int) -> None:
        for layer in self.layers:
            layer.keys = arrays[f"layers.{layer.index}.keys"]
            layer.values = arrays[f"layers.{layer.index}.values"]
            self._check_saved_buffers(layer.index, layer.keys, layer.values, capacity)

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
