"""The Qwen2.5-Omni talker: a small Qwen2 decoder that turns the thinker's reply into codec tokens (speech units).

Its input at every step is the sum of two tracks (transformers 5.24, ``Qwen2_5OmniTalkerForConditionalGeneration``
and ``Qwen2_5OmniForConditionalGeneration.generate``):

- the *text track*: the thinker's last-layer (final-norm) hidden state plus the thinker's input embedding of one
  text token, in the thinker's width (``embedding_size``); media placeholder embeddings are zeroed;
- the *codec track*: the talker's own embedding of the previous codec token (also ``embedding_size`` wide).

``thinker_to_talker_proj`` maps the sum to the talker width. The prompt is the thinker's prompt (text track only,
at the thinker's TMRoPE positions) followed by the speaker's text-bos embedding (+ codec pad) and the first reply
token (+ codec bos). After that, codec step k reads reply token k (one text token per codec token), then the
text-eos embedding once, then the text-pad embedding until the talker emits a codec end or pad token. Positions
after the prompt are sequential. So the talker can run in lockstep with the thinker, one step behind it:
:class:`TalkerStream` is that state for one reply.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..loading import CheckpointError, config_fields
from .config import TextConfig
from .language import DecoderLayer, mrope_cos_sin


@dataclass
class TalkerConfig:
    vocab_size: int = 8448
    embedding_size: int = 3584
    hidden_size: int = 3584
    intermediate_size: int = 18944
    num_hidden_layers: int = 28
    num_attention_heads: int = 28
    num_key_value_heads: int = 4
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    mrope_section: list[int] = field(default_factory=lambda: [16, 24, 24])
    tts_text_start_token_id: int = 151860
    tts_text_end_token_id: int = 151861
    tts_text_pad_token_id: int = 151859
    tts_codec_start_token_id: int = 8293
    tts_codec_end_token_id: int = 8294
    tts_codec_pad_token_id: int = 8292
    tts_codec_mask_token_id: int = 8296

    @classmethod
    def from_dict(cls, d: dict) -> "TalkerConfig":
        kw = config_fields(cls, d)
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if "rope_theta" in rope:
            kw["rope_theta"] = rope["rope_theta"]
        if "mrope_section" in rope:
            kw["mrope_section"] = list(rope["mrope_section"])
        if d.get("use_sliding_window"):
            raise CheckpointError("talker_config: use_sliding_window is not supported (released models have it off)")
        return cls(**kw)

    @property
    def text(self) -> TextConfig:
        """The decoder layers' shape, as a thinker text config (same Qwen2 layer, same M-RoPE)."""
        return TextConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                          intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
                          num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                          rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
                          mrope_section=list(self.mrope_section), head_dim=self.head_dim)

    @property
    def stop_codes(self) -> tuple[int, int]:
        """The codes that end a spoken reply (transformers' ``talker_eos_token_id`` default [8292, 8294])."""
        return (self.tts_codec_pad_token_id, self.tts_codec_end_token_id)


class TalkerModel(nn.Module):
    """Checkpoint prefix ``talker.model.``: codec embeddings (``embedding_size`` wide), decoder layers, final norm."""

    def __init__(self, c: TalkerConfig):
        super().__init__()
        t = c.text
        self.embed_tokens = nn.Embedding(c.vocab_size, c.embedding_size)
        self.layers = [DecoderLayer(t) for _ in range(c.num_hidden_layers)]
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)


class Talker(nn.Module):
    def __init__(self, config: TalkerConfig):
        super().__init__()
        self.config = config
        self.thinker_to_talker_proj = nn.Linear(config.embedding_size, config.hidden_size, bias=True)
        self.model = TalkerModel(config)
        self.codec_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        hd = config.head_dim
        self._inv_freq = mx.array(1.0 / (config.rope_theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd)))

    def embed_codec(self, ids) -> mx.array:
        return self.model.embed_tokens(mx.array(np.asarray(ids, dtype=np.int32)))

    def make_cache(self):
        from mlx_lm.models.cache import KVCache

        return [KVCache() for _ in self.model.layers]

    def __call__(self, inputs_embeds: mx.array, cache=None, positions=None) -> mx.array:
        """Codec logits ``[B, T, vocab]`` (float32) for summed text+codec tracks ``[B, T, embedding_size]`` at
        M-RoPE ``positions`` ``[3, T]`` (None: sequential after the cache)."""
        h = self.thinker_to_talker_proj(inputs_embeds)
        t = h.shape[1]
        if positions is None:
            offset = cache[0].offset if cache is not None else 0
            positions = np.broadcast_to(np.arange(offset, offset + t), (3, t))
        pos = positions if isinstance(positions, mx.array) else mx.array(np.asarray(positions, dtype=np.int64))
        cos, sin = mrope_cos_sin(pos, self._inv_freq, self.config.mrope_section, h.dtype)
        caches = cache if cache is not None else [None] * len(self.model.layers)
        for layer, c in zip(self.model.layers, caches):
            h = layer(h, cos, sin, c)
        return self.codec_head(self.model.norm(h)).astype(mx.float32)


@dataclass
class CodecSampling:
    """The talker's sampling, as transformers' ``generate(talker_*)`` defaults: top-k 40, top-p 0.8,
    temperature 0.9, repetition penalty 1.05 over every code seen (prompt codes included). ``greedy`` keeps the
    penalty and takes the arg-max (the parity tests use it)."""

    greedy: bool = False
    temperature: float = 0.9
    top_k: int = 40
    top_p: float = 0.8
    repetition_penalty: float = 1.05
    seed: int | None = None


def choose_code(logits: mx.array, seen: np.ndarray, sampling: CodecSampling, suppress: int,
                key: mx.array | None = None) -> int:
    """One code from ``logits`` ``[vocab]`` (float32), processed as transformers' logits processors do: the
    repetition penalty on every id in ``seen``, ``suppress`` masked, then temperature, top-k and top-p. ``key``:
    the draw's PRNG key (None: MLX's global generator)."""
    lg = np.array(logits, dtype=np.float32, copy=True)
    p = sampling.repetition_penalty
    if p and p != 1.0 and seen.size:
        ids = np.unique(seen)
        s = lg[ids]
        lg[ids] = np.where(s < 0, s * p, s / p)
    lg[suppress] = -np.inf
    if sampling.greedy:
        return int(np.argmax(lg))
    lg = lg / sampling.temperature
    if sampling.top_k and sampling.top_k < lg.size:
        kth = np.partition(lg, -sampling.top_k)[-sampling.top_k]
        lg = np.where(lg < kth, -np.inf, lg)
    order = np.argsort(lg)  # ascending, as transformers' TopPLogitsWarper
    probs = np.exp(lg[order] - lg[order][-1])
    probs /= probs.sum()
    cum = np.cumsum(probs)
    drop = cum <= (1 - sampling.top_p)
    drop[-1] = False
    lg[order[drop]] = -np.inf
    probs = np.exp(lg - lg.max())
    probs /= probs.sum()
    return int(mx.random.categorical(mx.log(mx.array(probs)), key=key).item())


class TalkerStream:
    """One reply's talker: its own KV cache (freed with the object), fed one text-track vector per codec step.

    ``prompt`` ``[T, E]``: text track of the prompt (thinker hidden + input embedding, media rows zeroed), at
    ``positions`` ``[3, T]``. ``text_bos`` / ``text_eos`` / ``text_pad``: the thinker's input embeddings of the
    speaker's bos token and the tts text eos / pad tokens ``[E]``. ``start(first)`` prefills and returns the
    first code; ``step(vector)`` returns the next (``vector`` None once the text has ended: eos, then pad).
    ``done`` is set when a stop code comes or ``max_codes`` codes were made; stop codes are not returned.

    ``codec_prompt=False`` reproduces ``generate()`` of transformers 5.24, which leaves the codec pad / bos
    embeddings out of the prompt: ``GenerationMixin.generate`` replaces an all-ones attention mask with None
    (generation/utils.py 2899-2907) and the talker's forward adds them only when it gets a mask. The talker's
    own forward with a mask (and transformers 4.x) adds them, so that is the default here.
    """

    def __init__(self, talker: Talker, prompt: mx.array, positions: np.ndarray, text_bos: mx.array,
                 text_eos: mx.array, text_pad: mx.array, *, sampling: CodecSampling | None = None,
                 max_codes: int = 4096, codec_prompt: bool = True):
        self.talker, self.c = talker, talker.config
        self.prompt, self.positions = prompt, np.asarray(positions, dtype=np.int64)
        self.text_bos, self.text_eos, self.text_pad = text_bos, text_eos, text_pad
        self.sampling = sampling or CodecSampling()
        self.max_codes = max_codes
        self.codec_prompt = codec_prompt
        self.cache = talker.make_cache()
        n = prompt.shape[0]
        self.seen = [self.c.tts_codec_mask_token_id] * n + [self.c.tts_codec_pad_token_id,
                                                            self.c.tts_codec_start_token_id]
        self.codes: list[int] = []
        self.done = False
        self._eos_fed = False
        self._next_pos = int(self.positions.max()) + 1 if n else 0
        self._last: int | None = None
        # a seeded reply draws from its own key: the thinker's sampler and other sessions' threads share MLX's
        # global generator, so seeding that would not make the codes reproducible
        self._key = mx.random.key(self.sampling.seed) if self.sampling.seed is not None else None

    def _choose(self, logits: mx.array) -> int | None:
        key = None
        if self._key is not None:
            self._key, key = mx.random.split(self._key)
        code = choose_code(logits, np.asarray(self.seen), self.sampling, self.c.tts_codec_start_token_id, key)
        self.seen.append(code)
        if code in self.c.stop_codes:
            self.done = True
            return None
        self.codes.append(code)
        self._last = code
        if len(self.codes) >= self.max_codes:
            self.done = True
        return code

    def start(self, first: mx.array) -> int | None:
        c = self.c
        codec = self.talker.embed_codec([c.tts_codec_pad_token_id, c.tts_codec_start_token_id])
        tail = mx.stack([self.text_bos, first])
        if self.codec_prompt:
            tail = tail + codec.astype(first.dtype)
        x = mx.concatenate([self.prompt, tail.astype(self.prompt.dtype)], axis=0)[None]
        p = self._next_pos
        pos = np.concatenate([self.positions, np.broadcast_to(np.arange(p, p + 2), (3, 2))], axis=1)
        self._next_pos = p + 2
        logits = self.talker(x, self.cache, pos)[0, -1]
        return self._choose(logits)

    def step(self, vector: mx.array | None = None) -> int | None:
        if self.done:
            return None
        if vector is None:
            vector = self.text_pad if self._eos_fed else self.text_eos
            self._eos_fed = True
        x = (self.talker.embed_codec([self._last])[0].astype(vector.dtype) + vector)[None, None]
        p = self._next_pos
        self._next_pos += 1
        logits = self.talker(x, self.cache, np.full((3, 1), p, dtype=np.int64))[0, -1]
        return self._choose(logits)
