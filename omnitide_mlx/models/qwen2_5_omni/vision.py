"""The thinker's vision encoder (the Qwen2.5-VL ViT).

Input rows are 14x14 patches of 2 frames (``[N, 3*2*14*14]``, flattened C, T, ph, pw), ordered merge block by
merge block (each 2x2 block's four patches consecutively), frame by frame. The Conv3d patch embedding has kernel ==
stride, so it is one matmul. Attention uses a 2-D rotary embedding of each patch's (h, w). Most blocks attend inside
windows of ``window_size`` pixels (4x4 merged tokens in the released models); the blocks listed in
``fullatt_block_indexes`` attend over a whole frame. Nothing ever attends across frames. The merger turns each 2x2
block into one LLM token.
"""

from __future__ import annotations

from collections import defaultdict

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..blocks import MLP
from .config import VisionConfig


def segment_attention(q: mx.array, k: mx.array, v: mx.array, bounds: np.ndarray, scale: float) -> mx.array:
    """Block-diagonal attention over a packed sequence: ``q, k, v`` ``[N, heads, hd]``, segment ``i`` covers rows
    ``bounds[i]:bounds[i + 1]`` and attends only to itself. Segments of equal length run as one batch."""
    bounds = np.asarray(bounds, dtype=np.int64)
    starts, lengths = bounds[:-1], np.diff(bounds)
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, n in enumerate(lengths.tolist()):
        if n > 0:
            by_length[n].append(i)
    pieces: dict[int, mx.array] = {}
    for n, segs in by_length.items():
        idx = mx.array((starts[segs][:, None] + np.arange(n)[None, :]).reshape(-1).astype(np.int32))
        s = len(segs)

        def gather(x):
            return x[idx].reshape(s, n, x.shape[1], x.shape[2]).transpose(0, 2, 1, 3)

        out = mx.fast.scaled_dot_product_attention(gather(q), gather(k), gather(v), scale=scale)
        out = out.transpose(0, 2, 1, 3)  # [s, n, heads, hd]
        for j, seg in enumerate(segs):
            pieces[seg] = out[j]
    return mx.concatenate([pieces[i] for i in sorted(pieces)], axis=0)


def rotate_half(x: mx.array) -> mx.array:
    h = x.shape[-1] // 2
    return mx.concatenate([-x[..., h:], x[..., :h]], axis=-1)


# --- index bookkeeping (numpy, from the grids) ----------------------------------------------------------------
def patch_hw(grid_thw: np.ndarray, merge: int) -> np.ndarray:
    """(h, w) of every patch ``[N, 2]`` in merge-block order, repeated for each frame."""
    out = []
    for t, h, w in np.asarray(grid_thw).tolist():
        hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        hh = hh.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        ww = ww.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        out.append(np.tile(np.stack([hh, ww], axis=-1), (t, 1)))
    return np.concatenate(out, axis=0)


def window_index(grid_thw: np.ndarray, merge: int, window_merged: int) -> tuple[np.ndarray, np.ndarray]:
    """The permutation of merged tokens that groups them window by window (windows of ``window_merged`` x
    ``window_merged`` merged tokens, row-major over each frame, partial windows at the borders), and the window
    bounds in patch rows."""
    order, bounds, base = [], [0], 0
    unit = merge * merge
    for t, h, w in np.asarray(grid_thw).tolist():
        lh, lw = h // merge, w // merge
        idx = np.arange(t * lh * lw).reshape(t, lh, lw)
        for f in range(t):
            for r0 in range(0, lh, window_merged):
                for c0 in range(0, lw, window_merged):
                    win = idx[f, r0:r0 + window_merged, c0:c0 + window_merged].reshape(-1)
                    order.append(win + base)
                    bounds.append(bounds[-1] + win.size * unit)
        base += t * lh * lw
    return np.concatenate(order), np.asarray(bounds, dtype=np.int64)


def frame_bounds(grid_thw: np.ndarray) -> np.ndarray:
    """Patch-row bounds of every frame (the full-attention segments)."""
    sizes = [h * w for t, h, w in np.asarray(grid_thw).tolist() for _ in range(t)]
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


# --- modules ----------------------------------------------------------------------------------------------------
class PatchEmbed(nn.Module):
    def __init__(self, args: VisionConfig):
        super().__init__()
        self.proj = nn.Linear(args.patch_dim, args.hidden_size, bias=False)  # Conv3d weight, flattened

    def __call__(self, x: mx.array) -> mx.array:
        return self.proj(x)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.q = nn.Linear(dim, dim, bias=True)
        self.k = nn.Linear(dim, dim, bias=True)
        self.v = nn.Linear(dim, dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, bounds: np.ndarray) -> mx.array:
        n = x.shape[0]
        q = self.q(x).reshape(n, self.num_heads, self.head_dim)
        k = self.k(x).reshape(n, self.num_heads, self.head_dim)
        v = self.v(x).reshape(n, self.num_heads, self.head_dim)
        dtype = q.dtype
        q32, k32 = q.astype(mx.float32), k.astype(mx.float32)
        q = (q32 * cos + rotate_half(q32) * sin).astype(dtype)
        k = (k32 * cos + rotate_half(k32) * sin).astype(dtype)
        return self.proj(segment_attention(q, k, v, bounds, self.scale).reshape(n, -1))


class VisionMLP(MLP):
    """The vision tower's SwiGLU, with biases (models/blocks.py)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__(dim, hidden, bias=True)


class VisionBlock(nn.Module):
    def __init__(self, args: VisionConfig):
        super().__init__()
        self.norm1 = nn.RMSNorm(args.hidden_size, eps=1e-6)
        self.norm2 = nn.RMSNorm(args.hidden_size, eps=1e-6)
        self.attn = VisionAttention(args.hidden_size, args.num_heads)
        self.mlp = VisionMLP(args.hidden_size, args.intermediate_size)

    def __call__(self, x, cos, sin, bounds):
        x = x + self.attn(self.norm1(x), cos, sin, bounds)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, args: VisionConfig):
        super().__init__()
        self.hidden = args.hidden_size * args.spatial_merge_size ** 2
        self.ln_q = nn.RMSNorm(args.hidden_size, eps=1e-6)
        self.mlp = [nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, args.out_hidden_size)]

    def __call__(self, x):
        x = self.ln_q(x).reshape(-1, self.hidden)
        for layer in self.mlp:
            x = layer(x)
        return x


class VisionEncoder(nn.Module):
    def __init__(self, args: VisionConfig):
        super().__init__()
        self.args = args
        self.patch_embed = PatchEmbed(args)
        self.blocks = [VisionBlock(args) for _ in range(args.depth)]
        self.merger = PatchMerger(args)
        quarter = args.head_dim // 2
        self._inv_freq = 1.0 / (args.rope_theta ** (np.arange(0, quarter, 2, dtype=np.float32) / quarter))

    def __call__(self, pixel_values: mx.array, grid_thw) -> mx.array:
        """Merged embeddings ``[N / 4, out_hidden]`` in the input's (t, h/2, w/2) row-major order."""
        a = self.args
        grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
        n = int(np.sum(np.prod(grid, axis=-1)))
        if pixel_values.ndim != 2 or pixel_values.shape != (n, a.patch_dim):
            raise ValueError(f"pixel values have shape {tuple(pixel_values.shape)}; the grids {grid.tolist()} need "
                             f"({n}, {a.patch_dim})")
        merge, unit = a.spatial_merge_size, a.spatial_merge_size ** 2
        win_order, win_bounds = window_index(grid, merge, a.window_size // merge // a.patch_size)
        full_bounds = frame_bounds(grid)
        rows = (win_order[:, None] * unit + np.arange(unit)[None, :]).reshape(-1)  # window order, in patch rows

        hw = patch_hw(grid, merge)[rows].astype(np.float32)
        freqs = np.concatenate([hw[:, :1] * self._inv_freq, hw[:, 1:] * self._inv_freq], axis=-1)
        emb = np.concatenate([freqs, freqs], axis=-1)
        cos = mx.array(np.cos(emb))[:, None, :]
        sin = mx.array(np.sin(emb))[:, None, :]

        x = self.patch_embed(pixel_values)[mx.array(rows.astype(np.int32))]
        full = set(a.fullatt_block_indexes)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, full_bounds if i in full else win_bounds)
        merged = self.merger(x)
        return merged[mx.array(np.argsort(win_order).astype(np.int32))]
