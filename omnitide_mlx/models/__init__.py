"""Model ports, one folder and one family record each (models/family.py). ``load(path_or_id)`` reads config.json
and hands the folder to the family whose record accepts its ``model_type``."""

from __future__ import annotations

import os
from pathlib import Path

from .loading import CheckpointError, load_config, resolve_model_path  # no MLX import at module level


def load(path_or_id: str | os.PathLike, **kwargs):
    """Load a model and its processor from a local folder or a Hugging Face id (through the local cache).

    Returns ``(model, processor)``. Raises ``CheckpointError`` with the reason when the folder is not a
    checkpoint of a supported model, or its weights do not match its config.
    """
    path = resolve_model_path(path_or_id, revision=kwargs.pop("revision", None))
    config = load_config(path)
    from .family import family_for_model_type, model_types

    model_type = config.get("model_type")
    family = family_for_model_type(model_type)
    if family is None:
        supported = ", ".join(sorted(model_types()))
        raise CheckpointError(f"{path}: model_type {model_type!r} is not supported (supported: {supported})")
    return family.load(Path(path), config, **kwargs)
