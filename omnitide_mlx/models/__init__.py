"""Model ports. ``load(path_or_id)`` reads config.json and hands the folder to the port for its ``model_type``."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from .loading import CheckpointError, load_config, resolve_model_path  # no MLX import at module level

# config.json "model_type" -> module with ``load_model(path, config, **kw) -> (model, processor)``
MODEL_TYPES: dict[str, str] = {
    "qwen2_5_omni": "omnitide_mlx.models.qwen2_5_omni",
    "qwen2_5_omni_thinker": "omnitide_mlx.models.qwen2_5_omni",
    "minicpmo": "omnitide_mlx.models.minicpmo",
}


def load(path_or_id: str | os.PathLike, **kwargs):
    """Load a model and its processor from a local folder or a Hugging Face id (through the local cache).

    Returns ``(model, processor)``. Raises ``CheckpointError`` with the reason when the folder is not a
    checkpoint of a supported model, or its weights do not match its config.
    """
    path = resolve_model_path(path_or_id, revision=kwargs.pop("revision", None))
    config = load_config(path)
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        supported = ", ".join(sorted(MODEL_TYPES))
        raise CheckpointError(f"{path}: model_type {model_type!r} is not supported (supported: {supported})")
    module = importlib.import_module(MODEL_TYPES[model_type])
    return module.load_model(Path(path), config, **kwargs)
