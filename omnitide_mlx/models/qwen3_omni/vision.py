"""Qwen3-Omni's vision encoder on MLX (the Qwen3-VL ViT): 16-pixel patches of 2 frames, a learned 48x48 position
table resampled bilinearly to each grid, 2-D rotary attention inside each frame, and DeepStack.

As transformers' ``Qwen3OmniMoeVisionEncoder`` computes it:

- patch rows come in merge-block order (the processor's layout); the Conv3d patch embedding (kernel = stride) is one
  matmul over the flattened ``[C, tp, p, p]`` patch;
- the position table (``pos_embed``, ``num_position_embeddings`` = side^2 rows) is resampled to the frame's
  ``h x w`` patches with align-corners bilinear weights (4 taps per patch) and added; every frame of a video gets
  the same table;
- 2-D RoPE: a quarter of the head's frequencies each for the patch row and column (``[h, w, h, w]`` over the head
  dim, NeoX halves), applied in float32;
- attention is full inside each frame (each temporal patch), never across frames;
- blocks are pre-LayerNorm (eps 1e-6) with a GELU-tanh MLP;
- after the blocks listed in ``deepstack_visual_indexes`` a ``merger_list`` merger (LayerNorm *after* the 2x2
  shuffle) gives one DeepStack feature per index; the final ``merger`` (LayerNorm before the shuffle) gives the LLM
  tokens. The LLM adds DeepStack feature k to the visual tokens' hidden states after its decoder layer k.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .config import VisionConfig


def rotate_half(x: mx.array) -> mx.array:
    h = x.shape[-1] // 2
    return mx.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def patch_rows_cols(grid_thw, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """Row and column (in patches) of every patch of every frame, in merge-block order."""
    rows, cols = [], []
    for t, h, w in (tuple(int(v) for v in g) for g in np.asarray(grid_thw).reshape(-1, 3)):
        r = np.arange(h).reshape(h // merge, merge, 1, 1)
        c = np.arange(w).reshape(1, 1, w // merge, merge)
        rr = np.broadcast_to(r, (h // merge, merge, w // merge, merge)).transpose(0, 2, 1, 3).reshape(-1)
        cc = np.broadcast_to(c, (h // merge, merge, w // merge, merge)).transpose(0, 2, 1, 3).reshape(-1)
        rows.append(np.tile(rr, t))
        cols.append(np.tile(cc, t))
    return np.concatenate(rows), np.concatenate(cols)


def bilinear_taps(grid_thw, side: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices ``[N, 4]`` into the flattened ``side x side`` table and their weights ``[N, 4]`` (align corners)."""
    rows, cols = patch_rows_cols(grid_thw, merge)
    sizes_h, sizes_w = [], []
    for t, h, w in (tuple(int(v) for v in g) for g in np.asarray(grid_thw).reshape(-1, 3)):
        sizes_h.append(np.full(t * h * w, h))
        sizes_w.append(np.full(t * h * w, w))
    sizes_h, sizes_w = np.concatenate(sizes_h), np.concatenate(sizes_w)

    def axis(index, size):
        src = index.astype(np.float32) * np.float32(side - 1) / np.maximum(size - 1, 1).astype(np.float32)
        floor = np.floor(src)
        taps = np.clip(floor.astype(np.int64)[:, None] + np.arange(2), 0, side - 1)
        weights = np.clip(1 - np.abs(src[:, None] - floor[:, None] - np.arange(2)), 0, None).astype(np.float32)
        return taps, weights

    ht, hw = axis(rows, sizes_h)
    wt, ww = axis(cols, sizes_w)
    idx = (ht[:, :, None] * side + wt[:, None, :]).reshape(-1, 4)
    wts = (hw[:, :, None] * ww[:, None, :]).reshape(-1, 4)
    return idx, wts


def frame_ids(grid_thw) -> np.ndarray:
    """Which attention block (frame) each patch belongs to."""
    sizes = [int(h) * int(w) for t, h, w in np.asarray(grid_thw).reshape(-1, 3) for _ in range(int(t))]
    return np.repeat(np.arange(len(sizes)), sizes)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, mask) -> mx.array:
        n, d = x.shape
        hd = d // self.num_heads
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, hd).transpose(1, 0, 2, 3)
        dtype = q.dtype
        q32, k32 = q.astype(mx.float32), k.astype(mx.float32)
        q = (q32 * cos + rotate_half(q32) * sin).astype(dtype)
        k = (k32 * cos + rotate_half(k32) * sin).astype(dtype)
        out = mx.fast.scaled_dot_product_attention(q.transpose(1, 0, 2)[None], k.transpose(1, 0, 2)[None],
                                                   v.transpose(1, 0, 2)[None], scale=hd ** -0.5, mask=mask)
        return self.proj(out[0].transpose(1, 0, 2).reshape(n, d))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden, bias=True)
        self.linear_fc2 = nn.Linear(hidden, dim, bias=True)

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_fc2(nn.gelu_approx(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(c.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(c.hidden_size, eps=1e-6)
        self.attn = VisionAttention(c.hidden_size, c.num_heads)
        self.mlp = VisionMLP(c.hidden_size, c.intermediate_size)

    def __call__(self, x, cos, sin, mask):
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """2x2 merge of neighbouring patches and a GELU MLP to the LLM width; ``postshuffle``: LayerNorm over the merged
    vector (the DeepStack mergers) instead of over each patch (the final merger)."""

    def __init__(self, c: VisionConfig, postshuffle: bool):
        super().__init__()
        self.merged = c.hidden_size * c.spatial_merge_size ** 2
        self.postshuffle = postshuffle
        self.ln_q = nn.LayerNorm(self.merged if postshuffle else c.hidden_size, eps=1e-6)
        self.mlp = [nn.Linear(self.merged, self.merged), nn.GELU(), nn.Linear(self.merged, c.out_hidden_size)]

    def __call__(self, x: mx.array) -> mx.array:
        x = self.ln_q(x.reshape(-1, self.merged)) if self.postshuffle else self.ln_q(x).reshape(-1, self.merged)
        for layer in self.mlp:
            x = layer(x)
        return x


class PatchEmbed(nn.Module):
    """The Conv3d (kernel = stride) as a matmul; ``proj.weight`` is stored flattened ``[D, C*tp*p*p]``."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.proj = nn.Linear(c.patch_dim, c.hidden_size, bias=True)

    def __call__(self, x: mx.array) -> mx.array:
        return self.proj(x)


class VisionEncoder(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.config = c
        self.patch_embed = PatchEmbed(c)
        self.pos_embed = nn.Embedding(c.num_position_embeddings, c.hidden_size)
        self.blocks = [VisionBlock(c) for _ in range(c.depth)]
        self.merger = PatchMerger(c, postshuffle=False)
        self.merger_list = [PatchMerger(c, postshuffle=True) for _ in c.deepstack_visual_indexes]
        quarter = c.head_dim // 2
        self._inv_freq = (1.0 / (c.rope_theta ** (np.arange(0, quarter, 2, dtype=np.float32) / quarter))
                          ).astype(np.float32)

    def rotary(self, grid_thw) -> tuple[mx.array, mx.array]:
        rows, cols = patch_rows_cols(grid_thw, self.config.spatial_merge_size)
        fr = rows[:, None].astype(np.float32) * self._inv_freq
        fc = cols[:, None].astype(np.float32) * self._inv_freq
        angles = np.concatenate([fr, fc, fr, fc], axis=-1)
        a = mx.array(angles)[:, None, :]  # [N, 1, hd]: broadcast over heads
        return mx.cos(a), mx.sin(a)

    def __call__(self, pixels: mx.array, grid_thw) -> tuple[mx.array, list[mx.array]]:
        """Patch rows ``[N, C*tp*p*p]`` and their grids -> (LLM tokens ``[N / merge^2, out]``, DeepStack features,
        one ``[N / merge^2, out]`` per ``deepstack_visual_indexes`` entry)."""
        c = self.config
        grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
        n = int(sum(int(t) * int(h) * int(w) for t, h, w in grid))
        if pixels.shape != (n, c.patch_dim):
            raise ValueError(f"pixel rows {tuple(pixels.shape)} do not match the grids ({n}, {c.patch_dim})")
        m = c.spatial_merge_size
        if any(int(h) % m or int(w) % m for _, h, w in grid):
            raise ValueError(f"grid {grid.tolist()} is not a multiple of the merge size {m}")
        h = self.patch_embed(pixels)
        idx, wts = bilinear_taps(grid, int(round(c.num_position_embeddings ** 0.5)), m)
        pos = (self.pos_embed(mx.array(idx.astype(np.int32))) * mx.array(wts)[..., None]).sum(axis=1)
        h = h + pos.astype(h.dtype)
        cos, sin = self.rotary(grid)
        ids = frame_ids(grid)
        mask = mx.array(ids[:, None] == ids[None, :]) if ids[-1] > 0 else None
        deep = []
        for i, blk in enumerate(self.blocks):
            h = blk(h, cos, sin, mask)
            if i in c.deepstack_visual_indexes:
                deep.append(self.merger_list[c.deepstack_visual_indexes.index(i)](h))
        return self.merger(h), deep


def hf_vision_shapes(c: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every vision tensor of a released checkpoint (names after ``visual.``) and its HF shape."""
    d, i, m = c.hidden_size, c.intermediate_size, c.hidden_size * c.spatial_merge_size ** 2
    s = {"patch_embed.proj.weight": (d, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size),
         "patch_embed.proj.bias": (d,), "pos_embed.weight": (c.num_position_embeddings, d)}
    for b in range(c.depth):
        p = f"blocks.{b}."
        for name in ("norm1", "norm2"):
            s[p + f"{name}.weight"], s[p + f"{name}.bias"] = (d,), (d,)
        s[p + "attn.qkv.weight"], s[p + "attn.qkv.bias"] = (3 * d, d), (3 * d,)
        s[p + "attn.proj.weight"], s[p + "attn.proj.bias"] = (d, d), (d,)
        s[p + "mlp.linear_fc1.weight"], s[p + "mlp.linear_fc1.bias"] = (i, d), (i,)
        s[p + "mlp.linear_fc2.weight"], s[p + "mlp.linear_fc2.bias"] = (d, i), (d,)
    for pre, ln in [("merger.", d)] + [(f"merger_list.{k}.", m) for k in range(len(c.deepstack_visual_indexes))]:
        s[pre + "ln_q.weight"], s[pre + "ln_q.bias"] = (ln,), (ln,)
        s[pre + "mlp.0.weight"], s[pre + "mlp.0.bias"] = (m, m), (m,)
        s[pre + "mlp.2.weight"], s[pre + "mlp.2.bias"] = (c.out_hidden_size, m), (c.out_hidden_size,)
    return s
