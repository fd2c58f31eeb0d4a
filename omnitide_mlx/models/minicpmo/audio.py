"""Whisper encoder with MiniCPM-o's streaming additions, the audio projector and the 5-frame pooling.

Offline, the official code runs the encoder with a *block-causal* mask: with ``audio_chunk_length`` 1 s, encoder
frame i (50 per second) sees every frame from the start through the end of its own 1 s chunk. Streaming feeds the
same chunks one at a time, keeping each layer's keys and values (full attention over the cache plus the chunk,
positions continuing from the cache length). Each chunk's mel carries 2 extra frames of context on each side that
are trimmed after the stride-2 convolution (one encoder frame each), so the CNN sees the same neighbours as
offline: streaming then equals the offline chunked encoder exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .config import AudioConfig


def chunk_visibility(size: int, chunk: int) -> np.ndarray:
    """``subsequent_chunk_mask``: [size, size] bool, query i sees keys [0, end of its own chunk)."""
    ends = np.minimum((np.arange(size) // chunk + 1) * chunk, size)
    return np.arange(size)[None, :] < ends[:, None]


class WhisperAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def __call__(self, x, mask, past=None):
        b, l, d = x.shape

        def split(t):
            return t.reshape(b, l, self.heads, -1).transpose(0, 2, 1, 3)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        if past is not None:
            k = mx.concatenate([past[0], k], axis=2)
            v = mx.concatenate([past[1], v], axis=2)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.out_proj(out.transpose(0, 2, 1, 3).reshape(b, l, d)), (k, v)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: AudioConfig):
        super().__init__()
        d = cfg.d_model
        self.self_attn = WhisperAttention(d, cfg.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def __call__(self, x, mask, past=None):
        h, kv = self.self_attn(self.self_attn_layer_norm(x), mask, past)
        x = x + h
        return x + self.fc2(nn.gelu(self.fc1(self.final_layer_norm(x)))), kv


@dataclass
class WhisperStreamCache:
    """Per-layer keys and values of the audio frames encoded so far in a stream."""

    kv: list = field(default_factory=list)

    @property
    def length(self) -> int:
        return int(self.kv[0][0].shape[2]) if self.kv else 0


class WhisperEncoder(nn.Module):
    def __init__(self, cfg: AudioConfig):
        super().__init__()
        d = cfg.d_model
        # MLX layout (O, K, I); the checkpoint's PyTorch OIK is transposed by Model.sanitize
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, d, 3, padding=1)
        self.conv2 = nn.Conv1d(d, d, 3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(cfg.max_source_positions, d)
        self.layers = [EncoderLayer(cfg) for _ in range(cfg.encoder_layers)]
        self.layer_norm = nn.LayerNorm(d)

    @property
    def dtype(self) -> mx.Dtype:
        return self.conv1.weight.dtype

    @property
    def max_positions(self) -> int:
        return self.embed_positions.weight.shape[0]

    def __call__(self, features: mx.array, mask: mx.array | None = None, cache: WhisperStreamCache | None = None,
                 trim: tuple[int, int] = (0, 0)) -> mx.array:
        """``features`` [B, n_mels, T] -> hidden states [B, T', d] after the final layer norm.

        ``cache``: a stream's cache, extended in place (positions continue from its length). ``trim``: encoder
        frames to drop at the start and end after the convolutions (the extra mel context of a streamed chunk).
        """
        x = nn.gelu(self.conv1(features.transpose(0, 2, 1)))
        x = nn.gelu(self.conv2(x))
        head, tail = trim
        if head:
            x = x[:, head:]
        if 0 < tail < x.shape[1]:
            x = x[:, :-tail]
        past_len = cache.length if cache is not None else 0
        t = x.shape[1]
        table = self.embed_positions.weight
        if past_len + t > table.shape[0]:  # the official encoder repeats its last position past 30 s
            pos = mx.concatenate([table[past_len:], mx.repeat(table[-1:], past_len + t - table.shape[0], axis=0)])
        else:
            pos = table[past_len:past_len + t]
        x = x + pos
        new_kv = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, mask, cache.kv[i] if cache is not None and cache.kv else None)
            new_kv.append(kv)
        if cache is not None:
            cache.kv = new_kv
        return self.layer_norm(x)


class AudioProjector(nn.Module):
    """``MultiModalProjector``: Linear -> ReLU -> Linear."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.linear1 = nn.Linear(in_dim, out_dim)
        self.linear2 = nn.Linear(out_dim, out_dim)

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear2(nn.relu(self.linear1(x)))


def avg_pool(x: mx.array, step: int) -> mx.array:
    """``AvgPool1d(step, stride=step)`` over time: [B, T, D] -> [B, T // step, D] (the remainder is dropped)."""
    b, t, d = x.shape
    n = t // step
    return x[:, : n * step].reshape(b, n, step, d).mean(axis=2)
