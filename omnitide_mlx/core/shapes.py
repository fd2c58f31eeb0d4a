"""Language-model shapes of the models omnitide streams, declared once (no framework, no weights).

A shape is what sizes a model's KV cache and its per-token compute: layers, query / KV heads, head dim, hidden and
MLP sizes, vocabulary and RoPE base. The simulator's profiles (``core/profiles.py``), both attention benchmarks (via
the profiles) and the stream benchmark's shape-true models (``bench/shape_models.py``) all read them from here.

Every figure is the released checkpoint's ``config.json`` (the thinker's ``text_config`` for Qwen2.5-Omni, the LLM's
config for MiniCPM-o), as written down with its source in ``shared/reference/`` (``qwen2_5_omni.md`` "Sub-config
defaults" and "3B"; ``minicpm_o_4_5.md`` 1.2 "Sizes") and docs/models/. A loaded model takes its shape from its own
config.json, never from here: ``models/budget.py`` and the ports' ``kv_spec()`` read the checkpoint.
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
    family: str  # "qwen2_5_omni" (Qwen2 decoder, q/k/v biases, M-RoPE) or "minicpmo" (Qwen3: q/k norms, 1-D RoPE)
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


QWEN2_5_OMNI_7B = ModelShape(
    "qwen2.5-omni-7b", "qwen2_5_omni", layers=28, hidden=3584, intermediate=18944, q_heads=28, kv_heads=4,
    head_dim=128, vocab=152064, rope_theta=1e6,
    source="Qwen/Qwen2.5-Omni-7B thinker text_config (= transformers' Qwen2_5OmniTextConfig defaults; a Qwen2.5-7B "
           "LLM): shared/reference/qwen2_5_omni.md, 'Sub-config defaults'")
QWEN2_5_OMNI_3B = ModelShape(
    "qwen2.5-omni-3b", "qwen2_5_omni", layers=36, hidden=2048, intermediate=11008, q_heads=16, kv_heads=2,
    head_dim=128, vocab=151936, rope_theta=1e6,
    source="Qwen/Qwen2.5-Omni-3B thinker text_config (a Qwen2.5-3B LLM): shared/reference/qwen2_5_omni.md, '3B'")
MINICPM_O_4_5 = ModelShape(
    "minicpm-o-4.5", "minicpmo", layers=36, hidden=4096, intermediate=12288, q_heads=32, kv_heads=8, head_dim=128,
    vocab=151748, rope_theta=1e6,
    source="openbmb/MiniCPM-o-4_5 config.json (a Qwen3-8B LLM): shared/reference/minicpm_o_4_5.md, 1.2 'Sizes'")
MINICPM_O_2_6 = ModelShape(
    "minicpm-o-2.6", "minicpmo", layers=28, hidden=3584, intermediate=18944, q_heads=28, kv_heads=4, head_dim=128,
    vocab=151700, rope_theta=1e6,
    source="openbmb/MiniCPM-o-2_6 config.json (a Qwen2.5-7B LLM; no port, simulator profile only)")

SHAPES: dict[str, ModelShape] = {s.name: s for s in (QWEN2_5_OMNI_7B, QWEN2_5_OMNI_3B, MINICPM_O_4_5, MINICPM_O_2_6)}
