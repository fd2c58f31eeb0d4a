"""A Llama decoder (GQA, RMSNorm, SwiGLU, RoPE) on MLX, with weights from a GGUF file.

Attention goes through the cache as docs/design.md fixes it: an ``OmniCache`` (begin_step / per-layer ``attend`` /
end_step), an mlx-lm ``KVCache`` list (``update_and_fetch``), or None. RoPE is *traditional* (interleaved pairs)
because GGUF's q / k rows are permuted for it (gguf_file.py); the cache's ``RopeSpec`` says so, which makes the
re-rotation of kept keys after an eviction exact. The MLP and the pre-norm layer around the attention are the
shared blocks (models/blocks.py).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ...rope import RopeSpec
from .. import blocks
from ..attention import cached_attention, forward_step, rope_at, sequential_positions
from ..base import KVSpec
from .gguf_file import LlamaConfig


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.scale = c.head_dim ** -0.5
        self.rope_base = c.rope_theta
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def __call__(self, x: mx.array, positions, cache) -> mx.array:
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(b, t, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, t, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        q = rope_at(q, positions, self.head_dim, self.rope_base, traditional=True)
        k = rope_at(k, positions, self.head_dim, self.rope_base, traditional=True)
        out = cached_attention(q, k, v, cache, self.scale)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, t, -1))


class DecoderLayer(blocks.DecoderLayer):
    """One Llama layer: this attention in the shared pre-norm block (models/blocks.py); called as
    ``layer(x, positions, cache)``."""

    def __init__(self, c: LlamaConfig):
        super().__init__(Attention(c), c.hidden_size, c.intermediate_size, c.rms_norm_eps)


class LlamaModel(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = [DecoderLayer(c) for _ in range(c.num_hidden_layers)]
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)


class LanguageModel(nn.Module):
    """``language_model(inputs_embeds [1, T, H], cache, positions [T]) -> logits [1, T, vocab]``."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def layers(self):
        return self.model.layers

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.embed_tokens

    def hidden_states(self, inputs_embeds: mx.array, cache=None, positions=None) -> mx.array:
        h = inputs_embeds if inputs_embeds.ndim == 3 else inputs_embeds[None]
        t = h.shape[1]
        pos = sequential_positions(positions, t, cache)
        with forward_step(cache, t, len(self.layers)) as layer_caches:
            for layer, c in zip(self.layers, layer_caches):
                h = layer(h, pos, c)
        return self.model.norm(h)

    def __call__(self, inputs_embeds: mx.array, cache=None, positions=None, last_only: bool = False) -> mx.array:
        """``last_only``: the last position's logits only (``[B, 1, vocab]``), all a streaming session reads (the
        vocabulary projection is a large share of a short step on a CPU)."""
        h = self.hidden_states(inputs_embeds, cache, positions)
        if last_only:
            h = h[:, -1:]
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def make_cache(self):
        """One mlx-lm ``KVCache`` per layer (unbounded: the reference in tests)."""
        from mlx_lm.models.cache import KVCache

        return [KVCache() for _ in self.layers]

    def rope_spec(self) -> RopeSpec:
        return RopeSpec(self.config.head_dim, self.config.rope_theta, traditional=True)


class Model(nn.Module):
    """What the session needs of a model: ``language_model``, ``kv_spec()``, ``stream_adapter(tokenizer)``."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.language_model = LanguageModel(config)

    @property
    def dtype(self) -> mx.Dtype:
        return self.language_model.model.norm.weight.dtype

    def kv_spec(self) -> KVSpec:
        c = self.config
        return KVSpec(num_layers=c.num_hidden_layers, kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                      rope=self.language_model.rope_spec(), position_axes=1)

    def stream_adapter(self, tokenizer, **kw):
        from .adapter import TextStreamAdapter

        return TextStreamAdapter(self, tokenizer, **kw)

    def load_weights_from(self, weights: dict[str, np.ndarray], dtype=mx.float32) -> None:
        """Load ``gguf_file.read_weights`` output; every parameter must be there with its shape."""
        from mlx.utils import tree_flatten

        from .gguf_file import GGUFError

        want = {f"{k}": v.shape for k, v in tree_flatten(self.language_model.parameters())}
        missing = sorted(set(want) - set(weights))
        unexpected = sorted(set(weights) - set(want))
        bad = sorted(k for k in set(want) & set(weights) if tuple(weights[k].shape) != tuple(want[k]))
        if missing or unexpected or bad:
            detail = "; ".join(f"{what}: {', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''}"
                               for what, keys in (("missing", missing), ("unexpected", unexpected),
                                                  ("mis-shaped", bad)) if keys)
            raise GGUFError(f"the GGUF weights do not match the config ({detail})")
        self.language_model.load_weights([(k, mx.array(v).astype(dtype)) for k, v in weights.items()])
        mx.eval(self.language_model.parameters())
