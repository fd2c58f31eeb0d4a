"""A tiny MiniCPM-o 4.5 checkpoint in the released layout, for tests and CPU runs of the whole pipeline.

``make_tiny_checkpoint(dst)`` writes config.json (Hugging Face layout), model.safetensors with the official key
names and PyTorch layouts (``llm.`` / ``vpm.`` / ``apm.``, OIHW / OIK convolutions, the resampler's fused
``in_proj_weight``) and the real 151,748-entry tokenizer files, with an empty tokenizer.json as in the release.
Every parameter is drawn at random (norm gains 1 + 0.1 N, biases 0.02 N, the rest N / sqrt(fan_in)): default
inits (unit gains, zero biases, a zero resampler query) would hide bugs.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
from mlx.utils import tree_flatten

from .config import ModelConfig
from .model import Model

TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json", "added_tokens.json",
                   "special_tokens_map.json", "generation_config.json", "preprocessor_config.json")
_NORM = re.compile(r"(norm\d?|layernorm|ln_q|ln_kv|ln_post)\.weight$")


def default_tokenizer_dir() -> Path:
    """The real MiniCPM-o 4.5 tokenizer files vendored with the repository's tests."""
    return Path(__file__).resolve().parents[3] / "tests" / "data" / "tokenizers" / "minicpm-o-4_5"


def tiny_config(**overrides) -> dict:
    """config.json of a tiny model: the released structure, small sizes, the real vocabulary and query_num 64
    (the processor's placeholders always hold 64 image tokens)."""
    cfg = {
        "architectures": ["MiniCPMO"], "model_type": "minicpmo",
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6, "vocab_size": 151748,
        "rope_theta": 1000000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "attention_bias": False, "hidden_act": "silu", "bos_token_id": 151643, "eos_token_id": [151645, 151643],
        "query_num": 64, "image_size": 448, "patch_size": 14, "drop_vision_last_layer": False,
        "vision_batch_size": 16, "audio_pool_step": 5, "audio_chunk_length": 1.0, "stream_input": False,
        "init_vision": True, "init_audio": True, "init_tts": False, "use_image_id": True, "slice_mode": True,
        "slice_config": {"max_slice_nums": 9, "patch_size": 14, "scale_resolution": 448, "model_type": "minicpmv"},
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 48, "intermediate_size": 96,
                          "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 70, "patch_size": 14,
                          "layer_norm_eps": 1e-6},
        "audio_config": {"model_type": "whisper", "d_model": 32, "encoder_layers": 2, "encoder_attention_heads": 4,
                         "encoder_ffn_dim": 128, "num_mel_bins": 80, "max_source_positions": 1500},
        "torch_dtype": "float32",
    }
    for k, v in overrides.items():
        if isinstance(v, dict) and isinstance(cfg.get(k), dict):
            cfg[k] = {**cfg[k], **v}
        else:
            cfg[k] = v
    return cfg


def random_weights(model: Model, seed: int) -> dict[str, np.ndarray]:
    """Every parameter of ``model`` re-drawn (MLX names and layouts), float32."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, p in tree_flatten(model.parameters()):
        shape = tuple(p.shape)
        if _NORM.search(name):
            a = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
        elif name.endswith("bias"):
            a = 0.02 * rng.standard_normal(shape, dtype=np.float32)
        else:
            a = rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[-1]))
        out[name] = a.astype(np.float32)
    return out


def to_official_layout(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """MLX names and layouts -> the released checkpoint's (the inverse of ``Model.sanitize``)."""
    out = {}
    for k, v in weights.items():
        if k == "vision_tower.embeddings.patch_embedding.weight":
            v = v.transpose(0, 3, 1, 2)  # OHWI -> OIHW
        elif k in ("audio_tower.conv1.weight", "audio_tower.conv2.weight"):
            v = v.transpose(0, 2, 1)  # OKI -> OIK
        k = re.sub(r"^language_model\.", "llm.", k)
        k = re.sub(r"^vision_tower\.", "vpm.", k)
        k = re.sub(r"^audio_tower\.", "apm.", k)
        out[k] = np.ascontiguousarray(v)
    return out


def make_tiny_checkpoint(dst: str | Path, seed: int = 0, tokenizer_dir: str | Path | None = None,
                         **config_overrides) -> Path:
    """Write a tiny random MiniCPM-o 4.5 checkpoint folder at ``dst`` (created); returns its path.

    ``config_overrides`` replace top-level config.json fields (dicts are merged), e.g. ``vocab_size=512`` for a
    model without the tokenizer's vocabulary or ``vision_config={"num_hidden_layers": 3}``.
    """
    from safetensors.numpy import save_file

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(**config_overrides)
    model = Model(ModelConfig.from_dict(cfg))
    weights = to_official_layout(random_weights(model, seed))
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    src = Path(tokenizer_dir) if tokenizer_dir is not None else default_tokenizer_dir()
    missing = [f for f in TOKENIZER_FILES if not (src / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{src} lacks the tokenizer files {', '.join(missing)}; pass tokenizer_dir= "
                                "(a folder with the MiniCPM-o 4.5 vocab.json, merges.txt, tokenizer_config.json...)")
    for f in TOKENIZER_FILES:
        shutil.copy2(src / f, dst / f)
    (dst / "tokenizer.json").write_bytes(b"")  # empty, as in the released checkpoint: rebuilt on load
    return dst
