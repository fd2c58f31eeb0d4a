"""Random tiny Qwen3-Omni checkpoints in the released on-disk layout, for tests and demos without weights.

``make_tiny_checkpoint`` writes what a Hub download of ``Qwen/Qwen3-Omni-30B-A3B-Instruct`` looks like, only small:
the released config.json layout (``model_type`` "qwen3_omni_moe", the thinker under ``thinker_config`` with 4.x
``rope_scaling`` {interleaved, mrope_interleaved, mrope_section} + ``rope_theta``, ``talker_config`` and
``code2wav_config`` beside it), ``model.safetensors`` with every thinker tensor under its released name (per-expert
``mlp.experts.E.{gate,up,down}_proj.weight``, ``visual.merger_list.K``, ``audio_tower.conv2d1`` ...), a complete
tiny talker, code predictor and Code2Wav (``talker.*``, ``code2wav.*``, which the thinker ignores), the Qwen2 BPE files with the Qwen3-Omni special tokens
and ``preprocessor_config.json``.

Every parameter is drawn at random so that no bug hides behind a default: weights N(0, 1/fan_in), biases
N(0, 0.2), norm weights 1 + N(0, 0.2), embeddings and the vision position table N(0, 1), routers N(0, 1/fan_in)
scaled up x4 so that the top-k choice is decisive (no near-ties that float rounding could flip). transformers
loads the same folder, which makes it the common input of the parity tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .config import ModelConfig

TINY_BASE = 1000  # tiny special ids: real - 151643 + 1000
TINY_VOCAB = 1040
REAL_BASE = 151643

# Qwen3-Omni's added tokens, in id order from 151643 (the released tokenizer_config.json's added_tokens_decoder).
SPECIAL_TOKENS: list[tuple[str, bool]] = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False), ("<|audio_start|>", True), ("<|audio_end|>", True),
    ("<tts_pad>", True), ("<tts_text_bos>", True), ("<tts_text_eod>", True), ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
]


# role words that are single tokens in the real vocabulary but split in the tiny one: added after the specials
TINY_ROLES = {"assistant": TINY_BASE + len(SPECIAL_TOKENS), "system": TINY_BASE + len(SPECIAL_TOKENS) + 1}


def special_ids(base: int) -> dict[str, int]:
    return {c: base + i for i, (c, _) in enumerate(SPECIAL_TOKENS)}


def tiny_config(*, text_layers: int = 3, vision_depth: int = 3, audio_layers: int = 2, num_experts: int = 8,
                top_k: int = 2, mlp_only_layers=(1,), deepstack=(0, 1), vocab: str = "tiny") -> dict:
    """The released full-model config.json with a tiny thinker (and tiny talker / code2wav sections).

    Defaults: 3 text layers (layer 1 dense through ``mlp_only_layers``), 8 experts with 2 active, head_dim 16 with
    ``mrope_section`` [4, 2, 2] (t h w t h w, then a t-only tail, like the released [24, 20, 20]), a 3-block vision
    tower with DeepStack after blocks 0 and 1, and a 2-layer AuT whose attention windows hold 4 chunks (52 tokens)."""
    base = TINY_BASE if vocab == "tiny" else REAL_BASE
    vocab_size = TINY_VOCAB if vocab == "tiny" else 152064
    ids = special_ids(base)
    text = {
        "attention_bias": False, "attention_dropout": 0.0, "decoder_sparse_step": 1, "head_dim": 16,
        "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96,
        "max_position_embeddings": 65536, "mlp_only_layers": list(mlp_only_layers), "model_type": "qwen3_omni_moe_text",
        "moe_intermediate_size": 32, "norm_topk_prob": True, "num_attention_heads": 4, "num_experts": num_experts,
        "num_experts_per_tok": top_k, "num_hidden_layers": text_layers, "num_key_value_heads": 2,
        "output_router_logits": False, "rms_norm_eps": 1e-06,
        "rope_scaling": {"interleaved": True, "mrope_interleaved": True, "mrope_section": [4, 2, 2],
                         "rope_type": "default"},
        "rope_theta": 1000000, "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 0,
        "sliding_window": None, "use_cache": True, "use_qk_norm": True, "use_sliding_window": False,
        "vocab_size": vocab_size,
    }
    vision = {
        "apply_vit_abs_pos_embed": True, "deepstack_visual_indexes": list(deepstack), "depth": vision_depth,
        "hidden_act": "gelu_pytorch_tanh", "hidden_size": 32, "image_size": 128, "in_channels": 3, "in_chans": 3,
        "initializer_range": 0.02, "intermediate_size": 64, "model_type": "qwen3_omni_moe_vision_encoder",
        "num_heads": 2, "num_position_embeddings": 64, "out_hidden_size": 64, "patch_size": 16,
        "spatial_merge_size": 2, "spatial_patch_size": 16, "temporal_patch_size": 2, "tokens_per_second": 2,
    }
    audio = {
        "activation_dropout": 0, "activation_function": "gelu", "attention_dropout": 0, "conv_chunksize": 500,
        "d_model": 32, "dropout": 0, "downsample_hidden_size": 16, "encoder_attention_heads": 2,
        "encoder_ffn_dim": 64, "encoder_layers": audio_layers, "initializer_range": 0.02,
        "max_source_positions": 1500, "model_type": "qwen3_omni_moe_audio_encoder", "n_window": 50,
        "n_window_infer": 400, "num_hidden_layers": audio_layers, "num_mel_bins": 128, "output_dim": 64,
        "scale_embedding": False,
    }
    thinker = {
        "audio_config": audio, "audio_end_token_id": ids["<|audio_end|>"],
        "audio_start_token_id": ids["<|audio_start|>"], "audio_token_id": ids["<|audio_pad|>"], "dtype": "float32",
        "image_token_id": ids["<|image_pad|>"], "initializer_range": 0.02, "model_type": "qwen3_omni_moe_thinker",
        "position_id_per_seconds": 13, "seconds_per_chunk": 2, "text_config": text, "user_token_id": 872,
        "video_token_id": ids["<|video_pad|>"], "vision_config": vision,
        "vision_end_token_id": ids["<|vision_end|>"], "vision_start_token_id": ids["<|vision_start|>"],
    }
    talker = {  # the released talker_config's fields, tiny: codebook-0 codes are 0..31 (= Code2Wav's codebook),
        # the top 1,024 codec ids are the specials (transformers suppresses them all but codec_eos)
        "accept_hidden_layer": 2, "audio_end_token_id": ids["<|audio_end|>"],
        "audio_start_token_id": ids["<|audio_start|>"], "audio_token_id": ids["<|audio_pad|>"],
        "codec_bos_id": 1041, "codec_eos_token_id": 1042, "codec_nothink_id": 1043, "codec_pad_id": 1040,
        "codec_think_bos_id": 1044, "codec_think_eos_id": 1045, "image_token_id": ids["<|image_pad|>"],
        "model_type": "qwen3_omni_moe_talker", "num_code_groups": 4, "output_router_logits": False,
        "position_id_per_seconds": 13, "seconds_per_chunk": 2,
        "speaker_id": {"chelsie": 1046, "ethan": 1047, "aiden": 1048}, "spatial_merge_size": 2,
        "thinker_hidden_size": 64, "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "code_predictor_config": {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
                                  "num_hidden_layers": 2, "num_key_value_heads": 1, "head_dim": 16,
                                  "vocab_size": 32, "num_code_groups": 4, "rms_norm_eps": 1e-06,
                                  "rope_theta": 1000000, "sliding_window": None, "use_sliding_window": False,
                                  "model_type": "qwen3_omni_moe_talker_code_predictor"},
        "text_config": {"hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16, "num_experts": 4,
                        "num_experts_per_tok": 2, "norm_topk_prob": False, "num_attention_heads": 2,
                        "num_hidden_layers": 2, "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 1056,
                        "shared_expert_intermediate_size": 32, "rms_norm_eps": 1e-06, "rope_theta": 1000000,
                        "rope_scaling": {"interleaved": True, "mrope_interleaved": True, "mrope_section": [4, 2, 2],
                                         "rope_type": "default"},
                        "sliding_window": None, "use_sliding_window": False, "hidden_act": "silu",
                        "model_type": "qwen3_omni_moe_talker_text", "decoder_sparse_step": 1,
                        "mlp_only_layers": []},
    }
    code2wav = {"codebook_size": 32, "decoder_dim": 32, "hidden_size": 32, "intermediate_size": 64,
                "num_attention_heads": 2, "num_hidden_layers": 2, "num_key_value_heads": 2, "num_quantizers": 4,
                "sliding_window": 8, "upsample_rates": [2, 3], "upsampling_ratios": [2, 2], "rms_norm_eps": 1e-05,
                "layer_scale_initial_scale": 0.01, "max_position_embeddings": 8000, "attention_bias": False,
                "hidden_act": "silu", "model_type": "qwen3_omni_moe_code2wav"}
    # the role tokens after <|im_start|>: one token each, as in the released vocabulary (the tiny one adds
    # "assistant" and "system" as tokens: transformers' talker prompt takes <|im_start|>assistant\n as 3 tokens)
    assistant, system = (TINY_ROLES["assistant"], TINY_ROLES["system"]) if vocab == "tiny" else (77091, 8948)
    return {"architectures": ["Qwen3OmniMoeForConditionalGeneration"], "assistant_token_id": assistant,
            "code2wav_config": code2wav, "enable_audio_output": True, "im_end_token_id": ids["<|im_end|>"],
            "im_start_token_id": ids["<|im_start|>"], "model_type": "qwen3_omni_moe", "system_token_id": system,
            "talker_config": talker, "thinker_config": thinker, "transformers_version": "4.57.0.dev0",
            "tts_bos_token_id": ids["<tts_text_bos>"], "tts_eos_token_id": ids["<tts_text_eod>"],
            "tts_pad_token_id": ids["<tts_pad>"], "user_token_id": 872}


def thinker_weight_shapes(thinker: dict) -> dict[str, tuple[int, ...]]:
    """Every thinker tensor of a released checkpoint (names without ``thinker.``) and its HF shape."""
    from .audio import hf_audio_shapes  # noqa: PLC0415 (these two modules import MLX)
    from .vision import hf_vision_shapes  # noqa: PLC0415

    c = ModelConfig.from_dict(thinker)
    t = c.text_config
    s: dict[str, tuple[int, ...]] = {}
    h, hd = t.hidden_size, t.head_dim
    q, kv = t.num_attention_heads * hd, t.num_key_value_heads * hd
    s["model.embed_tokens.weight"] = (t.vocab_size, h)
    for i in range(t.num_hidden_layers):
        p = f"model.layers.{i}."
        s[p + "input_layernorm.weight"] = s[p + "post_attention_layernorm.weight"] = (h,)
        for name, out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            s[p + f"self_attn.{name}.weight"] = (out, h)
            if t.attention_bias:
                s[p + f"self_attn.{name}.bias"] = (out,)
        s[p + "self_attn.o_proj.weight"] = (h, q)
        s[p + "self_attn.q_norm.weight"] = s[p + "self_attn.k_norm.weight"] = (hd,)
        if t.is_sparse(i):
            s[p + "mlp.gate.weight"] = (t.num_experts, h)
            for e in range(t.num_experts):
                s[p + f"mlp.experts.{e}.gate_proj.weight"] = (t.moe_intermediate_size, h)
                s[p + f"mlp.experts.{e}.up_proj.weight"] = (t.moe_intermediate_size, h)
                s[p + f"mlp.experts.{e}.down_proj.weight"] = (h, t.moe_intermediate_size)
        else:
            s[p + "mlp.gate_proj.weight"] = s[p + "mlp.up_proj.weight"] = (t.intermediate_size, h)
            s[p + "mlp.down_proj.weight"] = (h, t.intermediate_size)
    s["model.norm.weight"] = (h,)
    if not c.tie_word_embeddings:
        s["lm_head.weight"] = (t.vocab_size, h)
    s.update({"visual." + k: v for k, v in hf_vision_shapes(c.vision_config).items()})
    s.update({"audio_tower." + k: v for k, v in hf_audio_shapes(c.audio_config).items()})
    return s


def draw(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """One random parameter (see the module docstring)."""
    is_norm = any(k in name for k in ("norm", "ln_q", "ln_post"))
    if "embed_tokens" in name or "pos_embed" in name:
        x = rng.standard_normal(shape)
    elif name.endswith("bias"):
        x = 0.2 * rng.standard_normal(shape)
    elif is_norm:
        x = 1.0 + 0.2 * rng.standard_normal(shape)
    else:
        x = rng.standard_normal(shape) / np.sqrt(int(np.prod(shape[1:])))
        if name.endswith("mlp.gate.weight"):
            x *= 4.0
    return x.astype(np.float32)


def talker_tensors(talker: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Every ``talker.*`` tensor (per-expert, as released), drawn as :func:`draw` draws the thinker's."""
    from .talker import TalkerConfig, hf_talker_shapes  # noqa: PLC0415

    return {"talker." + k: draw(k, shape, rng)
            for k, shape in hf_talker_shapes(TalkerConfig.from_dict(talker)).items()}


CODE2WAV_DECODER_GAIN = 0.5  # the random decoder's convs: at 1.0, 96 % of samples saturate at +-1; at 0.5, none


def code2wav_tensors(code2wav: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Every ``code2wav.*`` tensor, random: as :func:`draw`, SnakeBeta log-parameters N(0, 0.2), LayerScales and
    ConvNeXt gammas 0.5 (1 + N(0, 0.2)) so that every residual branch matters (released init: 0.01 and 1e-6)."""
    from .code2wav import Code2WavConfig, hf_code2wav_shapes  # noqa: PLC0415

    out = {}
    for k, shape in hf_code2wav_shapes(Code2WavConfig.from_dict(code2wav)).items():
        last = k.rsplit(".", 1)[-1]
        if last in ("alpha", "beta"):
            x = 0.2 * rng.standard_normal(shape)
        elif last in ("scale", "gamma"):
            x = 0.5 * (1 + 0.2 * rng.standard_normal(shape))
        else:
            x = draw(k, shape, rng)
            if k.startswith("decoder.") and last == "weight":
                x = x * CODE2WAV_DECODER_GAIN
        out["code2wav." + k] = np.asarray(x, dtype=np.float32)
    return out


def write_tokenizer(dst: Path, tokenizer_dir: Path, vocab: str = "tiny") -> None:
    """Qwen2 BPE files (the first 1000 tokens and the merges among them, or all) and the Qwen3-Omni special tokens
    in ``tokenizer_config.json``."""
    from ..qwen2_5_omni.processor import read_bpe_files  # noqa: PLC0415

    full_vocab, merges = read_bpe_files(Path(tokenizer_dir))
    if vocab == "tiny":
        kept = {tok: i for tok, i in full_vocab.items() if i < TINY_BASE}
        merges = [(a, b) for a, b in merges if a in kept and b in kept and a + b in kept]
        full_vocab, base = kept, TINY_BASE
    else:
        base = max(full_vocab.values()) + 1
    with open(dst / "vocab.json", "w", encoding="utf-8") as f:
        json.dump(full_vocab, f, ensure_ascii=False)
    with open(dst / "merges.txt", "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    tokens = SPECIAL_TOKENS + ([(w, False) for w in TINY_ROLES] if vocab == "tiny" else [])
    added = {str(base + i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                             "single_word": False, "special": special}
             for i, (c, special) in enumerate(tokens)}
    cfg = {"add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added, "bos_token": None,
           "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None, "errors": "replace",
           "model_max_length": 131072, "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer",
           "image_token": "<|image_pad|>", "audio_token": "<|audio_pad|>", "video_token": "<|video_pad|>",
           "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
           "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>"}
    with open(dst / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)


PREPROCESSOR_CONFIG = {  # the released preprocessor_config.json's fields
    "processor_class": "Qwen3OmniMoeProcessor", "image_processor_type": "Qwen2VLImageProcessor",
    "feature_extractor_type": "WhisperFeatureExtractor", "min_pixels": 3136, "max_pixels": 12845056,
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True, "do_normalize": True, "do_rescale": True,
    "do_resize": True, "rescale_factor": 0.00392156862745098, "resample": 3, "feature_size": 128,
    "sampling_rate": 16000, "n_fft": 400, "hop_length": 160, "chunk_length": 300, "n_samples": 4800000,
    "nb_max_frames": 30000, "dither": 0.0, "padding_side": "right", "padding_value": 0.0,
    "return_attention_mask": True,
}


def make_tiny_checkpoint(dst, *, tokenizer_dir, seed: int = 0, prefix: bool = True, extra_keys: bool = True,
                         speech: bool = True, **sizes) -> Path:
    """Write a random tiny Qwen3-Omni checkpoint to ``dst`` (a folder) and return its path.

    ``tokenizer_dir``: a folder with the Qwen2 ``vocab.json`` + ``merges.txt`` (tests/data/tokenizers/qwen2).
    ``prefix`` / ``extra_keys``: the released layout (``thinker.`` names, every talker and code2wav tensor); turn
    them off for a bare-thinker checkpoint. ``speech=False``: the -Thinking layout (no talker_config /
    code2wav_config, ``enable_audio_output`` false, no talker or code2wav tensors). ``sizes``: the keywords of
    :func:`tiny_config`."""
    from safetensors.numpy import save_file  # noqa: PLC0415

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    config = tiny_config(**sizes)
    if not speech:
        config = {k: v for k, v in config.items() if k not in ("talker_config", "code2wav_config")}
        config["enable_audio_output"] = False
        extra_keys = False
    if not prefix:
        config = dict(config["thinker_config"], architectures=["Qwen3OmniMoeThinkerForConditionalGeneration"])
    rng = np.random.default_rng(seed)
    thinker = config.get("thinker_config", config)
    pre = "thinker." if prefix else ""
    tensors = {pre + k: draw(k, shape, rng) for k, shape in thinker_weight_shapes(thinker).items()}
    if prefix and extra_keys:
        tensors.update(talker_tensors(config["talker_config"], rng))
        tensors.update(code2wav_tensors(config["code2wav_config"], rng))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with open(dst / "config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    with open(dst / "preprocessor_config.json", "w", encoding="utf-8") as f:
        json.dump(PREPROCESSOR_CONFIG, f, indent=2)
    write_tokenizer(dst, Path(tokenizer_dir), vocab=sizes.get("vocab", "tiny"))
    return dst
