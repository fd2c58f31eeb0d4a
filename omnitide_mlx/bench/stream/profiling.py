"""The engine with optional attention profiling, and the step counter that notes each forward step's tokens and
the keys its queries visit (the session's FLOP count)."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from ...cache import DECODE_MAX_TOKENS, OmniCache, OmniLayerCache
from ...core.page import PageTable
from ...session import MlxBackend, keep_cpu_buffers


class ProfiledLayerCache(OmniLayerCache):
    """``attend`` timed between evaluated inputs and evaluated output (profiled runs only)."""

    def attend(self, q, k, v, scale):
        mx.eval(q, k, v)
        t0 = time.perf_counter()
        out = super().attend(q, k, v, scale)
        mx.eval(out)
        self._parent.record_attention(q.shape[2], time.perf_counter() - t0)
        return out


class ProfiledOmniCache(OmniCache):
    """OmniCache that adds up attention time (prefill / decode steps apart) and migration time."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.layers = [ProfiledLayerCache(self, i) for i in range(self.num_layers)]
        self.attention_s = {"prefill": 0.0, "decode": 0.0}
        self.migration_s = 0.0

    def record_attention(self, tokens: int, seconds: float) -> None:
        self.attention_s["decode" if tokens <= DECODE_MAX_TOKENS else "prefill"] += seconds

    def migrate(self, plan) -> int:
        t0 = time.perf_counter()
        moved = super().migrate(plan)
        mx.synchronize()
        self.migration_s += time.perf_counter() - t0
        return moved


class ProfiledBackend(MlxBackend):
    """The MLX backend over a ProfiledOmniCache."""

    def make_cache(self, model, spec, *, dtype, placement, page_size, subblock_size, collect_scores, kv_quant):
        keep_cpu_buffers()  # as MlxBackend.make_cache does
        return ProfiledOmniCache.for_spec(spec, dtype=dtype, page_size=page_size, subblock_size=subblock_size,
                                          placement=placement, collect_scores=collect_scores, **kv_quant)


class StepCounter:
    """A backend (``MlxBackend`` or ``ProfiledBackend``) wrapped to note, per forward step, its tokens and the keys
    its queries visit (for the session's FLOP count), and the physical span right after each unit's prefill (the
    span attention walked before maintenance: the peak span counts it). The engine variant says which forwards
    are prefills (``prefills``: how many of the next forwards are); every other call goes to the backend."""

    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name
        self.quantised_kv = inner.quantised_kv
        self.steps: list[tuple[int, int]] = []  # (tokens, keys visited) per forward step
        self.prefills = 1  # the system prompt's, in the session's constructor
        self.prefill_span = 0
        self.peak_span = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, model, cache, embeds, positions, *, hidden=False, extras=None):
        out = self.inner.forward(model, cache, embeds, positions, hidden=hidden, extras=extras)  # evaluation already started
        t = int(embeds.shape[0])  # (async): the count overlaps it
        table = cache.page_table
        slots = np.flatnonzero(table.seq >= table.next_seq - t)
        tile = table.subblock_size if t <= DECODE_MAX_TOKENS else table.page_size
        self.steps.append((t, tile_keys_visited(table, slots, tile)[1]))
        if self.prefills:
            self.prefills -= 1
            self.prefill_span = table.stats().physical_span
            self.peak_span = max(self.peak_span, self.prefill_span)
        return out


def tile_keys_visited(table: PageTable, slots: np.ndarray, tile: int) -> tuple[int, int]:
    """(active slots, keys visited summed over the step's queries): a query reads every slot of each active tile
    that holds a key visible to it (holes included), as a tile-skipping kernel does."""
    seq = table.seq
    tiles = table.active_pages() if tile == table.page_size else table.active_subblocks()
    key = np.where(seq < 0, np.iinfo(np.int64).max, seq).reshape(-1, tile)[tiles]
    tile_min = np.sort(key.min(axis=1))
    visible = np.searchsorted(tile_min, seq[slots], side="right")
    return int(tiles.size * tile), int(visible.sum() * tile)
