"""Qwen3-Omni's Code2Wav on MLX: 16 codebooks at 12.5 Hz -> 24 kHz waveform, causal throughout.

As transformers' ``Qwen3OmniMoeCode2Wav`` computes it:

1. each codebook's code is offset into one shared table (``code_embedding``, ``codebook_size x num_quantizers``
   rows) and the 16 embeddings are averaged;
2. a pre-transformer: RoPE attention with a causal sliding window of ``sliding_window`` frames (72: a frame sees
   itself and the 71 before it), SwiGLU, RMSNorm, each residual branch scaled by a learned LayerScale;
3. two upsamplers (transposed conv, kernel = stride = 2, then a ConvNeXt block with a causal depthwise conv);
4. the decoder: a causal conv to ``decoder_dim``, four blocks (SnakeBeta, transposed conv of kernel 2r / stride r
   trimmed by r on both sides, three residual units with causal dilated convs, dilations 1, 3, 9), SnakeBeta and a
   causal conv to one channel, clamped to [-1, 1]. ``total_upsample`` = 8 x 5 x 4 x 3 x 2 x 2 = 1,920 samples a
   frame.

Everything is causal (left padding only), so ``chunked_decode`` (transformers' streamed decode: chunks of 300 frames
with 25 frames of left context, the context's samples dropped) is what a stream can emit as codes arrive.

MLX's CPU backend runs dilated and transposed convolutions far slower than the matmuls they amount to
(docs/models/qwen2_5_omni.md), so dilated causal convs run as undilated convs over the input's phases, transposed
convs as one matmul and an overlap-add (qwen2_5_omni/token2wav.py's ``ConvTranspose1d``), and the depthwise conv as
seven shifted multiply-adds. Channels-last throughout (``[B, T, C]``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..loading import CheckpointError, config_fields
from ..qwen2_5_omni.token2wav import ConvTranspose1d


@dataclass
class Code2WavConfig:
    codebook_size: int = 2048
    num_quantizers: int = 16
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 8
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    attention_bias: bool = False
    sliding_window: int = 72
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    decoder_dim: int = 1536
    upsample_rates: list[int] = field(default_factory=lambda: [8, 5, 4, 3])
    upsampling_ratios: list[int] = field(default_factory=lambda: [2, 2])
    hidden_act: str = "silu"

    def __post_init__(self):
        if self.hidden_act != "silu":
            raise CheckpointError(f"code2wav_config: hidden_act {self.hidden_act!r} is not supported (silu)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError("code2wav_config: attention heads are not a multiple of key/value heads")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def total_upsample(self) -> int:
        return int(np.prod(list(self.upsample_rates) + list(self.upsampling_ratios)))

    @property
    def tail_samples(self) -> int:
        """How many samples short of ``frames x total_upsample`` a decode is (555 released: each decoder block's
        transposed conv needs the next frame for its last ``r`` outputs, so they are trimmed)."""
        n = int(np.prod(self.upsampling_ratios))
        for r in self.upsample_rates:
            n = (n - 1) * r
        return self.total_upsample - n

    @classmethod
    def from_dict(cls, d: dict) -> "Code2WavConfig":
        kw = config_fields(cls, d)
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if "rope_theta" in rope:
            kw["rope_theta"] = rope["rope_theta"]
        for k in ("upsample_rates", "upsampling_ratios"):
            if k in kw:
                kw[k] = list(kw[k])
        return cls(**kw)


def snake_beta(x: mx.array, alpha: mx.array, beta: mx.array) -> mx.array:
    """``x + sin(x e^alpha)^2 / (e^beta + 1e-9)`` (log-scale parameters, as released)."""
    return x + (1.0 / (mx.exp(beta) + 1e-9)) * mx.sin(x * mx.exp(alpha)) ** 2


class SnakeBeta(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.alpha = mx.zeros((channels,))
        self.beta = mx.zeros((channels,))

    def __call__(self, x):
        return snake_beta(x, self.alpha, self.beta)


class _Conv(nn.Module):
    """Holds ``weight`` ``[out, k, in]`` (MLX layout) and ``bias``: the checkpoint's ``conv.`` submodule."""

    def __init__(self, cin: int, cout: int, kernel: int):
        super().__init__()
        self.weight = mx.zeros((cout, kernel, cin))
        self.bias = mx.zeros((cout,))


class CausalConv1d(nn.Module):
    """Conv1d (stride 1) with ``(kernel - 1) * dilation`` zeros on the left; a dilated one runs as undilated convs
    over the padded input's ``dilation`` interleaved phases."""

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int = 1):
        super().__init__()
        self.conv = _Conv(cin, cout, kernel)
        self.kernel, self.dilation = kernel, dilation

    def __call__(self, x):
        d, k = self.dilation, self.kernel
        pad = (k - 1) * d
        w, b = self.conv.weight, self.conv.bias
        if d == 1:
            return mx.conv1d(mx.pad(x, [(0, 0), (pad, 0), (0, 0)]), w) + b
        n, t, c = x.shape
        m = -(-t // d)  # outputs per phase
        xp = mx.pad(x, [(0, 0), (pad, d * m - t), (0, 0)])  # [n, pad + d*m, c]
        phases = xp.reshape(n, -1, d, c).transpose(0, 2, 1, 3).reshape(n * d, -1, c)
        y = mx.conv1d(phases, w)[:, :m]
        return y.reshape(n, d, m, -1).transpose(0, 2, 1, 3).reshape(n, m * d, -1)[:, :t] + b


class CausalDepthwiseConv1d(nn.Module):
    """Depthwise causal conv (``groups = channels``; checkpoint weight ``[C, 1, k]``, stored ``[C, k, 1]``) as ``k``
    shifted multiply-adds."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.conv = _Conv(1, channels, kernel)
        self.kernel = kernel

    def __call__(self, x):
        k, t = self.kernel, x.shape[1]
        xp = mx.pad(x, [(0, 0), (k - 1, 0), (0, 0)])
        w = self.conv.weight[:, :, 0]  # [C, k]
        y = xp[:, 0:t] * w[:, 0]
        for j in range(1, k):
            y = y + xp[:, j:j + t] * w[:, j]
        return y + self.conv.bias


class CausalTransConv1d(nn.Module):
    """Transposed conv (kernel ``k``, stride ``s``) with ``k - s`` samples trimmed from each end, as released."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int):
        super().__init__()
        self.conv = ConvTranspose1d(cin, cout, kernel, stride, 0)
        self.trim = kernel - stride

    def __call__(self, x):
        y = self.conv(x)
        return y[:, self.trim:y.shape[1] - self.trim] if self.trim else y


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalDepthwiseConv1d(dim, 7)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = mx.zeros((dim,))

    def __call__(self, x):
        h = self.pwconv2(nn.gelu(self.pwconv1(self.norm(self.dwconv(x)))))
        return x + self.gamma * h


def _rotate_half(x):
    h = x.shape[-1] // 2
    return mx.concatenate([-x[..., h:], x[..., :h]], axis=-1)


class Attention(nn.Module):
    def __init__(self, c: Code2WavConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        d, hd, bias = c.hidden_size, c.head_dim, c.attention_bias
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(d, self.n_kv * hd, bias=bias)
        self.v_proj = nn.Linear(d, self.n_kv * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=bias)

    def __call__(self, x, cos, sin, mask):
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(b, t, self.n_kv, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, t, self.n_kv, -1).transpose(0, 2, 1, 3)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, t, -1))


class LayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale = mx.zeros((dim,))

    def __call__(self, x):
        return self.scale * x


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerLayer(nn.Module):
    def __init__(self, c: Code2WavConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(c.hidden_size)
        self.mlp_layer_scale = LayerScale(c.hidden_size)

    def __call__(self, x, cos, sin, mask):
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin, mask))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class PreTransformer(nn.Module):
    def __init__(self, c: Code2WavConfig):
        super().__init__()
        self.config = c
        self.layers = [TransformerLayer(c) for _ in range(c.num_hidden_layers)]
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        hd = c.head_dim
        self._inv_freq = (1.0 / (c.rope_theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd))).astype(np.float32)

    def __call__(self, h: mx.array) -> mx.array:
        t = h.shape[1]
        angles = np.arange(t, dtype=np.float32)[:, None] * self._inv_freq
        angles = mx.array(np.concatenate([angles, angles], axis=-1))
        cos, sin = mx.cos(angles).astype(h.dtype), mx.sin(angles).astype(h.dtype)
        i = np.arange(t)
        mask = mx.array((i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - self.config.sliding_window))
        for layer in self.layers:
            h = layer(h, cos, sin, mask)
        return self.norm(h)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, 7, dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, 1)

    def __call__(self, x):
        return x + self.conv2(self.act2(self.conv1(self.act1(x))))


class DecoderBlock(nn.Module):
    def __init__(self, c: Code2WavConfig, i: int):
        super().__init__()
        cin, cout, r = c.decoder_dim // 2 ** i, c.decoder_dim // 2 ** (i + 1), c.upsample_rates[i]
        self.block = [SnakeBeta(cin), CausalTransConv1d(cin, cout, 2 * r, r)] + [ResidualUnit(cout, d)
                                                                                for d in (1, 3, 9)]

    def __call__(self, x):
        for layer in self.block:
            x = layer(x)
        return x


class Code2Wav(nn.Module):
    """``Code2Wav(codes [B, num_quantizers, T]) -> waveform [B, 1, samples]`` in [-1, 1] (24 kHz released)."""

    def __init__(self, c: Code2WavConfig):
        super().__init__()
        self.config = c
        self.pre_transformer = PreTransformer(c)
        self.code_embedding = nn.Embedding(c.codebook_size * c.num_quantizers, c.hidden_size)
        self.upsample = [[CausalTransConv1d(c.hidden_size, c.hidden_size, f, f), ConvNeXtBlock(c.hidden_size)]
                         for f in c.upsampling_ratios]
        out = c.decoder_dim // 2 ** len(c.upsample_rates)
        self.decoder = ([CausalConv1d(c.hidden_size, c.decoder_dim, 7)]
                        + [DecoderBlock(c, i) for i in range(len(c.upsample_rates))]
                        + [SnakeBeta(out), CausalConv1d(out, 1, 7)])

    @property
    def total_upsample(self) -> int:
        return self.config.total_upsample

    def __call__(self, codes) -> mx.array:
        c = self.config
        codes = mx.array(np.asarray(codes)) if not isinstance(codes, mx.array) else codes
        if codes.ndim != 3 or codes.shape[1] != c.num_quantizers:
            raise ValueError(f"codes must be [batch, {c.num_quantizers}, frames], got {tuple(codes.shape)}")
        offsets = mx.arange(c.num_quantizers)[None, :, None] * c.codebook_size
        h = self.code_embedding(codes.astype(mx.int32) + offsets).mean(axis=1)  # [B, T, H]
        h = self.pre_transformer(h)
        for up, block in self.upsample:
            h = block(up(h))
        for layer in self.decoder:
            h = layer(h)
        return mx.clip(h, -1.0, 1.0).transpose(0, 2, 1)

    def chunked_decode(self, codes, chunk_size: int = 300, left_context_size: int = 25) -> mx.array:
        """transformers' streamed decode: chunks of ``chunk_size`` frames, each run with up to
        ``left_context_size`` frames before it and the context's samples dropped."""
        codes = mx.array(np.asarray(codes)) if not isinstance(codes, mx.array) else codes
        wavs, start, n = [], 0, codes.shape[-1]
        while start < n:
            end = min(start + chunk_size, n)
            ctx = left_context_size if start - left_context_size > 0 else start
            wav = self(codes[..., start - ctx:end])
            wavs.append(wav[..., ctx * self.total_upsample:])
            start = end
        return mx.concatenate(wavs, axis=-1)

    def decode_stream(self, codes, chunk_size: int = 300, left_context_size: int = 25):
        """Yield the waveform ``[B, 1, n]`` piece by piece as ``chunked_decode`` computes it, but joined without
        holes: transformers drops ``context x total_upsample`` samples from each chunk after the first, which skips
        the ``tail_samples`` (23 ms released) the previous chunk could not produce yet; here each later chunk starts
        where the previous one stopped. The pieces add up to the whole decode's length, and with a left context
        that covers the decoder's receptive field they equal the whole decode."""
        codes = mx.array(np.asarray(codes)) if not isinstance(codes, mx.array) else codes
        start, n, tail = 0, codes.shape[-1], self.config.tail_samples
        if left_context_size * self.total_upsample < tail:
            raise ValueError(f"left_context_size must cover the {tail}-sample tail "
                             f"(>= {-(-tail // self.total_upsample)} frames)")
        while start < n:
            end = min(start + chunk_size, n)
            ctx = left_context_size if start - left_context_size > 0 else start
            wav = self(codes[..., start - ctx:end])
            yield wav[..., ctx * self.total_upsample - tail:] if ctx else wav
            start = end

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """``code2wav.*`` checkpoint tensors -> this module's names and channels-last conv layouts."""
        out = {}
        for k, v in weights.items():
            if not k.startswith("code2wav."):
                continue
            k = k[len("code2wav."):]
            if k.endswith("conv.weight") and v.ndim == 3:
                # transposed convs: [in, out, k] -> [out, k, in]; convs (depthwise too): [out, in, k] -> [out, k, in]
                transposed = (k.startswith("upsample.") and ".0.conv." in k) or ".block.1.conv." in k
                v = v.transpose(1, 2, 0) if transposed else v.transpose(0, 2, 1)
            out[k] = v
        return out


class Code2WavStream:
    """Frames in, audio out as soon as a chunk is complete: ``decode_stream``'s chunks (``chunk_size`` frames with
    ``left_context_size`` frames of context, joined without holes), fed one frame at a time. ``add(frame)`` returns
    the PCM that became ready (``[samples]`` float32, maybe empty); ``finish()`` the rest."""

    def __init__(self, code2wav: Code2Wav, chunk_size: int = 25, left_context_size: int = 25):
        tail = code2wav.config.tail_samples
        if left_context_size * code2wav.total_upsample < tail:
            raise ValueError(f"left_context_size must cover the {tail}-sample tail")
        self.code2wav, self.chunk_size, self.context = code2wav, chunk_size, left_context_size
        self.frames: list[list[int]] = []
        self.start = 0  # first frame not yet emitted

    def _emit(self, end: int) -> np.ndarray:
        c2w, start = self.code2wav, self.start
        ctx = self.context if start - self.context > 0 else start
        codes = mx.array(np.asarray(self.frames[start - ctx:end], dtype=np.int64).T[None])
        wav = c2w(codes)
        if ctx:
            wav = wav[..., ctx * c2w.total_upsample - c2w.config.tail_samples:]
        self.start = end
        return np.array(wav.astype(mx.float32)).reshape(-1)

    def add(self, frame) -> np.ndarray:
        self.frames.append([int(c) for c in frame])
        if len(self.frames) - self.start >= self.chunk_size:
            return self._emit(self.start + self.chunk_size)
        return np.zeros(0, dtype=np.float32)

    def finish(self) -> np.ndarray:
        if self.start < len(self.frames):
            return self._emit(len(self.frames))
        return np.zeros(0, dtype=np.float32)


def hf_code2wav_shapes(c: Code2WavConfig) -> dict[str, tuple[int, ...]]:
    """Every Code2Wav tensor of a released checkpoint (names after ``code2wav.``) and its HF shape."""
    d, hd = c.hidden_size, c.head_dim
    s = {"code_embedding.weight": (c.codebook_size * c.num_quantizers, d), "pre_transformer.norm.weight": (d,)}
    for i in range(c.num_hidden_layers):
        p = f"pre_transformer.layers.{i}."
        s[p + "self_attn.q_proj.weight"] = (c.num_attention_heads * hd, d)
        s[p + "self_attn.k_proj.weight"] = s[p + "self_attn.v_proj.weight"] = (c.num_key_value_heads * hd, d)
        s[p + "self_attn.o_proj.weight"] = (d, c.num_attention_heads * hd)
        s[p + "mlp.gate_proj.weight"] = s[p + "mlp.up_proj.weight"] = (c.intermediate_size, d)
        s[p + "mlp.down_proj.weight"] = (d, c.intermediate_size)
        s[p + "input_layernorm.weight"] = s[p + "post_attention_layernorm.weight"] = (d,)
        s[p + "self_attn_layer_scale.scale"] = s[p + "mlp_layer_scale.scale"] = (d,)
    for i, f in enumerate(c.upsampling_ratios):
        p = f"upsample.{i}."
        s[p + "0.conv.weight"], s[p + "0.conv.bias"] = (d, d, f), (d,)
        s[p + "1.dwconv.conv.weight"], s[p + "1.dwconv.conv.bias"] = (d, 1, 7), (d,)
        s[p + "1.norm.weight"], s[p + "1.norm.bias"] = (d,), (d,)
        s[p + "1.pwconv1.weight"], s[p + "1.pwconv1.bias"] = (4 * d, d), (4 * d,)
        s[p + "1.pwconv2.weight"], s[p + "1.pwconv2.bias"] = (d, 4 * d), (d,)
        s[p + "1.gamma"] = (d,)
    s["decoder.0.conv.weight"], s["decoder.0.conv.bias"] = (c.decoder_dim, d, 7), (c.decoder_dim,)
    for i, r in enumerate(c.upsample_rates):
        cin, cout = c.decoder_dim // 2 ** i, c.decoder_dim // 2 ** (i + 1)
        p = f"decoder.{i + 1}.block."
        s[p + "0.alpha"] = s[p + "0.beta"] = (cin,)
        s[p + "1.conv.weight"], s[p + "1.conv.bias"] = (cin, cout, 2 * r), (cout,)
        for j in range(3):
            q = p + f"{j + 2}."
            s[q + "act1.alpha"] = s[q + "act1.beta"] = s[q + "act2.alpha"] = s[q + "act2.beta"] = (cout,)
            s[q + "conv1.conv.weight"], s[q + "conv1.conv.bias"] = (cout, cout, 7), (cout,)
            s[q + "conv2.conv.weight"], s[q + "conv2.conv.bias"] = (cout, cout, 1), (cout,)
    out = c.decoder_dim // 2 ** len(c.upsample_rates)
    n = len(c.upsample_rates) + 1
    s[f"decoder.{n}.alpha"] = s[f"decoder.{n}.beta"] = (out,)
    s[f"decoder.{n + 1}.conv.weight"], s[f"decoder.{n + 1}.conv.bias"] = (1, out, 7), (1,)
    return s


def load_code2wav(path, config: dict) -> Code2Wav:
    """The Code2Wav of a released checkpoint folder (``code2wav_config`` and the ``code2wav.*`` tensors)."""
    from pathlib import Path

    from ..loading import load_safetensors, load_weights_strict

    if not isinstance(config.get("code2wav_config"), dict):
        raise CheckpointError("config.json has no code2wav_config (a -Thinking checkpoint has no speech)")
    model = Code2Wav(Code2WavConfig.from_dict(config["code2wav_config"]))
    load_weights_strict(model, model.sanitize(load_safetensors(Path(path))), what=f"code2wav in {path}")
    mx.eval(model.parameters())
    return model
