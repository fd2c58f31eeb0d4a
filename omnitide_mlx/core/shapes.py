"""A language model's shape and the KV bytes it costs per token, each defined once (no framework, no weights).

A shape is what sizes a model's KV cache and its per-token compute: layers, query / KV heads, head dim, hidden and
MLP sizes, vocabulary and RoPE base. The released models' shapes are data in their folders' family records
(``models/<family>/family.py``: the released ``config.json`` figures with their sources); the simulator's profiles,
both attention benchmarks and the stream benchmark's shape-true models read them there, and a loaded checkpoint's
shape comes from its own config.json through its record (``models/budget.py``).
"""

from __future__ import annotations

from dataclasses import dataclass


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2, kv_bits: int | None = None,
                       group_size: int = 64) -> int:
    """K and V bytes of one token over all layers, the one definition (the caches, the budgets, the simulator and
    the benchmarks all call it): float, ``2 x layers x kv_heads x head_dim x dtype_bytes``; quantised to
    ``kv_bits``, a row is the packed values plus a scale and a bias (``dtype_bytes`` each, the cache dtype's) per
    group of ``group_size``, as mlx's ``quantize`` stores it."""
    if not kv_bits:
        row = head_dim * dtype_bytes
    else:
        row = head_dim * kv_bits // 8 + 2 * (head_dim // group_size) * dtype_bytes
    return 2 * layers * kv_heads * row


@dataclass(frozen=True)
class ModelShape:
    """One language model's shape (the decoder that holds the KV cache)."""

    name: str
    family: str  # the model family record's name (models/family.py): which port's decoder and unit layout
    layers: int
    hidden: int
    intermediate: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rope_theta: float = 1e6
    source: str = ""  # where the figures come from

    def kv_bytes_per_token(self, dtype_bytes: int = 2, kv_bits: int | None = None, group_size: int = 64) -> int:
        """K and V of every layer for one token (:func:`kv_bytes_per_token`)."""
        return kv_bytes_per_token(self.layers, self.kv_heads, self.head_dim, dtype_bytes, kv_bits, group_size)

    def linear_macs_per_token(self) -> int:
        """Multiply-adds of one token through one layer's projections and MLP (norms, RoPE, biases left out)."""
        q = self.q_heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        return self.hidden * q + 2 * self.hidden * kv + q * self.hidden + 3 * self.hidden * self.intermediate

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in ("name", "family", "layers", "hidden", "intermediate", "q_heads",
                                               "kv_heads", "head_dim", "vocab", "rope_theta")}
