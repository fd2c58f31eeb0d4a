"""Qwen2.5-Omni thinker on PyTorch: transformers' ``Qwen2_5OmniThinkerForConditionalGeneration`` streamed unit by
unit through an :class:`~omnitide_mlx.torch.cache.OmniTorchCache`.

The unit layouts (token ids, spans, TMRoPE positions, which encoder output fills which placeholder) are the MLX
port's, from ``models/qwen2_5_omni/layout.py``; only the embeddings differ: here transformers' token embeddings,
vision encoder and audio encoder compute them. The numpy processor (tokenizer, patches, log-mel) is the MLX port's
too, so both backends feed their models the same numbers.

The language model runs with the ``"omnitide"`` attention implementation (the encoders keep SDPA), and every step
gets explicit 3-row TMRoPE ``position_ids`` taken from the units, so positions after an OmniPick eviction follow the
shift rule exactly as on MLX; transformers' ``rope_deltas`` bookkeeping is never used.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from ..models.loading import CheckpointError, load_config, resolve_model_path
from ..models.qwen2_5_omni.config import ModelConfig
from ..models.qwen2_5_omni.layout import QwenOmniLayout, kv_spec
from ..models.qwen2_5_omni.processor import Processor
from .cache import ATTENTION_NAME, register_attention

MODEL_TYPES = ("qwen2_5_omni", "qwen2_5_omni_thinker")
_DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class TorchQwenOmni:
    """A loaded thinker and what the engine asks of a model: ``config``, ``kv_spec()``, ``stream_adapter()``."""

    def __init__(self, thinker, config: ModelConfig):
        self.hf = thinker
        self.config = config

    @property
    def device(self) -> torch.device:
        return self.hf.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.hf.lm_head.weight.dtype

    def kv_spec(self):
        return kv_spec(self.config)

    def stream_adapter(self, processor, **kw) -> "TorchQwenOmniAdapter":
        return TorchQwenOmniAdapter(self, processor, **kw)

    @torch.no_grad()
    def step_logits(self, embeds: torch.Tensor, positions: np.ndarray, cache) -> torch.Tensor:
        """Prefill ``embeds`` ``[T, hidden]`` at TMRoPE ``positions`` ``[3, T]`` through ``cache``; the last token's
        logits ``[vocab]`` (only that row goes through the LM head)."""
        pos = torch.as_tensor(np.asarray(positions, dtype=np.int64), device=self.device)
        if pos.ndim != 2 or pos.shape[0] != 3 or pos.shape[1] != embeds.shape[0]:
            raise ValueError(f"positions must be [3, {embeds.shape[0]}], got {tuple(pos.shape)}")
        out = self.hf.model.language_model(inputs_embeds=embeds[None], position_ids=pos[:, None, :], cache=cache,
                                           use_cache=True)
        return self.hf.lm_head(out.last_hidden_state[:, -1])[0]


class TorchQwenOmniEmbedder:
    """transformers' token embeddings and encoders of one thinker, for the unit layouts
    (``models/qwen2_5_omni/layout.py: QwenOmniEmbedder``)."""

    def __init__(self, model: TorchQwenOmni):
        self.model = model

    @torch.no_grad()
    def embed_tokens(self, ids) -> torch.Tensor:
        t = torch.as_tensor(np.asarray(ids, dtype=np.int64), device=self.model.device)
        return self.model.hf.get_input_embeddings()(t)

    @torch.no_grad()
    def vision_features(self, rows: np.ndarray, grid) -> torch.Tensor:
        hf = self.model.hf.model
        pixels = torch.as_tensor(rows, device=self.model.device).to(hf.visual.dtype)
        grid_thw = torch.as_tensor(np.asarray([grid], dtype=np.int64), device=self.model.device)
        out = hf.get_video_features(pixels, grid_thw, return_dict=True)
        return torch.cat(list(out.pooler_output), dim=0)

    @torch.no_grad()
    def audio_features(self, mel: np.ndarray) -> torch.Tensor:
        hf = self.model.hf.model
        feats = torch.as_tensor(mel[None], device=self.model.device).to(hf.audio_tower.dtype)
        mask = torch.ones(1, mel.shape[1], dtype=torch.long, device=self.model.device)
        return hf.get_audio_features(feats, mask, return_dict=True).last_hidden_state

    def scatter(self, embeds: torch.Tensor, slots: np.ndarray, feats: torch.Tensor) -> torch.Tensor:
        if feats.shape[0] != slots.size:
            raise ValueError(f"{slots.size} placeholder tokens but the encoder gave {feats.shape[0]} embeddings")
        out = embeds.clone()
        out[torch.as_tensor(slots, device=embeds.device)] = feats.to(embeds.dtype)
        return out


class TorchQwenOmniAdapter(QwenOmniLayout):
    """The unit layouts of :class:`~omnitide_mlx.models.qwen2_5_omni.layout.QwenOmniLayout` with a
    :class:`TorchQwenOmniEmbedder` (transformers' embeddings and encoders)."""

    def __init__(self, model: TorchQwenOmni, processor, **kw):
        super().__init__(model, processor, TorchQwenOmniEmbedder(model), **kw)


def _thinker_config(path: Path, config: dict):
    from transformers import AutoConfig, Qwen2_5OmniThinkerConfig

    if config.get("model_type") == "qwen2_5_omni":
        if not isinstance(config.get("thinker_config"), dict):
            raise CheckpointError(f"{path}/config.json: a qwen2_5_omni config without thinker_config")
        return Qwen2_5OmniThinkerConfig.from_dict(config["thinker_config"])
    return AutoConfig.from_pretrained(path)


def default_dtype(device, config: dict) -> torch.dtype:
    """float32 on the CPU; the checkpoint's dtype on an accelerator (bfloat16 for the released models)."""
    if torch.device(device).type == "cpu":
        return torch.float32
    thinker = config.get("thinker_config", config)
    name = thinker.get("torch_dtype") or config.get("torch_dtype") or "bfloat16"
    return _DTYPE_NAMES.get(str(name), torch.bfloat16)


def load(path_or_id: str | os.PathLike, device="cpu", dtype: torch.dtype | str | None = None,
         encoder_attention: str = "sdpa", **processor_kw) -> tuple[TorchQwenOmni, Processor]:
    """Load a Qwen2.5-Omni checkpoint (local folder or Hugging Face id through the local cache) with transformers:
    the thinker only (``thinker.`` names of a released checkpoint are handled by transformers; talker and token2wav
    weights are skipped), safetensors only; and the numpy processor. Returns ``(model, processor)``."""
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    path = resolve_model_path(path_or_id)
    config = load_config(path)
    if config.get("model_type") not in MODEL_TYPES:
        raise CheckpointError(f"{path}: the PyTorch path runs Qwen2.5-Omni ({', '.join(MODEL_TYPES)}); this "
                              f"checkpoint's model_type is {config.get('model_type')!r}")
    if config.get("omnitide_converted"):
        raise CheckpointError(f"{path} holds MLX weights written by 'omnitide convert'; the PyTorch path needs the "
                              "original Hugging Face checkpoint")
    if not sorted(path.glob("*.safetensors")):
        raise CheckpointError(f"{path} holds no *.safetensors weights (pickle-based weights are never loaded)")
    device = torch.device(device)
    if isinstance(dtype, str):
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPE_NAMES)}, got {dtype!r}")
        dtype = _DTYPE_NAMES[dtype]
    dtype = dtype or default_dtype(device, config)
    register_attention()
    attn = {"text_config": ATTENTION_NAME, "vision_config": encoder_attention, "audio_config": encoder_attention,
            "": encoder_attention}
    thinker, info = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(
        path, config=_thinker_config(path, config), dtype=dtype, attn_implementation=attn, use_safetensors=True,
        output_loading_info=True)
    missing = sorted(info.get("missing_keys") or [])
    mismatched = info.get("mismatched_keys") or []
    if missing or mismatched:
        raise CheckpointError(f"the checkpoint in {path} does not match its config: missing {missing[:10]}, "
                              f"mis-shaped {list(mismatched)[:10]}")
    thinker = thinker.to(device).eval()
    return TorchQwenOmni(thinker, ModelConfig.from_dict(config)), Processor.from_pretrained(path, **processor_kw)
