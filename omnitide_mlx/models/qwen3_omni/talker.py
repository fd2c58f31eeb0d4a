"""Qwen3-Omni's talker and code predictor on MLX: thinker states -> 16 codebooks a frame at 12.5 Hz.

As transformers 5.24's ``Qwen3OmniMoeTalkerForConditionalGeneration`` and ``Qwen3OmniMoeForConditionalGeneration
.generate`` compute it:

- the talker is a Qwen3-MoE decoder (q/k norms, interleaved M-RoPE) whose every layer is sparse with a *shared
  expert* gated by ``sigmoid(shared_expert_gate(x))`` (transformers builds the dense MLP for ``mlp_only_layers`` and
  then overwrites it with the MoE block, so every layer is MoE whatever the config says); its head ``codec_head``
  predicts codebook 0;
- its prompt (``talker_prompt``): every token of every user turn, projected from the thinker -- media tokens
  (audio / image / video pads) through ``hidden_projection`` from thinker layer ``accept_hidden_layer``, the other
  tokens through ``text_projection`` from the thinker's input embeddings -- then nine assistant rows:
  ``<|im_start|>assistant\\n`` (text projection, no codec), four ``tts_pad`` + ``tts_bos`` + the first reply token
  (text side) added to the codec side ``[nothink, think_bos, think_eos, speaker, pad, bos]``;
- each later step feeds the sum of the 16 codebook embeddings of the previous frame plus the next reply token's
  text projection (``trailing``: reply tokens 1.., then ``tts_eos``, then ``tts_pad`` for ever);
- the code predictor (a small dense Qwen3 decoder, 1-D RoPE from 0 for every frame) takes ``[talker's last hidden,
  embedding of codebook 0]`` and predicts codebooks 1..15 one by one, codebook ``g`` through ``lm_head[g - 1]``
  and embedded for the next through ``codec_embedding[g - 1]``;
- decoding: repetition penalty 1.05 over the codebook-0 codes so far, the top 1,024 codec ids suppressed except
  ``codec_eos``, stop at ``codec_eos``; greedy (the parity reference) or sampled as transformers' defaults
  (:data:`TALKER_SAMPLING`: top-k 50, temperature 0.9; :data:`PREDICTOR_SAMPLING`: top-k 50, top-p 0.8). A frame's 16 codes are complete
  once the next talker step has run the code predictor for it, so the frame of the final (eos) code is never
  emitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import SwitchGLU

from .. import blocks
from ..loading import CheckpointError, config_fields
from ..qwen2_5_omni.talker import CodecSampling, choose_code
from .config import TextConfig
from .language import Attention, DecoderLayer, mrope_axis_of_freq, mrope_cos_sin, stack_experts


GREEDY = CodecSampling(greedy=True)
TALKER_SAMPLING = CodecSampling(temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05)
PREDICTOR_SAMPLING = CodecSampling(temperature=1.0, top_k=50, top_p=0.8, repetition_penalty=1.0)
_NONE = np.zeros(0, dtype=np.int64)


@dataclass
class TalkerConfig:
    text: TextConfig
    predictor: TextConfig
    shared_expert_intermediate_size: int = 0
    num_code_groups: int = 16
    thinker_hidden_size: int = 2048
    accept_hidden_layer: int = 24
    codec_eos_token_id: int = 2150
    codec_nothink_id: int = 2155
    codec_think_bos_id: int = 2156
    codec_think_eos_id: int = 2157
    codec_pad_id: int = 2148
    codec_bos_id: int = 2149
    speaker_id: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict) -> "TalkerConfig":
        text = dict(d.get("text_config") or {})
        shared = int(text.pop("shared_expert_intermediate_size", 0) or 0)
        text["mlp_only_layers"] = []  # transformers makes every talker layer MoE (see the module docstring)
        pred = dict(d.get("code_predictor_config") or {})
        hd = pred.get("head_dim") or pred["hidden_size"] // pred["num_attention_heads"]
        pred.update(num_experts=0, rope_scaling={"mrope_section": [hd // 2, 0, 0], "rope_type": "default"})
        kw = config_fields(cls, d)
        for k in ("text", "predictor"):
            kw.pop(k, None)
        t, p = TextConfig.from_dict(text), TextConfig.from_dict(pred)
        if p.hidden_size != t.hidden_size:
            raise CheckpointError("talker_config: the code predictor's hidden size differs from the talker's")
        return cls(text=t, predictor=p, shared_expert_intermediate_size=shared, **kw)


class ResizeMLP(nn.Module):
    def __init__(self, din: int, hidden: int, dout: int):
        super().__init__()
        self.linear_fc1 = nn.Linear(din, hidden, bias=True)
        self.linear_fc2 = nn.Linear(hidden, dout, bias=True)

    def __call__(self, x):
        return self.linear_fc2(nn.silu(self.linear_fc1(x)))


class SharedExpertMoe(nn.Module):
    def __init__(self, t: TextConfig, shared: int):
        super().__init__()
        self.top_k, self.norm_topk_prob = t.num_experts_per_tok, t.norm_topk_prob
        self.gate = nn.Linear(t.hidden_size, t.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(t.hidden_size, t.moe_intermediate_size, t.num_experts)
        self.shared_expert = blocks.MLP(t.hidden_size, shared)
        self.shared_expert_gate = nn.Linear(t.hidden_size, 1, bias=False)

    def __call__(self, x):
        probs = mx.softmax(self.gate(x).astype(mx.float32), axis=-1)
        inds = mx.argpartition(-probs, kth=self.top_k - 1, axis=-1)[..., :self.top_k]
        scores = mx.take_along_axis(probs, inds, axis=-1)
        if self.norm_topk_prob:
            scores = scores / scores.sum(axis=-1, keepdims=True)
        y = (self.switch_mlp(x, inds) * scores.astype(x.dtype)[..., None]).sum(axis=-2)
        return y + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class TalkerLayer(nn.Module):
    def __init__(self, c: TalkerConfig):
        super().__init__()
        t = c.text
        self.self_attn = Attention(t)
        self.mlp = SharedExpertMoe(t, c.shared_expert_intermediate_size)
        self.input_layernorm = nn.RMSNorm(t.hidden_size, eps=t.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(t.hidden_size, eps=t.rms_norm_eps)

    def __call__(self, x, cos, sin, cache=None):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


def _rope(args: TextConfig):
    hd = args.head_dim
    inv = mx.array(1.0 / (args.rope_theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd)), dtype=mx.float32)
    return inv, mrope_axis_of_freq(hd, args.mrope_section)


def _cos_sin(positions, inv, axes, dtype):
    pos = mx.array(np.asarray(positions, dtype=np.float32))
    if pos.ndim == 1:
        pos = mx.broadcast_to(pos[None], (3, pos.shape[0]))
    return mrope_cos_sin(pos, inv, axes, dtype)


class TalkerModel(nn.Module):
    def __init__(self, c: TalkerConfig):
        super().__init__()
        t = c.text
        self.codec_embedding = nn.Embedding(t.vocab_size, t.hidden_size)
        self.layers = [TalkerLayer(c) for _ in range(t.num_hidden_layers)]
        self.norm = nn.RMSNorm(t.hidden_size, eps=t.rms_norm_eps)


class CodePredictorModel(nn.Module):
    def __init__(self, c: TalkerConfig):
        super().__init__()
        p = c.predictor
        self.layers = [DecoderLayer(p, i) for i in range(p.num_hidden_layers)]
        self.norm = nn.RMSNorm(p.hidden_size, eps=p.rms_norm_eps)
        self.codec_embedding = [nn.Embedding(p.vocab_size, p.hidden_size) for _ in range(c.num_code_groups - 1)]


class CodePredictor(nn.Module):
    def __init__(self, c: TalkerConfig):
        super().__init__()
        self.model = CodePredictorModel(c)
        self.lm_head = [nn.Linear(c.predictor.hidden_size, c.predictor.vocab_size, bias=False)
                        for _ in range(c.num_code_groups - 1)]
        self._inv, self._axes = _rope(c.predictor)

    def codes(self, past_hidden: mx.array, code0: int, code0_embed: mx.array, sampling: CodecSampling = GREEDY,
              key=None) -> tuple[list[int], list[mx.array]]:
        """Codebooks 1.. for one frame: (codes, their embeddings ``[1, 1, H]``); ``key``: the frame's PRNG key."""
        from mlx_lm.models.cache import KVCache

        cache = [KVCache() for _ in self.model.layers]
        x = mx.concatenate([past_hidden, code0_embed], axis=1)
        pos, codes, embeds = 0, [], []
        for g in range(len(self.lm_head)):
            t = x.shape[1]
            cos, sin = _cos_sin(np.arange(pos, pos + t), self._inv, self._axes, x.dtype)
            h = x
            for layer, c in zip(self.model.layers, cache):
                h = layer(h, cos, sin, c)
            logits = self.lm_head[g](self.model.norm(h[:, -1:]))[0, -1]
            if sampling.greedy:
                code = int(mx.argmax(logits).item())
            else:
                code = choose_code(logits.astype(mx.float32), _NONE, sampling, _NONE,
                                   None if key is None else mx.random.split(key, len(self.lm_head))[g])
            codes.append(code)
            x = self.model.codec_embedding[g](mx.array([[code]]))
            embeds.append(x)
            pos += t
        return codes, embeds


class Talker(nn.Module):
    """Checkpoint prefix ``talker.``."""

    def __init__(self, c: TalkerConfig):
        super().__init__()
        self.config = c
        t = c.text
        self.model = TalkerModel(c)
        self.text_projection = ResizeMLP(c.thinker_hidden_size, t.intermediate_size, t.hidden_size)
        self.hidden_projection = ResizeMLP(c.thinker_hidden_size, t.intermediate_size, t.hidden_size)
        self.codec_head = nn.Linear(t.hidden_size, t.vocab_size, bias=False)
        self.code_predictor = CodePredictor(c)
        self._inv, self._axes = _rope(t)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return stack_experts({k[len("talker."):]: v for k, v in weights.items() if k.startswith("talker.")})

    def forward(self, embeds: mx.array, positions, cache) -> mx.array:
        """Final-norm hidden states ``[1, T, H]`` for ``embeds`` at ``positions`` (``[3, T]``)."""
        cos, sin = _cos_sin(positions, self._inv, self._axes, embeds.dtype)
        h = embeds
        for layer, c in zip(self.model.layers, cache):
            h = layer(h, cos, sin, c)
        return self.model.norm(h)

    def generate(self, prompt: mx.array, positions: np.ndarray, trailing: mx.array, tts_pad: mx.array, *,
                 max_new_tokens: int = 4096, sampling: CodecSampling | None = None,
                 predictor_sampling: CodecSampling | None = None) -> np.ndarray:
        """Codes ``[num_code_groups, frames]`` for one reply (see the module docstring): greedy with transformers'
        repetition penalty by default; ``sampling`` / ``predictor_sampling`` (e.g. :data:`TALKER_SAMPLING`,
        :data:`PREDICTOR_SAMPLING`) sample, reproducibly when ``sampling.seed`` is set."""
        stream = TalkerStream(self, max_new_tokens=max_new_tokens, sampling=sampling,
                              predictor_sampling=predictor_sampling)
        stream.start(prompt, positions)
        frames = []
        while not stream.done:
            k = len(frames)
            frame = stream.step(trailing[:, k:k + 1] if k < trailing.shape[1] else tts_pad)
            if frame is not None:
                frames.append(frame)
        return np.asarray(frames, dtype=np.int64).T.reshape(self.config.num_code_groups, -1)


class TalkerStream:
    """One reply's talker, stepped as the text arrives (``Talker.generate`` is this in a loop).

    ``start(prompt, positions)`` prefills the talker and picks codebook 0 of frame 0. Each ``step(text_row)`` runs
    the code predictor for the pending frame, feeds the frame's summed embeddings plus ``text_row`` (the next reply
    token's text projection, ``tts_eos`` once the text has ended, then ``tts_pad``) and picks the next codebook 0;
    it returns the completed frame (``num_code_groups`` codes). ``done`` once ``codec_eos`` is picked or
    ``max_new_tokens`` codes are; the KV cache is the object's own."""

    def __init__(self, talker: Talker, *, max_new_tokens: int = 4096, sampling: CodecSampling | None = None,
                 predictor_sampling: CodecSampling | None = None):
        from mlx_lm.models.cache import KVCache

        c = talker.config
        self.talker, self.max_new_tokens = talker, max_new_tokens
        self.sampling = sampling or CodecSampling(greedy=True, repetition_penalty=1.05)
        self.predictor_sampling = predictor_sampling or (GREEDY if self.sampling.greedy else PREDICTOR_SAMPLING)
        seed = self.sampling.seed
        self.step_keys = None if seed is None else mx.random.split(mx.random.key(seed), max_new_tokens)
        vocab = c.text.vocab_size
        suppressed = np.zeros(vocab, dtype=bool)
        suppressed[max(vocab - 1024, 0):] = True
        suppressed[c.codec_eos_token_id] = False
        self.bias = mx.array(np.where(suppressed, -np.inf, 0.0).astype(np.float32))
        self.suppressed_ids = np.nonzero(suppressed)[0]
        self.cache = [KVCache() for _ in talker.model.layers]
        self.generated: list[int] = []
        self.hidden = None
        self.next_position = 0.0
        self.done = False

    def _keys(self, k: int):
        return (None, None) if self.step_keys is None else tuple(mx.random.split(self.step_keys[k]))

    def _pick(self) -> None:
        t, s = self.talker, self.sampling
        logits = t.codec_head(self.hidden[:, -1:])[0, -1].astype(mx.float32)
        k = len(self.generated)
        if s.greedy:
            if self.generated and s.repetition_penalty != 1.0:
                seen = mx.array(sorted(set(self.generated)))
                vals = logits[seen]
                p = s.repetition_penalty
                logits[seen] = mx.where(vals < 0, vals * p, vals / p)
            code0 = int(mx.argmax(logits + self.bias).item())
        else:
            code0 = choose_code(logits, np.asarray(self.generated, dtype=np.int64), s, self.suppressed_ids,
                                self._keys(k)[0])
        self.generated.append(code0)
        if code0 == t.config.codec_eos_token_id or len(self.generated) >= self.max_new_tokens:
            self.done = True

    def start(self, prompt: mx.array, positions: np.ndarray) -> None:
        self.hidden = self.talker.forward(prompt, positions, self.cache)
        self.next_position = float(np.max(positions)) + 1
        self._pick()

    def step(self, text_row: mx.array) -> list[int] | None:
        if self.done:
            return None
        t = self.talker
        k = len(self.generated) - 1
        code0 = self.generated[-1]
        embed0 = t.model.codec_embedding(mx.array([[code0]]))
        rest, rest_embeds = t.code_predictor.codes(self.hidden[:, -1:], code0, embed0, self.predictor_sampling,
                                                   self._keys(k)[1])
        x = embed0
        for e in rest_embeds:
            x = x + e
        self.hidden = t.forward(x + text_row, np.full((3, 1), self.next_position, dtype=np.float32), self.cache)
        self.next_position += 1
        self._pick()
        return [code0] + rest


def talker_prompt(thinker, talker: Talker, config: dict, input_ids: np.ndarray, generated: list[int],
                  embeds0: mx.array, hidden_l: mx.array, speaker: str, eos_ids=(151645,)):
    """(prompt rows ``[1, T, H]``, talker input ids ``[T]``, trailing rows ``[1, n, H]``, tts_pad ``[1, 1, H]``).

    ``embeds0`` / ``hidden_l``: the thinker's input embeddings and its layer-``accept_hidden_layer`` output over the
    prompt and the reply but its last token (``[1, S + len(generated) - 1, H_thinker]``)."""
    c = talker.config
    tc = thinker.config
    ids = np.asarray(input_ids).reshape(-1)
    seq = np.concatenate([ids, np.asarray(generated, dtype=np.int64)])
    n = ids.shape[0]
    speaker_id = {k.lower(): v for k, v in c.speaker_id.items()}.get(speaker.lower())
    if speaker_id is None:
        raise ValueError(f"unknown speaker {speaker!r} (this checkpoint has {sorted(c.speaker_id)})")
    im_start, user = config["im_start_token_id"], config["user_token_id"]
    # user rows: every token whose last <|im_start|> is followed by the user role token
    starts = np.where(ids == im_start, np.arange(n), -1)
    prev = np.maximum.accumulate(starts).clip(min=0)
    role = ids[np.minimum(prev + 1, n - 1)]
    user_idx = np.nonzero(role == user)[0]
    media = np.isin(seq[user_idx], [tc.audio_token_id, tc.image_token_id, tc.video_token_id])
    rows_text = talker.text_projection(embeds0[0, mx.array(user_idx.astype(np.int32))])
    rows_media = talker.hidden_projection(hidden_l[0, mx.array(user_idx.astype(np.int32))])
    user_rows = mx.where(mx.array(media)[:, None], rows_media, rows_text)
    # assistant rows
    a = [i for i in range(n - 1) if ids[i] == im_start and ids[i + 1] == config["assistant_token_id"]]
    if not a:
        raise ValueError("the prompt has no <|im_start|>assistant turn")
    a = a[-1]
    special = mx.array([[config["tts_bos_token_id"], config["tts_eos_token_id"], config["tts_pad_token_id"]]])
    bos, eos, pad = (talker.text_projection(thinker.language_model.embed(special))[:, i:i + 1] for i in range(3))
    assistant = talker.text_projection(embeds0[:, a:])
    text_side = mx.concatenate([assistant[:, :3], mx.repeat(pad, 4, axis=1), bos, assistant[:, 3:4]], axis=1)
    codec_ids = mx.array([[c.codec_nothink_id, c.codec_think_bos_id, c.codec_think_eos_id, speaker_id,
                           c.codec_pad_id, c.codec_bos_id]])
    codec_side = mx.concatenate([mx.zeros((1, 3, c.text.hidden_size), dtype=text_side.dtype),
                                 talker.model.codec_embedding(codec_ids)], axis=1)
    trailing = mx.concatenate([assistant[:, 4:], eos], axis=1)
    hits = [i for i, t in enumerate(generated) if t in set(eos_ids)]
    first = hits[0] if hits else len(generated)
    j = np.arange(trailing.shape[1])
    trailing = mx.where(mx.array(j > first)[None, :, None], pad, trailing)
    trailing = mx.where(mx.array(j == first)[None, :, None], eos, trailing)
    prompt = mx.concatenate([user_rows[None], text_side + codec_side], axis=1)
    talker_ids = np.concatenate([seq[user_idx], np.full(9, config["tts_pad_token_id"])])
    return prompt, talker_ids, trailing, pad


def load_talker(path, config: dict) -> Talker:
    from pathlib import Path

    from ..loading import load_safetensors, load_weights_strict

    if not isinstance(config.get("talker_config"), dict):
        raise CheckpointError("config.json has no talker_config (a -Thinking checkpoint has no speech)")
    talker = Talker(TalkerConfig.from_dict(config["talker_config"]))
    load_weights_strict(talker, talker.sanitize(load_safetensors(Path(path))), what=f"talker in {path}")
    mx.eval(talker.parameters())
    return talker


def hf_talker_shapes(c: TalkerConfig) -> dict[str, tuple[int, ...]]:
    """Every talker tensor of a released checkpoint (names after ``talker.``) and its HF shape."""
    t, p = c.text, c.predictor
    s = {"model.codec_embedding.weight": (t.vocab_size, t.hidden_size), "model.norm.weight": (t.hidden_size,),
         "codec_head.weight": (t.vocab_size, t.hidden_size)}
    for name in ("text_projection", "hidden_projection"):
        s[f"{name}.linear_fc1.weight"] = (t.intermediate_size, c.thinker_hidden_size)
        s[f"{name}.linear_fc1.bias"] = (t.intermediate_size,)
        s[f"{name}.linear_fc2.weight"] = (t.hidden_size, t.intermediate_size)
        s[f"{name}.linear_fc2.bias"] = (t.hidden_size,)

    def attn(pre, a: TextConfig):
        hd = a.head_dim
        s[pre + "self_attn.q_proj.weight"] = (a.num_attention_heads * hd, a.hidden_size)
        s[pre + "self_attn.k_proj.weight"] = s[pre + "self_attn.v_proj.weight"] = (a.num_key_value_heads * hd,
                                                                                  a.hidden_size)
        s[pre + "self_attn.o_proj.weight"] = (a.hidden_size, a.num_attention_heads * hd)
        s[pre + "self_attn.q_norm.weight"] = s[pre + "self_attn.k_norm.weight"] = (hd,)
        s[pre + "input_layernorm.weight"] = s[pre + "post_attention_layernorm.weight"] = (a.hidden_size,)

    for i in range(t.num_hidden_layers):
        pre = f"model.layers.{i}."
        attn(pre, t)
        s[pre + "mlp.gate.weight"] = (t.num_experts, t.hidden_size)
        for e in range(t.num_experts):
            s[pre + f"mlp.experts.{e}.gate_proj.weight"] = (t.moe_intermediate_size, t.hidden_size)
            s[pre + f"mlp.experts.{e}.up_proj.weight"] = (t.moe_intermediate_size, t.hidden_size)
            s[pre + f"mlp.experts.{e}.down_proj.weight"] = (t.hidden_size, t.moe_intermediate_size)
        sh = c.shared_expert_intermediate_size
        s[pre + "mlp.shared_expert.gate_proj.weight"] = s[pre + "mlp.shared_expert.up_proj.weight"] = (sh,
                                                                                                      t.hidden_size)
        s[pre + "mlp.shared_expert.down_proj.weight"] = (t.hidden_size, sh)
        s[pre + "mlp.shared_expert_gate.weight"] = (1, t.hidden_size)
    for i in range(p.num_hidden_layers):
        pre = f"code_predictor.model.layers.{i}."
        attn(pre, p)
        s[pre + "mlp.gate_proj.weight"] = s[pre + "mlp.up_proj.weight"] = (p.intermediate_size, p.hidden_size)
        s[pre + "mlp.down_proj.weight"] = (p.hidden_size, p.intermediate_size)
    s["code_predictor.model.norm.weight"] = (p.hidden_size,)
    for g in range(c.num_code_groups - 1):
        s[f"code_predictor.model.codec_embedding.{g}.weight"] = (p.vocab_size, p.hidden_size)
        s[f"code_predictor.lm_head.{g}.weight"] = (p.vocab_size, p.hidden_size)
    return s
