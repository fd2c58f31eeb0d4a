"""Attention and migration kernels: Metal sources in ``metal/`` for Apple GPUs, MLX-ops references elsewhere.

Both implementations of a kernel share one contract (docs/design.md); the references are also the oracles the
Metal kernels are tested against (tests/metal_check on Linux, tests/metal on a Mac).
"""

from .attention import (
    DECODE_TILE,
    PREFILL_TILE,
    AttentionError,
    TilePlan,
    backend,
    merge_partials,
    metal_attention_spec,
    plan_tiles,
    reference_attention,
    tile_skip_attention,
)
from .compact import page_compact, page_compact_reference, page_compact_spec

__all__ = [
    "DECODE_TILE", "PREFILL_TILE", "AttentionError", "TilePlan", "backend", "merge_partials",
    "metal_attention_spec", "page_compact", "page_compact_reference", "page_compact_spec", "plan_tiles",
    "reference_attention", "tile_skip_attention",
]
