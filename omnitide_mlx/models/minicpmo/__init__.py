"""MiniCPM-o 4.5 (OpenBMB): Qwen3-8B LLM, SigLIP + resampler with image slices, streaming Whisper audio.

``load_model(path, config)`` is what ``omnitide_mlx.load`` calls for ``model_type`` "minicpmo": it reads the
official checkpoint layout (or a folder written by ``omnitide convert``) and returns ``(model, processor)``.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from ..loading import CheckpointError
from .config import ConfigError, ModelConfig
from .processor import MiniCPMOProcessor

__all__ = ["ConfigError", "MiniCPMOProcessor", "Model", "ModelConfig", "load_model"]


def __getattr__(name):  # MLX is imported when the model is first used: layout.py stays importable without it
    if name == "Model":
        value = importlib.import_module(".model", __name__).Model
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_model(path: Path, config: dict, dtype=None, lazy: bool = False, **_):
    """Build the model from ``config``, load and check every weight, and the processor from the same folder.

    ``dtype``: cast floating weights (e.g. ``mx.float32`` on CPU; default: as stored). Raises
    ``CheckpointError`` (the config does not describe a model this port runs, or the weights do not match it,
    with every missing / unexpected / mis-shaped key listed).
    """
    import mlx.core as mx

    from ..loading import apply_quantization, load_safetensors, load_weights_strict
    from .model import Model

    path = Path(path)
    cfg = ModelConfig.from_dict(config)
    weights = load_safetensors(path)
    if cfg.tts_config is not None and any(k.startswith("tts.") for k in weights):
        from .tts import TTSArgs

        cfg.tts = TTSArgs.from_dict(cfg.tts_config)  # speech output: model.tts (else model.require_tts() raises)
    else:  # no TTS asked for or none stored: any tts.* weights are not loaded
        weights = {k: v for k, v in weights.items() if not k.startswith("tts.")}
    model = Model(cfg)
    if not cfg.converted:
        weights = model.sanitize(weights)
    if dtype is not None:
        weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    apply_quantization(model, config, weights)
    load_weights_strict(model, weights, what=f"checkpoint in {path}")
    if not lazy:
        mx.eval(model.parameters())
    try:
        processor = MiniCPMOProcessor.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: the tokenizer / processor files do not load ({e})") from None
    if len(processor.tokenizer) > cfg.text.vocab_size:
        raise CheckpointError(f"{path}: the tokenizer has {len(processor.tokenizer)} tokens but vocab_size is "
                              f"{cfg.text.vocab_size}")
    model.eval()
    model.checkpoint_path = path  # token2wav and the voices load from here (assets/token2wav) on the first spoken reply
    return model, processor
