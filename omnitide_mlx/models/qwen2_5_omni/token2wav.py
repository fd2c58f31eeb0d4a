"""Qwen2.5-Omni token2wav on MLX: codec tokens -> mel (a DiT flow-matching model) -> 24 kHz waveform (BigVGAN).

As transformers 5.24 defines it (``Qwen2_5OmniToken2WavModel``):

- **DiT** (``code2wav_dit_model``): each codec token is embedded and repeated ``repeats`` (2) times, so one token
  is two mel frames. The input of every frame is ``[noisy mel, ECAPA-TDNN(reference mel), code embedding, speaker
  vector]`` projected to the model width; 22 blocks of adaptive-LayerNorm attention + MLP conditioned on the flow
  time; attention is limited to blocks of ``block_size`` frames (a layer in ``look_backward_layers`` also sees the
  block before, one in ``look_ahead_layers`` the block after); rotary positions act on the first head only, on
  interleaved pairs. ``sample`` integrates the flow from Gaussian noise with a fixed-step RK4 (3/8 rule) over a
  "swayed" time grid, with classifier-free guidance (the unconditioned pass has no speaker, no reference mel and
  code 0 everywhere): ``v = v_c + (v_c - v_u) * guidance_scale``.
- **BigVGAN** (``code2wav_bigvgan_model``): log-mel -> dB-normalised spectrogram -> conv, 6 transposed-conv
  upsamplers (x240 in all: one mel frame is 10 ms at 24 kHz), each followed by the mean of 3 AMP residual blocks
  whose activations are anti-aliased SnakeBeta (2x upsample, snake, 2x downsample with a Kaiser-sinc filter).

Everything runs channels-last (``[B, T, C]``), MLX's native convolution layout, so no transposes sit between
layers; checkpoint conv weights are transposed once at load (``sanitize``). The anti-aliasing filters are the same
for every channel, so the resampling is done as shifted multiply-adds over ``[B, T, C]`` (polyphase) rather than
as a depthwise convolution (see docs/benchmarks.md, "Speech").
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..loading import config_fields


@dataclass
class DiTConfig:
    hidden_size: int = 1024
    num_hidden_layers: int = 22
    num_attention_heads: int = 16
    ff_mult: int = 2
    emb_dim: int = 512
    head_dim: int = 64
    rope_theta: float = 10000.0
    block_size: int = 24
    look_ahead_layers: list[int] = field(default_factory=lambda: [10])
    look_backward_layers: list[int] = field(default_factory=lambda: [0, 20])
    repeats: int = 2
    num_embeds: int = 8193
    mel_dim: int = 80
    enc_emb_dim: int = 192
    enc_dim: int = 128
    enc_channels: list[int] = field(default_factory=lambda: [256, 256, 256, 256, 768])
    enc_kernel_sizes: list[int] = field(default_factory=lambda: [5, 3, 3, 3, 1])
    enc_dilations: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 1])
    enc_attention_channels: int = 64
    enc_res2net_scale: int = 2
    enc_se_channels: int = 64
    max_position_embeddings: int = 32768

    @classmethod
    def from_dict(cls, d: dict) -> "DiTConfig":
        kw = config_fields(cls, d)
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if "rope_theta" in rope:
            kw["rope_theta"] = rope["rope_theta"]
        return cls(**kw)


@dataclass
class BigVGANConfig:
    mel_dim: int = 80
    upsample_initial_channel: int = 1536
    resblock_kernel_sizes: list[int] = field(default_factory=lambda: [3, 7, 11])
    resblock_dilation_sizes: list = field(default_factory=lambda: [[1, 3, 5], [1, 3, 5], [1, 3, 5]])
    upsample_rates: list[int] = field(default_factory=lambda: [5, 3, 2, 2, 2, 2])
    upsample_kernel_sizes: list[int] = field(default_factory=lambda: [11, 7, 4, 4, 4, 4])

    @classmethod
    def from_dict(cls, d: dict) -> "BigVGANConfig":
        return cls(**config_fields(cls, d))

    @property
    def hop(self) -> int:
        """Waveform samples per mel frame (240: 10 ms at 24 kHz)."""
        return int(np.prod(self.upsample_rates))


SAMPLE_RATE = 24000


# --- ECAPA-TDNN speaker encoder (on the reference mel) -----------------------------------------------------------

def _reflect_pad(x: mx.array, left: int, right: int) -> mx.array:
    """Reflect-pad ``[B, T, C]`` along time (torch ``padding_mode="reflect"``)."""
    if not left and not right:
        return x
    t = x.shape[1]
    idx = np.concatenate([np.arange(left, 0, -1), np.arange(t), np.arange(t - 2, t - 2 - right, -1)])
    return x[:, mx.array(idx)]


class TDNNBlock(nn.Module):
    """Conv1d with torch's ``padding="same"`` and reflect padding, then ReLU."""

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, dilation=dilation)
        total = dilation * (kernel - 1)
        self.pad = (total // 2, total - total // 2)

    def __call__(self, x):
        return nn.relu(self.conv(_reflect_pad(x, *self.pad)))


class Res2NetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, scale: int, kernel: int, dilation: int):
        super().__init__()
        self.scale = scale
        self.blocks = [TDNNBlock(cin // scale, cout // scale, kernel, dilation) for _ in range(scale - 1)]

    def __call__(self, x):
        parts = mx.split(x, self.scale, axis=-1)
        out, prev = [parts[0]], None
        for i in range(1, self.scale):
            prev = self.blocks[i - 1](parts[i] if i == 1 else parts[i] + prev)
            out.append(prev)
        return mx.concatenate(out, axis=-1)


class SEBlock(nn.Module):
    def __init__(self, cin: int, se: int, cout: int):
        super().__init__()
        self.conv1 = nn.Conv1d(cin, se, 1)
        self.conv2 = nn.Conv1d(se, cout, 1)

    def __call__(self, x):
        s = x.mean(axis=1, keepdims=True)
        return x * mx.sigmoid(self.conv2(nn.relu(self.conv1(s))))


class SERes2NetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, scale: int, se: int, kernel: int, dilation: int):
        super().__init__()
        self.tdnn1 = TDNNBlock(cin, cout, 1, 1)
        self.res2net_block = Res2NetBlock(cout, cout, scale, kernel, dilation)
        self.tdnn2 = TDNNBlock(cout, cout, 1, 1)
        self.se_block = SEBlock(cout, se, cout)

    def __call__(self, x):
        return self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x)))) + x


class AttentiveStatsPool(nn.Module):
    eps = 1e-12

    def __init__(self, channels: int, attention_channels: int):
        super().__init__()
        self.tdnn = TDNNBlock(channels * 3, attention_channels, 1, 1)
        self.conv = nn.Conv1d(attention_channels, channels, 1)

    def _stats(self, x, w):
        mean = (w * x).sum(axis=1)
        std = mx.sqrt(mx.maximum((w * (x - mean[:, None]) ** 2).sum(axis=1), self.eps))
        return mean, std

    def __call__(self, x):
        t = x.shape[1]
        mean, std = self._stats(x, mx.full((1, t, 1), 1.0 / t, dtype=x.dtype))
        ctx = mx.concatenate([x, mx.broadcast_to(mean[:, None], x.shape), mx.broadcast_to(std[:, None], x.shape)],
                             axis=-1)
        att = mx.softmax(self.conv(mx.tanh(self.tdnn(ctx))), axis=1)
        mean, std = self._stats(x, att)
        return mx.concatenate([mean, std], axis=-1)[:, None]  # [B, 1, 2C]


class ECAPA(nn.Module):
    def __init__(self, c: DiTConfig):
        super().__init__()
        ch, ks, dil = c.enc_channels, c.enc_kernel_sizes, c.enc_dilations
        self.blocks = [TDNNBlock(c.mel_dim, ch[0], ks[0], dil[0])]
        self.blocks += [SERes2NetBlock(ch[i - 1], ch[i], c.enc_res2net_scale, c.enc_se_channels, ks[i], dil[i])
                        for i in range(1, len(ch) - 1)]
        self.mfa = TDNNBlock(ch[-1], ch[-1], ks[-1], dil[-1])
        self.asp = AttentiveStatsPool(ch[-1], c.enc_attention_channels)
        self.fc = nn.Conv1d(ch[-1] * 2, c.enc_dim, 1)

    def __call__(self, mel):
        """``mel`` ``[B, T, mel_dim]`` -> ``[B, enc_dim]``."""
        x, outs = mel, []
        for block in self.blocks:
            x = block(x)
            outs.append(x)
        x = self.mfa(mx.concatenate(outs[1:], axis=-1))
        return self.fc(self.asp(x))[:, 0]


# --- DiT ---------------------------------------------------------------------------------------------------------

class TimestepEmbedding(nn.Module):
    def __init__(self, dim: int, freq_dim: int = 256):
        super().__init__()
        self.freq_dim = freq_dim
        self.time_mlp = [nn.Linear(freq_dim, dim), nn.Linear(dim, dim)]

    def __call__(self, t: mx.array) -> mx.array:
        half = self.freq_dim // 2
        freqs = mx.exp(mx.arange(half, dtype=mx.float32) * -(math.log(10000) / (half - 1)))
        e = 1000.0 * t[:, None] * freqs[None]
        e = mx.concatenate([mx.sin(e), mx.cos(e)], axis=-1)
        return self.time_mlp[1](nn.silu(self.time_mlp[0](e)))


class CodecEmbedding(nn.Module):
    def __init__(self, num: int, dim: int, repeats: int):
        super().__init__()
        self.repeats = repeats
        self.codec_embed = nn.Embedding(num + 1, dim)

    def __call__(self, codes: mx.array) -> mx.array:
        return mx.repeat(self.codec_embed(codes), self.repeats, axis=1)


class InputEmbedding(nn.Module):
    def __init__(self, c: DiTConfig):
        super().__init__()
        self.mel_dim = c.mel_dim
        self.proj = nn.Linear(c.mel_dim + c.enc_dim + c.enc_emb_dim + c.emb_dim, c.hidden_size)
        self.spk_encoder = ECAPA(c)

    def static(self, ref_mel: mx.array, code_embed: mx.array, cond: mx.array) -> mx.array:
        """The part of the projection that does not change during sampling: ``[B, T, hidden]`` for reference
        mel ``[B, R, mel]``, code embeddings ``[B, T, emb]`` and speaker vector ``[B, enc_emb]`` (bias included)."""
        t = code_embed.shape[1]
        spk = self.spk_encoder(ref_mel)
        spk = mx.broadcast_to(spk[:, None], (spk.shape[0], t, spk.shape[-1]))
        rest = mx.concatenate([spk, code_embed, mx.broadcast_to(cond[:, None], (cond.shape[0], t, cond.shape[-1]))],
                              axis=-1)
        return rest @ self.proj.weight[:, self.mel_dim:].T + self.proj.bias

    def __call__(self, x: mx.array, static: mx.array) -> mx.array:
        return x @ self.proj.weight[:, :self.mel_dim].T + static


class AdaLayerNormZero(nn.Module):
    def __init__(self, dim: int, chunks: int):
        super().__init__()
        self.chunks = chunks
        self.linear = nn.Linear(dim, dim * chunks)

    def __call__(self, t_emb):
        return mx.split(self.linear(nn.silu(t_emb)), self.chunks, axis=-1)


def _layer_norm(x):
    return mx.fast.layer_norm(x, None, None, 1e-6)


class DiTAttention(nn.Module):
    def __init__(self, c: DiTConfig):
        super().__init__()
        self.heads, self.head_dim, self.theta = c.num_attention_heads, c.head_dim, c.rope_theta
        inner = c.head_dim * c.num_attention_heads
        self.to_q = nn.Linear(c.hidden_size, inner)
        self.to_k = nn.Linear(c.hidden_size, inner)
        self.to_v = nn.Linear(c.hidden_size, inner)
        self.to_out = nn.Linear(inner, c.hidden_size)

    def _rope_first_head(self, x):
        """Rotary positions on head 0 only, on interleaved pairs (the checkpoint's layout)."""
        head0 = mx.fast.rope(x[:, :1], self.head_dim, traditional=True, base=self.theta, scale=1.0, offset=0)
        return mx.concatenate([head0, x[:, 1:]], axis=1)

    def __call__(self, x, mask):
        b, t, _ = x.shape
        q, k, v = (f(x).reshape(b, t, self.heads, self.head_dim).transpose(0, 2, 1, 3)
                   for f in (self.to_q, self.to_k, self.to_v))
        q, k = self._rope_first_head(q), self._rope_first_head(k)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5, mask=mask)
        return self.to_out(out.transpose(0, 2, 1, 3).reshape(b, t, -1))


class DiTMLP(nn.Module):
    def __init__(self, dim: int, mult: int):
        super().__init__()
        self.ff = [nn.Linear(dim, dim * mult), nn.Linear(dim * mult, dim)]

    def __call__(self, x):
        return self.ff[1](nn.gelu_approx(self.ff[0](x)))


class DiTBlock(nn.Module):
    def __init__(self, c: DiTConfig, look_back: int, look_ahead: int):
        super().__init__()
        self.look_back, self.look_ahead = look_back, look_ahead
        self.attn_norm = AdaLayerNormZero(c.hidden_size, 6)
        self.attn = DiTAttention(c)
        self.ff = DiTMLP(c.hidden_size, c.ff_mult)

    def __call__(self, x, t_emb, masks):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.attn_norm(t_emb)
        h = _layer_norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None]
        x = x + gate_msa[:, None] * self.attn(h, masks[(self.look_back, self.look_ahead)])
        h = _layer_norm(x) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        return x + gate_mlp[:, None] * self.ff(h)


def block_masks(frames: int, block_size: int, pairs) -> dict:
    """Additive attention masks ``[T, T]`` per (look-back, look-ahead) pair: frame j is visible from frame i when
    ``-back <= block(j) - block(i) <= ahead``."""
    blocks = np.arange(frames) // block_size
    diff = blocks[None, :] - blocks[:, None]
    out = {}
    for back, ahead in set(pairs):
        ok = (diff >= -back) & (diff <= ahead)
        out[(back, ahead)] = mx.array(np.where(ok, 0.0, -np.inf).astype(np.float32))
    return out


def sway_time_grid(steps: int, sway: float | None) -> np.ndarray:
    """The ODE's time points: ``linspace(0, 1, steps)`` bent by ``sway * (cos(pi/2 t) - 1 + t)`` (float32)."""
    t = np.linspace(0, 1, steps, dtype=np.float32)
    if sway is not None:
        t = (t + np.float32(sway) * (np.cos(np.float32(np.pi / 2) * t) - 1 + t)).astype(np.float32)
    return t


class DiT(nn.Module):
    def __init__(self, c: DiTConfig):
        super().__init__()
        self.config = c
        self.time_embed = TimestepEmbedding(c.hidden_size)
        self.text_embed = CodecEmbedding(c.num_embeds, c.emb_dim, c.repeats)
        self.input_embed = InputEmbedding(c)
        self.transformer_blocks = [
            DiTBlock(c, 1 if i in c.look_backward_layers else 0, 1 if i in c.look_ahead_layers else 0)
            for i in range(c.num_hidden_layers)]
        self.norm_out = AdaLayerNormZero(c.hidden_size, 2)
        self.proj_out = nn.Linear(c.hidden_size, c.mel_dim)

    def velocity(self, x: mx.array, t: mx.array, static: mx.array, masks: dict) -> mx.array:
        """The flow velocity ``[B, T, mel]`` at state ``x`` and time ``t`` (scalar or ``[B]``)."""
        t = mx.broadcast_to(mx.array(t, dtype=mx.float32).reshape(-1), (x.shape[0],))
        t_emb = self.time_embed(t)
        h = self.input_embed(x, static)
        for block in self.transformer_blocks:
            h = block(h, t_emb, masks)
        scale, shift = self.norm_out(t_emb)
        return self.proj_out(_layer_norm(h) * (1 + scale[:, None]) + shift[:, None])

    def sample(self, codes: mx.array, cond: mx.array, ref_mel: mx.array, noise: mx.array, *, num_steps: int = 10,
               guidance_scale: float = 0.5, sway_coefficient: float | None = -1.0) -> mx.array:
        """Mel ``[B, 2 * codes, mel]`` (channels-last) from ``codes`` ``[B, N]``, speaker vector ``cond``
        ``[B, enc_emb]``, reference mel ``ref_mel`` ``[B, R, mel]`` and initial ``noise`` ``[B, 2N, mel]``."""
        c = self.config
        frames = codes.shape[1] * c.repeats
        if frames > c.max_position_embeddings:
            raise ValueError(f"{codes.shape[1]} codes make {frames} mel frames, more than the DiT's "
                             f"{c.max_position_embeddings}")
        if tuple(noise.shape) != (codes.shape[0], frames, c.mel_dim):
            raise ValueError(f"noise must be {(codes.shape[0], frames, c.mel_dim)}, got {tuple(noise.shape)}")
        masks = block_masks(frames, c.block_size, [(b.look_back, b.look_ahead) for b in self.transformer_blocks])
        embed = self.input_embed
        guided = guidance_scale >= 1e-5
        static = embed.static(ref_mel, self.text_embed(codes), cond)
        if guided:  # the unconditioned half: no speaker, no reference mel, code 0 everywhere
            null = embed.static(mx.zeros_like(ref_mel), self.text_embed(mx.zeros_like(codes)), mx.zeros_like(cond))
            static = mx.concatenate([static, null], axis=0)

        def f(t, x):
            if not guided:
                return self.velocity(x, t, static, masks)
            v = self.velocity(mx.concatenate([x, x], axis=0), t, static, masks)
            vc, vu = mx.split(v, 2, axis=0)
            return vc + (vc - vu) * guidance_scale

        ts = sway_time_grid(num_steps, sway_coefficient)
        x = noise
        third, two_thirds = 1 / 3, 2 / 3
        for t0, t1 in zip(ts[:-1], ts[1:]):  # RK4, 3/8 rule (transformers' RungeKutta4ODESolver)
            dt = np.float32(t1 - t0)
            k1 = f(t0, x)
            k2 = f(np.float32(t0 + dt * third), x + dt * k1 * third)
            k3 = f(np.float32(t0 + dt * two_thirds), x + dt * (k2 - k1 * third))
            k4 = f(t1, x + dt * (k1 - k2 + k3))
            x = x + (k1 + 3 * (k2 + k3) + k4) * dt / 8
            mx.eval(x)
        return x


# --- BigVGAN -----------------------------------------------------------------------------------------------------

def kaiser_sinc_filter(cutoff: float, half_width: float, kernel_size: int) -> np.ndarray:
    """The anti-aliasing low-pass filter (a Kaiser-windowed sinc, normalised to sum 1), as BigVGAN builds it."""
    even = kernel_size % 2 == 0
    half = kernel_size // 2
    attenuation = 2.285 * (half - 1) * math.pi * 4 * half_width + 7.95
    if attenuation > 50.0:
        beta = 0.1102 * (attenuation - 8.7)
    elif attenuation >= 21.0:
        beta = 0.5842 * (attenuation - 21) ** 0.4 + 0.07886 * (attenuation - 21.0)
    else:
        beta = 0.0
    window = np.kaiser(kernel_size, beta).astype(np.float64)
    t = (np.arange(-half, half) + 0.5) if even else (np.arange(kernel_size) - half)
    f = 2 * cutoff * window * np.sinc(2 * cutoff * t)
    return (f / f.sum()).astype(np.float32)


def _edge_pad(x: mx.array, left: int, right: int) -> mx.array:
    return mx.pad(x, [(0, 0), (left, right), (0, 0)], mode="edge")


class AntiAliasedSnake(nn.Module):
    """2x upsample (transposed conv with the filter, replicate-padded) -> SnakeBeta -> 2x downsample, on
    ``[B, T, C]``. The filter is shared by all channels, so both resamplers are 6 or 12 shifted multiply-adds
    (polyphase), not a depthwise convolution."""

    kernel = 12
    ratio = 2

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = mx.zeros((channels,))
        self.beta = mx.zeros((channels,))
        self._filter = [float(v) for v in kaiser_sinc_filter(0.5 / self.ratio, 0.6 / self.ratio, self.kernel)]

    def _upsample(self, x):
        k, s, f = self.kernel, self.ratio, self._filter
        pad = k // s - 1
        pad_left = pad * s + (k - s) // 2
        xp = _edge_pad(x, pad, pad)
        t = x.shape[1]
        phases = []
        for r in range(s):  # output i = s*n + r reads taps k' = (r + pad_left) mod s, at xp[n + (r + pad_left - k')//s]
            acc = None
            for kk in range((r + pad_left) % s, k, s):
                off = (r + pad_left - kk) // s
                term = xp[:, off:off + t] * (s * f[kk])
                acc = term if acc is None else acc + term
            phases.append(acc)
        return mx.stack(phases, axis=2).reshape(x.shape[0], t * s, x.shape[2])

    def _downsample(self, x):
        k, s, f = self.kernel, self.ratio, self._filter
        xp = _edge_pad(x, k // 2 - int(k % 2 == 0), k // 2)
        n = (xp.shape[1] - k) // s + 1
        acc = None
        for kk in range(k):
            term = xp[:, kk:kk + s * (n - 1) + 1:s] * f[kk]
            acc = term if acc is None else acc + term
        return acc

    def __call__(self, x):
        if x.dtype == mx.float32 and self.alpha.dtype == mx.float32 and mx.default_device() == mx.cpu:
            return self._cpu(x)
        x = self._upsample(x)
        a, b = mx.exp(self.alpha), mx.exp(self.beta)
        x = x + (1.0 / (b + 1e-9)) * mx.sin(x * a) ** 2
        return self._downsample(x)

    def _cpu(self, x):
        """The same three steps in NumPy, for MLX's CPU backend only (the Metal path above stays plain MLX): MLX's
        CPU ``sin`` goes element by element (7x NumPy's SIMD loop, stepaudio2/cpu_math.py) and every shifted
        multiply-add of the resamplers is a separate pass with its own buffer; here each is an in-place NumPy loop.
        Measured on BigVGAN at the released width, 1 s of audio, 2 shared cores: the activations took 11.5 s of
        18.4 s through MLX ops. Equal to the MLX path to float rounding (summation order is the same)."""
        k, s, f = self.kernel, self.ratio, self._filter
        a = np.exp(np.asarray(self.alpha, dtype=np.float32))
        inv_b = np.float32(1.0) / (np.exp(np.asarray(self.beta, dtype=np.float32)) + np.float32(1e-9))
        xs = np.asarray(x)
        bsz, t, c = xs.shape
        pad = k // s - 1
        pad_left = pad * s + (k - s) // 2
        xp = np.concatenate([np.repeat(xs[:, :1], pad, axis=1), xs, np.repeat(xs[:, -1:], pad, axis=1)], axis=1)
        up = np.empty((bsz, t, s, c), np.float32)
        tmp = np.empty((bsz, t, c), np.float32)
        for r in range(s):
            acc = up[:, :, r]
            first = True
            for kk in range((r + pad_left) % s, k, s):
                off = (r + pad_left - kk) // s
                if first:
                    np.multiply(xp[:, off:off + t], np.float32(s * f[kk]), out=acc)
                    first = False
                else:
                    np.multiply(xp[:, off:off + t], np.float32(s * f[kk]), out=tmp)
                    acc += tmp
        up = up.reshape(bsz, t * s, c)
        with np.errstate(all="ignore"):
            y = np.multiply(up, a)
            np.sin(y, out=y)
            y *= y
            y *= inv_b
            y += up
        left, right = k // 2 - int(k % 2 == 0), k // 2
        yp = np.concatenate([np.repeat(y[:, :1], left, axis=1), y, np.repeat(y[:, -1:], right, axis=1)], axis=1)
        n = (yp.shape[1] - k) // s + 1
        out = np.multiply(yp[:, 0:s * (n - 1) + 1:s], np.float32(f[0]))
        tmp = np.empty_like(out)
        for kk in range(1, k):
            np.multiply(yp[:, kk:kk + s * (n - 1) + 1:s], np.float32(f[kk]), out=tmp)
            out += tmp
        return mx.array(out)


class DilatedConv1d(nn.Module):
    """A "same" Conv1d with dilation ``d``, run as ``d`` undilated convolutions over the input's interleaved phases.

    MLX's CPU convolution is ~100x slower with dilation than without (measured on this machine, [1, 240, 768],
    kernel 3: 0.033 s undilated, 3.4 s at dilation 5; kernel 11: 0.17 s / 10.6 s), and BigVGAN's residual blocks
    use dilations 3 and 5. Output ``t = r + d*m`` only reads inputs ``r + d*(m + j)``, so phase ``r`` of the padded
    input through the undilated kernel gives every ``d``-th output. Same parameters as ``nn.Conv1d``."""

    def __init__(self, channels: int, kernel: int, dilation: int):
        super().__init__()
        scale = (channels * kernel) ** -0.5
        self.weight = mx.random.uniform(-scale, scale, (channels, kernel, channels))
        self.bias = mx.zeros((channels,))
        self.dilation, self.pad = dilation, (kernel * dilation - dilation) // 2

    def __call__(self, x):
        d = self.dilation
        if d == 1:
            return mx.conv1d(x, self.weight, padding=self.pad) + self.bias
        b, t, c = x.shape
        m = -(-t // d)  # outputs per phase (the last phases are cropped)
        xp = mx.pad(x, [(0, 0), (self.pad, self.pad + d * m - t), (0, 0)])
        phases = xp.reshape(b, -1, d, c).transpose(0, 2, 1, 3).reshape(b * d, -1, c)  # [b*d, L/d, c]
        y = mx.conv1d(phases, self.weight)[:, :m]  # [b*d, m, c]
        y = y.reshape(b, d, m, -1).transpose(0, 2, 1, 3).reshape(b, m * d, -1)[:, :t]
        return y + self.bias


class ConvTranspose1d(nn.Module):
    """``nn.ConvTranspose1d`` (same parameters) as one matmul and an overlap-add: MLX's CPU transposed convolution
    took 10.5 s for BigVGAN's first upsampler on 1 s of audio ([1, 100, 1536] -> [1, 500, 768], kernel 11,
    stride 5) where the matmul takes 0.7 s. Tap ``j = q * stride + r`` of input ``n`` lands on output
    ``(n + q) * stride + r``, so the taps group into ``ceil(kernel / stride)`` shifted sums per phase ``r``."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, padding: int):
        super().__init__()
        scale = (cin * kernel) ** -0.5
        self.weight = mx.random.uniform(-scale, scale, (cout, kernel, cin))
        self.bias = mx.zeros((cout,))
        self.stride, self.padding = stride, padding

    def __call__(self, x):
        b, t, _ = x.shape
        co, k, ci = self.weight.shape
        s = self.stride
        q_taps = -(-k // s)
        w = self.weight.transpose(1, 0, 2).reshape(k * co, ci)
        z = (x @ w.T).reshape(b, t, k, co)
        if q_taps * s != k:
            z = mx.pad(z, [(0, 0), (0, 0), (0, q_taps * s - k), (0, 0)])
        z = z.reshape(b, t, q_taps, s, co)
        y = None
        for q in range(q_taps):
            part = mx.pad(z[:, :, q], [(0, 0), (q, q_taps - 1 - q), (0, 0), (0, 0)])
            y = part if y is None else y + part
        y = y.reshape(b, (t + q_taps - 1) * s, co)
        return y[:, self.padding:(t - 1) * s + k - self.padding] + self.bias


class AMPBlock(nn.Module):
    def __init__(self, channels: int, kernel: int, dilations):
        super().__init__()
        self.convs1 = [DilatedConv1d(channels, kernel, d) for d in dilations]
        self.convs2 = [nn.Conv1d(channels, channels, kernel, padding=(kernel - 1) // 2) for _ in dilations]
        self.activations = [AntiAliasedSnake(channels) for _ in range(2 * len(dilations))]

    def __call__(self, x):
        for i, (c1, c2) in enumerate(zip(self.convs1, self.convs2)):
            h = c2(self.activations[2 * i + 1](c1(self.activations[2 * i](x))))
            x = x + h
        return x


class BigVGAN(nn.Module):
    def __init__(self, c: BigVGANConfig):
        super().__init__()
        self.config = c
        ch = c.upsample_initial_channel
        self.conv_pre = nn.Conv1d(c.mel_dim, ch, 7, padding=3)
        self.ups = [ConvTranspose1d(ch // 2 ** i, ch // 2 ** (i + 1), k, s, (k - s) // 2)
                    for i, (s, k) in enumerate(zip(c.upsample_rates, c.upsample_kernel_sizes))]
        self.resblocks = [AMPBlock(ch // 2 ** (i + 1), k, d) for i in range(len(c.upsample_rates))
                          for k, d in zip(c.resblock_kernel_sizes, c.resblock_dilation_sizes)]
        last = ch // 2 ** len(c.upsample_rates)
        self.activation_post = AntiAliasedSnake(last)
        self.conv_post = nn.Conv1d(last, 1, 7, padding=3, bias=False)

    @staticmethod
    def normalise(mel: mx.array) -> mx.array:
        """Natural-log mel -> dB (floor -115 dB, minus 20 dB) -> [-1, 1], as the checkpoint was trained."""
        min_level = math.exp(-115 / 20.0 * math.log(10))
        db = 20 * mx.log10(mx.maximum(mx.exp(mel), min_level)) - 20
        return mx.clip(2 * ((db + 115) / 115) - 1, -1, 1)

    def __call__(self, mel: mx.array) -> mx.array:
        """Waveform ``[B, T * hop]`` in [-1, 1] from mel ``[B, T, mel]``."""
        x = self.conv_pre(self.normalise(mel))
        n = len(self.config.resblock_kernel_sizes)
        for i, up in enumerate(self.ups):
            x = up(x)
            x = sum(self.resblocks[i * n + j](x) for j in range(n)) / n
        x = self.conv_post(self.activation_post(x))
        return mx.clip(x[..., 0], -1.0, 1.0)


class Token2Wav(nn.Module):
    """Checkpoint prefix ``token2wav.``: ``code2wav_dit_model`` + ``code2wav_bigvgan_model``."""

    def __init__(self, dit: DiTConfig, bigvgan: BigVGANConfig):
        super().__init__()
        self.code2wav_dit_model = DiT(dit)
        self.code2wav_bigvgan_model = BigVGAN(bigvgan)

    @classmethod
    def from_dict(cls, d: dict) -> "Token2Wav":
        return cls(DiTConfig.from_dict(d.get("dit_config") or {}), BigVGANConfig.from_dict(d.get("bigvgan_config") or {}))

    @property
    def dit(self) -> DiT:
        return self.code2wav_dit_model

    @property
    def vocoder(self) -> BigVGAN:
        return self.code2wav_bigvgan_model

    @property
    def samples_per_code(self) -> int:
        return self.dit.config.repeats * self.vocoder.config.hop

    def __call__(self, codes, cond, ref_mel, noise, **kw) -> mx.array:
        """Waveform ``[B, N * samples_per_code]`` for codes ``[B, N]`` (see ``DiT.sample``)."""
        mel = self.dit.sample(codes, cond, ref_mel, noise, **kw)
        wav = self.vocoder(mel)
        mx.eval(wav)
        return wav


# --- checkpoint names --------------------------------------------------------------------------------------------

# (transformers' name piece, this module's) for the Sequential / ModuleList indices and wrappers that differ
_RENAMES = (("time_embed.time_mlp.2.", "time_embed.time_mlp.1."), (".ff.ff.3.", ".ff.ff.1."),
            (".attn.to_out.0.", ".attn.to_out."), (".act.alpha", ".alpha"), (".act.beta", ".beta"))
_UPS = re.compile(r"(\.ups\.\d+)\.0\.(weight|bias)$")
_UPS_MLX = re.compile(r"(\.ups\.\d+)\.(weight|bias)$")


def sanitize_token2wav(weights: dict) -> dict:
    """``token2wav.*`` tensors (prefix removed) in transformers' names and layouts -> this module's: conv weights
    channels-last, ``Sequential`` indices compacted."""
    out = {}
    for k, v in weights.items():
        for hf, ours in _RENAMES:
            k = k.replace(hf, ours)
        k = _UPS.sub(r"\1.\2", k)
        if k.endswith("weight") and v.ndim == 3:
            v = v.transpose(1, 2, 0) if ".ups." in k else v.transpose(0, 2, 1)  # [in,out,k] / [out,in,k] -> [out,k,in]
        out[k] = v
    return out


def hf_token2wav_shapes(model: "Token2Wav") -> dict[str, tuple[int, ...]]:
    """The transformers names and shapes of ``model``'s parameters (the inverse of ``sanitize_token2wav``): what a
    released checkpoint holds under ``token2wav.``; the tiny-checkpoint builder writes them."""
    from mlx.utils import tree_flatten

    out = {}
    for k, v in tree_flatten(model.parameters()):
        shape = tuple(v.shape)
        if len(shape) == 3:
            o, kk, i = shape
            shape = (i, o, kk) if ".ups." in k else (o, i, kk)
        k = _UPS_MLX.sub(r"\1.0.\2", k)
        for hf, ours in _RENAMES:
            k = k.replace(ours, hf)
        out[k] = shape
    return out
