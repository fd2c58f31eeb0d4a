"""OmniTorchCache: the paged KV cache of a streaming session in PyTorch, as a transformers ``Cache``.

The same design as the MLX OmniCache (omnitide_mlx/cache.py, docs/design.md): every layer keeps one K and one V
buffer ``[1, kv_heads, capacity, head_dim]`` whose row ``i`` is slot ``i`` of one shared
:class:`~omnitide_mlx.core.page.PageTable`; the table decides where new tokens go, which pages are active and how
entries move; keys are stored rotated at the positions their tokens had when written, shifted by every eviction
since; the cache stores no positions (the History does), and its tokens in ``seq`` order are the history's tokens
in logical order.

transformers drives it through ``Cache.update`` (reference qwen2_5_omni.md section 7): the first layer's update of
a forward opens a *step* (allocates the new tokens' slots for the owner set by ``set_owner`` and plans the step's
attention once for every layer); each layer's update writes its K/V into those slots. Two ways to attend:

- ``attention="omnitide"`` (default): the model's attention implementation is ``"omnitide"`` (registered by
  :func:`register_attention`); ``update`` returns the layer's whole buffers and the attention function runs
  the cache's kernel over the active tiles (flex / sdpa / reference, omnitide_mlx/torch/attention.py). The step
  closes when every layer has attended.
- ``attention="transformers"``: any attention implementation of transformers (eager, sdpa); ``update`` returns the
  retained entries in logical order followed by the new ones (a gather), and ``get_mask_sizes`` reports
  ``(retained + q_len, seen - retained)`` so transformers' causal mask is right for the shortened history.

Around the model, the session calls the same methods as on the MLX cache: ``evict(plan, history)`` frees the
deleted tokens' slots and re-rotates each kept key by ``-shift`` once in float32 (stochastic rounding back to half
precision); ``migrate(plan)`` executes an OmniPage plan with one source/destination map for every layer: the source
rows are gathered into scratch before any destination is written (paper 6.2), then scattered in place;
``token_scores``, ``layout_stats``, ``nbytes``, ``save`` / ``load`` (safetensors + JSON, the MLX cache's format).
"""

from __future__ import annotations

import contextvars
import json
import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..core.page import AllocClass, LayoutError, LayoutStats, MigrationPlan, PageTable, check_move_order
from ..rope import RopeSpec
from .attention import KERNELS, StepPlan, attend, plan_step
from .rope import rotate_tokens, stochastic_round

CACHE_FORMAT = "omnitide-cache/1"  # the MLX OmniCache's format: files are interchangeable
ATTENTION_NAME = "omnitide"  # the attention implementation name registered with transformers
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_OPEN_STEP: contextvars.ContextVar = contextvars.ContextVar("omnitide_open_step", default=None)


class CacheError(ValueError):
    """Misuse of the cache: a step left open, shapes that do not match, a plan for another layout, ..."""


def _dtype_name(dtype) -> str:
    for name, d in _DTYPES.items():
        if d == dtype:
            return name
    raise CacheError(f"KV dtype must be float16, bfloat16 or float32, got {dtype}")


def default_kernel(device) -> str:
    """FlexAttention on CUDA (block-sparse over the page table), SDPA over the span elsewhere."""
    return "flex" if torch.device(device).type == "cuda" else "sdpa"


@dataclass
class _Step:
    slots: np.ndarray
    slots_t: torch.Tensor
    write: slice | torch.Tensor  # a slice when the slots are consecutive
    plan: StepPlan | None  # attention="omnitide" only
    retained_before: int
    tokens: int
    written: int = 0
    attended: int = 0
    order: torch.Tensor | None = None  # attention="transformers": retained + new slots in logical order


class OmniTorchLayer(CacheLayerMixin):
    """One layer's K/V buffers (``keys`` / ``values``, as transformers' layers name them)."""

    is_sliding = False
    is_croppable = False
    is_compileable = False

    def __init__(self, parent: "OmniTorchCache", index: int):
        super().__init__()
        self._parent = parent
        self.index = index

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Buffers are allocated by the cache as the page table grows; nothing to do per layer."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self._parent._update(self.index, key_states, value_states)

    def get_seq_length(self) -> int:
        return self._parent.seen_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        kept = self._parent._retained_before_step()
        return kept + query_length, self._parent.seen_tokens - kept

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise CacheError("an OmniTorchCache is not reset: make a new one")

    def crop(self, tokens_to_remove: int) -> None:
        raise CacheError("an OmniTorchCache cannot be cropped: tokens leave it through evict(plan)")

    def reorder_cache(self, beam_idx) -> None:
        raise CacheError("an OmniTorchCache holds one sequence (batch 1, no beam search)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise CacheError("an OmniTorchCache holds one sequence (batch 1)")

    def batch_select_indices(self, indices) -> None:
        raise CacheError("an OmniTorchCache holds one sequence (batch 1)")

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else 2 * self.keys.numel() * self.keys.element_size()


class OmniTorchCache(Cache):
    """Per-layer paged K/V buffers with one shared page table (see the module docstring for the protocol).

    ``placement``: ``"class_aware"`` (OmniPage) or ``"first_fit"`` (plain, and the ordered-suffix layout);
    ``kernel``: ``"flex"``, ``"sdpa"`` or ``"reference"`` (default: flex on CUDA, sdpa elsewhere; a cache that
    collects H2O scores always uses the reference kernel, the only one that exposes them); ``attention``:
    ``"omnitide"`` or ``"transformers"`` (module docstring); ``rounding``: how re-rotated keys return to a
    half-precision cache (``"stochastic"``, seeded by ``seed`` and the eviction count, or ``"nearest"``).
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, rope: RopeSpec | None = None,
                 dtype: torch.dtype = torch.float16, device="cpu", *, page_size: int = 64, subblock_size: int = 32,
                 placement: str = "class_aware", grow_pages: int = 4, collect_scores: bool = False,
                 kernel: str | None = None, attention: str = "omnitide", rounding: str = "stochastic",
                 seed: int = 0):
        for name, val in (("num_layers", num_layers), ("kv_heads", kv_heads), ("head_dim", head_dim),
                          ("grow_pages", grow_pages)):
            if not isinstance(val, (int, np.integer)) or val <= 0:
                raise CacheError(f"{name} must be a positive int, got {val!r}")
        _dtype_name(dtype)
        if rounding not in ("stochastic", "nearest"):
            raise CacheError(f"rounding must be 'stochastic' or 'nearest', got {rounding!r}")
        if attention not in ("omnitide", "transformers"):
            raise CacheError(f"attention must be 'omnitide' or 'transformers', got {attention!r}")
        self.device = torch.device(device)
        kernel = kernel or default_kernel(self.device)
        if kernel not in KERNELS:
            raise CacheError(f"unknown kernel {kernel!r}; choose from {KERNELS}")
        self.num_layers, self.kv_heads, self.head_dim = int(num_layers), int(kv_heads), int(head_dim)
        self.rope = rope
        self.dtype = dtype
        self.grow_pages = int(grow_pages)
        self.collect_scores = bool(collect_scores)
        self.kernel = "reference" if self.collect_scores else kernel
        self.kernel_fallback: str | None = None  # why flex gave way to sdpa, when it did
        self.attention = attention
        self.rounding = rounding
        self.seed = int(seed)
        self.evictions = 0
        self.table = PageTable(page_size, subblock_size, placement=placement)
        super().__init__(layers=[OmniTorchLayer(self, i) for i in range(self.num_layers)])
        self._capacity = 0
        self._owner: tuple[int, AllocClass] | None = None
        self._step: _Step | None = None
        self._scores = torch.zeros(0, dtype=torch.float32, device=self.device)
        self.seen_tokens = 0  # tokens written through completed steps: transformers' logical sequence length
        self.moved_rows = 0
        self.rotated_rows = 0

    @classmethod
    def for_spec(cls, spec, dtype=torch.float16, device="cpu", **kw) -> "OmniTorchCache":
        """A cache for a model's ``KVSpec`` (models/base.py)."""
        return cls(spec.num_layers, spec.kv_heads, spec.head_dim, spec.rope, dtype, device, **kw)

    def set_kernel(self, kernel: str) -> None:
        """Switch the attention kernel (flex / sdpa / reference); a score-collecting cache keeps the reference."""
        if kernel not in KERNELS:
            raise CacheError(f"unknown kernel {kernel!r}; choose from {KERNELS}")
        if self._step is not None:
            raise CacheError("set_kernel() inside an open step")
        self.kernel = "reference" if self.collect_scores else kernel

    # --- shape ----------------------------------------------------------------------------------------------
    @property
    def page_table(self) -> PageTable:
        return self.table

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def retained(self) -> int:
        return self.table.retained

    @property
    def in_step(self) -> bool:
        """A forward step is open (its slots are allocated, not every layer has finished)."""
        return self._step is not None

    # --- one forward step -----------------------------------------------------------------------------------
    def set_owner(self, uid: int, alloc_class: AllocClass | int = AllocClass.RECENT_CONTEXT) -> None:
        """The unit (and allocation class) the next written tokens belong to. Decode steps of a reply keep the
        reply's uid: their tokens append to that unit in order."""
        if self._step is not None:
            raise CacheError("set_owner() inside an open step")
        if not isinstance(uid, (int, np.integer)) or uid < 0:
            raise CacheError(f"owner uid must be a non-negative int, got {uid!r}")
        self._owner = (int(uid), AllocClass(alloc_class))

    def begin_step(self, tokens: int) -> np.ndarray:
        """Allocate ``tokens`` slots for the owner and plan this step's attention; returns the slots. The first
        layer's ``update`` calls it when no step is open."""
        if self._step is not None:
            raise CacheError("begin_step() while a step is open: the previous forward did not finish "
                             "(call abort_step())")
        if self._owner is None:
            raise CacheError("a forward step before set_owner(uid, alloc_class)")
        if not isinstance(tokens, (int, np.integer)) or tokens <= 0:
            raise CacheError(f"a step writes a positive number of tokens, got {tokens!r}")
        uid, cls = self._owner
        retained_before = self.table.retained
        slots = self.table.allocate(int(tokens), uid, cls)
        self._ensure_capacity(self.table.capacity)
        slots_t = torch.as_tensor(slots, device=self.device)
        contiguous = bool(np.all(np.diff(slots) == 1))
        write = slice(int(slots[0]), int(slots[-1]) + 1) if contiguous else slots_t
        plan = None
        if self.attention == "omnitide":
            plan = plan_step(self._slot_seq(), self.table.seq[slots], self.table.page_size, self.device)
        self._step = _Step(slots, slots_t, write, plan, retained_before, int(tokens))
        if self.attention == "omnitide":
            _OPEN_STEP.set(self)
        return slots

    def abort_step(self) -> None:
        """Give back the open step's slots (a forward that failed half way); the cache is as before the step."""
        step = self._step
        if step is None:
            raise CacheError("abort_step() without an open step")
        self._step = None
        _OPEN_STEP.set(None)
        self.table.free(step.slots)

    def _close_step(self) -> None:
        self.seen_tokens += self._step.tokens
        self._step = None
        _OPEN_STEP.set(None)

    def _retained_before_step(self) -> int:
        return self._step.retained_before if self._step is not None else self.table.retained

    def _update(self, index: int, k: torch.Tensor, v: torch.Tensor):
        """Write layer ``index``'s new K/V (RoPE applied) into the step's slots; see the module docstring for
        what is returned."""
        if self._step is None:
            if index != 0:
                raise CacheError(f"layer {index} updated before layer 0 opened the step")
            self.begin_step(int(k.shape[2]))
        step = self._step
        if index != step.written:
            self.abort_step()
            raise CacheError(f"layer {index} updated out of order (expected layer {step.written}); the step's slots "
                             "were given back")
        want = (1, self.kv_heads, step.tokens, self.head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            self.abort_step()
            raise CacheError(f"layer {index}: k / v must be {want}, got {tuple(k.shape)} / {tuple(v.shape)}")
        layer = self.layers[index]
        if isinstance(step.write, slice):
            layer.keys[:, :, step.write] = k.to(self.dtype)
            layer.values[:, :, step.write] = v.to(self.dtype)
        else:
            layer.keys.index_copy_(2, step.write, k.to(self.dtype))
            layer.values.index_copy_(2, step.write, v.to(self.dtype))
        step.written += 1
        if self.attention == "omnitide":
            return layer.keys, layer.values
        if step.order is None:
            step.order = torch.as_tensor(self.logical_slots(), device=self.device)
        out = layer.keys.index_select(2, step.order), layer.values.index_select(2, step.order)
        if step.written == self.num_layers:
            self._close_step()
        return out

    def attend(self, index: int, q: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
        """Layer ``index``'s attention over the active tiles (the ``"omnitide"`` attention function calls it).
        ``keys`` must be what this layer's ``update`` returned."""
        step = self._step
        if step is None or step.plan is None:
            raise CacheError("attend() outside a step of an attention='omnitide' cache")
        layer = self.layers[index]
        if keys is not layer.keys:
            raise CacheError(f"layer {index}: the keys given to attention are not this cache's buffer")
        if index != step.attended or index >= step.written:
            self.abort_step()
            raise CacheError(f"layer {index} attended out of order; the step's slots were given back")
        try:
            if self.collect_scores:
                out, scores = attend(self.kernel, q, layer.keys, layer.values, step.plan, scale, return_scores=True)
                self._scores += scores
            else:
                out = attend(self.kernel, q, layer.keys, layer.values, step.plan, scale)
        except Exception as e:
            if self.kernel != "flex":
                self.abort_step()
                raise
            # FlexAttention unavailable or not compilable here: SDPA over the span from now on (said once, recorded)
            self.kernel, self.kernel_fallback = "sdpa", f"{type(e).__name__}: {e}"[:500]
            warnings.warn(f"FlexAttention failed ({self.kernel_fallback}); this cache falls back to SDPA over the "
                          "span", RuntimeWarning, stacklevel=2)
            out = attend(self.kernel, q, layer.keys, layer.values, step.plan, scale)
        step.attended += 1
        if step.attended == self.num_layers:
            self._close_step()
        return out

    def _slot_seq(self) -> np.ndarray:
        seq = self.table.seq
        if seq.shape[0] == self._capacity:
            return seq
        out = np.full(self._capacity, -1, dtype=np.int64)
        out[: seq.shape[0]] = seq
        return out

    def _ensure_capacity(self, needed: int) -> None:
        if needed <= self._capacity:
            return
        page = self.table.page_size
        new = max(needed, self._capacity + self.grow_pages * page)
        new = -(-new // page) * page
        shape = (1, self.kv_heads, new, self.head_dim)
        for layer in self.layers:
            keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
            values = torch.zeros(shape, dtype=self.dtype, device=self.device)
            if layer.keys is not None:
                keys[:, :, : self._capacity] = layer.keys
                values[:, :, : self._capacity] = layer.values
            layer.keys, layer.values = keys, values
            layer.is_initialized = True
        extra = torch.zeros(new - self._capacity, dtype=torch.float32, device=self.device)
        self._scores = torch.cat([self._scores, extra])
        self._capacity = new

    # --- eviction ---------------------------------------------------------------------------------------------
    def logical_slots(self) -> np.ndarray:
        """The occupied slots in logical (seq) order: slot of the history's k-th token."""
        seq = self.table.seq
        occ = np.flatnonzero(seq >= 0)
        return occ[np.argsort(seq[occ], kind="stable")]

    def slots_of_unit(self, uid: int) -> np.ndarray:
        return self.table.slots_of_unit(uid)

    def evict(self, plan, history=None) -> np.ndarray:
        """Apply a :class:`~omnitide_mlx.core.pick.RetentionPlan`: free the deleted tokens' slots and re-rotate each
        kept key by ``-shift`` once, in float32, with the model's RopeSpec. ``history`` is the history the plan was
        made for (before ``apply_plan``); when given, the cache is checked against it. Returns the freed slots."""
        if self._step is not None:
            raise CacheError("evict() inside an open step")
        if history is not None:
            plan.validate(history)
            self.table.check_history(history)
        order = self.logical_slots()
        if order.size != plan.tokens_before:
            raise CacheError(f"the cache holds {order.size} tokens, the plan was made for {plan.tokens_before}")
        shifts = plan.kept_token_shifts()
        kept = order[plan.keep_mask()]
        moving = shifts != 0
        if moving.any():
            if self.rope is None:
                raise CacheError("this plan shifts positions, but the cache has no RopeSpec to re-rotate keys")
            self._rerotate(kept[moving], shifts[moving])
        freed = self.table.apply_retention(plan)
        self.evictions += 1
        if self.collect_scores and freed.size:
            self._scores[torch.as_tensor(freed, device=self.device)] = 0.0
        return freed

    def _rerotate(self, slots: np.ndarray, shifts: np.ndarray) -> None:
        """Rotate the keys at ``slots`` by ``-shifts``: gather, one float32 rotation, one rounding, scatter."""
        idx = torch.as_tensor(slots, device=self.device)
        offsets = torch.as_tensor(-shifts, device=self.device)
        for layer in self.layers:
            rows = layer.keys[0].index_select(1, idx).transpose(0, 1).to(torch.float32)  # [n, Hkv, D]
            rot = rotate_tokens(rows, offsets, self.rope)
            if self.rounding == "stochastic":
                gen = torch.Generator(device=self.device)
                gen.manual_seed((self.seed * 1_000_003 + self.evictions) * 4096 + layer.index)
                rot = stochastic_round(rot, self.dtype, gen)
            layer.keys.index_copy_(2, idx, rot.to(self.dtype).transpose(0, 1)[None])
        self.rotated_rows += int(slots.size)

    # --- migration --------------------------------------------------------------------------------------------
    def migrate(self, plan: MigrationPlan) -> int:
        """Execute an accepted OmniPage migration plan: one source / destination map for every layer; per layer
        the source rows of K and V are gathered into scratch, then written to the destinations in place (no
        write can clobber a source another move still needs). Then the metadata moves. Returns rows moved."""
        if self._step is not None:
            raise CacheError("migrate() inside an open step")
        if not plan.accepted:
            raise CacheError(f"migration plan ({plan.mode}) was not accepted: {plan.reason}")
        if plan.before != self.table.stats():
            raise CacheError("migration plan was made for a different layout (plan it on this cache's table, now)")
        check_move_order(plan.src, plan.dst, self.table.occupancy())
        if plan.src.size:
            src = torch.as_tensor(plan.src, device=self.device)
            dst = torch.as_tensor(plan.dst, device=self.device)
            for layer in self.layers:
                for buf in (layer.keys, layer.values):
                    rows = buf.index_select(2, src)  # scratch: the moved rows only
                    buf.index_copy_(2, dst, rows)
                    del rows
            if self.collect_scores:
                moved = self._scores.index_select(0, src)
                self._scores[src] = 0.0
                self._scores.index_copy_(0, dst, moved)
        self.table.apply_migration(plan)
        self.moved_rows += int(plan.src.size)
        return int(plan.src.size)

    def migration_bytes(self, plan: MigrationPlan) -> int:
        """K and V bytes a plan copies across all layers."""
        return self.bytes_per_token * int(plan.src.size)

    # --- H2O ------------------------------------------------------------------------------------------------
    def token_scores(self, history=None) -> np.ndarray:
        """Accumulated attention per token of the history, in logical order (needs ``collect_scores``)."""
        if not self.collect_scores:
            raise CacheError("token_scores() needs OmniTorchCache(..., collect_scores=True)")
        if history is not None:
            self.table.check_history(history)
        idx = torch.as_tensor(self.logical_slots(), device=self.device)
        return self._scores.index_select(0, idx).cpu().numpy().astype(np.float32)

    # --- introspection ----------------------------------------------------------------------------------------
    def layout_stats(self) -> LayoutStats:
        return self.table.stats()

    @property
    def nbytes(self) -> int:
        """Bytes of the K/V buffers (allocated capacity, all layers)."""
        return sum(layer.nbytes for layer in self.layers)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.kv_heads * self.head_dim * torch.empty(0, dtype=self.dtype).element_size()

    def stats(self) -> dict:
        s = self.table.stats().to_json()
        s.update(buffer_capacity=self._capacity, kv_bytes=self.nbytes,
                 kv_bytes_retained=s["retained_cells"] * self.bytes_per_token,
                 kv_bytes_span=s["physical_span"] * self.bytes_per_token, moved_rows=self.moved_rows,
                 rotated_rows=self.rotated_rows, kernel=self.kernel, kernel_fallback=self.kernel_fallback,
                 attention=self.attention)
        return s

    # --- persistence (the MLX OmniCache's safetensors layout) --------------------------------------------------
    @property
    def state(self) -> dict[str, torch.Tensor]:
        if self._step is not None:
            raise CacheError("state of a cache with an open step")
        arrays: dict[str, torch.Tensor] = {}
        for layer in self.layers:
            if layer.keys is not None:
                arrays[f"layers.{layer.index}.keys"] = layer.keys
                arrays[f"layers.{layer.index}.values"] = layer.values
        t = self.table.state()
        for name in ("slots", "seq", "unit", "cls"):
            arrays[f"table.{name}"] = torch.as_tensor(np.asarray(t[name], dtype=np.int64).astype(np.int32))
        if self.collect_scores:
            arrays["scores"] = self._scores
        return arrays

    @property
    def meta_state(self) -> dict:
        t = self.table.state()
        return {
            "format": CACHE_FORMAT,
            "num_layers": self.num_layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
            "dtype": _dtype_name(self.dtype),
            "rope": self.rope.to_json() if self.rope is not None else None,
            "grow_pages": self.grow_pages, "collect_scores": self.collect_scores,
            "rounding": self.rounding, "seed": self.seed, "evictions": self.evictions,
            "capacity": self._capacity,
            "owner": list(self._owner) if self._owner is not None else None,
            "moved_rows": self.moved_rows, "rotated_rows": self.rotated_rows,
            "table": {k: t[k] for k in ("page_size", "subblock_size", "placement", "capacity", "next_seq",
                                        "partial")},
            "seen_tokens": self.seen_tokens, "kernel": self.kernel, "attention": self.attention,
        }

    @classmethod
    def from_state(cls, arrays: dict[str, torch.Tensor], meta: dict, device="cpu", kernel: str | None = None
                   ) -> "OmniTorchCache":
        """A cache from ``state`` / ``meta_state`` (also an MLX OmniCache's). ``kernel`` overrides the saved one
        (a cache saved on CUDA with flex can continue on a CPU with sdpa)."""
        if meta.get("format") != CACHE_FORMAT:
            raise CacheError(f"not an OmniTide cache state (format {meta.get('format')!r}, want {CACHE_FORMAT!r})")
        try:
            tm = meta["table"]
            device = torch.device(device)
            saved_kernel = meta.get("kernel")
            if kernel is None and saved_kernel == "flex" and device.type != "cuda":
                saved_kernel = None  # flex is the CUDA default; elsewhere take the device's default
            cache = cls(meta["num_layers"], meta["kv_heads"], meta["head_dim"],
                        RopeSpec.from_json(meta["rope"]) if meta["rope"] else None, _DTYPES[meta["dtype"]], device,
                        page_size=tm["page_size"], subblock_size=tm["subblock_size"], placement=tm["placement"],
                        grow_pages=meta["grow_pages"], collect_scores=meta["collect_scores"],
                        kernel=kernel or saved_kernel, attention=meta.get("attention", "omnitide"),
                        rounding=meta["rounding"], seed=meta["seed"])
            cache.evictions = int(meta["evictions"])
            table_state = dict(tm)
            for name in ("slots", "seq", "unit", "cls"):
                table_state[name] = arrays[f"table.{name}"].to(torch.int64).tolist()
            cache.table = PageTable.from_state(table_state)
            cap = int(meta["capacity"])
            want = (1, cache.kv_heads, cap, cache.head_dim)
            for layer in cache.layers:
                if not cap:
                    continue
                keys, values = arrays[f"layers.{layer.index}.keys"], arrays[f"layers.{layer.index}.values"]
                if tuple(keys.shape) != want or tuple(values.shape) != want:
                    raise CacheError(f"layer {layer.index}: saved buffers are {tuple(keys.shape)}, expected {want}")
                if keys.dtype != cache.dtype or values.dtype != cache.dtype:
                    raise CacheError(f"layer {layer.index}: saved buffers are {keys.dtype}, expected {cache.dtype}")
                layer.keys = keys.to(device).contiguous()
                layer.values = values.to(device).contiguous()
                layer.is_initialized = True
            cache._capacity = cap
            if cap < cache.table.capacity:
                raise CacheError(f"buffers hold {cap} slots, the page table {cache.table.capacity}")
            cache._scores = (arrays["scores"].to(device=device, dtype=torch.float32).clone() if cache.collect_scores
                             else torch.zeros(cap, dtype=torch.float32, device=device))
            cache._owner = (int(meta["owner"][0]), AllocClass(meta["owner"][1])) if meta["owner"] else None
            cache.moved_rows, cache.rotated_rows = int(meta["moved_rows"]), int(meta["rotated_rows"])
            cache.seen_tokens = int(meta.get("seen_tokens", cache.table.next_seq))
        except KeyError as e:
            raise CacheError(f"incomplete cache state: missing {e}") from e
        except LayoutError as e:
            raise CacheError(f"bad page table in the saved state: {e}") from e
        return cache

    def save(self, path: str | os.PathLike, metadata: dict | None = None) -> None:
        """One safetensors file: arrays as tensors, configuration as JSON metadata."""
        from safetensors.torch import save_file

        arrays = {k: v.detach().to("cpu").contiguous() for k, v in self.state.items()}
        save_file(arrays, str(path), metadata={"omnitide_cache": json.dumps(self.meta_state),
                                                "user": json.dumps(metadata or {})})

    @classmethod
    def load(cls, path: str | os.PathLike, device="cpu", kernel: str | None = None, return_metadata: bool = False):
        """Restore a cache written by :meth:`save` (or by the MLX OmniCache)."""
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                arrays = {k: f.get_tensor(k) for k in f.keys()}
        except FileNotFoundError:
            raise
        except Exception as e:  # safetensors raises its own error types for a damaged file
            raise CacheError(f"{path} is not a readable safetensors file ({e})") from None
        if "omnitide_cache" not in meta:
            raise CacheError(f"{path} holds no OmniTide cache (no 'omnitide_cache' metadata)")
        cache = cls.from_state(arrays, json.loads(meta["omnitide_cache"]), device=device, kernel=kernel)
        if return_metadata:
            return cache, json.loads(meta.get("user", "{}"))
        return cache


# --- transformers' attention interface ---------------------------------------------------------------------------
def omnitide_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The ``"omnitide"`` attention implementation: the open step's cache attends over its active tiles. Without
    an open step (a forward with no OmniTorchCache) it is transformers' SDPA attention."""
    cache = _OPEN_STEP.get()
    if cache is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = cache.attend(module.layer_idx, query, key, scale)
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> str:
    """Register ``"omnitide"`` with transformers' ``AttentionInterface`` (idempotent); returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, omnitide_attention)
    return ATTENTION_NAME
