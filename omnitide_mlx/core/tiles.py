"""Per-step tile planning for attention over a paged KV buffer: the framework-neutral half (numpy only).

Both attention paths (MLX: ``kernels/attention.py: plan_tiles``; PyTorch: ``torch/attention.py: plan_step``)
plan a forward step once and share the plan across every layer. What they share lives here once: the buffer's
serials (``key_seq[j]`` = serial of the entry in slot ``j``, -1 free; key ``j`` is visible to query ``i`` iff
``0 <= key_seq[j] <= q_seq[i]``), the step's query serials, the active tiles (given by the page table, or the
occupied ones), their validation, the page-rounded span and each active tile's smallest serial. Each path adds
its own arrays (MLX arrays, torch tensors) and its kernel-specific checks on top. ``AttentionError`` is the one
error of the attention contract for both paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .errors import OmniTideError

NO_SEQ = int(np.iinfo(np.int32).max)  # the serial a free slot gets in ``visible_key``: visible to no query


class AttentionError(OmniTideError, ValueError):
    """Arguments that break the attention contract (shapes, tiles, a step with no visible key, an unknown kernel),
    on either path."""


@dataclass(frozen=True)
class StepTiles:
    """The host-side facts about one step's keys and queries that every layer (and both paths) share."""

    tile: int
    capacity: int
    key_seq: np.ndarray  # [capacity] int64, own copy: serial per slot, -1 free (the step's new slots included)
    q_seq: np.ndarray  # [T] int64: the serials of the step's tokens
    tiles: np.ndarray  # sorted, unique active tile ids (int64)

    @property
    def n_tiles(self) -> int:
        return int(self.tiles.shape[0])

    @property
    def active_slots(self) -> int:
        return self.n_tiles * self.tile

    @property
    def span(self) -> int:
        """The tile-rounded end of the last active tile (0 when none is active)."""
        return int(self.tiles[-1] + 1) * self.tile if self.tiles.size else 0

    @cached_property
    def visible_key(self) -> np.ndarray:
        """``key_seq`` with free slots as ``NO_SEQ``: one comparison ``visible_key <= q`` masks holes and the
        future."""
        return np.where(self.key_seq < 0, NO_SEQ, self.key_seq)

    @cached_property
    def tile_min(self) -> np.ndarray:
        """Per active tile, the smallest serial it holds (``NO_SEQ`` when it holds none)."""
        if not self.tiles.size:
            return np.zeros(0, np.int64)
        return self.visible_key.reshape(-1, self.tile)[self.tiles].min(axis=1)


class OnStepTiles:
    """Read-through of a :class:`StepTiles` held as ``self.step``: what both paths' step plans (MLX ``TilePlan``,
    torch ``StepPlan``) expose of the framework-neutral plan, written once."""

    step: StepTiles

    @property
    def tile(self) -> int:
        return self.step.tile

    @property
    def capacity(self) -> int:
        return self.step.capacity

    @property
    def tiles(self) -> np.ndarray:
        """Sorted active tile ids (int64)."""
        return self.step.tiles

    @property
    def tile_min(self) -> np.ndarray:
        """Per active tile: the smallest serial it holds (``NO_SEQ`` when it holds none)."""
        return self.step.tile_min

    @property
    def n_tiles(self) -> int:
        return self.step.n_tiles

    @property
    def active_slots(self) -> int:
        return self.step.active_slots

    @property
    def span(self) -> int:
        return self.step.span


def plan_step_tiles(key_seq, q_seq, tile: int, tiles=None) -> StepTiles:
    """Validate one step's page-table side and plan its tiles. ``key_seq`` (1-D) must cover whole tiles of
    ``tile`` slots; ``q_seq`` (1-D) serials must be >= 0. ``tiles``: the active tile ids (any order; unique, in
    range), or None for the tiles holding any entry. Raises :class:`AttentionError`."""
    key = np.array(key_seq, dtype=np.int64)  # a copy: the table's arrays are read-only and change later
    qs = np.array(q_seq, dtype=np.int64)
    if key.ndim != 1 or key.size % tile:
        raise AttentionError(f"key_seq must cover whole pages of {tile} slots: capacity {key.size} (shape "
                             f"{key.shape}) is not a multiple of the tile size {tile}")
    if qs.ndim != 1:
        raise AttentionError(f"q_seq must be 1-D, got shape {qs.shape}")
    if qs.size and qs.min() < 0:
        raise AttentionError("q_seq must be >= 0")
    n = key.size // tile
    if tiles is None:
        t = np.flatnonzero((key >= 0).reshape(n, tile).any(axis=1)).astype(np.int64)
    else:
        t = np.sort(np.asarray(tiles, dtype=np.int64).reshape(-1))
        if t.size:
            if t[0] < 0 or t[-1] >= n:
                raise AttentionError(f"tile ids must lie in [0, {n}), got [{t[0]}, {t[-1]}]")
            if np.any(t[1:] == t[:-1]):
                raise AttentionError("tile ids must be unique")
    return StepTiles(tile=int(tile), capacity=int(key.size), key_seq=key, q_seq=qs, tiles=t)
