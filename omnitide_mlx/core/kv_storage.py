"""KVStorage: the tensor half of a paged KV cache, which :class:`~omnitide_mlx.core.paged_cache.PagedKVCache` is
composed with.

The cache (core) keeps the page table and decides which slots a step writes, which keys an eviction re-rotates and
by how much, which rows a migration moves, and what a saved file holds; its storage keeps every layer's K/V buffers
(and the per-slot H2O scores) in one array framework and does the tensor work those decisions need. The MLX storage
is ``omnitide_mlx/cache_storage.py: MlxKVStorage``, the PyTorch one ``omnitide_mlx/torch/cache_storage.py:
TorchKVStorage``. A storage is built for one cache and reads its shape (``kv_heads``, ``head_dim``, ``dtype``,
``rope``, ``rounding``, ``collect_scores``) and its ``layers`` (each with ``index``, ``keys``, ``values``,
``nbytes``). Slots are numpy int64 arrays; "arrays" are the framework's.
"""

from __future__ import annotations

from typing import Protocol


class KVStorage(Protocol):
    """What a :class:`~omnitide_mlx.core.paged_cache.PagedKVCache` asks of the buffers behind it."""

    @property
    def dtype_bytes(self) -> int:
        """Bytes of one element of the cache's dtype."""

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token across all layers (a quantised storage counts its packed rows and scales)."""

    def grow(self, old: int, new: int) -> None:
        """Extend every layer's buffers and the per-slot state from ``old`` to ``new`` slots (zero-filled)."""

    def shrink(self, capacity: int) -> None:
        """Cut every layer's buffers and the per-slot state to their first ``capacity`` slots (copies, so the old
        buffers are freed); the slots cut are free."""

    def rerotate(self, slots, shifts, seeds: list[int]) -> None:
        """Rotate the keys at ``slots`` by ``-shifts`` (one rotation per key, in float32, one rounding back to the
        cache's dtype); ``seeds[i]`` seeds layer ``i``'s stochastic rounding."""

    def release(self, slots) -> None:
        """Slots an eviction gave back: forget their scores and any per-slot state."""

    def move_rows(self, src, dst) -> None:
        """Move every layer's rows (and the scores) from ``src`` to ``dst`` slots; the sources are read before any
        destination is written."""

    def scores_at(self, slots):
        """The accumulated attention of ``slots`` (numpy float32)."""

    def to_array(self, a):
        """A numpy array as the framework's array."""

    def to_numpy(self, a):
        """A framework array as numpy."""

    def scores_state(self):
        """The per-slot scores as one saved array."""

    def buffer_arrays(self) -> dict:
        """Every buffer by saved name (``layers.{i}.keys`` / ``.values`` and any per-slot arrays of its own)."""

    def load_buffers(self, arrays: dict, capacity: int) -> None:
        """Install saved buffers of ``capacity`` slots, checked against the cache's shape and dtype."""

    def load_scores(self, arrays: dict, capacity: int) -> None:
        """Install saved scores (a score-collecting cache) or zeros for ``capacity`` slots."""
