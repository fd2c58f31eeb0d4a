"""Qwen2.5-Omni thinker (3B, 7B) on MLX: ``load_model(path, config) -> (Model, Processor)``."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from ..loading import apply_quantization, load_safetensors, load_weights_strict
from .adapter import QwenOmniAdapter
from .config import ModelConfig
from .model import Model
from .processor import DEFAULT_SYSTEM_PROMPT, Processor

__all__ = ["DEFAULT_SYSTEM_PROMPT", "Model", "ModelConfig", "Processor", "QwenOmniAdapter", "load_model"]


def load_model(path: Path, config: dict, *, dtype: mx.Dtype | None = None, **kwargs):
    """Build the thinker from ``config`` (config.json as a dict), load the folder's safetensors weights (talker
    and token2wav weights are skipped) and the processor. ``dtype`` casts floating weights after loading."""
    path = Path(path)
    model = Model(ModelConfig.from_dict(config))
    weights = load_safetensors(path)
    if not config.get("omnitide_converted"):
        weights = model.sanitize(weights)
    apply_quantization(model, config, weights)
    load_weights_strict(model, weights, what=f"checkpoint in {path}")
    if dtype is not None:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    model.eval()
    return model, Processor.from_pretrained(path, **kwargs)
