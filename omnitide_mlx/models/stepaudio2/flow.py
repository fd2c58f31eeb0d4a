"""StepAudio2 token2wav flow model in MLX: speech tokens (25/s) -> 80-band mel frames (50/s), offline and streaming.

A port of ``stepaudio2.cosyvoice2`` from ``minicpmo-utils`` 1.0.7 (``CausalMaskedDiffWithXvec`` with
``UpsampleConformerEncoderV2`` and ``CausalConditionalCFM`` over a ``DiT`` estimator), read top to bottom:

- the encoder: token embedding -> linear embed (LayerNorm, x sqrt(d)) -> pre-lookahead convs (the next
  ``pre_lookahead_len`` tokens) -> conformer blocks with ESPnet relative-position attention -> nearest x2 upsample and
  a causal conv -> a second embed -> more conformer blocks -> LayerNorm;
- the decoder: ``n_timesteps`` Euler steps on a cosine schedule, each running the DiT on the conditional and the
  unconditional (zeroed mu / speaker / prompt mel) inputs and mixing them with ``inference_cfg_rate``.

Offline (``inference``) every position attends to every other. Streaming (``setup_cache`` + ``inference_chunk``)
keeps the official caches, in the official layouts (channels first, batch 1):

- ``conformer_cnn_cache`` (1, C, 2 + 2 * up_stride): the pre-lookahead conv's and the upsampling conv's left context;
- ``conformer_att_cache`` (blocks + up_blocks, 1, heads, 2 * t, 2 * d_k): keys | values, the token-rate layers'
  t frames packed twice (``[cache, cache]``) so that they stack with the mel-rate layers' 2 t frames;
- ``estimator_cnn_cache`` (n_timesteps, depth, 2, 2 * hidden, 2) and ``estimator_att_cache`` (n_timesteps, depth, 2,
  heads, T, 2 * head_dim): one DiT cache per Euler step, batch 2 for the guidance pair. The DiT puts the new chunk's
  keys *before* the cached ones (``[new, cache]``, attention there has no positions, so the order only matters to
  the trimming in ``trim_estimator_cache``).

Departures from the official code, none of which change a number it computes: caches hold ``n_timesteps`` x
``depth`` entries (the official solver writes into fixed 16 x 16 scratch buffers and returns all 16 rows, the
unused ones stale); the pre-lookahead conv keeps the last two frames of ``[cache, new]`` (the official code keeps
those of the new frames only, which is the same whenever a chunk has at least two fresh tokens and breaks the next
call when it has one); tokens outside the vocabulary and noise too short for a request are errors.

The noise: the official CFM draws ``rand_noise`` (1, 80, 30000) once with ``torch.randn`` when it is built and
slices it at the output frame offset (offline ``[0, T)``, streaming ``[offset, offset + T)`` with ``offset`` the
estimator cache length). Here it is a fixed array too: ``decoder.rand_noise`` from the weights when they carry one,
else a standard normal draw from NumPy's generator with ``noise_seed`` (the official values depend on torch's RNG
state at construction and are not reproduced); ``set_noise`` installs given values.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..loading import CheckpointError
from . import cpu_math
from .config import DecoderConfig, DiTConfig, EncoderConfig, FlowConfig, parse_flow_yaml

NOISE_FRAMES = 50 * 600  # the official buffer: 600 s of mel frames
HISTORY_FRAMES = 100  # Token2wav keeps the prompt plus this many frames of each attention cache


def _act(name: str):
    return {"swish": cpu_math.silu, "relu": nn.relu, "gelu": nn.gelu, "tanh": cpu_math.tanh}[name]


def _causal_pad(x: mx.array, left: int, right: int = 0) -> mx.array:
    """Zero-pad (B, T, C) along time."""
    return mx.pad(x, [(0, 0), (left, right), (0, 0)])


# ------------------------------------------------------------------------------------------------ encoder pieces


def rel_position_embedding(size: int, d_model: int) -> mx.array:
    """ESPnet relative positions (1, 2 size - 1, d): rows for relative positions size-1 down to -(size-1),
    sin on even channels, cos on odd (what ``EspnetRelPositionalEncoding.position_encoding(size)`` slices)."""
    div = np.exp(np.arange(0, d_model, 2, dtype=np.float32) * np.float32(-(math.log(10000.0) / d_model)))
    pos = np.arange(size - 1, -size, -1, dtype=np.float32)[:, None]
    pe = np.zeros((2 * size - 1, d_model), dtype=np.float32)
    pe[:, 0::2] = np.sin(pos * div)
    pe[:, 1::2] = np.cos(pos * div)
    return mx.array(pe[None])


class LinearEmbed(nn.Module):
    """``LinearNoSubsampling``: Linear -> LayerNorm(eps 1e-5) -> x sqrt(d) (the positional module's scaling)."""

    def __init__(self, idim: int, odim: int):
        super().__init__()
        self.out = [nn.Linear(idim, odim), nn.LayerNorm(odim, eps=1e-5)]
        self.xscale = math.sqrt(odim)

    def __call__(self, x: mx.array) -> mx.array:
        return self.out[1](self.out[0](x)) * self.xscale


class RelPositionAttention(nn.Module):
    """``RelPositionMultiHeadedAttention`` (Transformer-XL style, ESPnet's ``rel_shift``), with a key|value cache
    (B, H, T_cache, 2 d_k) put before the new frames."""

    def __init__(self, n_head: int, n_feat: int, key_bias: bool):
        super().__init__()
        self.h, self.d_k = n_head, n_feat // n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat, bias=key_bias)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.linear_pos = nn.Linear(n_feat, n_feat, bias=False)
        self.pos_bias_u = mx.zeros((n_head, self.d_k))
        self.pos_bias_v = mx.zeros((n_head, self.d_k))

    @staticmethod
    def rel_shift(x: mx.array) -> mx.array:
        """ESPnet's shift, literally: (B, H, T1, P) -> (B, H, T1, P // 2 + 1) by the pad-and-reshape trick."""
        b, h, t1, p = x.shape
        x = mx.concatenate([mx.zeros((b, h, t1, 1), dtype=x.dtype), x], axis=-1)
        x = x.reshape(b, h, p + 1, t1)[:, :, 1:].reshape(b, h, t1, p)
        return x[..., : p // 2 + 1]

    def __call__(self, x: mx.array, pos_emb: mx.array, cache: mx.array | None = None):
        b, t, _ = x.shape
        q = self.linear_q(x).reshape(b, t, self.h, self.d_k)
        k = self.linear_k(x).reshape(b, t, self.h, self.d_k).transpose(0, 2, 1, 3)
        v = self.linear_v(x).reshape(b, t, self.h, self.d_k).transpose(0, 2, 1, 3)
        if cache is not None and cache.shape[0] > 0:
            k = mx.concatenate([cache[..., : self.d_k], k], axis=2)
            v = mx.concatenate([cache[..., self.d_k:], v], axis=2)
        new_cache = mx.concatenate([k, v], axis=-1)
        p = self.linear_pos(pos_emb).reshape(pos_emb.shape[0], -1, self.h, self.d_k).transpose(0, 2, 1, 3)
        q_u = (q + self.pos_bias_u).transpose(0, 2, 1, 3)
        q_v = (q + self.pos_bias_v).transpose(0, 2, 1, 3)
        ac = q_u @ k.transpose(0, 1, 3, 2)
        bd = q_v @ p.transpose(0, 1, 3, 2)
        if ac.shape != bd.shape:
            bd = self.rel_shift(bd)
        scores = (ac + bd) / math.sqrt(self.d_k)
        out = mx.softmax(scores, axis=-1, precise=True) @ v
        out = out.transpose(0, 2, 1, 3).reshape(b, t, self.h * self.d_k)
        return self.linear_out(out), new_cache


class FeedForward(nn.Module):
    def __init__(self, idim: int, hidden: int, act: str):
        super().__init__()
        self.w_1 = nn.Linear(idim, hidden)
        self.w_2 = nn.Linear(hidden, idim)
        self.act = _act(act)

    def __call__(self, x):
        return self.w_2(self.act(self.w_1(x)))


class ConformerLayer(nn.Module):
    """``ConformerEncoderLayer`` as the flow builds it: attention and feed-forward only (no macaron, no conv)."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        d = cfg.output_size
        self.self_attn = RelPositionAttention(cfg.attention_heads, d, cfg.key_bias)
        self.feed_forward = FeedForward(d, cfg.linear_units, cfg.activation_type)
        self.norm_mha = nn.LayerNorm(d, eps=1e-12)
        self.norm_ff = nn.LayerNorm(d, eps=1e-12)
        self.normalize_before = cfg.normalize_before

    def __call__(self, x, pos_emb, cache=None):
        pre = self.normalize_before
        att, new_cache = self.self_attn(self.norm_mha(x) if pre else x, pos_emb, cache)
        x = x + att
        if not pre:
            x = self.norm_mha(x)
        x = x + self.feed_forward(self.norm_ff(x) if pre else x)
        if not pre:
            x = self.norm_ff(x)
        return x, new_cache


class PreLookaheadLayer(nn.Module):
    """conv1 (kernel L + 1) looks ``L`` tokens ahead, conv2 (kernel 3) is causal; residual."""

    def __init__(self, channels: int, pre_lookahead_len: int):
        super().__init__()
        self.pre_lookahead_len = pre_lookahead_len
        self.conv1 = nn.Conv1d(channels, channels, pre_lookahead_len + 1)
        self.conv2 = nn.Conv1d(channels, channels, 3)

    def __call__(self, x):
        out = nn.leaky_relu(self.conv1(_causal_pad(x, 0, self.pre_lookahead_len)), 0.01)
        return self.conv2(_causal_pad(out, 2)) + x

    def forward_chunk(self, x, cache: mx.array | None):
        """x (B, T, C) holds T - L fresh frames and L lookahead frames; cache (B, 2, C) channels last."""
        out = nn.leaky_relu(self.conv1(x), 0.01)
        if cache is None:
            cache = mx.zeros((x.shape[0], 2, out.shape[2]), dtype=out.dtype)
        out = mx.concatenate([cache, out], axis=1)
        new_cache = out[:, -2:]
        return self.conv2(out) + x[:, : -self.pre_lookahead_len], new_cache


class Upsample1D(nn.Module):
    """Nearest upsampling by ``stride`` then a causal conv (kernel 2 stride + 1, left context 2 stride)."""

    def __init__(self, channels: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(channels, channels, stride * 2 + 1)

    def _repeat(self, x):
        b, t, c = x.shape
        return mx.broadcast_to(x[:, :, None, :], (b, t, self.stride, c)).reshape(b, t * self.stride, c)

    def __call__(self, x):
        return self.conv(_causal_pad(self._repeat(x), self.stride * 2))

    def forward_chunk(self, x, cache: mx.array | None):
        out = self._repeat(x)
        if cache is None:
            cache = mx.zeros((x.shape[0], self.stride * 2, x.shape[2]), dtype=x.dtype)
        out = mx.concatenate([cache, out], axis=1)
        return self.conv(out), out[:, -self.stride * 2:]


class UpsampleConformerEncoderV2(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.output_size
        self.embed = LinearEmbed(cfg.input_size, d)
        self.pre_lookahead_layer = PreLookaheadLayer(d, cfg.pre_lookahead_len)
        self.encoders = [ConformerLayer(cfg) for _ in range(cfg.num_blocks)]
        self.up_layer = Upsample1D(d, cfg.up_stride)
        self.up_embed = LinearEmbed(cfg.input_size, d)
        self.up_encoders = [ConformerLayer(cfg) for _ in range(cfg.num_up_blocks)]
        self.after_norm = nn.LayerNorm(d, eps=1e-5)

    def __call__(self, xs: mx.array) -> mx.array:
        """Offline: (1, T, input_size) token embeddings -> (1, stride T, output_size)."""
        d = self.cfg.output_size
        xs = self.pre_lookahead_layer(self.embed(xs))
        pos = rel_position_embedding(xs.shape[1], d)
        for layer in self.encoders:
            xs, _ = layer(xs, pos)
        xs = self.up_embed(self.up_layer(xs))
        pos = rel_position_embedding(xs.shape[1], d)
        for layer in self.up_encoders:
            xs, _ = layer(xs, pos)
        return self.after_norm(xs) if self.cfg.normalize_before else xs

    def forward_chunk(self, xs, last_chunk: bool, cnn_cache: mx.array | None, att_cache: mx.array | None):
        """Streaming: xs (1, T, input_size) with the lookahead tokens at the end (padded with zero frames on the
        last chunk) -> (1, stride (T - L), output_size) and the new caches (official layouts, see the module)."""
        cfg = self.cfg
        n1, L, s = cfg.num_blocks, cfg.pre_lookahead_len, cfg.up_stride
        if s != 2:
            raise ValueError(f"streaming needs up_stride 2 (the packed attention cache), this flow has {s}")
        if att_cache is not None and att_cache.shape[3] % 2:
            raise ValueError(f"conformer_att_cache time axis {att_cache.shape[3]} is not even")
        if cnn_cache is not None and cnn_cache.shape[2] != 2 + 2 * s:
            raise ValueError(f"conformer_cnn_cache has {cnn_cache.shape[2]} frames, expected {2 + 2 * s}")
        offset1 = att_cache.shape[3] // 2 if att_cache is not None else 0
        cache1 = [att_cache[i, :, :, :offset1] for i in range(n1)] if att_cache is not None else [None] * n1
        cache2 = ([att_cache[n1 + i] for i in range(cfg.num_up_blocks)] if att_cache is not None
                  else [None] * cfg.num_up_blocks)
        cnn1 = cnn_cache[:, :, :2].transpose(0, 2, 1) if cnn_cache is not None else None
        cnn2 = cnn_cache[:, :, 2:].transpose(0, 2, 1) if cnn_cache is not None else None

        xs = self.embed(xs)
        if last_chunk:
            xs = _causal_pad(xs, 0, L)
        xs, new_cnn1 = self.pre_lookahead_layer.forward_chunk(xs, cnn1)
        pos = rel_position_embedding(offset1 + xs.shape[1], cfg.output_size)
        new1 = []
        for layer, c in zip(self.encoders, cache1):
            xs, nc = layer(xs, pos, c)
            new1.append(nc)
        xs, new_cnn2 = self.up_layer.forward_chunk(xs, cnn2)
        xs = self.up_embed(xs)
        pos = rel_position_embedding(offset1 * s + xs.shape[1], cfg.output_size)
        new2 = []
        for layer, c in zip(self.up_encoders, cache2):
            xs, nc = layer(xs, pos, c)
            new2.append(nc)
        if cfg.normalize_before:
            xs = self.after_norm(xs)
        token_rate = mx.stack(new1, axis=0)
        new_att = mx.concatenate([mx.concatenate([token_rate, token_rate], axis=3), mx.stack(new2, axis=0)], axis=0)
        new_cnn = mx.concatenate([new_cnn1, new_cnn2], axis=1).transpose(0, 2, 1)
        return xs, new_cnn, new_att


# ------------------------------------------------------------------------------------------------ DiT estimator


def _layer_norm(x, eps=1e-6):
    return mx.fast.layer_norm(x, None, None, eps)


def _modulate(x, shift, scale):
    return x * (1 + scale) + shift


_gelu_tanh = cpu_math.gelu_tanh
_mish = cpu_math.mish


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden: int, freq_dim: int = 256):
        super().__init__()
        self.mlp = [nn.Linear(freq_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden)]
        self.freq_dim = freq_dim

    def __call__(self, t: mx.array) -> mx.array:
        half = self.freq_dim // 2
        freqs = mx.exp(-math.log(10000) * mx.arange(half, dtype=mx.float32) / half)
        args = (t * 1000)[:, None] * freqs[None]
        emb = mx.concatenate([mx.cos(args), mx.sin(args)], axis=-1)
        if self.freq_dim % 2:
            emb = mx.concatenate([emb, mx.zeros_like(emb[:, :1])], axis=-1)
        for layer in self.mlp:
            emb = layer(emb)
        return emb


class DiTAttention(nn.Module):
    """qk-normed attention without positions; the chunk cache (B, H, T, 2 head_dim) goes *after* the new keys."""

    def __init__(self, dim: int, num_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        inner = num_heads * head_dim
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.q_norm = nn.LayerNorm(head_dim, eps=1e-5)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-5)
        self.proj = nn.Linear(inner, dim)

    def _heads(self, x):
        b, t, _ = x.shape
        return x.reshape(b, t, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)

    def __call__(self, x, cache: mx.array | None = None):
        b, t, _ = x.shape
        q = self.q_norm(self._heads(self.to_q(x)))
        k = self.k_norm(self._heads(self.to_k(x)))
        v = self._heads(self.to_v(x))
        if cache is not None:
            k = mx.concatenate([k, cache[..., : self.head_dim]], axis=2)
            v = mx.concatenate([v, cache[..., self.head_dim:]], axis=2)
        new_cache = mx.concatenate([k, v], axis=-1)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5)
        return self.proj(out.transpose(0, 2, 1, 3).reshape(b, t, -1)), new_cache


class CausalConvBlock(nn.Module):
    """causal conv (k 3) -> LayerNorm -> Mish -> causal conv (k 3); cache (B, 2 C, 2) channels first as the
    official ``[conv1 input, conv2 input]``."""

    def __init__(self, channels: int, kernel_size: int = 3):
        super().__init__()
        self.channels, self.pad = channels, kernel_size - 1
        self.conv1 = nn.Conv1d(channels, channels, kernel_size)
        self.norm = nn.LayerNorm(channels, eps=1e-5)
        self.conv2 = nn.Conv1d(channels, channels, kernel_size)

    def __call__(self, x, cache: mx.array | None = None):
        b = x.shape[0]
        if cache is None:
            c1 = c2 = mx.zeros((b, self.pad, self.channels), dtype=x.dtype)
        else:
            c1 = cache[:, : self.channels].transpose(0, 2, 1)
            c2 = cache[:, self.channels:].transpose(0, 2, 1)
        x = mx.concatenate([c1, x], axis=1)
        n1 = x[:, -self.pad:]
        x = _mish(self.norm(self.conv1(x)))
        x = mx.concatenate([c2, x], axis=1)
        n2 = x[:, -self.pad:]
        x = self.conv2(x)
        return x, mx.concatenate([n1, n2], axis=2).transpose(0, 2, 1)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def __call__(self, x):
        return self.fc2(_gelu_tanh(self.fc1(x)))


class DiTBlock(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        h = cfg.hidden_size
        self.attn = DiTAttention(h, cfg.num_heads, cfg.head_dim)
        self.mlp = MLP(h, int(h * cfg.mlp_ratio))
        self.conv = CausalConvBlock(h, 3)
        self.adaLN_modulation = [nn.SiLU(), nn.Linear(h, 9 * h)]

    def modulation(self, c):
        return self.adaLN_modulation[1](nn.silu(c))

    def __call__(self, x, c, cnn_cache=None, att_cache=None, mod=None):
        """``mod``: ``modulation(c)`` when the caller has it already (it depends on the timestep only)."""
        if mod is None:
            mod = self.modulation(c)
        (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp,
         shift_conv, scale_conv, gate_conv) = mx.split(mod, 9, axis=-1)
        att, new_att = self.attn(_modulate(_layer_norm(x), shift_msa, scale_msa), att_cache)
        x = x + gate_msa * att
        conv, new_cnn = self.conv(_modulate(_layer_norm(x), shift_conv, scale_conv), cnn_cache)
        x = x + gate_conv * conv
        x = x + gate_mlp * self.mlp(_modulate(_layer_norm(x), shift_mlp, scale_mlp))
        return x, new_cnn, new_att


class FinalLayer(nn.Module):
    def __init__(self, hidden: int, out_channels: int):
        super().__init__()
        self.adaLN_modulation = [nn.SiLU(), nn.Linear(hidden, 2 * hidden)]
        self.linear = nn.Linear(hidden, out_channels)

    def modulation(self, c):
        return self.adaLN_modulation[1](nn.silu(c))

    def __call__(self, x, c, mod=None):
        shift, scale = mx.split(self.modulation(c) if mod is None else mod, 2, axis=-1)
        return self.linear(_modulate(_layer_norm(x), shift, scale))


class DiT(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.cfg = cfg
        self.t_embedder = TimestepEmbedder(cfg.hidden_size)
        self.in_proj = nn.Linear(cfg.in_channels, cfg.hidden_size)
        self.blocks = [DiTBlock(cfg) for _ in range(cfg.depth)]
        self.final_layer = FinalLayer(cfg.hidden_size, cfg.out_channels)

    def modulations(self, t: mx.array) -> list[mx.array]:
        """What depends on the timestep only: every block's adaLN modulation and the final layer's, for t (B,)
        -> (B, 1, 9 hidden) per block, then (B, 1, 2 hidden)."""
        c = self.t_embedder(t)[:, None]
        return [block.modulation(c) for block in self.blocks] + [self.final_layer.modulation(c)]

    def __call__(self, x, mu, t, spks, cond, cnn_cache=None, att_cache=None, mods=None, stack: bool = True):
        """x, mu, cond (B, T, C) channels last, t (B,), spks (B, C). With caches (depth, ...) -> new caches too.
        ``mods``: ``modulations(t)`` computed before (for one row, it broadcasts over the batch); then t is unused.
        ``stack=False`` returns the new caches as per-block lists (the CFM stacks all steps at once)."""
        if mods is None:
            mods = self.modulations(t)
        spks = mx.broadcast_to(spks[:, None], (x.shape[0], x.shape[1], spks.shape[-1]))
        h = self.in_proj(mx.concatenate([x, mu, spks, cond], axis=-1))
        new_cnn, new_att = [], []
        for i, block in enumerate(self.blocks):
            h, nc, na = block(h, None, None if cnn_cache is None else cnn_cache[i],
                              None if att_cache is None else att_cache[i], mod=mods[i])
            new_cnn.append(nc)
            new_att.append(na)
        if not stack:
            return self.final_layer(h, None, mod=mods[-1]), new_cnn, new_att
        return self.final_layer(h, None, mod=mods[-1]), mx.stack(new_cnn), mx.stack(new_att)


# ------------------------------------------------------------------------------------------------ CFM and flow


def cosine_t_span(n_timesteps: int) -> mx.array:
    t = np.linspace(0, 1, n_timesteps + 1, dtype=np.float32)
    return mx.array(1 - np.cos(t * np.float32(0.5 * np.pi)))


class _ModulationMemo:
    """A plain holder (never a parameter): the weights the memoised modulations came from, and them by timestep."""

    def __init__(self):
        self.weights, self.values = [], {}


class CausalConditionalCFM(nn.Module):
    def __init__(self, cfg: DecoderConfig, noise_seed: int = 0, noise_frames: int = NOISE_FRAMES):
        super().__init__()
        self.cfg = cfg
        self.estimator = DiT(cfg.estimator)
        rng = np.random.default_rng(noise_seed)
        self._noise = mx.array(rng.standard_normal((1, cfg.estimator.out_channels, noise_frames), dtype=np.float32))
        self._mod_memo = _ModulationMemo()

    @property
    def rand_noise(self) -> mx.array:
        """The fixed noise (1, out_channels, frames), sliced at the output frame offset."""
        return self._noise

    def set_noise(self, noise) -> None:
        noise = mx.array(noise, dtype=mx.float32)
        out = self.cfg.estimator.out_channels
        if noise.ndim != 3 or noise.shape[0] != 1 or noise.shape[1] != out:
            raise ValueError(f"noise must be (1, {out}, frames), got {tuple(noise.shape)}")
        self._noise = noise

    def _noise_at(self, offset: int, n: int) -> mx.array:
        if offset + n > self._noise.shape[2]:
            raise ValueError(f"the fixed noise holds {self._noise.shape[2]} frames; frames {offset}..{offset + n} "
                             "were asked for (the official buffer is 600 s of mel)")
        return self._noise[:, :, offset: offset + n].transpose(0, 2, 1)

    def _modulations(self, t: mx.array) -> list[mx.array]:
        """The estimator's timestep modulations for the guidance pair's shared t (1,), kept across calls: the Euler
        timesteps are the same every chunk, and these are 16 x (512 x 4608) weights read per step at the released
        size. Recomputed when any weight they use was replaced."""
        est = self.estimator
        weights = [p for _, p in tree_flatten(est.t_embedder.parameters())]
        weights += [b.adaLN_modulation[1].weight for b in est.blocks] + [b.adaLN_modulation[1].bias for b in est.blocks]
        weights += [est.final_layer.adaLN_modulation[1].weight, est.final_layer.adaLN_modulation[1].bias]
        memo = self._mod_memo
        if len(memo.weights) != len(weights) or any(a is not b for a, b in zip(memo.weights, weights)):
            memo.weights, memo.values = weights, {}
        key = float(t.item())
        if key not in memo.values:
            mods = est.modulations(t)
            mx.eval(mods)
            memo.values[key] = mods
        return memo.values[key]

    def _guided(self, v):
        cfg_rate = self.cfg.inference_cfg_rate
        return (1.0 + cfg_rate) * v[:1] - cfg_rate * v[1:]

    def __call__(self, mu, spks, cond, n_timesteps: int):
        """Offline: mu, cond (1, T, C) channels last, spks (1, C) -> (1, T, C)."""
        x = self._noise_at(0, mu.shape[1])
        t_span = cosine_t_span(n_timesteps)
        mu_in = mx.concatenate([mu, mx.zeros_like(mu)])
        spks_in = mx.concatenate([spks, mx.zeros_like(spks)])
        cond_in = mx.concatenate([cond, mx.zeros_like(cond)])
        t, dt = t_span[0:1], t_span[1] - t_span[0]
        for step in range(1, n_timesteps + 1):
            v, _, _ = self.estimator(mx.concatenate([x, x]), mu_in, mx.concatenate([t, t]), spks_in, cond_in,
                                     mods=self._modulations(t))
            x = x + dt * self._guided(v)
            t = t + dt
            if step < n_timesteps:
                dt = t_span[step + 1] - t
        return x

    def forward_chunk(self, mu, spks, cond, n_timesteps: int, cnn_cache=None, att_cache=None):
        """Streaming: one chunk, with per-step estimator caches (see the module). Returns (x, cnn, att)."""
        offset = att_cache.shape[4] if att_cache is not None else 0
        if att_cache is not None and att_cache.shape[0] < n_timesteps:
            raise ValueError(f"estimator caches hold {att_cache.shape[0]} steps; n_timesteps is {n_timesteps} "
                             "(use the n_timesteps of setup_cache)")
        x = self._noise_at(offset, mu.shape[1])
        t_span = cosine_t_span(n_timesteps)
        mu_in = mx.concatenate([mu, mx.zeros_like(mu)])
        spks_in = mx.concatenate([spks, mx.zeros_like(spks)])
        cond_in = mx.concatenate([cond, mx.zeros_like(cond)])
        t, dt = t_span[0:1], t_span[1] - t_span[0]
        new_cnn, new_att = [], []
        for step in range(1, n_timesteps + 1):
            v, nc, na = self.estimator(mx.concatenate([x, x]), mu_in, mx.concatenate([t, t]), spks_in, cond_in,
                                       None if cnn_cache is None else cnn_cache[step - 1],
                                       None if att_cache is None else att_cache[step - 1],
                                       mods=self._modulations(t), stack=False)
            new_cnn += nc
            new_att += na
            x = x + dt * self._guided(v)
            t = t + dt
            if step < n_timesteps:
                dt = t_span[step + 1] - t
        depth = len(self.estimator.blocks)  # one copy of all n_timesteps x depth caches, not one per step and one more
        return (x, mx.stack(new_cnn).reshape((n_timesteps, depth) + new_cnn[0].shape),
                mx.stack(new_att).reshape((n_timesteps, depth) + new_att[0].shape))


def _l2_normalize(x, eps=1e-12):
    return x / mx.maximum(mx.sqrt(mx.sum(x * x, axis=-1, keepdims=True)), eps)


class CausalMaskedDiffWithXvec(nn.Module):
    """The flow: tokens + speaker embedding (+ prompt tokens and mel) -> mel (1, output_size, frames)."""

    def __init__(self, cfg: FlowConfig, noise_seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.encoder = UpsampleConformerEncoderV2(cfg.encoder)
        self.encoder_proj = nn.Linear(cfg.encoder.output_size, cfg.output_size)
        self.decoder = CausalConditionalCFM(cfg.decoder, noise_seed)

    @property
    def pre_lookahead_len(self) -> int:
        return self.cfg.encoder.pre_lookahead_len

    @property
    def up_rate(self) -> int:
        return self.cfg.encoder.up_stride

    def _tokens(self, token, what: str, clamp: bool = False) -> mx.array:
        t = np.asarray(token.tolist() if isinstance(token, mx.array) else token, dtype=np.int64)
        if t.ndim == 1:
            t = t[None]
        if t.ndim != 2 or t.shape[0] != 1:
            raise ValueError(f"{what} must be a 1-D token list or a (1, T) array, got shape {t.shape}")
        if clamp:
            t = np.maximum(t, 0)  # the offline path clamps as the official one does (padding ids are -1 there)
        if t.size and (t.min() < 0 or t.max() >= self.cfg.vocab_size):
            raise ValueError(f"{what} holds ids outside [0, {self.cfg.vocab_size}): min {t.min()}, max {t.max()}")
        return mx.array(t.astype(np.int32))

    def _speaker(self, spk) -> mx.array:
        spk = mx.array(spk, dtype=mx.float32).reshape(1, -1)
        if spk.shape[1] != self.cfg.spk_embed_dim:
            raise ValueError(f"speaker embedding has {spk.shape[1]} values, the flow expects {self.cfg.spk_embed_dim}")
        return self.spk_embed_affine_layer(_l2_normalize(spk))

    def _mel(self, mel, what: str) -> mx.array:
        mel = mx.array(mel, dtype=mx.float32)
        if mel.ndim == 2:
            mel = mel[None]
        if mel.ndim != 3 or mel.shape[0] != 1 or mel.shape[2] != self.cfg.output_size:
            raise ValueError(f"{what} must be (frames, {self.cfg.output_size}) or (1, frames, "
                             f"{self.cfg.output_size}), got {tuple(mel.shape)}")
        return mel

    def inference(self, token, prompt_token, prompt_feat, embedding, n_timesteps: int = 10) -> mx.array:
        """Offline: the whole utterance at once. token, prompt_token: ids; prompt_feat (frames, C) with frames =
        up_rate x prompt tokens (Token2wav pads the prompt mel to that); embedding (spk_embed_dim,).
        Returns the generated mel (1, output_size, up_rate x tokens)."""
        tokens = mx.concatenate([self._tokens(prompt_token, "prompt tokens", clamp=True),
                                 self._tokens(token, "tokens", clamp=True)], axis=1)
        if tokens.shape[1] == 0:
            raise ValueError("no tokens to synthesise")
        prompt_feat = self._mel(prompt_feat, "prompt mel")
        spks = self._speaker(embedding)
        h = self.encoder_proj(self.encoder(self.input_embedding(tokens)))
        mel_len1 = prompt_feat.shape[1]
        if mel_len1 > h.shape[1]:
            raise ValueError(f"prompt mel has {mel_len1} frames, more than the {h.shape[1]} the tokens make")
        cond = mx.concatenate([prompt_feat, mx.zeros((1, h.shape[1] - mel_len1, h.shape[2]))], axis=1)
        feat = self.decoder(h, spks, cond, n_timesteps)
        return feat[:, mel_len1:].transpose(0, 2, 1)

    def setup_cache(self, token, mel, spk, n_timesteps: int = 10) -> dict:
        """Prime the streaming caches with the prompt: ``token`` = prompt tokens plus ``pre_lookahead_len``
        lookahead tokens (Token2wav appends the first three prompt tokens), ``mel`` the prompt mel
        (frames = up_rate x prompt tokens)."""
        if n_timesteps < 1:
            raise ValueError("n_timesteps must be positive")
        token = self._tokens(token, "prompt tokens")
        mel = self._mel(mel, "prompt mel")
        if (token.shape[1] - self.pre_lookahead_len) * self.up_rate != mel.shape[1]:
            raise ValueError(f"setup_cache needs (tokens - {self.pre_lookahead_len}) x {self.up_rate} == mel frames; "
                             f"got {token.shape[1]} tokens and {mel.shape[1]} frames")
        spks = self._speaker(spk)
        h, conf_cnn, conf_att = self.encoder.forward_chunk(self.input_embedding(token), False, None, None)
        h = self.encoder_proj(h)
        _, est_cnn, est_att = self.decoder.forward_chunk(h, spks, mel, n_timesteps)
        cache = {"conformer_cnn_cache": conf_cnn, "conformer_att_cache": conf_att,
                 "estimator_cnn_cache": est_cnn, "estimator_att_cache": est_att}
        mx.eval(cache)
        return cache

    def inference_chunk(self, token, spk, cache: dict, last_chunk: bool = False, n_timesteps: int = 10):
        """One streaming chunk: ``token`` = fresh tokens followed by ``pre_lookahead_len`` lookahead tokens (the
        last chunk: just the remaining tokens). Returns (mel (1, output_size, up_rate x fresh), new cache)."""
        if cache is None or any(k not in cache for k in ("conformer_cnn_cache", "conformer_att_cache",
                                                          "estimator_cnn_cache", "estimator_att_cache")):
            raise ValueError("inference_chunk needs the cache from setup_cache (or the previous chunk)")
        token = self._tokens(token, "tokens")
        n = token.shape[1]
        if n == 0 or (not last_chunk and n <= self.pre_lookahead_len):
            raise ValueError(f"a {'final' if last_chunk else 'non-final'} chunk of {n} tokens: non-final chunks need "
                             f"more than {self.pre_lookahead_len} (fresh tokens plus the lookahead), final ones at "
                             "least one")
        spks = self._speaker(spk)
        h, conf_cnn, conf_att = self.encoder.forward_chunk(self.input_embedding(token), last_chunk,
                                                          cache["conformer_cnn_cache"], cache["conformer_att_cache"])
        h = self.encoder_proj(h)
        feat, est_cnn, est_att = self.decoder.forward_chunk(h, spks, mx.zeros_like(h), n_timesteps,
                                                            cache["estimator_cnn_cache"], cache["estimator_att_cache"])
        new_cache = {"conformer_cnn_cache": conf_cnn, "conformer_att_cache": conf_att,
                     "estimator_cnn_cache": est_cnn, "estimator_att_cache": est_att}
        feat = feat.transpose(0, 2, 1)
        mx.eval(feat, new_cache)
        return feat, new_cache


# ------------------------------------------------------------------------------------------------ cache trimming


def trim_estimator_cache(cache: dict, prompt_frames: int, keep: int = HISTORY_FRAMES) -> dict:
    """Token2wav's ``_trim_estimator_cache``: past ``prompt_frames + keep`` frames, keep the first
    ``prompt_frames`` and the last ``keep`` along the time axis (axis 4), in the cache's own order."""
    att = cache["estimator_att_cache"]
    if att.shape[4] > prompt_frames + keep:
        cache = dict(cache, estimator_att_cache=mx.concatenate([att[:, :, :, :, :prompt_frames],
                                                                att[:, :, :, :, -keep:]], axis=4))
    return cache


def trim_conformer_cache(cache: dict, prompt_frames: int, num_blocks: int, keep: int = HISTORY_FRAMES) -> dict:
    """Token2wav's ``_trim_conformer_cache``: the token-rate layers keep ``prompt_frames // 2`` + ``keep // 2`` of
    their (unpacked) frames, the mel-rate layers ``prompt_frames`` + ``keep``; then repacked."""
    att = cache["conformer_att_cache"]
    if att.shape[3] > prompt_frames + keep:
        tok = att[:num_blocks, :, :, : att.shape[3] // 2]
        tok = mx.concatenate([tok[:, :, :, : prompt_frames // 2], tok[:, :, :, tok.shape[3] - keep // 2:]], axis=3)
        mel = mx.concatenate([att[num_blocks:, :, :, :prompt_frames], att[num_blocks:, :, :, att.shape[3] - keep:]],
                             axis=3)
        cache = dict(cache, conformer_att_cache=mx.concatenate([mx.concatenate([tok, tok], axis=3), mel], axis=0))
    return cache



def trim_packed_conformer_cache(cache: dict, prompt_frames: int, keep: int = HISTORY_FRAMES) -> dict:
    """minicpmo-utils 1.0.6's conformer trim: past ``prompt_frames + keep`` frames, the first ``prompt_frames`` and
    the last ``keep`` of the packed cache (axis 3) as they are, for every layer alike (1.0.7 unpacks first:
    ``trim_conformer_cache``)."""
    att = cache["conformer_att_cache"]
    if att.shape[3] > prompt_frames + keep:
        cache = dict(cache, conformer_att_cache=mx.concatenate([att[:, :, :, :prompt_frames],
                                                                att[:, :, :, att.shape[3] - keep:]], axis=3))
    return cache

# ------------------------------------------------------------------------------------------------ weights

_RENAMES = ((".conv.block.1.", ".conv.conv1."), (".conv.block.3.", ".conv.norm."), (".conv.block.6.", ".conv.conv2."))
NOISE_KEY = "decoder.rand_noise"


def sanitize_flow_weights(weights: dict) -> dict:
    """Official ``flow.pt`` key names and layouts -> this module's: the DiT conv block's ``block.1/3/6`` become
    ``conv1 / norm / conv2`` and every conv weight goes from (out, in, k) to MLX's (out, k, in). The flow has no
    weight norm and no batch norm; anything else is left for the strict check to name."""
    out = {}
    for k, v in weights.items():
        for old, new in _RENAMES:
            k = k.replace(old, new)
        if k.endswith(".weight") and v.ndim == 3:
            v = v.transpose(0, 2, 1)
        out[k] = v
    return out


def flow_from_weights(cfg: FlowConfig, weights: dict, what: str = "flow weights",
                      noise_seed: int = 0) -> CausalMaskedDiffWithXvec:
    """A flow for ``cfg`` holding ``weights`` (official names and layouts); ``decoder.rand_noise``, when present,
    becomes the fixed noise. Raises CheckpointError naming the missing, unexpected and mis-shaped keys."""
    from ..loading import load_weights_strict

    weights = dict(weights)
    noise = weights.pop(NOISE_KEY, None)
    model = CausalMaskedDiffWithXvec(cfg, noise_seed)
    load_weights_strict(model, {k: v.astype(mx.float32) for k, v in sanitize_flow_weights(weights).items()}, what)
    if noise is not None:
        model.decoder.set_noise(noise)
    mx.eval(model.parameters())
    return model


def load_flow(folder, noise_seed: int = 0) -> CausalMaskedDiffWithXvec:
    """The flow of a token2wav folder: ``flow.yaml`` and ``flow.safetensors`` or the released ``flow.pt`` (read
    with torch, tensors only; see weights.py)."""
    from pathlib import Path

    folder = Path(folder)
    cfg_path = folder / "flow.yaml"
    if not cfg_path.is_file():
        raise CheckpointError(f"{folder} has no flow.yaml: not a StepAudio2 token2wav folder")
    cfg = parse_flow_yaml(cfg_path.read_text(encoding="utf-8"))
    from .weights import read_weights, weight_file

    weights = {k: mx.array(v) for k, v in read_weights(folder, "flow").items()}
    return flow_from_weights(cfg, weights, f"flow weights {weight_file(folder, 'flow')}", noise_seed)
