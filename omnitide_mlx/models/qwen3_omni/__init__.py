"""Qwen3-Omni thinker (30B-A3B Instruct / Thinking / Captioner layouts) on MLX:
``load_model(path, config) -> (Model, Processor)``.

The config, processor and M-RoPE positions are numpy-only; ``Model`` and ``load_model`` pull MLX in when first used.
The port is self-contained in this folder; family.py is the record that registers it with the engine
(docs/models/qwen3_omni.md, "The family record").
"""

from __future__ import annotations

import importlib
from pathlib import Path

from .config import ModelConfig
from .processor import Processor

__all__ = ["Model", "ModelConfig", "Processor", "load", "load_model"]

_LAZY = {"Model": ".model"}


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_model(path: Path, config: dict, *, dtype=None, **kwargs):
    """Build the thinker from ``config`` (config.json as a dict), load the folder's safetensors weights (talker and
    code2wav weights are skipped) and the processor. ``dtype`` (an ``mx.Dtype``) casts floating weights after
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
    model.checkpoint_path = path
    return model, Processor.from_pretrained(path, **kwargs)


def load(path_or_id, *, revision: str | None = None, dtype=None, **kwargs):
    """A local folder or a Hub id (through the local Hugging Face cache; safetensors only, no remote code) ->
    (Model, Processor), as ``omnitide_mlx.load`` gives for a Qwen3-Omni checkpoint; a config of another family is
    refused before any weight is read."""
    from ..loading import CheckpointError, load_config, resolve_model_path

    path = resolve_model_path(path_or_id, revision)
    config = load_config(path)
    if config.get("model_type") not in ("qwen3_omni_moe", "qwen3_omni_moe_thinker"):
        raise CheckpointError(f"{path} holds a {config.get('model_type')!r} model, not Qwen3-Omni")
    return load_model(path, config, dtype=dtype, **kwargs)
