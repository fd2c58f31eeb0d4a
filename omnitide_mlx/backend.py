"""The backend protocol: what the streaming engine asks of an array framework. Imports no array framework.

A :class:`~omnitide_mlx.engine.StreamingSession` is composed of a backend object; the engine keeps everything
else (units, retention, replies, threads, persistence). Two backends exist:

- ``MlxBackend`` (``omnitide_mlx/session.py``, used by ``OmniSession``): the MLX ports, the OmniCache with its
  Metal / tile-skip attention, mlx-lm's samplers, MLX safetensors;
- ``TorchBackend`` (``omnitide_mlx/torch/session.py``, used by ``TorchSession``): transformers' Qwen2.5-Omni
  thinker, the OmniTorchCache, torch sampling and safetensors. It never imports MLX.

A backend is one object per session (the torch one holds its device, load dtype, kernel and OmniPage migration
mode). Every method takes what it works on (model, cache) as arguments, so a wrapper (the stream benchmark's
step counter, ``bench/stream/profiling.py``) can observe calls without knowing the engine's internals.

Arrays: ``logits`` / ``embeds`` / ``hidden`` are the backend's own array type; ``positions`` are numpy
``[axes, T]`` int arrays (one row per rotary axis); ``to_numpy`` brings an array back to the host.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Backend(Protocol):
    """An array framework as the engine uses it."""

    name: str  # "mlx", "torch": recorded in saved sessions and reported by stats()
    quantised_kv: bool  # whether make_cache takes kv_quant options (quantised K/V)

    # --- model ---------------------------------------------------------------------------------------------
    def load_model(self, path) -> tuple[Any, Any]:
        """``(model, processor)`` from a local path or a Hugging Face id."""

    def default_kv_dtype(self, model) -> Any:
        """The KV dtype when the caller gives none (the model's activation dtype)."""

    def dtype_from_name(self, name: str) -> Any:
        """The dtype a saved session names (``float16``, ...); ValueError for one the backend lacks."""

    def dtype_name(self, dtype) -> str:
        """The name ``dtype_from_name`` reads back."""

    # --- cache ---------------------------------------------------------------------------------------------
    def layout_spec(self, name: str) -> Any:
        """The ``core.layout.LayoutSpec`` a policy's layout name (``native`` / ``omnipage`` / ``eager``) means on
        this backend (the torch backend picks OmniPage's migration mode for its kernels)."""

    def kv_bytes_per_token(self, spec, dtype, kv_quant: dict) -> int:
        """KV bytes one token costs in a cache ``make_cache`` would build (a KV budget divides by this)."""

    def make_cache(self, model, spec, *, dtype, placement: str, page_size: int, subblock_size: int,
                   collect_scores: bool, kv_quant: dict) -> Any:
        """An empty paged KV cache (a ``core.paged_cache.PagedKVCache``) for the model's ``KVSpec``."""

    def load_cache(self, model, path: Path) -> Any:
        """The cache a session saved to ``path`` (``cache.save``), on the model's device. A backend whose
        layout depends on the saved table (the torch OmniPage migration mode) adopts it here."""

    # --- steps -----------------------------------------------------------------------------------------------
    def forward(self, model, cache, embeds, positions: np.ndarray, *, hidden: bool = False,
                extras: dict | None = None) -> tuple[Any, Any]:
        """Prefill ``embeds`` ``[T, hidden]`` at ``positions`` ``[axes, T]`` into ``cache``; returns the last
        token's logits ``[vocab]`` and, with ``hidden``, the final-norm hidden states ``[T, hidden]`` (None
        from a backend that does not keep them). ``extras``: the unit's ``PreparedUnit.extras``; the entries
        whose names are keyword arguments of the model's language model are passed to it (Qwen3-Omni's
        ``deepstack``: visual features added after its first decoder layers). Evaluation may still be running
        (``eval`` waits). A failed forward leaves the cache as it was."""

    def eval(self, *arrays) -> None:
        """Wait until ``arrays`` (None entries ignored) are computed."""

    def sampler(self, sampling) -> Callable[[Any, list[int]], int]:
        """``(logits, generated ids) -> next id`` for a ``Sampling`` (mlx-lm's semantics; ``temp`` 0 greedy)."""

    # --- array I/O -------------------------------------------------------------------------------------------
    def to_numpy(self, array) -> np.ndarray:
        """A float32 host copy of a floating array."""

    def save_arrays(self, path: Path, arrays: dict) -> None:
        """Write named arrays (the backend's or numpy) to a safetensors file."""

    def load_arrays(self, path: Path) -> dict:
        """The named arrays of a safetensors file written by ``save_arrays``."""
