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
from .cache_storage import QUANT_PARTS, MlxKVStorage
from .core.page import AllocClass
from .core.paged_cache import (
    CACHE_FORMAT,
    CacheError,
    PagedKVCache,
    check_state_meta,
    load_file,
    saved_config,
)
from .kernels import DECODE_TILE, PREFILL_TILE, AttentionError, plan_tiles
from .kernels.quantized import FREE_SEQ, KeyShift, check_quant
from .rope import RopeSpec

__all__ = ["CACHE_FORMAT", "DECODE_MAX_TOKENS", "CacheError", "OmniCache", "OmniLayerCache", "stochastic_round"]

KV_REROTATE = ("deferred", "requantize")
DECODE_MAX_TOKENS = 19  # steps of fewer than 20 tokens take the decode path (32-slot subblocks), as llama.cpp does


class OmniCache(PagedKVCache):
    """Per-layer paged K/V buffers with one shared page table (see the module docstring for the protocol); the
    bookkeeping is :class:`~omnitide_mlx.core.paged_cache.PagedKVCache`'s, shared with the torch cache, composed
    with an :class:`~omnitide_mlx.cache_storage.MlxKVStorage` (``storage``) that holds the tensor work.

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
    QUANT_PARTS = QUANT_PARTS

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
        self.kv_bits = None if kv_bits is None else int(kv_bits)
        self.kv_group_size = int(kv_group_size)
        self.keep_sinks_full = bool(keep_sinks_full)
        self.layers = [OmniLayerCache(self, i) for i in range(self.num_layers)]
        self.storage = MlxKVStorage(self)
        self._step: CacheStep | None = None
        self._step_scores: mx.array | None = None
        self.capture_queries: frozenset[int] | None = None  # layers whose queries attend() keeps (recall)
        self.captured: dict[int, mx.array] = {}

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
        st = self.storage
        if self.keep_sinks_full:
            if self._owner[1] == AllocClass.MUST_KEEP:
                full_write = write_index(st.take_full_rows(slots))
            slot_seq = np.where(st.full_row[: slot_seq.shape[0]] >= 0, -1, slot_seq)  # not in the quantised rows
        plan = plan_tiles(slot_seq, self.table.seq[slots], tiles, tile)
        self._step = CacheStep(slots=slots, write=write_index(slots), plan=plan, tokens=int(tokens),
                           full_write=full_write)
        if st.shift.size:
            st.shift[slots] = 0  # new keys are written at their positions
            if st.shift.any():
                self._step.shift = KeyShift(st.shift[: self._capacity].copy(), self.rope.rotate_tokens)
        if self.keep_sinks_full and (st.full_slot >= 0).any():
            used = np.flatnonzero(st.full_slot >= 0)
            fseq = np.full(st.full_slot.shape[0], FREE_SEQ, dtype=np.int64)
            fseq[used] = self.table.seq[st.full_slot[used]]
            self._step.full_seq = mx.array(fseq.astype(np.int32))
            self._step.full_used = mx.array(used.astype(np.int32))
            self._step.full_slots = mx.array(st.full_slot[used].astype(np.int32))
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
            self.storage.scores[: self._capacity] += np.array(self._step_scores, dtype=np.float32)
            self._step_scores = None

    def abort_step(self) -> None:
        """Give back the open step's slots (a forward that failed half way); the cache is as before the step."""
        step = self._step
        if step is None:
            raise CacheError("abort_step() without begin_step()")
        self._step = None
        self._step_scores = None
        self.storage.release_full_rows(step.slots)
        self.table.free(step.slots)

    # --- persistence (safetensors + JSON, like mlx-lm prompt caches; state: PagedKVCache) ---------------------
    @property
    def meta_state(self) -> dict:
        meta = super().meta_state
        if self.kv_bits:
            meta["kv_quant"] = {"bits": self.kv_bits, "group_size": self.kv_group_size,
                                "keep_sinks_full": self.keep_sinks_full, "rerotate": self.kv_rerotate}
        return meta

    @classmethod
    def from_state(cls, arrays: dict[str, mx.array], meta: dict) -> "OmniCache":
        """A cache from ``state`` / ``meta_state`` (also an OmniTorchCache's): an empty cache of the saved
        configuration, filled by :meth:`~omnitide_mlx.core.paged_cache.PagedKVCache.load_state`."""
        check_state_meta(meta, cls.STATE_NAME, quantised_kv=True)
        cfg = saved_config(meta, cls.STATE_NAME)
        rope = cfg.pop("rope")
        try:
            quant, dtype = _quant_options(meta), cls.DTYPES[cfg.pop("dtype")]
        except KeyError as e:
            raise CacheError(f"incomplete {cls.STATE_NAME} state: missing {e}") from e
        cache = cls(cfg.pop("num_layers"), cfg.pop("kv_heads"), cfg.pop("head_dim"),
                    RopeSpec.from_json(rope) if rope else None, dtype, **cfg, **quant)
        return cache.load_state(arrays, meta)

    def save(self, path: str | os.PathLike, metadata: dict | None = None) -> None:
        """Write the cache to one safetensors file: arrays as tensors, configuration as JSON metadata."""
        mx.save_safetensors(str(path), self.state, self.file_metadata(metadata))

    @classmethod
    def load(cls, path: str | os.PathLike, return_metadata: bool = False):
        """Restore a cache written by :meth:`save` (and the user metadata when asked)."""
        arrays, meta = mx.load(str(path), return_metadata=True)
        return load_file(cls, path, arrays, meta, return_metadata)


def _quant_options(meta: dict) -> dict:
    """OmniCache keyword arguments of a saved cache's quantisation (none for a float cache)."""
    q = meta.get("kv_quant")
    if not q:
        return {}
    return {"kv_bits": q["bits"], "kv_group_size": q["group_size"], "keep_sinks_full": q["keep_sinks_full"],
            "kv_rerotate": q["rerotate"]}
