"""The thinker's audio encoder: a Whisper-style encoder that works in 2-second chunks.

Each clip's mel frames (100 a second) are cut into chunks of ``2 * n_window`` frames (200 = 2 s; the last may be
shorter). Each chunk goes through the conv front end on its own (zero padded, so a short chunk never sees its
neighbour), gets the sinusoidal position table from 0 again, and attends only inside itself. The 2x average
pooling then runs over the whole clip (pairs of consecutive frames, an odd tail dropped), followed by LayerNorm
and the projection to the LLM width: one token per 40 ms.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .config import AudioConfig
from .vision import segment_attention


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> np.ndarray:
    """Whisper's position table ``[length, channels]``: sin in the first half, cos in the second (float32)."""
    inc = np.log(max_timescale) / (channels // 2 - 1)
    inv = np.exp(-inc * np.arange(channels // 2, dtype=np.float32))
    t = np.arange(length, dtype=np.float32)[:, None] * inv[None, :]
    return np.concatenate([np.sin(t), np.cos(t)], axis=1).astype(np.float32)


def chunk_lengths(feature_lens: np.ndarray, chunk: int) -> np.ndarray:
    """Frames in each chunk, clip after clip (full chunks of ``chunk`` frames, then the remainder)."""
    out = []
    for n in np.asarray(feature_lens).tolist():
        full, rest = divmod(int(n), chunk)
        out += [chunk] * full + ([rest] if rest else [])
    return np.asarray(out, dtype=np.int64)


class AudioAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.q_proj = nn.Linear(dim, dim, bias=True)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=True)
        self.out_proj = nn.Linear(dim, dim, bias=True)

    def __call__(self, x: mx.array, bounds: np.ndarray) -> mx.array:
        n = x.shape[0]
        q = self.q_proj(x).reshape(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(n, self.num_heads, self.head_dim)
        v = self.v_proj(x).reshape(n, self.num_heads, self.head_dim)
        return self.out_proj(segment_attention(q, k, v, bounds, self.scale).reshape(n, -1))


class AudioEncoderLayer(nn.Module):
    def __init__(self, args: AudioConfig):
        super().__init__()
        self.self_attn = AudioAttention(args.d_model, args.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(args.d_model)
        self.fc1 = nn.Linear(args.d_model, args.encoder_ffn_dim)
        self.fc2 = nn.Linear(args.encoder_ffn_dim, args.d_model)
        self.final_layer_norm = nn.LayerNorm(args.d_model)

    def __call__(self, x, bounds):
        x = x + self.self_attn(self.self_attn_layer_norm(x), bounds)
        return x + self.fc2(nn.gelu(self.fc1(self.final_layer_norm(x))))


class AudioEncoder(nn.Module):
    def __init__(self, args: AudioConfig):
        super().__init__()
        self.args = args
        self.conv1 = nn.Conv1d(args.num_mel_bins, args.d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(args.d_model, args.d_model, kernel_size=3, stride=2, padding=1)
        self.layers = [AudioEncoderLayer(args) for _ in range(args.encoder_layers)]
        self.ln_post = nn.LayerNorm(args.d_model)
        self.proj = nn.Linear(args.d_model, args.output_dim)
        self.audio_bos_eos_token = nn.Embedding(2, args.output_dim)  # in the checkpoints, unused by the thinker
        self._positions = sinusoids(args.max_source_positions, args.d_model)

    def __call__(self, features: mx.array, feature_lens) -> mx.array:
        """``features`` ``[mels, sum(L)]`` (the valid frames of every clip, concatenated) and the clips' frame
        counts ``L`` -> ``[sum(tokens), output_dim]``."""
        a = self.args
        lens = np.asarray(feature_lens, dtype=np.int64).reshape(-1)
        if features.ndim != 2 or features.shape[0] != a.num_mel_bins or features.shape[1] != int(lens.sum()):
            raise ValueError(f"audio features have shape {tuple(features.shape)}; expected ({a.num_mel_bins}, "
                             f"{int(lens.sum())})")
        if (lens <= 0).any():
            raise ValueError(f"every audio needs at least one mel frame (lengths {lens.tolist()})")
        clens = chunk_lengths(lens, 2 * a.n_window)
        width = int(clens.max())
        # chunks as a zero-padded batch [chunks, width, mels] (channels last for MLX convs)
        starts = np.concatenate([[0], np.cumsum(clens)[:-1]])
        idx = starts[:, None] + np.arange(width)[None, :]
        valid = np.arange(width)[None, :] < clens[:, None]
        frames = features.T[mx.array(np.where(valid, idx, 0).astype(np.int32))]
        frames = frames * mx.array(valid[..., None].astype(np.float32)).astype(frames.dtype)
        h = nn.gelu(self.conv1(frames)) * mx.array(valid[..., None].astype(np.float32)).astype(frames.dtype)
        h = nn.gelu(self.conv2(h))  # [chunks, ceil(width / 2), d]
        h = h + mx.array(self._positions[:h.shape[1]]).astype(h.dtype)[None]
        after = (clens - 1) // 2 + 1
        keep = (np.arange(h.shape[1])[None, :] < after[:, None]).reshape(-1)
        x = h.reshape(-1, h.shape[-1])[mx.array(np.nonzero(keep)[0].astype(np.int32))]

        bounds = np.concatenate([[0], np.cumsum(after)]).astype(np.int64)
        for layer in self.layers:
            x = layer(x, bounds)

        clip_after = (lens - 1) // 2 + 1
        pooled = (clip_after - 2) // 2 + 1
        offsets = np.concatenate([[0], np.cumsum(clip_after)[:-1]])
        first = np.concatenate([o + 2 * np.arange(p) for o, p in zip(offsets, pooled)]).astype(np.int32)
        x = (x[mx.array(first)] + x[mx.array(first + 1)]) / 2
        return self.proj(self.ln_post(x))
