"""SigLIP (navit) vision tower: variable-size images as padded batches of 14x14 patches.

Inputs are the official processor's layout: each slice is ``(3, 14, L*14)``, its ``L = h*w`` patches (row-major)
laid side by side, with ``tgt_size = (h, w)``. Slices of different sizes are padded into one batch; padded patches
are masked as keys (the official ``patch_attention_mask``) and get position id 0.

Position ids are NaViT *buckets* of a fixed ``n x n`` table (n = image_size / patch_size = 70 in the release), and
the official code computes them with float32 ``torch.arange``, whose rounding decides a bucket at some side lengths
(nb = 25, 49, 50, ... differ from exact arithmetic). ``torch_arange_f32`` reproduces torch's CPU kernel bit for bit:
the double-precision base of each 8-lane vector block rounded to float32, plus ``lane * step`` in double, and the
scalar formula for the tail that does not fill two vectors.
"""

from __future__ import annotations

import math
from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .config import ModelConfig, VisionConfig

_TORCH_VEC_LANES = 8  # float32 lanes of torch's CPU Vectorized<float> (AVX2); the loop unrolls two vectors


def torch_arange_f32(start: float, end: float, step: float) -> np.ndarray:
    """``torch.arange(start, end, step)`` in float32 on CPU, value for value."""
    n = int(math.ceil((end - start) / step))
    idx = np.arange(max(n, 0))
    vec_end = (n // (2 * _TORCH_VEC_LANES)) * (2 * _TORCH_VEC_LANES)
    lane = idx % _TORCH_VEC_LANES
    base = (start + step * (idx - lane)).astype(np.float32).astype(np.float64)
    vec = (base + lane * step).astype(np.float32)
    scalar = (start + step * idx).astype(np.float32)
    return np.where(idx < vec_end, vec, scalar)


@lru_cache(maxsize=512)
def bucket_ids(num_patches: int, patches_per_side: int) -> np.ndarray:
    """Bucket (0..n-1) of each of ``num_patches`` patches along one side, as the official SigLIP embedding
    computes it: ``bucketize(arange(0, 1 - 1e-6, 1/nb), arange(1/n, 1, 1/n), right=True)`` in float32."""
    n = patches_per_side
    boundaries = torch_arange_f32(1.0 / n, 1.0, 1.0 / n)
    fractions = torch_arange_f32(0.0, 1.0 - 1e-6, 1.0 / num_patches)
    out = np.searchsorted(boundaries, fractions, side="right").astype(np.int32)
    out.setflags(write=False)
    return out


def position_ids(h: int, w: int, patches_per_side: int) -> np.ndarray:
    """Row-major position ids of an ``h x w`` patch grid into the ``n x n`` position table."""
    return (bucket_ids(h, patches_per_side)[:, None] * patches_per_side
            + bucket_ids(w, patches_per_side)[None, :]).reshape(-1)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def __call__(self, x: mx.array, mask: mx.array | None) -> mx.array:
        b, l, d = x.shape

        def split(t):
            return t.reshape(b, l, self.heads, -1).transpose(0, 2, 1, 3)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.out_proj(out.transpose(0, 2, 1, 3).reshape(b, l, d))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def __call__(self, x: mx.array) -> mx.array:
        return self.fc2(nn.gelu_approx(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.self_attn = Attention(cfg.hidden_size, cfg.num_attention_heads)
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def __call__(self, x: mx.array, mask: mx.array | None) -> mx.array:
        x = x + self.self_attn(self.layer_norm1(x), mask)
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig, num_layers: int):
        super().__init__()
        self.layers = [EncoderLayer(cfg) for _ in range(num_layers)]


class Embeddings(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.patch_size = cfg.patch_size
        self.patches_per_side = cfg.patches_per_side
        # MLX layout (O, kh, kw, I); the checkpoint's PyTorch OIHW is transposed by Model.sanitize
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, stride=cfg.patch_size)
        self.position_embedding = nn.Embedding(self.patches_per_side ** 2, cfg.hidden_size)

    def __call__(self, pixels: mx.array, pos_ids: mx.array) -> mx.array:
        """``pixels`` [B, 14, L*14, 3] (NHWC strip of patches) -> [B, L, D] plus position embeddings."""
        x = self.patch_embedding(pixels)  # [B, 1, L, D]
        return x.reshape(x.shape[0], -1, x.shape[-1]) + self.position_embedding(pos_ids)


class VisionTower(nn.Module):
    """``SiglipVisionTransformer`` with ``drop_vision_last_layer`` applied (the dropped layer is not built)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        vc = cfg.vision
        self.cfg = vc
        self.embeddings = Embeddings(vc)
        self.encoder = Encoder(vc, cfg.vision_layers_used)
        self.post_layernorm = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)

    @property
    def dtype(self) -> mx.Dtype:
        return self.embeddings.patch_embedding.weight.dtype

    def __call__(self, pixels: mx.array, tgt_sizes: np.ndarray) -> mx.array:
        """``pixels`` [B, 3, 14, Lmax*14] zero-padded strips, ``tgt_sizes`` [B, 2] (h, w) -> [B, Lmax, D]."""
        tgt_sizes = np.asarray(tgt_sizes, dtype=np.int64).reshape(-1, 2)
        b = pixels.shape[0]
        l_max = pixels.shape[-1] // self.cfg.patch_size
        lengths = tgt_sizes[:, 0] * tgt_sizes[:, 1]
        pos = np.zeros((b, l_max), dtype=np.int32)  # padded patches keep position 0, as in the official code
        for i, (h, w) in enumerate(tgt_sizes):
            pos[i, : h * w] = position_ids(int(h), int(w), self.cfg.patches_per_side)
        x = self.embeddings(pixels.transpose(0, 2, 3, 1), mx.array(pos))
        mask = None
        if (lengths < l_max).any():  # keys beyond a slice's own patches are padding
            mask = mx.array((np.arange(l_max)[None, :] < lengths[:, None])[:, None, None, :])
        for layer in self.encoder.layers:
            x = layer(x, mask)
        return self.post_layernorm(x)


def pad_slices(slices: list[np.ndarray], patch_size: int) -> np.ndarray:
    """Official-layout slices ``(3, p, L_i*p)`` -> one zero-padded batch ``(B, 3, p, Lmax*p)``."""
    width = max(s.shape[-1] for s in slices)
    out = np.zeros((len(slices), 3, patch_size, width), dtype=np.float32)
    for i, s in enumerate(slices):
        out[i, :, :, : s.shape[-1]] = s
    return out
