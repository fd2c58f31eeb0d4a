"""MiniCPM-o 4.5's TTS (``MiniCPMTTS``): a small Llama that turns the LLM's reply, chunk by chunk, into s3tokenizer
audio tokens (25 per second of speech), as the official ``streaming_generate`` runs it.

The official streaming path (``MiniCPMO.streaming_generate`` + ``utils.TTSStreamingGenerator.generate_with_buffer``,
OpenBMB/MiniCPM-o-Demo ``MiniCPMO45/`` at commit 28b60cf) does, per text chunk the LLM produced (10 tokens, 11 in the
first chunk minus the token whose hidden state is not known yet):

1. condition = ``emb_text(token_ids) + normalize(projector_semantic(llm_hidden))`` (the "hidden_text_merge" rule,
   hard-wired in ``streaming_generate``; the L2 normalisation only when ``normalize_projected_hidden``). The LLM
   hidden state of a token is the final-norm hidden state *of that token as input* (``hidden_states[-1]`` of the
   forward that consumed it), i.e. ``LanguageModel.hidden_states`` at the token's own position.
2. the last text chunk gets ``emb_text(text_eos_token_id)`` appended; every chunk gets ``emb_text(audio_bos_token_id)``.
3. the condition is prefilled into the TTS's own KV cache at positions continuing the reply; audio tokens are then
   decoded one at a time (each fed back through ``emb_code[0]``) until the audio eos (``num_audio_tokens - 1``), at
   most 500 per chunk. The eos token is never emitted nor fed back.
4. tokens are buffered and handed out 25 at a time (``chunk_size``); the rest waits for the next text chunk. The last
   text chunk flushes the buffer (a shorter, possibly empty, final chunk); when the LLM stops without a terminator
   the buffer is flushed as it is (no text eos).

Between chunks the cache follows the config's ``attention_type`` exactly as the official generator does:
``full_attention`` (keep everything), ``sliding_window`` (keep the last
``streaming_sliding_window_audio_window_size`` cached tokens after every forward, positions keep counting),
``sliding_recompute`` (the class default: drop the cache and prefill the previous chunk's condition + its audio tokens
+ the new condition from position 0) and ``reindex`` (keep the first chunk as a sink plus the previous chunk, whose
keys are re-rotated as the official ``_reindex_kv_cache`` does).

Sampling (``TTSSampling``, the official ``TTSSamplingParams`` defaults as ``streaming_generate`` passes them to
``gen_logits``): logits / temperature; then, except for the very first token of the reply, the repetition penalty over
the last 16 tokens of the reply (``penalty ** count``: negative logits multiplied, positive divided), top-p then top-k
(transformers' warpers, each keeping at least 3 tokens); then a draw from the softmax. ``TTSSamplingParams.min_p``,
``win_size`` and ``tau_r`` are not used by the official streaming path, nor here. ``greedy=True`` takes the argmax of
the same processed logits (the official path with its multinomial draw replaced by an argmax).

Only codebook 0 is used, for any ``num_vq`` (the official streaming generator reads codebook 0 only). The released
``tts_config`` values (attention_type, normalize_projected_hidden, num_vq) were not available here; missing fields
take the official class defaults (attention_type "sliding_recompute").

API (what the engine drives while the LLM streams text)::

    tts = model.tts                                   # None when the checkpoint has no TTS; model.require_tts() raises
    reply = tts.start_reply(TTSSampling(), seed=0)    # one per spoken reply: own KV cache, RNG, token buffer
    for ids, hidden, finished in llm_chunks:          # ids [n] int, hidden [n, llm_dim] (final-norm, per token)
        for chunk in reply.feed(ids, hidden, last=finished):
            vocoder.push(chunk)                       # list[int]: 25 tokens, the final one of a reply shorter
    if not reply.done:                                # the LLM stopped at its token limit (no terminator)
        tail = reply.finish()                         # [] or [remaining tokens]

``feed`` returns every chunk the official generator yields for that text chunk (in order); after ``last=True`` the
reply is done and the list ends with the reply's final chunk (possibly empty, as the official generator yields it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..loading import CheckpointError, config_fields
from .. import blocks
from ..attention import cached_attention, rope_at

ATTENTION_TYPES = ("full_attention", "sliding_window", "sliding_recompute", "reindex")
PROJECTOR_TYPES = ("mlp", "minicpm", "default")


@dataclass
class TTSArgs:
    """``tts_config`` of config.json (defaults: the official ``MiniCPMTTSConfig``). The Llama backbone takes the
    ``LlamaConfig`` defaults for what the TTS config does not pass on: RMSNorm eps 1e-6, RoPE theta 10000, SiLU."""

    llm_dim: int = 2560
    llm_intermediate_size: int = 768
    projector_type: str = "mlp"
    hidden_act: str = "silu"  # of the "minicpm" projector only
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_attention_heads: int = 12
    num_hidden_layers: int = 20
    num_key_value_heads: int = 12
    max_position_embeddings: int = 4096
    num_audio_tokens: int = 4097
    num_text_tokens: int = 21178
    num_vq: int = 1
    audio_bos_token_id: int = 21132
    text_eos_token_id: int = 21133
    condition_type: str = "llm_hidden"  # streaming_generate always uses hidden_text_merge; kept for reference
    backbone_model: str = "llama"
    normalize_projected_hidden: bool = False
    attention_type: str = "sliding_recompute"
    recomputed_chunks: int = 1
    window_size: int = 2
    streaming_sliding_window_audio_window_size: int = 300
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    @classmethod
    def from_dict(cls, d: dict | None) -> "TTSArgs":
        from .config import ConfigError

        args = cls(**config_fields(cls, d or {}))
        if args.backbone_model != "llama":
            raise ConfigError(f"tts backbone_model {args.backbone_model!r} is not supported (MiniCPM-o 4.5: llama)")
        if args.projector_type not in PROJECTOR_TYPES:
            raise ConfigError(f"tts projector_type {args.projector_type!r} is not one of {PROJECTOR_TYPES}")
        if args.attention_type not in ATTENTION_TYPES:
            raise ConfigError(f"tts attention_type {args.attention_type!r} is not one of {ATTENTION_TYPES}")
        if args.projector_type == "minicpm" and args.hidden_act != "silu":
            raise ConfigError(f"tts hidden_act {args.hidden_act!r} is not supported (silu)")
        if args.hidden_size % args.num_attention_heads or args.num_attention_heads % args.num_key_value_heads:
            raise ConfigError(f"tts hidden_size {args.hidden_size} / {args.num_attention_heads} heads / "
                              f"{args.num_key_value_heads} KV heads do not divide")
        if args.attention_type == "sliding_recompute" and args.window_size <= args.recomputed_chunks:
            raise ConfigError("tts sliding_recompute needs window_size > recomputed_chunks (the official check)")
        if args.num_vq < 1:
            raise ConfigError("tts num_vq must be at least 1")
        return args

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def eos_token_id(self) -> int:
        """The audio eos: the last audio token (``streaming_generate`` passes ``num_audio_tokens - 1``)."""
        return self.num_audio_tokens - 1


@dataclass
class TTSSampling:
    """The official ``TTSSamplingParams`` fields the streaming path uses, plus its fixed settings."""

    temperature: float = 0.8
    top_p: float = 0.85
    top_k: int = 25
    repetition_penalty: float = 1.05
    greedy: bool = False
    penalty_window: int = 16  # CustomRepetitionPenaltyLogitsProcessorRepeat(past_window=16)
    min_tokens_to_keep: int = 3  # TopP / TopK warpers built by gen_logits
    max_new_tokens_per_chunk: int = 500  # generate_with_buffer's max_new_token
    chunk_size: int = 25  # audio_token_chunk_size: s3tokenizer, 25 tokens per second

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (use greedy=True for argmax), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {self.top_k}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.chunk_size < 1 or self.max_new_tokens_per_chunk < 1:
            raise ValueError("chunk_size and max_new_tokens_per_chunk must be >= 1")


# --- modules ----------------------------------------------------------------------------------------------------

class Attention(nn.Module):
    """Llama attention: no biases, NeoX RoPE at explicit positions."""

    def __init__(self, args: TTSArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.scale = self.head_dim ** -0.5
        self.rope_base = args.rope_theta
        dim = args.hidden_size
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=False)

    def __call__(self, x: mx.array, position: int, cache) -> mx.array:
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(b, t, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, t, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        q = rope_at(q, position, self.head_dim, self.rope_base)
        k = rope_at(k, position, self.head_dim, self.rope_base)
        out = cached_attention(q, k, v, cache, self.scale)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, t, -1))


class Backbone(nn.Module):
    """``LlamaModel`` fed with embeddings only (its ``embed_tokens`` is never used, so not loaded)."""

    def __init__(self, args: TTSArgs):
        super().__init__()
        self.layers = [blocks.DecoderLayer(Attention(args), args.hidden_size, args.intermediate_size,
                                           args.rms_norm_eps) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, position: int, cache: list) -> mx.array:
        for layer, c in zip(self.layers, cache):
            x = layer(x, position, c)
        return self.norm(x)


class MLPProjector(nn.Module):
    """The official ``MultiModalProjector``: Linear -> ReLU -> Linear, with biases."""

    def __init__(self, dim_in: int, dim_out: int):
        super().__init__()
        self.linear1 = nn.Linear(dim_in, dim_out)
        self.linear2 = nn.Linear(dim_out, dim_out)

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear2(nn.relu(self.linear1(x)))


class MiniCPMProjector(nn.Module):
    """The official ``MiniCPMMLP``: SwiGLU with biases from ``llm_dim`` to ``hidden_size``."""

    def __init__(self, args: TTSArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.llm_dim, args.llm_intermediate_size)
        self.up_proj = nn.Linear(args.llm_dim, args.llm_intermediate_size)
        self.down_proj = nn.Linear(args.llm_intermediate_size, args.hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


def _projector(args: TTSArgs) -> nn.Module:
    if args.projector_type == "mlp":
        return MLPProjector(args.llm_dim, args.hidden_size)
    if args.projector_type == "minicpm":
        return MiniCPMProjector(args)
    return nn.Linear(args.llm_dim, args.hidden_size, bias=False)


class _LayerKV:
    """One layer's K/V ([1, H, L, D]) for one reply: appended to, truncated, re-rotated."""

    def __init__(self):
        self.keys = None
        self.values = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def update_and_fetch(self, k: mx.array, v: mx.array):
        if self.keys is None:
            self.keys, self.values = k, v
        else:
            self.keys = mx.concatenate([self.keys, k], axis=2)
            self.values = mx.concatenate([self.values, v], axis=2)
        return self.keys, self.values


def materialize_weight_norm(g: mx.array, v: mx.array) -> mx.array:
    """torch ``weight_norm(dim=0)``: ``weight = g * v / ||v||`` with the norm over each output row."""
    g = g.astype(mx.float32).reshape(-1, 1)
    v32 = v.astype(mx.float32)
    norm = mx.sqrt(mx.sum(v32 * v32, axis=1, keepdims=True))
    return (v32 * (g / norm)).astype(v.dtype)


class MiniCPMTTS(nn.Module):
    """The TTS weights and forward; ``start_reply`` opens a streaming reply (module docstring)."""

    def __init__(self, args: TTSArgs):
        super().__init__()
        self.args = args
        self.emb_text = nn.Embedding(args.num_text_tokens, args.hidden_size)
        self.emb_code = [nn.Embedding(args.num_audio_tokens, args.hidden_size) for _ in range(args.num_vq)]
        self.head_code = [nn.Linear(args.hidden_size, args.num_audio_tokens, bias=False) for _ in range(args.num_vq)]
        self.projector_semantic = _projector(args)
        self.model = Backbone(args)

    # --- weights ------------------------------------------------------------------------------------------------
    @staticmethod
    def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Official names (without the ``tts.`` prefix) -> this module's. ``head_code.N``'s weight_norm
        (``parametrizations.weight.original0`` = g, ``original1`` = v) is materialised; the backbone's
        ``embed_tokens`` (the TTS is fed embeddings only) and ``projector_spk`` (speaker embeddings: not used by the
        streaming path) are dropped. Already-materialised names (a converted folder) pass unchanged."""
        out, g_v = {}, {}
        for k, v in weights.items():
            if k.startswith(("model.embed_tokens.", "projector_spk.")) or k.endswith("rotary_emb.inv_freq"):
                continue
            if ".parametrizations.weight.original" in k:
                base, which = k.split(".parametrizations.weight.original")
                g_v.setdefault(base, {})[which] = v
                continue
            out[k] = v
        for base, parts in g_v.items():
            if set(parts) != {"0", "1"}:
                raise CheckpointError(f"tts.{base}: the weight_norm needs both original0 (g) and original1 (v)")
            out[f"{base}.weight"] = materialize_weight_norm(parts["0"], parts["1"])
        return out

    # --- forward pieces -----------------------------------------------------------------------------------------
    def condition(self, token_ids, hidden_states) -> mx.array:
        """``emb_text(ids) + normalize(projector_semantic(hidden))`` -> [1, n, hidden_size] (checked inputs)."""
        ids = np.asarray(token_ids.tolist() if isinstance(token_ids, mx.array) else token_ids).reshape(-1)
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"token ids must be integers, got dtype {ids.dtype}")
        h = hidden_states if isinstance(hidden_states, mx.array) else mx.array(np.asarray(hidden_states, np.float32))
        if h.ndim == 3:
            if h.shape[0] != 1:
                raise ValueError(f"hidden states must be [n, llm_dim] or [1, n, llm_dim], got {tuple(h.shape)}")
            h = h[0]
        if h.ndim != 2 or h.shape[-1] != self.args.llm_dim:
            raise ValueError(f"hidden states must be [n, {self.args.llm_dim}] (the LLM hidden size the TTS was "
                             f"trained on), got {tuple(h.shape)}")
        if h.shape[0] != ids.size:
            raise ValueError(f"{ids.size} token ids but {h.shape[0]} hidden states: one hidden state per token")
        if ids.size and (ids.min() < 0 or ids.max() >= self.args.num_text_tokens):
            raise ValueError(f"token ids must be in [0, {self.args.num_text_tokens}), got {ids.min()}..{ids.max()}")
        dtype = self.emb_text.weight.dtype
        text = self.emb_text(mx.array(ids.astype(np.int32)))
        proj = self.projector_semantic(h.astype(dtype))
        if self.args.normalize_projected_hidden:  # F.normalize(p=2, dim=-1, eps=1e-12)
            norm = mx.sqrt(mx.sum(proj * proj, axis=-1, keepdims=True))
            proj = proj / mx.maximum(norm, 1e-12)
        return (text + proj)[None]

    def token_embedding(self, token_id: int) -> mx.array:
        """``emb_text`` of one special id -> [1, 1, hidden]."""
        return self.emb_text(mx.array([token_id], dtype=mx.int32))[None]

    def logits(self, embeds: mx.array, position: int, cache: list) -> mx.array:
        """Run ``embeds`` [1, T, hidden] at positions ``position..`` through the backbone (appending to ``cache``)
        and return the codebook-0 logits of the last position [num_audio_tokens] (float32)."""
        h = self.model(embeds, position, cache)
        return self.head_code[0](h[:, -1]).astype(mx.float32)[0]

    def make_cache(self) -> list[_LayerKV]:
        return [_LayerKV() for _ in self.model.layers]

    def start_reply(self, sampling: TTSSampling | None = None, seed: int | None = None,
                    draw: Callable[[np.ndarray], int] | None = None) -> "TTSReply":
        """A fresh reply (own KV cache, RNG and buffer). ``seed``: reproducible draws (None: MLX's global generator).
        ``draw``: replaces the random draw (it gets the softmax probabilities of the processed logits and returns a
        token id), e.g. to replay a recorded run."""
        return TTSReply(self, sampling or TTSSampling(), seed=seed, draw=draw)


# --- sampling ---------------------------------------------------------------------------------------------------

def process_logits(logits: np.ndarray, history: list[int], s: TTSSampling, first: bool) -> np.ndarray:
    """The official per-step logit processing (float32): / temperature; unless ``first`` (no audio token yet in
    the reply): repetition penalty over the last ``penalty_window`` tokens, top-p, top-k (transformers 4.51's
    ``TopPLogitsWarper`` then ``TopKLogitsWarper``, both keeping ``min_tokens_to_keep``). Filtered entries -inf."""
    x = logits.astype(np.float32) / np.float32(s.temperature)
    if first:
        return x
    if s.repetition_penalty != 1.0:
        window = history[-s.penalty_window:]
        counts = np.bincount(np.asarray(window, dtype=np.int64), minlength=x.shape[-1])[: x.shape[-1]]
        alpha = np.power(np.float32(s.repetition_penalty), counts.astype(np.float32)).astype(np.float32)
        x = np.where(x < 0, x * alpha, x / alpha).astype(np.float32)
    keep = s.min_tokens_to_keep
    if s.top_p is not None and s.top_p < 1.0:
        order = np.argsort(x, kind="stable")  # ascending, as torch.sort(descending=False)
        sorted_x = x[order]
        e = np.exp(sorted_x - sorted_x.max())
        cum = np.cumsum(e / e.sum(), dtype=np.float32)
        remove = cum <= np.float32(1 - s.top_p)
        remove[-keep:] = False
        x = x.copy()
        x[order[remove]] = -np.inf
    if s.top_k is not None:
        k = min(max(s.top_k, keep), x.shape[-1])
        kth = np.sort(x)[-k]
        x = np.where(x < kth, -np.inf, x).astype(np.float32)
    return x


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


# --- one streaming reply ----------------------------------------------------------------------------------------

@dataclass
class _ChunkInfo:
    condition: mx.array
    audio_tokens: list[int] = field(default_factory=list)


class TTSReply:
    """The official ``TTSStreamingGenerator`` for one reply (see the module docstring)."""

    def __init__(self, tts: MiniCPMTTS, sampling: TTSSampling, seed: int | None = None,
                 draw: Callable[[np.ndarray], int] | None = None):
        self.tts, self.args, self.sampling = tts, tts.args, sampling
        self.cache = tts.make_cache()
        self.text_start_pos = 0
        self.chunks_fed = 0
        self.generated: list[int] = []  # every audio token of the reply (the repetition penalty's history)
        self.buffer: list[int] = []
        self.chunk_info: list[_ChunkInfo] = []
        self.done = False
        self._draw = draw
        # seed: a reproducible reply; None draws from MLX's global generator
        self._key = mx.random.key(int(seed)) if seed is not None and draw is None and not sampling.greedy else None
        self.audio_bos = tts.token_embedding(self.args.audio_bos_token_id)
        self.text_eos = tts.token_embedding(self.args.text_eos_token_id)

    def feed(self, token_ids, hidden_states, last: bool = False) -> list[list[int]]:
        """One text chunk of the LLM (ids [n], final-norm hidden states [n, llm_dim]) -> the audio-token chunks it
        completes. ``last``: the LLM emitted its terminator (text eos is appended and the buffer is flushed).
        An empty chunk is accepted only as the last one."""
        n = len(token_ids.tolist() if isinstance(token_ids, mx.array) else np.asarray(token_ids).reshape(-1))
        if n == 0 and not last:
            raise ValueError("empty text chunk: feed at least one token (an empty chunk may only end the reply)")
        if n == 0:
            return self.feed_condition(mx.zeros((1, 0, self.args.hidden_size), self.tts.emb_text.weight.dtype), True)
        return self.feed_condition(self.tts.condition(token_ids, hidden_states), last)

    def finish(self) -> list[list[int]]:
        """The LLM stopped without a terminator: hand out what is buffered (``streaming_generate``'s final flush)
        and close the reply."""
        self._check_open()
        out = [self.buffer] if self.buffer else []
        self.buffer = []
        self.done = True
        return out

    def _check_open(self):
        if self.done:
            raise RuntimeError("this TTS reply is finished; start a new one with tts.start_reply()")

    def feed_condition(self, condition: mx.array, last: bool) -> list[list[int]]:
        """``generate_with_buffer`` on a condition [1, n, hidden] already built (the text/hidden merge)."""
        self._check_open()
        a, s = self.args, self.sampling
        parts = [condition] + ([self.text_eos] if last else []) + [self.audio_bos]
        condition = mx.concatenate(parts, axis=1)
        info = _ChunkInfo(condition)
        inputs = condition
        if a.attention_type == "sliding_recompute" and self.chunks_fed >= 1:
            prev = self.chunk_info[-1]
            pieces = [prev.condition]
            if prev.audio_tokens:
                pieces.append(self.tts.emb_code[0](mx.array(prev.audio_tokens, dtype=mx.int32))[None])
            inputs = mx.concatenate(pieces + [condition], axis=1)
            self.cache = self.tts.make_cache()
            self.text_start_pos = 0
        elif a.attention_type == "reindex" and self.chunks_fed >= 1:
            self._reindex()
        self.chunks_fed += 1
        prefill_len = inputs.shape[1]
        out: list[list[int]] = []
        chunk_tokens = 0
        for t in range(s.max_new_tokens_per_chunk):
            if t == 0:
                x, pos = inputs, self.text_start_pos
            else:
                x = self.tts.emb_code[0](mx.array([self.generated[-1]], dtype=mx.int32))[None]
                pos = self.text_start_pos + prefill_len + t - 1
            logits = self.tts.logits(x, pos, self.cache)
            if a.attention_type == "sliding_window":
                self._truncate(a.streaming_sliding_window_audio_window_size)
            mx.eval(logits, *[c.keys for c in self.cache])
            first = not self.generated and t == 0
            token = self._pick(process_logits(np.array(logits), self.generated, s, first))
            finished = token == a.eos_token_id
            if not finished:
                self.generated.append(token)
                self.buffer.append(token)
                info.audio_tokens.append(token)
                chunk_tokens += 1
            if not self.buffer:
                if last:
                    out.append([])
                break
            if len(self.buffer) >= s.chunk_size:
                out.append(self.buffer[: s.chunk_size])
                self.buffer = self.buffer[s.chunk_size:]
            elif finished:
                if last:
                    out.append(self.buffer)
                    self.buffer = []
                break
        self.chunk_info.append(info)
        self.text_start_pos += (prefill_len if a.attention_type == "sliding_recompute" else condition.shape[1]) \
            + chunk_tokens
        if last:  # streaming_generate's flush after the LLM's last chunk
            if self.buffer:
                out.append(self.buffer)
                self.buffer = []
            self.done = True
        return out

    # --- internals ----------------------------------------------------------------------------------------------
    def _pick(self, x: np.ndarray) -> int:
        if self.sampling.greedy:
            return int(np.argmax(x))
        probs = softmax(x.astype(np.float64)).astype(np.float32)
        if self._draw is not None:
            return int(self._draw(probs))
        if self._key is None:
            return int(mx.random.categorical(mx.array(x)).item())
        self._key, sub = mx.random.split(self._key)
        return int(mx.random.categorical(mx.array(x), key=sub).item())

    def _truncate(self, window: int):
        for c in self.cache:
            if c.length > window:
                c.keys, c.values = c.keys[:, :, -window:], c.values[:, :, -window:]

    def _reindex(self):
        """The official ``_reindex_kv_cache``: keep the first chunk (sink) and the previous chunk; the previous
        chunk's keys are rotated by RoPE angles ``arange(len) + (sink_len - old_start)`` (as the official code
        computes them) and the next positions continue at ``sink_len + last_len``."""
        if len(self.chunk_info) < 2:
            return
        total = self.cache[0].length
        sink = self.chunk_info[0].condition.shape[1] + len(self.chunk_info[0].audio_tokens)
        last_len = self.chunk_info[-1].condition.shape[1] + len(self.chunk_info[-1].audio_tokens)
        if total <= sink + last_len:
            return
        delta = np.arange(last_len) + (sink - (total - last_len))
        d = self.args.head_dim
        inv = 1.0 / (self.args.rope_theta ** (np.arange(0, d // 2, dtype=np.float32) / (d // 2)))
        ang = delta.astype(np.float32)[:, None] * inv[None].astype(np.float32)
        ang = np.concatenate([ang, ang], axis=-1)
        cos, sin = mx.array(np.cos(ang)), mx.array(np.sin(ang))
        for c in self.cache:
            k_last = c.keys[:, :, -last_len:]
            rot = mx.concatenate([-k_last[..., d // 2:], k_last[..., : d // 2]], axis=-1)
            k_last = k_last * cos.astype(k_last.dtype) + rot * sin.astype(k_last.dtype)
            c.keys = mx.concatenate([c.keys[:, :, :sink], k_last], axis=2)
            c.values = mx.concatenate([c.values[:, :, :sink], c.values[:, :, -last_len:]], axis=2)
        self.text_start_pos = sink + last_len


def tts_args_from_config(config: dict) -> TTSArgs | None:
    """The TTS args when config.json asks for a TTS (``init_tts``, default true as in ``MiniCPMOConfig``)."""
    if not config.get("init_tts", True):
        return None
    return TTSArgs.from_dict(config.get("tts_config"))


__all__ = ["MiniCPMTTS", "TTSArgs", "TTSReply", "TTSSampling", "materialize_weight_norm", "process_logits",
           "tts_args_from_config", "ATTENTION_TYPES"]
