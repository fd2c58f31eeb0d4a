"""TorchKVStorage: the tensor half of an :class:`~omnitide_mlx.torch.cache.OmniTorchCache`
(core/kv_storage.py: ``KVStorage``), in PyTorch on the cache's device.

It grows, shrinks, re-rotates, moves, saves and loads the rows of every layer's K/V buffers (the transformers
layers of the cache, ``keys`` / ``values``) and keeps the per-slot H2O scores beside them. The cache
(core/paged_cache.py) decides which slots; this module only does the work. Imports no MLX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ..core.paged_cache import check_saved_buffers
from ..core.shapes import kv_bytes_per_token
from .rope import rotate_tokens, stochastic_round

if TYPE_CHECKING:
    from .cache import OmniTorchCache


class TorchKVStorage:
    """The buffers of one OmniTorchCache (its ``layers``) and ``scores``, the accumulated attention per slot
    (float32, on the cache's device)."""

    def __init__(self, cache: "OmniTorchCache"):
        self.cache = cache
        self.device = cache.device
        self.scores = torch.zeros(0, dtype=torch.float32, device=self.device)

    # --- size ---------------------------------------------------------------------------------------------------
    @property
    def dtype_bytes(self) -> int:
        return torch.empty(0, dtype=self.cache.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        c = self.cache
        return kv_bytes_per_token(c.num_layers, c.kv_heads, c.head_dim, self.dtype_bytes)

    def grow(self, old: int, new: int) -> None:
        c = self.cache
        shape = (1, c.kv_heads, new, c.head_dim)
        for layer in c.layers:
            keys = torch.zeros(shape, dtype=c.dtype, device=self.device)
            values = torch.zeros(shape, dtype=c.dtype, device=self.device)
            if layer.keys is not None:
                keys[:, :, :old] = layer.keys
                values[:, :, :old] = layer.values
            layer.keys, layer.values = keys, values
            layer.is_initialized = True
        extra = torch.zeros(new - old, dtype=torch.float32, device=self.device)
        self.scores = torch.cat([self.scores, extra])

    def shrink(self, capacity: int) -> None:
        for layer in self.cache.layers:
            if layer.keys is not None:
                layer.keys = layer.keys[:, :, :capacity].clone()
                layer.values = layer.values[:, :, :capacity].clone()
        self.scores = self.scores[:capacity].clone()

    # --- eviction -----------------------------------------------------------------------------------------------
    def rerotate(self, slots: np.ndarray, shifts: np.ndarray, seeds: list[int]) -> None:
        """Rotate the keys at ``slots`` by ``-shifts``: gather, one float32 rotation, one rounding, scatter."""
        c = self.cache
        idx = torch.as_tensor(slots, device=self.device)
        offsets = torch.as_tensor(-shifts, device=self.device)
        for layer in c.layers:
            rows = layer.keys[0].index_select(1, idx).transpose(0, 1).to(torch.float32)  # [n, Hkv, D]
            rot = rotate_tokens(rows, offsets, c.rope)
            if c.rounding == "stochastic":
                gen = torch.Generator(device=self.device)
                gen.manual_seed(seeds[layer.index])
                rot = stochastic_round(rot, c.dtype, gen)
            layer.keys.index_copy_(2, idx, rot.to(c.dtype).transpose(0, 1)[None])

    def release(self, slots: np.ndarray) -> None:
        if self.cache.collect_scores:
            self.scores[torch.as_tensor(slots, device=self.device)] = 0.0

    # --- migration ----------------------------------------------------------------------------------------------
    def move_rows(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Per layer, the source rows of K and V are gathered into scratch, then written to the destinations in
        place (no write can clobber a source another move still needs)."""
        src_t = torch.as_tensor(src, device=self.device)
        dst_t = torch.as_tensor(dst, device=self.device)
        for layer in self.cache.layers:
            for buf in (layer.keys, layer.values):
                rows = buf.index_select(2, src_t)  # scratch: the moved rows only
                buf.index_copy_(2, dst_t, rows)
                del rows
        if self.cache.collect_scores:
            moved = self.scores.index_select(0, src_t)
            self.scores[src_t] = 0.0
            self.scores.index_copy_(0, dst_t, moved)

    def scores_at(self, slots: np.ndarray) -> np.ndarray:
        idx = torch.as_tensor(slots, device=self.device)
        return self.scores.index_select(0, idx).cpu().numpy().astype(np.float32)

    # --- persistence (the MLX OmniCache's saved names: core/paged_cache.py) --------------------------------------
    def to_array(self, a: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(a)

    def to_numpy(self, a: torch.Tensor) -> np.ndarray:
        return a.detach().cpu().numpy()

    def scores_state(self) -> torch.Tensor:
        return self.scores

    def buffer_arrays(self) -> dict:
        arrays = {}
        for layer in self.cache.layers:
            if layer.keys is not None:
                arrays[f"layers.{layer.index}.keys"] = layer.keys
                arrays[f"layers.{layer.index}.values"] = layer.values
        return arrays

    def load_buffers(self, arrays: dict[str, torch.Tensor], capacity: int) -> None:
        c = self.cache
        for layer in c.layers:
            keys, values = arrays[f"layers.{layer.index}.keys"], arrays[f"layers.{layer.index}.values"]
            check_saved_buffers(layer.index, keys, values, (1, c.kv_heads, capacity, c.head_dim), c.dtype)
            layer.keys = keys.to(self.device).contiguous()
            layer.values = values.to(self.device).contiguous()
            layer.is_initialized = True

    def load_scores(self, arrays: dict[str, torch.Tensor], capacity: int) -> None:
        self.scores = (arrays["scores"].to(device=self.device, dtype=torch.float32).clone()
                       if self.cache.collect_scores
                       else torch.zeros(capacity, dtype=torch.float32, device=self.device))
