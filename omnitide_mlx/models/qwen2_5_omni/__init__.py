"""Qwen2.5-Omni thinker (3B, 7B) on MLX: ``load_model(path, config) -> (Model, Processor)``.

Imports are lazy: the config, processor, TMRoPE positions and unit layouts (layout.py) are numpy-only and are
shared with the PyTorch path, which must never import MLX; ``Model``, ``QwenOmniAdapter`` and ``load_model`` pull
MLX in when first used.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from .config import ModelConfig
from .processor import DEFAULT_SYSTEM_PROMPT, Processor

__all__ = ["DEFAULT_SYSTEM_PROMPT", "Model", "ModelConfig", "Processor", "QwenOmniAdapter", "load_model"]

_LAZY = {"Model": ".model", "QwenOmniAdapter": ".adapter"}


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_model(path: Path, config: dict, *, dtype=None, **kwargs):
    """Build the thinker from ``config`` (config.json as a dict), load the folder's safetensors weights (talker
    and token2wav weights are skipped) and the processor. ``dtype`` (an ``mx.Dtype``) casts floating weights after
    loading."""
    import mlx.core as mx

    from ..loading import apply_quantization, load_safetensors, load_weights_strict
    from .model import Model

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
    model.checkpoint_path = path  # the talker, token2wav and voices load from here on the first spoken reply
    return model, Processor.from_pretrained(path, **kwargs)
