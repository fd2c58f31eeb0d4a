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
import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..core.paged_cache import (
    CACHE_FORMAT,
    CacheError,
    PagedKVCache,
    check_state_meta,
    load_file,
    saved_config,
)
from ..rope import RopeSpec
from .attention import KERNELS, StepPlan, attend, plan_step
from .cache_storage import TorchKVStorage

__all__ = ["ATTENTION_NAME", "CACHE_FORMAT", "CacheError", "OmniTorchCache", "OmniTorchLayer", "default_kernel",
           "omnitide_attention", "register_attention"]

ATTENTION_NAME = "omnitide"  # the attention implementation name registered with transformers
_OPEN_STEP: contextvars.ContextVar = contextvars.ContextVar("omnitide_open_step", default=None)


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


class OmniTorchCache(PagedKVCache, Cache):
    """Per-layer paged K/V buffers with one shared page table (see the module docstring for the protocol); the
    bookkeeping is :class:`~omnitide_mlx.core.paged_cache.PagedKVCache`'s, shared with the MLX cache, composed
    with a :class:`~omnitide_mlx.torch.cache_storage.TorchKVStorage` (``storage``) that holds the tensor work.

    ``placement``: ``"class_aware"`` (OmniPage) or ``"first_fit"`` (plain, and the ordered-suffix layout);
    ``kernel``: ``"flex"``, ``"sdpa"`` or ``"reference"`` (default: flex on CUDA, sdpa elsewhere; a cache that
    collects H2O scores always uses the reference kernel, the only one that exposes them); ``attention``:
    ``"omnitide"`` or ``"transformers"`` (module docstring); ``rounding``: how re-rotated keys return to a
    half-precision cache (``"stochastic"``, seeded by ``seed`` and the eviction count, or ``"nearest"``).
    """

    DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
    STATE_NAME = "OmniTide cache"

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, rope: RopeSpec | None = None,
                 dtype: torch.dtype = torch.float16, device="cpu", *, page_size: int = 64, subblock_size: int = 32,
                 placement: str = "class_aware", grow_pages: int = 4, collect_scores: bool = False,
                 kernel: str | None = None, attention: str = "omnitide", rounding: str = "stochastic",
                 seed: int = 0):
        PagedKVCache.__init__(self, num_layers, kv_heads, head_dim, rope, dtype, page_size=page_size,
                              subblock_size=subblock_size, placement=placement, grow_pages=grow_pages,
                              collect_scores=collect_scores, rounding=rounding, seed=seed)
        if attention not in ("omnitide", "transformers"):
            raise CacheError(f"attention must be 'omnitide' or 'transformers', got {attention!r}")
        self.device = torch.device(device)
        kernel = kernel or default_kernel(self.device)
        if kernel not in KERNELS:
            raise CacheError(f"unknown kernel {kernel!r}; choose from {KERNELS}")
        self.kernel = "reference" if self.collect_scores else kernel
        self.kernel_fallback: str | None = None  # why flex gave way to sdpa, when it did
        self.attention = attention
        Cache.__init__(self, layers=[OmniTorchLayer(self, i) for i in range(self.num_layers)])
        self.storage = TorchKVStorage(self)
        self._step: _Step | None = None
        self.seen_tokens = 0  # tokens written through completed steps: transformers' logical sequence length

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

    # --- one forward step (set_owner: PagedKVCache) ---------------------------------------------------------
    def begin_step(self, tokens: int) -> np.ndarray:
        """Allocate ``tokens`` slots for the owner and plan this step's attention; returns the slots. The first
        layer's ``update`` calls it when no step is open."""
        if self._step is not None:
            raise CacheError("begin_step() while a step is open: the previous forward did not finish "
                             "(call abort_step())")
        if self._owner is None:
            raise CacheError("a forward step before set_owner(uid, alloc_class)")
        retained_before = self.table.retained
        slots = self._allocate_step(tokens)
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
                self.storage.scores += scores
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

    # --- introspection ----------------------------------------------------------------------------------------
    def stats(self) -> dict:
        s = super().stats()
        s.update(kernel=self.kernel, kernel_fallback=self.kernel_fallback, attention=self.attention)
        return s

    # --- persistence (the MLX OmniCache's safetensors layout; state: PagedKVCache) ---------------------------
    @property
    def meta_state(self) -> dict:
        return {**super().meta_state, "seen_tokens": self.seen_tokens, "kernel": self.kernel,
                "attention": self.attention}

    @classmethod
    def from_state(cls, arrays: dict[str, torch.Tensor], meta: dict, device="cpu", kernel: str | None = None
                   ) -> "OmniTorchCache":
        """A cache from ``state`` / ``meta_state`` (also an MLX OmniCache's): an empty cache of the saved
        configuration, filled by :meth:`~omnitide_mlx.core.paged_cache.PagedKVCache.load_state`. ``kernel``
        overrides the saved one (a cache saved on CUDA with flex can continue on a CPU with sdpa)."""
        check_state_meta(meta, cls.STATE_NAME, quantised_kv=False)
        device = torch.device(device)
        cfg = saved_config(meta, cls.STATE_NAME)
        rope = cfg.pop("rope")
        try:
            dtype = cls.DTYPES[cfg.pop("dtype")]
        except KeyError as e:
            raise CacheError(f"incomplete {cls.STATE_NAME} state: missing {e}") from e
        saved_kernel = meta.get("kernel")
        if kernel is None and saved_kernel == "flex" and device.type != "cuda":
            saved_kernel = None  # flex is the CUDA default; elsewhere take the device's default
        cache = cls(cfg.pop("num_layers"), cfg.pop("kv_heads"), cfg.pop("head_dim"),
                    RopeSpec.from_json(rope) if rope else None, dtype, device, kernel=kernel or saved_kernel,
                    attention=meta.get("attention", "omnitide"), **cfg)
        cache.load_state(arrays, meta)
        cache.seen_tokens = int(meta.get("seen_tokens", cache.table.next_seq))
        return cache

    def save(self, path: str | os.PathLike, metadata: dict | None = None) -> None:
        """One safetensors file: arrays as tensors, configuration as JSON metadata."""
        from safetensors.torch import save_file

        arrays = {k: v.detach().to("cpu").contiguous() for k, v in self.state.items()}
        save_file(arrays, str(path), metadata=self.file_metadata(metadata))

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
        return load_file(cls, path, arrays, meta, return_metadata, device=device, kernel=kernel)


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
