"""The Qwen3-Omni thinker: AuT audio encoder and vision encoder feeding a Qwen3-MoE LLM with interleaved M-RoPE and
DeepStack.

``Model.__call__`` takes the arrays transformers' processor produces (numpy or MLX) and returns logits, so the port
can be compared with ``Qwen3OmniMoeThinkerForConditionalGeneration`` input for input.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .audio import AudioEncoder
from .config import ModelConfig
from .language import LanguageModel, stack_experts
from .rope_index import get_rope_index
from .vision import VisionEncoder


def _np(x, dtype=None):
    if x is None:
        return None
    a = np.array(x) if isinstance(x, mx.array) else np.asarray(x)
    return a.astype(dtype) if dtype is not None else a


def _mx(x, dtype=mx.float32):
    return x.astype(dtype) if isinstance(x, mx.array) else mx.array(np.asarray(x)).astype(dtype)



class Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.language_model = LanguageModel(config.text_config, config.tie_word_embeddings)
        self.visual = VisionEncoder(config.vision_config)
        self.audio_tower = AudioEncoder(config.audio_config)

    # --- checkpoint -----------------------------------------------------------------------------------------
    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Hugging Face names and layouts -> this module's: drop ``thinker.`` and the talker / code2wav weights, put
        the LLM under ``language_model``, stack each MoE layer's per-expert projections into ``switch_mlp``
        (``[experts, out, in]``; a 5.x fused ``gate_up_proj`` is split), flatten the Conv3d patch embedding and
        make the audio Conv2d weights channels-last."""
        out: dict[str, mx.array] = {}
        for k, v in weights.items():
            if k.startswith(("talker.", "code2wav.")):
                continue
            if k.startswith("thinker."):
                k = k[len("thinker."):]
            if k.startswith("model.language_model."):  # transformers 5.x in-memory names
                k = "model." + k[len("model.language_model."):]
            elif k.startswith(("model.visual.", "model.audio_tower.")):
                k = k[len("model."):]
            if k.startswith(("model.", "lm_head.")):
                k = "language_model." + k
            if k == "visual.patch_embed.proj.weight" and v.ndim == 5:
                v = v.reshape(v.shape[0], -1)
            if k.startswith("audio_tower.conv2d") and k.endswith(".weight") and v.ndim == 4:
                v = v.transpose(0, 2, 3, 1)  # [out, in, kh, kw] -> [out, kh, kw, in]
            if k == "language_model.lm_head.weight" and self.config.tie_word_embeddings:
                continue
            out[k] = v
        return stack_experts(out)

    def quant_predicate(self, path: str, module: nn.Module) -> bool:
        """Quantise the language model (attention, experts, dense MLPs, embeddings, LM head); the MoE routers and
        the two encoders stay in float. The routers are 0.04 % of the thinker's weights (24 MiB in bf16), and a 4-bit
        router changes at least one of the 8 chosen experts for 59 % of token-layers at the released shape (8-bit:
        4.8 %; omnitide_mlx/bench/qwen3_omni.py, docs/models/qwen3_omni.md). The encoders stay in float as in the
        Qwen2.5-Omni port and mlx-vlm."""
        return path.startswith("language_model.") and not path.endswith(".mlp.gate")

    def kv_spec(self):
        from .adapter import kv_spec

        return kv_spec(self.config)

    def stream_adapter(self, processor, **kw):
        from .adapter import Qwen3OmniAdapter

        return Qwen3OmniAdapter(self, processor, **kw)

    def make_cache(self):
        from mlx_lm.models.cache import KVCache

        return [KVCache() for _ in self.language_model.layers]

    @property
    def dtype(self) -> mx.Dtype:
        return self.audio_tower.proj2.weight.dtype

    # --- encoders -------------------------------------------------------------------------------------------
    def get_image_features(self, pixel_values, grid_thw) -> tuple[mx.array, list[mx.array]]:
        """(LLM tokens ``[n, H]``, DeepStack features ``[[n, H], ...]``) of images or videos."""
        return self.visual(_mx(pixel_values, self.dtype), _np(grid_thw, np.int64))

    def get_audio_features(self, input_features, feature_attention_mask) -> mx.array:
        """``input_features`` ``[n, mels, frames]`` and its mask ``[n, frames]`` -> ``[tokens, hidden]``."""
        feats = _np(input_features, np.float32)
        mask = _np(feature_attention_mask).astype(bool)
        if feats.ndim != 3 or mask.shape != (feats.shape[0], feats.shape[2]):
            raise ValueError(f"input_features {feats.shape} and feature_attention_mask {mask.shape} do not match")
        valid = np.concatenate([feats[i][:, mask[i]] for i in range(feats.shape[0])], axis=1)
        return self.audio_tower(mx.array(valid).astype(self.dtype), mask.sum(-1))

    def get_input_embeddings(self, input_ids, pixel_values=None, image_grid_thw=None, pixel_values_videos=None,
                             video_grid_thw=None, input_features=None, feature_attention_mask=None):
        """(token embeddings ``[B, S, H]`` with the encoders' outputs at the placeholder slots, DeepStack
        ``(slots, [features per level])`` or None)."""
        c = self.config
        ids = _np(input_ids, np.int64)
        if ids.ndim == 1:
            ids = ids[None]
        embeds = self.language_model.embed(mx.array(ids.astype(np.int32)))
        flat = ids.reshape(-1)
        replaced, deep = [], []
        if input_features is not None:
            replaced.append((c.audio_token_id, self.get_audio_features(input_features, feature_attention_mask)))
        for token, pixels, grid in ((c.image_token_id, pixel_values, image_grid_thw),
                                    (c.video_token_id, pixel_values_videos, video_grid_thw)):
            if pixels is not None:
                feats, levels = self.get_image_features(pixels, grid)
                replaced.append((token, feats))
                deep.append((token, levels))
        if not replaced:
            return embeds, None
        b, s, h = embeds.shape
        flat_embeds = embeds.reshape(b * s, h)
        for token, feats in replaced:
            slots = np.nonzero(flat == token)[0]
            if slots.size != feats.shape[0]:
                raise ValueError(f"{slots.size} placeholder tokens (id {token}) but the encoder gave "
                                 f"{feats.shape[0]} embeddings")
            flat_embeds[mx.array(slots.astype(np.int32))] = feats.astype(flat_embeds.dtype)
        embeds = flat_embeds.reshape(b, s, h)
        if not deep or not deep[0][1]:
            return embeds, None
        # DeepStack: one feature per visual token (images and videos together, in sequence order) and level
        visual = np.isin(flat, [t for t, _ in deep])
        slots = np.nonzero(visual)[0]
        levels = []
        for level in range(len(deep[0][1])):
            joint = mx.zeros((slots.size, h), dtype=embeds.dtype)
            for token, feats in deep:
                where = np.nonzero(flat[slots] == token)[0]
                joint[mx.array(where.astype(np.int32))] = feats[level].astype(embeds.dtype)
            levels.append(joint)
        return embeds, (mx.array(slots.astype(np.int32)), levels)

    def get_rope_index(self, input_ids, image_grid_thw=None, video_grid_thw=None, attention_mask=None,
                       use_audio_in_video=False, feature_attention_mask=None, video_second_per_grid=None):
        """M-RoPE positions ``[3, B, S]`` and rope deltas ``[B, 1]`` (numpy float32, as transformers)."""
        c = self.config
        seqlens = None if feature_attention_mask is None else _np(feature_attention_mask).sum(-1)
        return get_rope_index(_np(input_ids), _np(image_grid_thw), _np(video_grid_thw), _np(attention_mask),
                              bool(use_audio_in_video), seqlens, _np(video_second_per_grid),
                              image_token_id=c.image_token_id, video_token_id=c.video_token_id,
                              audio_token_id=c.audio_token_id, vision_start_token_id=c.vision_start_token_id,
                              audio_start_token_id=c.audio_start_token_id,
                              spatial_merge_size=c.vision_config.spatial_merge_size,
                              position_id_per_seconds=c.position_id_per_seconds,
                              n_window=c.audio_config.n_window)

    # --- forward --------------------------------------------------------------------------------------------
    def prepare(self, input_ids, pixel_values=None, image_grid_thw=None, pixel_values_videos=None,
                video_grid_thw=None, video_second_per_grid=None, input_features=None, feature_attention_mask=None,
                attention_mask=None, use_audio_in_video=False):
        """(inputs_embeds ``[B, S, H]``, positions ``[3, B, S]``, rope deltas ``[B, 1]``, attention mask or None,
        DeepStack or None)."""
        ids = _np(input_ids, np.int64)
        if ids.ndim == 1:
            ids = ids[None]
        attn = np.ones_like(ids) if attention_mask is None else _np(attention_mask, np.int64).reshape(ids.shape)
        embeds, deepstack = self.get_input_embeddings(ids, pixel_values, image_grid_thw, pixel_values_videos,
                                                      video_grid_thw, input_features, feature_attention_mask)
        positions, deltas = self.get_rope_index(ids, image_grid_thw, video_grid_thw, attn, use_audio_in_video,
                                                feature_attention_mask, video_second_per_grid)
        mask = None
        if (attn == 0).any():  # padded batch: causal and key-not-padding
            s = ids.shape[1]
            causal = np.tril(np.ones((s, s), dtype=bool))
            mask = mx.array(causal[None, None] & (attn[:, None, None, :] == 1))
        return embeds, positions, deltas, mask, deepstack

    def __call__(self, input_ids, pixel_values=None, image_grid_thw=None, pixel_values_videos=None,
                 video_grid_thw=None, video_second_per_grid=None, input_features=None, feature_attention_mask=None,
                 attention_mask=None, use_audio_in_video=False, cache=None) -> mx.array:
        """Logits ``[B, S, vocab]`` for one full forward pass over processor outputs."""
        embeds, positions, _, mask, deepstack = self.prepare(
            input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw, video_second_per_grid,
            input_features, feature_attention_mask, attention_mask, use_audio_in_video)
        pos = positions[:, 0] if positions.shape[1] == 1 else positions
        return self.language_model(embeds, cache, pos, mask, deepstack=deepstack)

    def generate(self, max_new_tokens: int = 32, stop_token_ids=(), **inputs) -> list[int]:
        """Greedy decoding for one sequence (batch 1): prefill, then one token at a time at position
        ``previous max + 1`` on every axis (as transformers continues M-RoPE with the rope deltas)."""
        embeds, positions, _, _, deepstack = self.prepare(**inputs)
        if embeds.shape[0] != 1:
            raise ValueError("generate() takes one sequence (batch 1)")
        cache = self.make_cache()
        logits = self.language_model(embeds, cache, positions[:, 0], deepstack=deepstack)
        nxt = float(positions.max()) + 1
        out = []
        for _ in range(max_new_tokens):
            token = int(mx.argmax(logits[0, -1]).item())
            out.append(token)
            if token in stop_token_ids:
                break
            logits = self.language_model(self.language_model.embed(mx.array([[token]])), cache,
                                         np.array([nxt], dtype=np.float32))
            nxt += 1
        return out
