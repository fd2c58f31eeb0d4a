"""Qwen3, MiniCPM-o 4.5's language model: GQA attention with RMSNorm on q and k per head, plain NeoX RoPE.

Attention goes through the cache the way docs/design.md fixes it: an ``OmniCache`` (begin_step / per-layer
``attend`` / end_step), an mlx-lm ``KVCache`` / ``RotatingKVCache`` list (``update_and_fetch``), or None. The MLP and
the pre-norm layer around the attention are the shared blocks (models/blocks.py).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ...rope import RopeSpec
from .. import blocks
from ..attention import cached_attention, forward_step, rope_at, sequential_positions
from .config import TextConfig


class Attention(nn.Module):
    def __init__(self, args: TextConfig):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = self.head_dim ** -0.5
        self.rope_base = args.rope_theta
        dim = args.hidden_size
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, positions, cache) -> mx.array:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(b, t, self.n_heads, self.head_dim)).transpose(0, 2, 1, 3)
        k = self.k_norm(self.k_proj(x).reshape(b, t, self.n_kv_heads, self.head_dim)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, t, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        q = rope_at(q, positions, self.head_dim, self.rope_base)
        k = rope_at(k, positions, self.head_dim, self.rope_base)
        out = cached_attention(q, k, v, cache, self.scale)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, t, -1))


class DecoderLayer(blocks.DecoderLayer):
    """One Qwen3 layer: this attention in the shared pre-norm block (models/blocks.py); called as
    ``layer(x, positions, cache)``."""

    def __init__(self, args: TextConfig):
        super().__init__(Attention(args), args.hidden_size, args.intermediate_size, args.rms_norm_eps)


class Qwen3Model(nn.Module):
    def __init__(self, args: TextConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class LanguageModel(nn.Module):
    """``language_model(inputs_embeds [1, T, H], cache, positions [T])`` -> logits [1, T, vocab]."""

    def __init__(self, args: TextConfig):
        super().__init__()
        self.args = args
        self.model = Qwen3Model(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    @property
    def layers(self):
        return self.model.layers

    @property
    def embed_tokens(self) -> nn.Embedding:
        """The token embedding (call it with an int32 ``mx.array`` of ids)."""
        return self.model.embed_tokens

    def hidden_states(self, inputs_embeds: mx.array, cache=None, positions=None) -> mx.array:
        """The final-norm hidden states [B, T, H] (what the logits are computed from)."""
        if inputs_embeds.ndim == 2:
            inputs_embeds = inputs_embeds[None]
        t = inputs_embeds.shape[1]
        pos = sequential_positions(positions, t, cache)
        h = inputs_embeds
        with forward_step(cache, t, len(self.model.layers)) as layer_caches:
            for layer, c in zip(self.model.layers, layer_caches):
                h = layer(h, pos, c)
        return self.model.norm(h)

    def logits(self, hidden: mx.array) -> mx.array:
        """Logits of final-norm hidden states (a spoken reply computes both from one forward)."""
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    def __call__(self, inputs_embeds: mx.array, cache=None, positions=None, last_only: bool = False) -> mx.array:
        """Logits ``[B, T, vocab]``; ``last_only``: of the last position only (``[B, 1, vocab]``), all a streaming
        prefill needs (the full logits of a unit cost a vocabulary-wide matmul per token)."""
        h = self.hidden_states(inputs_embeds, cache, positions)
        return self.logits(h[:, -1:] if last_only else h)

    def make_cache(self):
        """One mlx-lm ``KVCache`` per layer (plain, unbounded: for tests and the simplex session)."""
        from mlx_lm.models.cache import KVCache

        return [KVCache() for _ in self.model.layers]

    def rope_spec(self) -> RopeSpec:
        return RopeSpec(self.args.head_dim, self.args.rope_theta, traditional=False)
