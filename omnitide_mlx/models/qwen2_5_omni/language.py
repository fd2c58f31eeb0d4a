"""The thinker's language model: a Qwen2 decoder (q/k/v biases, GQA, RMSNorm, SwiGLU) with M-RoPE.

The attention is Qwen2's own (below); the MLP and the pre-norm layer around it are the shared blocks
(models/blocks.py).

M-RoPE splits the head's rotary frequencies into bands (``mrope_section``, [16, 24, 24] in the released models):
band i reads its angles from position axis i % 3 (t, h, w). Rotation is NeoX style (halves, not pairs). When t, h
and w are equal (text) this is ordinary RoPE, and a uniform shift of all three axes is one plain NeoX rotation,
which is what the cache relies on to re-rotate keys after an eviction.

``LanguageModel.__call__(inputs_embeds [B, T, H], cache, positions [3, T] or [T]) -> logits`` is the generic entry
the session prefills every unit through; attention goes through the cache as docs/design.md shows.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ...cache import OmniCache
from .. import blocks
from ..attention import cached_attention, forward_step
from .config import TextConfig


def rotate_half(x: mx.array) -> mx.array:
    h = x.shape[-1] // 2
    return mx.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def mrope_cos_sin(positions: mx.array, inv_freq: mx.array, mrope_section: list[int], dtype: mx.Dtype
                  ) -> tuple[mx.array, mx.array]:
    """cos and sin ``[..., T, head_dim]`` for positions ``[3, ..., T]``: frequency j takes its angle from the axis
    of its band, and the half-dim table is repeated twice (rotate_half layout). Computed in float32."""
    axis_of_freq = np.concatenate([np.full(n, i % 3) for i, n in enumerate(mrope_section)])
    pos = positions.astype(mx.float32)[mx.array(axis_of_freq)]  # [hd/2, ..., T]: each frequency's own axis
    angles = mx.moveaxis(pos, 0, -1) * inv_freq  # [..., T, hd/2]
    angles = mx.concatenate([angles, angles], axis=-1)
    return mx.cos(angles).astype(dtype), mx.sin(angles).astype(dtype)


class Attention(nn.Module):
    def __init__(self, args: TextConfig):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = self.head_dim ** -0.5
        dim = args.hidden_size
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=False)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, cache=None, mask=None) -> mx.array:
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(b, t, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, t, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = cached_attention(q, k, v, cache, self.scale, mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, t, -1))


class DecoderLayer(blocks.DecoderLayer):
    """One Qwen2 layer: this attention in the shared pre-norm block (models/blocks.py); called as
    ``layer(x, cos, sin, cache, mask)``."""

    def __init__(self, args: TextConfig):
        super().__init__(Attention(args), args.hidden_size, args.intermediate_size, args.rms_norm_eps)


class TextModel(nn.Module):
    """Checkpoint prefix ``model.``: embeddings, decoder layers, final norm."""

    def __init__(self, args: TextConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class LanguageModel(nn.Module):
    def __init__(self, args: TextConfig, tie_word_embeddings: bool = False):
        super().__init__()
        self.args = args
        self.model = TextModel(args)
        self.tie_word_embeddings = tie_word_embeddings
        if not tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        hd = args.head_dim
        self._inv_freq = mx.array(1.0 / (args.rope_theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd)),
                                  dtype=mx.float32)

    @property
    def layers(self):
        return self.model.layers

    @property
    def embed_tokens(self) -> nn.Module:
        return self.model.embed_tokens

    def embed(self, input_ids) -> mx.array:
        return self.model.embed_tokens(mx.array(np.asarray(input_ids)) if not isinstance(input_ids, mx.array)
                                       else input_ids)

    def hidden_states(self, inputs_embeds: mx.array, cache=None, positions=None, mask=None) -> mx.array:
        """Final-norm hidden states ``[B, T, H]``. ``mask``: an optional additive or boolean attention mask
        (batches with padding; not with OmniCache, which builds its own visibility)."""
        h = inputs_embeds if inputs_embeds.ndim == 3 else inputs_embeds[None]
        t = h.shape[1]
        if positions is None:
            offset = 0
            if cache is not None and not isinstance(cache, OmniCache):
                offset = cache[0].offset
            positions = np.arange(offset, offset + t)
        pos = positions if isinstance(positions, mx.array) else mx.array(np.asarray(positions, dtype=np.int64))
        if pos.ndim == 1:
            pos = mx.broadcast_to(pos[None], (3, t))
        if pos.shape[0] != 3 or pos.shape[-1] != t or pos.ndim not in (2, 3):
            raise ValueError(f"positions must be [3, {t}], [3, B, {t}] or [{t}], got {tuple(pos.shape)}")
        cos, sin = mrope_cos_sin(pos, self._inv_freq, self.args.mrope_section, h.dtype)
        if pos.ndim == 3:  # per-sequence positions: [B, 1, T, hd] against [B, heads, T, hd]
            cos, sin = cos[:, None], sin[:, None]
        with forward_step(cache, t, len(self.layers)) as layer_caches:
            for layer, c in zip(self.layers, layer_caches):
                h = layer(h, cos, sin, c, mask)
        return self.model.norm(h)

    def logits(self, hidden: mx.array) -> mx.array:
        if self.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    def __call__(self, inputs_embeds: mx.array, cache=None, positions=None, mask=None,
                 last_only: bool = False) -> mx.array:
        """Logits ``[B, T, vocab]`` for ``inputs_embeds`` ``[B, T, H]`` (or ``[T, H]``) at ``positions``
        (``[3, T]`` TMRoPE positions, or ``[T]`` for text; None: sequential after what the cache holds).
        ``last_only``: logits of the last position only (``[B, 1, vocab]``): a streaming prefill needs no more,
        and a 2,300-token unit's full logits would cost a 152K-wide matmul per token and gigabytes."""
        h = self.hidden_states(inputs_embeds, cache, positions, mask)
        return self.logits(h[:, -1:] if last_only else h)
