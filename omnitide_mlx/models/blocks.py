"""The decoder blocks every language model here shares: the SwiGLU MLP and the pre-norm decoder layer.

Qwen2.5-Omni's thinker and talker (Qwen2), MiniCPM-o 4.5's LLM (Qwen3) and the GGUF Llama differ only in their
attention (biases, q/k norms, M-RoPE or 1-D RoPE, traditional or NeoX rotation); each model module keeps its own
``Attention`` and builds its layers from these blocks. Parameter names are the checkpoints' (``self_attn``,
``mlp.{gate,up,down}_proj``, ``input_layernorm``, ``post_attention_layernorm``), so weights load unchanged.

Why not mlx-lm's own ``TransformerBlock`` (as mlx-vlm reuses it): its attention is built in, takes RoPE offsets from
an mlx-lm cache and calls ``cache.update_and_fetch``; ours take explicit (TMRoPE) positions and attend through an
``OmniLayerCache`` (models/attention.py: ``cached_attention``). mlx-lm's ``qwen3.MLP`` would fit (same names, and
its compiled ``swiglu`` gives bit-identical results on the CPU in float16, bfloat16 and float32), but it has no bias
switch (the Qwen vision tower's MLP has biases) and mlx-lm's model classes are no stable API to build on; these eight
lines are ours.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..kernels.cpu_math import silu


class MLP(nn.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, dim: int, hidden: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(silu(self.gate_proj(x)) * self.up_proj(x))  # nn.silu; faster on the CPU


class DecoderLayer(nn.Module):
    """Pre-norm residual block: ``h = x + self_attn(input_layernorm(x), *attn_args)``, then
    ``h + mlp(post_attention_layernorm(h))``. ``attention`` is the model's own attention module; whatever the layer
    is called with after ``x`` (positions or cos / sin, the layer's cache, a mask) is passed on to it."""

    def __init__(self, attention: nn.Module, hidden_size: int, intermediate_size: int, eps: float):
        super().__init__()
        self.self_attn = attention
        self.mlp = MLP(hidden_size, intermediate_size)
        self.input_layernorm = nn.RMSNorm(hidden_size, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(hidden_size, eps=eps)

    def __call__(self, x: mx.array, *attn_args) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), *attn_args)
        return h + self.mlp(self.post_attention_layernorm(h))
