"""Qwen3-Omni's AuT audio encoder on MLX: chunked Conv2d downsampling, windowed Transformer, two-layer projection.

As transformers' ``Qwen3OmniMoeAudioEncoder`` computes it:

1. each clip's log-mel ``[mels, frames]`` is cut into chunks of ``2 * n_window`` frames (100 released, the last
   chunk shorter), and all chunks are zero-padded to the longest one (the padding matters: the second and third
   convolutions see GELU(bias) past a short chunk's end, not zeros);
2. three 3x3 stride-2 Conv2d + GELU over (mel, time) per chunk, then ``conv_out`` over channels x frequency; the
   sinusoidal position embedding restarts at 0 in every chunk; 100 frames give 13 tokens;
3. the valid tokens of all chunks, in order, go through the encoder layers with attention inside windows of
   ``max tokens per chunk * n_window_infer / (2 * n_window)`` tokens (8 chunks, 104 tokens = 8 s released), each
   clip's windows starting at its first token;
4. ``ln_post``, ``proj1``, GELU, ``proj2`` to the LLM width.
"""

from __future__ import annotations


import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .config import AudioConfig
from .rope_index import audio_token_count


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> np.ndarray:
    inc = np.log(max_timescale) / (channels // 2 - 1)
    inv = np.exp(-inc * np.arange(channels // 2, dtype=np.float32)).astype(np.float32)
    t = np.arange(length, dtype=np.float32)[:, None] * inv[None]
    return np.concatenate([np.sin(t), np.cos(t)], axis=1).astype(np.float32)


def chunk_lengths(feature_lens, n_window: int) -> list[int]:
    """Frame counts of every chunk of every clip, in order (full chunks of ``2 * n_window``, then the rest)."""
    size = 2 * n_window
    out = []
    for n in (int(x) for x in feature_lens):
        out += [size] * (n // size) + ([n % size] if n % size else [])
    return out


def attention_windows(feature_lens, n_window: int, n_window_infer: int) -> list[int]:
    """Token counts of the attention windows (transformers' ``get_audio_cu_seqlens``)."""
    per_chunk = max(audio_token_count(c, n_window) for c in chunk_lengths(feature_lens, n_window))
    window = per_chunk * (n_window_infer // (2 * n_window))
    out = []
    for n in (audio_token_count(int(x), n_window) for x in feature_lens):
        out += [window] * (n // window) + ([n % window] if n % window else [])
    return out


class EncoderLayer(nn.Module):
    def __init__(self, c: AudioConfig):
        super().__init__()
        d = c.d_model
        self.n_heads = c.encoder_attention_heads
        self.self_attn = nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            setattr(self.self_attn, name, nn.Linear(d, d, bias=True))
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, c.encoder_ffn_dim)
        self.fc2 = nn.Linear(c.encoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def attention(self, x: mx.array, mask: mx.array) -> mx.array:
        a = self.self_attn
        t, d = x.shape
        hd = d // self.n_heads

        def heads(y):
            return y.reshape(1, t, self.n_heads, hd).transpose(0, 2, 1, 3)

        out = mx.fast.scaled_dot_product_attention(heads(a.q_proj(x)), heads(a.k_proj(x)), heads(a.v_proj(x)),
                                                   scale=hd ** -0.5, mask=mask)
        return a.out_proj(out.transpose(0, 2, 1, 3).reshape(t, d))

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        x = x + self.attention(self.self_attn_layer_norm(x), mask)
        return x + self.fc2(nn.gelu(self.fc1(self.final_layer_norm(x))))


class AudioEncoder(nn.Module):
    def __init__(self, c: AudioConfig):
        super().__init__()
        self.config = c
        dh = c.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, dh, 3, stride=2, padding=1)
        self.conv2d2 = nn.Conv2d(dh, dh, 3, stride=2, padding=1)
        self.conv2d3 = nn.Conv2d(dh, dh, 3, stride=2, padding=1)
        self.conv_out = nn.Linear(c.conv_out_features, c.d_model, bias=False)
        self.layers = [EncoderLayer(c) for _ in range(c.encoder_layers)]
        self.ln_post = nn.LayerNorm(c.d_model)
        self.proj1 = nn.Linear(c.d_model, c.d_model)
        self.proj2 = nn.Linear(c.d_model, c.output_dim)
        self._pos = sinusoids(c.max_source_positions, c.d_model)

    def __call__(self, features: mx.array, feature_lens) -> mx.array:
        """``features`` ``[mels, sum(feature_lens)]`` (the clips' valid frames, concatenated) -> ``[tokens, out]``."""
        c = self.config
        lens = [int(x) for x in np.asarray(feature_lens).reshape(-1)]
        if features.shape[1] != sum(lens):
            raise ValueError(f"{features.shape[1]} mel frames given, feature lengths sum to {sum(lens)}")
        chunks = chunk_lengths(lens, c.n_window)
        longest = max(chunks)
        frames = features.T  # [frames, mels]
        padded, at = [], 0
        for n in chunks:
            piece = frames[at:at + n]
            at += n
            if n < longest:
                piece = mx.pad(piece, [(0, longest - n), (0, 0)])
            padded.append(piece)
        x = mx.stack(padded).transpose(0, 2, 1)[..., None]  # [chunks, mels, time, 1] (NHWC: H = mel, W = time)
        x = nn.gelu(self.conv2d1(x.astype(self.conv2d1.weight.dtype)))
        x = nn.gelu(self.conv2d2(x))
        x = nn.gelu(self.conv2d3(x))
        n, f, t, ch = x.shape
        x = self.conv_out(x.transpose(0, 2, 3, 1).reshape(n, t, ch * f))  # channel-major, as torch's view
        x = x + mx.array(self._pos[:t]).astype(x.dtype)
        valid = [audio_token_count(m, c.n_window) for m in chunks]
        idx = np.concatenate([i * t + np.arange(v) for i, v in enumerate(valid)])
        h = x.reshape(n * t, -1)[mx.array(idx.astype(np.int32))]
        windows = attention_windows(lens, c.n_window, c.n_window_infer)
        ids = np.repeat(np.arange(len(windows)), windows)
        mask = mx.array(ids[:, None] == ids[None, :]) if len(windows) > 1 else None
        for layer in self.layers:
            h = layer(h, mask)
        h = self.ln_post(h)
        return self.proj2(nn.gelu(self.proj1(h)))


def hf_audio_shapes(c: AudioConfig) -> dict[str, tuple[int, ...]]:
    """Every audio-tower tensor of a released checkpoint (names after ``audio_tower.``) and its HF shape."""
    d, dh, f = c.d_model, c.downsample_hidden_size, c.encoder_ffn_dim
    s = {"conv2d1.weight": (dh, 1, 3, 3), "conv2d1.bias": (dh,), "conv2d2.weight": (dh, dh, 3, 3),
         "conv2d2.bias": (dh,), "conv2d3.weight": (dh, dh, 3, 3), "conv2d3.bias": (dh,),
         "conv_out.weight": (d, c.conv_out_features)}
    for i in range(c.encoder_layers):
        p = f"layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            s[p + f"self_attn.{name}.weight"], s[p + f"self_attn.{name}.bias"] = (d, d), (d,)
        for name in ("self_attn_layer_norm", "final_layer_norm"):
            s[p + f"{name}.weight"], s[p + f"{name}.bias"] = (d,), (d,)
        s[p + "fc1.weight"], s[p + "fc1.bias"] = (f, d), (f,)
        s[p + "fc2.weight"], s[p + "fc2.bias"] = (d, f), (d,)
    s["ln_post.weight"], s["ln_post.bias"] = (d,), (d,)
    s["proj1.weight"], s["proj1.bias"] = (d, d), (d,)
    s["proj2.weight"], s["proj2.bias"] = (c.output_dim, d), (c.output_dim,)
    return s


