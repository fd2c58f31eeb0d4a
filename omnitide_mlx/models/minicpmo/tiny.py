"""A tiny MiniCPM-o 4.5 checkpoint in the released layout, for tests and CPU runs of the whole pipeline.

``make_tiny_checkpoint(dst)`` writes config.json (Hugging Face layout), model.safetensors with the official key
names and PyTorch layouts (``llm.`` / ``vpm.`` / ``apm.``, OIHW / OIK convolutions, the resampler's fused
``in_proj_weight``) and the real 151,748-entry tokenizer files, with an empty tokenizer.json as in the release.
Every parameter is drawn at random (norm gains 1 + 0.1 N, biases 0.02 N, the rest N / sqrt(fan_in)): default
inits (unit gains, zero biases, a zero resampler query) would hide bugs.

``tts=True`` adds the speech-output TTS: ``init_tts`` true, a tiny ``tts_config`` (``tiny_tts_config``) and random
``tts.*`` weights in the official layout: ``head_code.N`` as weight_norm ``parametrizations.weight.original0`` (g,
[V, 1]) / ``original1`` (v), the unused ``model.embed_tokens`` (LlamaConfig's 32000 rows) and ``projector_spk``.
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


def tiny_tts_config(llm_dim: int = 128, **overrides) -> dict:
    """``tts_config`` of a tiny TTS: the released structure and special ids (6562 audio tokens, 152064 text tokens,
    audio_bos 151687, text_eos 151692, hidden_text_merge with normalised projections), small sizes."""
    cfg = {"llm_dim": llm_dim, "llm_intermediate_size": 64, "projector_type": "mlp", "hidden_act": "silu",
           "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
           "num_key_value_heads": 2, "max_position_embeddings": 4096, "num_audio_tokens": 6562,
           "num_text_tokens": 152064, "num_vq": 1, "audio_bos_token_id": 151687, "text_eos_token_id": 151692,
           "condition_type": "hidden_text_merge", "backbone_model": "llama", "normalize_projected_hidden": True,
           "attention_type": "sliding_recompute", "recomputed_chunks": 1, "window_size": 2,
           "streaming_sliding_window_audio_window_size": 300, "top_p": 0.85, "top_k": 25,
           "repetition_penalty": 1.05}
    cfg.update(overrides)
    return cfg


def random_tts_weights(tts_config: dict, seed: int, eos_gain: float = 1.0) -> dict[str, np.ndarray]:
    """Random ``tts.*`` weights in the official layout (weight_norm unmaterialised, the unused keys included).
    ``eos_gain`` multiplies the audio-eos row's weight_norm gain: random weights almost never pick the eos, so each
    text chunk would run to the 500-token cap; a larger gain ends chunks after a few dozen tokens as a trained TTS
    does (about 25 a chunk)."""
    from .tts import MiniCPMTTS, TTSArgs

    args = TTSArgs.from_dict(tts_config)
    rng = np.random.default_rng(seed)
    mlx_names = random_weights(MiniCPMTTS(args), seed + 1)
    out = {}
    for k, v in mlx_names.items():
        m = re.fullmatch(r"head_code\.(\d+)\.weight", k)
        if m:
            out[f"tts.head_code.{m.group(1)}.parametrizations.weight.original0"] = \
                (0.5 + np.abs(rng.standard_normal((v.shape[0], 1)))).astype(np.float32)
            out[f"tts.head_code.{m.group(1)}.parametrizations.weight.original0"][args.eos_token_id] *= eos_gain
            out[f"tts.head_code.{m.group(1)}.parametrizations.weight.original1"] = v
        else:
            out[f"tts.{k}"] = v
    h, d = args.hidden_size, args.llm_dim
    out["tts.model.embed_tokens.weight"] = (rng.standard_normal((32000, h)) / np.sqrt(h)).astype(np.float32)
    for name, shape in (("linear1.weight", (h, d)), ("linear1.bias", (h,)), ("linear2.weight", (h, h)),
                        ("linear2.bias", (h,))):
        scale = 0.02 if name.endswith("bias") else 1 / np.sqrt(shape[-1])
        out[f"tts.projector_spk.{name}"] = (scale * rng.standard_normal(shape)).astype(np.float32)
    return out


def random_weights(model, seed: int) -> dict[str, np.ndarray]:
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


LISTEN_ID, TURN_EOS_ID, CHUNK_EOS_ID = 151705, 151717, 151718  # <|listen|>, <|turn_eos|>, <|chunk_eos|>


def bias_for_duplex(weights: dict[str, np.ndarray], listen: float = 7.0, turn_eos: float = 9.0,
                    chunk_eos: float = 5.0, turn_eos_embed: float = 50.0, coupling: float = 0.5) -> None:
    """Bias random weights (official names, in place) so that a duplex session takes every path: the lm_head rows
    of ``<|listen|>``, ``<|turn_eos|>`` and ``<|chunk_eos|>`` are scaled (each then wins the argmax for some
    inputs), and ``<|turn_eos|>``'s embedding is scaled so that its final hidden state is close to the direction
    ``norm.weight * embedding``, which is added to ``<|chunk_eos|>``'s row: a turn_eos is then often followed by
    the unit's end, as a trained model does. Values picked on seed 6 (tests/models/minicpmo/test_duplex.py)."""
    head, emb = weights["llm.lm_head.weight"], weights["llm.model.embed_tokens.weight"]
    direction = weights["llm.model.norm.weight"] * emb[TURN_EOS_ID]
    head[LISTEN_ID] *= np.float32(listen)
    head[TURN_EOS_ID] *= np.float32(turn_eos)
    head[CHUNK_EOS_ID] *= np.float32(chunk_eos)
    head[CHUNK_EOS_ID] += (np.float32(coupling) * direction / np.linalg.norm(direction)).astype(np.float32)
    emb[TURN_EOS_ID] *= np.float32(turn_eos_embed)


def make_tiny_checkpoint(dst: str | Path, seed: int = 0, tokenizer_dir: str | Path | None = None,
                         tts: bool = False, duplex_bias: bool = False, token2wav_layout: str = "1.0.7",
                         **config_overrides) -> Path:
    """Write a tiny random MiniCPM-o 4.5 checkpoint folder at ``dst`` (created); returns its path.

    ``tts``: with the TTS and an ``assets/token2wav`` folder in the ``token2wav_layout`` ("1.0.7": causal vocoder +
    ``config.yaml``; "1.0.6": the original HiFT, as the released checkpoint ships it).

    ``config_overrides`` replace top-level config.json fields (dicts are merged), e.g. ``vocab_size=512`` for a
    model without the tokenizer's vocabulary or ``vision_config={"num_hidden_layers": 3}``. ``duplex_bias``: random
    weights almost never pick a control token such as ``<|listen|>``; ``bias_for_duplex`` raises them so that a
    duplex session both listens and speaks.
    """
    from safetensors.numpy import save_file

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    if tts:
        config_overrides = {"init_tts": True, **config_overrides}
        config_overrides.setdefault("tts_config", tiny_tts_config(
            llm_dim=config_overrides.get("hidden_size", tiny_config()["hidden_size"])))
    cfg = tiny_config(**config_overrides)
    model = Model(ModelConfig.from_dict(cfg))
    weights = to_official_layout(random_weights(model, seed))
    if duplex_bias:
        bias_for_duplex(weights)
    if tts:
        weights.update(random_tts_weights(cfg["tts_config"], seed + 7, eos_gain=5.0))  # chunks of ~25-100 tokens
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
    if tts:  # and the token2wav folder the TTS speaks through, where the released checkpoint keeps it
        from ..stepaudio2.tiny import write_tiny_token2wav
        from .speech import TOKEN2WAV_DIR

        write_tiny_token2wav(dst / TOKEN2WAV_DIR, seed=seed + 11, layout=token2wav_layout)
    return dst
