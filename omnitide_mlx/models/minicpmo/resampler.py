"""The perceiver resampler: ``query_num`` learned queries cross-attend to a slice's SigLIP patches.

Keys get a 2-D sincos position embedding of the patch grid (computed in numpy float32 exactly as the official
``get_2d_sincos_pos_embed``: the first half of the channels encodes the column, the second the row); padded
patches of a batched slice are masked out (``key_padding_mask``). The attention is a ``torch.nn.MultiheadAttention``
in the checkpoint (fused ``in_proj_weight`` rows q, k, v) and is kept fused here.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np


def sincos_1d(dim: int, pos: np.ndarray) -> np.ndarray:
    omega = np.arange(dim // 2, dtype=np.float32)
    omega /= dim / 2.0
    omega = 1.0 / 10000 ** omega
    out = np.einsum("hw,d->hwd", pos, omega)
    return np.concatenate([np.sin(out), np.cos(out)], axis=-1)


def sincos_2d(dim: int, height: int, width: int) -> np.ndarray:
    """[height, width, dim] table: ``[i, j] = concat(E(j), E(i))`` with E the 1-D sincos of dim/2 channels."""
    grid_w, grid_h = np.meshgrid(np.arange(width, dtype=np.float32), np.arange(height, dtype=np.float32))
    return np.concatenate([sincos_1d(dim // 2, grid_w), sincos_1d(dim // 2, grid_h)], axis=-1).astype(np.float32)


class MultiheadAttention(nn.Module):
    """``torch.nn.MultiheadAttention`` (batch-second semantics dropped: inputs are [B, L, D])."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.in_proj_weight = mx.zeros((3 * dim, dim))
        self.in_proj_bias = mx.zeros((3 * dim,))
        self.out_proj = nn.Linear(dim, dim)

    def __call__(self, q: mx.array, k: mx.array, v: mx.array, key_mask: mx.array | None) -> mx.array:
        d = q.shape[-1]
        w, bias = self.in_proj_weight, self.in_proj_bias
        q = q @ w[:d].T + bias[:d]
        k = k @ w[d:2 * d].T + bias[d:2 * d]
        v = v @ w[2 * d:].T + bias[2 * d:]
        b = k.shape[0]

        def split(t):
            return t.reshape(t.shape[0], t.shape[1], self.heads, -1).transpose(0, 2, 1, 3)

        q = mx.broadcast_to(q, (b,) + q.shape[1:]) if q.shape[0] != b else q
        out = mx.fast.scaled_dot_product_attention(split(q), split(k), split(v), scale=(d // self.heads) ** -0.5,
                                                   mask=key_mask)
        return self.out_proj(out.transpose(0, 2, 1, 3).reshape(b, -1, d))


class Resampler(nn.Module):
    def __init__(self, num_queries: int, dim: int, heads: int, kv_dim: int):
        super().__init__()
        self.dim = dim
        self.query = mx.zeros((num_queries, dim))
        self.kv_proj = nn.Linear(kv_dim, dim, bias=False) if kv_dim != dim else None
        self.attn = MultiheadAttention(dim, heads)
        self.ln_q = nn.LayerNorm(dim, eps=1e-6)
        self.ln_kv = nn.LayerNorm(dim, eps=1e-6)
        self.ln_post = nn.LayerNorm(dim, eps=1e-6)
        self.proj = mx.zeros((dim, dim))
        self._pos_size = (0, 0)
        self._pos_table = None

    def pos_table(self, h: int, w: int) -> np.ndarray:
        """A sincos table covering an ``h x w`` grid (entries depend only on their own row and column, so a
        table grown on demand equals the official fixed 70 x 70 cache on every entry it holds)."""
        mh, mw = max(h, self._pos_size[0]), max(w, self._pos_size[1])
        if (mh, mw) != self._pos_size:
            self._pos_table = sincos_2d(self.dim, mh, mw)
            self._pos_size = (mh, mw)
        return self._pos_table

    def __call__(self, x: mx.array, tgt_sizes: np.ndarray) -> mx.array:
        """``x`` [B, Lmax, kv_dim] SigLIP outputs, ``tgt_sizes`` [B, 2] -> [B, num_queries, dim]."""
        tgt_sizes = np.asarray(tgt_sizes, dtype=np.int64).reshape(-1, 2)
        b, l_max = x.shape[0], x.shape[1]
        lengths = tgt_sizes[:, 0] * tgt_sizes[:, 1]
        table = self.pos_table(int(tgt_sizes[:, 0].max()), int(tgt_sizes[:, 1].max()))
        pos = np.zeros((b, l_max, self.dim), dtype=np.float32)
        for i, (h, w) in enumerate(tgt_sizes):
            pos[i, : h * w] = table[:h, :w].reshape(h * w, -1)
        if self.kv_proj is not None:
            x = self.kv_proj(x)
        x = self.ln_kv(x)
        q = self.ln_q(self.query)[None]
        mask = None
        if (lengths < l_max).any():
            mask = mx.array((np.arange(l_max)[None, :] < lengths[:, None])[:, None, None, :])
        out = self.attn(q, x + mx.array(pos).astype(x.dtype), x, mask)
        return self.ln_post(out) @ self.proj
