"""The Qwen3-Omni thinker's language model: a Qwen3-MoE decoder (q/k RMSNorm, GQA, no biases, softmax top-k routing
over SwiGLU experts) with interleaved M-RoPE and DeepStack visual features added after the first layers.

The experts run through mlx-lm's ``SwitchGLU`` (``mx.gather_mm``, ``mx.gather_qmm`` once quantised), never a Python
loop over experts. Routing is the released rule, as transformers' ``Qwen3OmniMoeThinkerTextTopKRouter`` computes it:
softmax over all experts in float32, the top ``num_experts_per_tok`` probabilities, renormalised to sum to one when
``norm_topk_prob``; a layer is sparse unless it is in ``mlp_only_layers`` or ``(layer + 1) % decoder_sparse_step``
is non-zero (then a dense SwiGLU of ``intermediate_size``). The thinker has no shared expert (the talker does).

Interleaved M-RoPE: frequency ``j`` of the head's ``head_dim / 2`` rotary frequencies reads its angle from the h
axis when ``j % 3 == 1`` and ``j < 3 * mrope_section[1]``, from the w axis when ``j % 3 == 2`` and
``j < 3 * mrope_section[2]``, else from the t axis ([24, 20, 20] released: t h w t h w ... then four t). The rotation
is NeoX style (halves). For text all three axes are equal and this is plain RoPE; a uniform shift of all axes is one
plain rotation, which is what the cache needs to re-rotate keys after an eviction.

``LanguageModel.__call__(inputs_embeds [B, T, H], cache, positions [3, T] or [T], deepstack=...) -> logits``.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import SwitchGLU

from ...cache import OmniCache
from .. import blocks
from ..attention import cached_attention, forward_step
from .config import TextConfig


def rotate_half(x: mx.array) -> mx.array:
    h = x.shape[-1] // 2
    return mx.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def mrope_axis_of_freq(head_dim: int, mrope_section: list[int]) -> np.ndarray:
    """Which position axis (0 t, 1 h, 2 w) each of the ``head_dim / 2`` rotary frequencies reads (interleaved)."""
    j = np.arange(head_dim // 2)
    axis = np.zeros_like(j)
    axis[(j % 3 == 1) & (j < 3 * mrope_section[1])] = 1
    axis[(j % 3 == 2) & (j < 3 * mrope_section[2])] = 2
    return axis


def mrope_cos_sin(positions: mx.array, inv_freq: mx.array, axis_of_freq: np.ndarray, dtype: mx.Dtype
                  ) -> tuple[mx.array, mx.array]:
    """cos and sin ``[..., T, head_dim]`` for positions ``[3, ..., T]`` (float32 math, then ``dtype``)."""
    pos = positions.astype(mx.float32)[mx.array(axis_of_freq)]  # [hd/2, ..., T]
    angles = mx.moveaxis(pos, 0, -1) * inv_freq
    angles = mx.concatenate([angles, angles], axis=-1)
    return mx.cos(angles).astype(dtype), mx.sin(angles).astype(dtype)


class Attention(nn.Module):
    def __init__(self, args: TextConfig):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = hd = args.head_dim
        self.scale = hd ** -0.5
        dim, bias = args.hidden_size, args.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=bias)
        self.q_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, cache=None, mask=None) -> mx.array:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(b, t, self.n_heads, self.head_dim)).transpose(0, 2, 1, 3)
        k = self.k_norm(self.k_proj(x).reshape(b, t, self.n_kv_heads, self.head_dim)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, t, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = cached_attention(q, k, v, cache, self.scale, mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, t, -1))


class SparseMoeBlock(nn.Module):
    """Router ``gate`` (no bias) and the experts as one ``SwitchGLU`` (``switch_mlp.{gate,up,down}_proj``, weights
    ``[experts, out, in]``)."""

    def __init__(self, args: TextConfig):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.num_experts)

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """(expert indices ``[..., k]``, their weights ``[..., k]`` in x's dtype)."""
        probs = mx.softmax(self.gate(x).astype(mx.float32), axis=-1)
        k = self.top_k
        inds = mx.argpartition(-probs, kth=k - 1, axis=-1)[..., :k]
        scores = mx.take_along_axis(probs, inds, axis=-1)
        if self.norm_topk_prob:
            scores = scores / mx.sum(scores, axis=-1, keepdims=True)
        return inds, scores.astype(x.dtype)

    def __call__(self, x: mx.array) -> mx.array:
        inds, scores = self.route(x)
        if inds.size >= CPU_GROUPED_MIN_PAIRS and _cpu_float(self.switch_mlp):
            y = grouped_glu(self.switch_mlp, x, inds)
        else:
            y = self.switch_mlp(x, inds)
        return (y * scores[..., None]).sum(axis=-2).astype(x.dtype)


# MLX's CPU gather_mm runs a prefill's (token, expert) rows one by one: at the released shape one layer took 4.5 s for
# 134 tokens against transformers' 0.75 s (bench/qwen3_omni.py --speed). On the CPU, float experts and at least this
# many (token, expert) pairs take grouped_glu's batched matmul instead; Metal and quantised experts keep gather_mm /
# gather_qmm, and decode steps (8 pairs) stay on gather_mm, which is the faster there.
CPU_GROUPED_MIN_PAIRS = 64


def _cpu_float(glu: SwitchGLU) -> bool:
    return mx.default_device() == mx.cpu and type(glu.gate_proj).__name__ == "SwitchLinear"


def grouped_glu(glu: SwitchGLU, x: mx.array, inds: mx.array) -> mx.array:
    """``glu(x, inds)`` as one batched matmul per projection over experts: the (token, expert) pairs are sorted by
    expert into a zero-padded ``[experts, capacity, hidden]`` block (capacity: the busiest expert's pair count), so
    BLAS runs ``experts`` GEMMs at once; no Python loop over experts. Exact up to float summation order."""
    shape = inds.shape
    k = shape[-1]
    flat_x = x.reshape(-1, x.shape[-1])
    e = inds.reshape(-1)
    p = e.shape[0]
    n_exp = glu.gate_proj.weight.shape[0]
    order = mx.argsort(e)
    e_sorted = e[order]
    counts = mx.zeros((n_exp,), dtype=mx.int32).at[e_sorted].add(1)
    starts = mx.cumsum(counts) - counts
    slot = mx.arange(p) - starts[e_sorted]
    capacity = int(counts.max().item())
    block = mx.zeros((n_exp, capacity, flat_x.shape[-1]), dtype=x.dtype)
    block[e_sorted, slot] = flat_x[order // k]
    wg, wu, wd = glu.gate_proj.weight, glu.up_proj.weight, glu.down_proj.weight  # [E, out, in]
    h = nn.silu(block @ wg.swapaxes(1, 2)) * (block @ wu.swapaxes(1, 2))
    out = h @ wd.swapaxes(1, 2)  # [E, C, hidden]
    y_sorted = out[e_sorted, slot]
    y = mx.zeros((p, flat_x.shape[-1]), dtype=out.dtype)
    y[order] = y_sorted
    return y.reshape(*shape[:-1], k, -1)


class DecoderLayer(nn.Module):
    """Pre-norm block: attention, then the MoE block or (mlp_only / off-step layers) a dense SwiGLU."""

    def __init__(self, args: TextConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = SparseMoeBlock(args) if args.is_sparse(layer) else blocks.MLP(args.hidden_size,
                                                                                 args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, cos, sin, cache=None, mask=None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class TextModel(nn.Module):
    """Checkpoint prefix ``model.``: embeddings, decoder layers, final norm."""

    def __init__(self, args: TextConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


def stack_experts(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Per-expert ``*.mlp.experts.{e}.{gate,up,down}_proj.weight`` (the released layout) -> one ``[experts, out, in]``
    ``*.mlp.switch_mlp.{proj}.weight`` each; a transformers 5.x fused ``experts.gate_up_proj`` ``[E, 2I, H]`` is
    split gate-first and ``experts.down_proj`` renamed. Other keys pass through."""
    out: dict[str, mx.array] = {}
    experts: dict[tuple[str, str], dict[int, mx.array]] = {}
    for k, v in weights.items():
        if ".mlp.experts." not in k:
            out[k] = v
            continue
        prefix, rest = k.split(".mlp.experts.", 1)
        parts = rest.split(".")
        if parts[0].isdigit() and len(parts) == 3 and parts[1] in ("gate_proj", "up_proj", "down_proj"):
            experts.setdefault((prefix, parts[1]), {})[int(parts[0])] = v
        elif rest == "gate_up_proj":
            half = v.shape[1] // 2
            out[f"{prefix}.mlp.switch_mlp.gate_proj.weight"] = v[:, :half]
            out[f"{prefix}.mlp.switch_mlp.up_proj.weight"] = v[:, half:]
        elif rest == "down_proj":
            out[f"{prefix}.mlp.switch_mlp.down_proj.weight"] = v
        else:
            out[k] = v
    for (prefix, proj), by_expert in experts.items():
        n = max(by_expert) + 1
        if sorted(by_expert) != list(range(n)):
            missing = sorted(set(range(n)) - set(by_expert))
            raise ValueError(f"{prefix}.mlp.experts: experts {missing} have no {proj}")
        out[f"{prefix}.mlp.switch_mlp.{proj}.weight"] = mx.stack([by_expert[e] for e in range(n)])
    return out


def add_deepstack(h: mx.array, slots: mx.array, feats: mx.array) -> mx.array:
    """``h`` with ``feats`` ``[n, H]`` added at the flat token indices ``slots`` (``[n]`` over ``B * T``)."""
    b, t, d = h.shape
    flat = h.reshape(b * t, d)
    flat = flat.at[slots].add(feats.astype(h.dtype))
    return flat.reshape(b, t, d)


class LanguageModel(nn.Module):
    def __init__(self, args: TextConfig, tie_word_embeddings: bool = False):
        super().__init__()
        self.args = args
        self.model = TextModel(args)
        self.tie_word_embeddings = tie_word_embeddings
        if not tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        hd = args.head_dim
        self._inv_freq = mx.array(1.0 / (args.rope_theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd)),
                                  dtype=mx.float32)
        self._axis_of_freq = mrope_axis_of_freq(hd, args.mrope_section)

    @property
    def layers(self):
        return self.model.layers

    @property
    def embed_tokens(self) -> nn.Module:
        return self.model.embed_tokens

    def embed(self, input_ids) -> mx.array:
        return self.model.embed_tokens(mx.array(np.asarray(input_ids)) if not isinstance(input_ids, mx.array)
                                       else input_ids)

    def hidden_states(self, inputs_embeds: mx.array, cache=None, positions=None, mask=None, deepstack=None,
                      return_layers: tuple[int, ...] = ()) -> mx.array:
        """Final-norm hidden states ``[B, T, H]``.

        ``deepstack``: ``(slots, [feats_0, feats_1, ...])``, flat token indices ``[n]`` (over ``B * T``) of the
        visual tokens and one ``[n, H]`` feature per DeepStack level, added after decoder layers 0, 1, ...
        ``return_layers``: also return the outputs of these layers (0 = the embeddings, i = after layer i), as
        ``(final, {i: h_i})``; the talker reads one of them."""
        h = inputs_embeds if inputs_embeds.ndim == 3 else inputs_embeds[None]
        t = h.shape[1]
        if positions is None:
            offset = 0
            if cache is not None and not isinstance(cache, OmniCache):
                offset = cache[0].offset
            positions = np.arange(offset, offset + t)
        pos = positions if isinstance(positions, mx.array) else mx.array(np.asarray(positions, dtype=np.float32))
        if pos.ndim == 1:
            pos = mx.broadcast_to(pos[None], (3, t))
        if pos.shape[0] != 3 or pos.shape[-1] != t or pos.ndim not in (2, 3):
            raise ValueError(f"positions must be [3, {t}], [3, B, {t}] or [{t}], got {tuple(pos.shape)}")
        cos, sin = mrope_cos_sin(pos, self._inv_freq, self._axis_of_freq, h.dtype)
        if pos.ndim == 3:
            cos, sin = cos[:, None], sin[:, None]
        slots, levels = deepstack if deepstack is not None else (None, [])
        kept = {0: h} if 0 in return_layers else {}
        with forward_step(cache, t, len(self.layers)) as layer_caches:
            for i, (layer, c) in enumerate(zip(self.layers, layer_caches)):
                h = layer(h, cos, sin, c, mask)
                if i + 1 in return_layers:  # the layer's own output, before DeepStack (what transformers records)
                    kept[i + 1] = h
                if i < len(levels):
                    h = add_deepstack(h, slots, levels[i])
        out = self.model.norm(h)
        return (out, kept) if return_layers else out

    def logits(self, hidden: mx.array) -> mx.array:
        if self.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    def __call__(self, inputs_embeds: mx.array, cache=None, positions=None, mask=None, last_only: bool = False,
                 deepstack=None) -> mx.array:
        """Logits ``[B, T, vocab]`` (``last_only``: ``[B, 1, vocab]``)."""
        h = self.hidden_states(inputs_embeds, cache, positions, mask, deepstack)
        return self.logits(h[:, -1:] if last_only else h)
