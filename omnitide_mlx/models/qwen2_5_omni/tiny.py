"""Random tiny Qwen2.5-Omni checkpoints in the released on-disk layout, for tests and demos without weights.

``make_tiny_checkpoint`` writes what a Hub download of Qwen2.5-Omni looks like, only small: a 4.x-style
config.json (``model_type`` "qwen2_5_omni", the thinker under ``thinker_config`` with ``rope_scaling`` +
``rope_theta``), ``model.safetensors`` with every thinker weight under ``thinker.`` plus some ``talker.`` and
``token2wav.`` weights the thinker must ignore, and the tokenizer files (``vocab.json``, ``merges.txt``,
``tokenizer_config.json`` with the special tokens) and ``preprocessor_config.json``.

Every parameter is drawn at random so that no bug hides behind a default: weights N(0, 1/fan_in), biases
N(0, 0.2), norm weights 1 + N(0, 0.2), embeddings N(0, 1). transformers loads the same folder, which makes it
the common input of the parity tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .config import ModelConfig
from .processor import SPECIAL_TOKENS, TEMPLATE_SYSTEM_PROMPT, read_bpe_files

REAL_VOCAB = 151936  # the 3B embedding rows
TINY_VOCAB = 1024
TINY_BASE = 1000  # tiny special ids: real - 151643 + 1000

CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% set image_count = namespace(value=0) %}{% set video_count = "
    "namespace(value=0) %}{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\n" + TEMPLATE_SYSTEM_PROMPT + "<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}{% for content in "
    "message['content'] %}{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_bos|><|IMAGE|><|vision_eos|>{% elif content['type'] == 'audio' or 'audio' in content or "
    "'audio_url' in content %}{% set audio_count.value = audio_count.value + 1 %}{% if add_audio_id %}Audio "
    "{{ audio_count.value }}: {% endif %}<|audio_bos|><|AUDIO|><|audio_eos|>{% elif content['type'] == 'video' or "
    "'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_bos|><|VIDEO|><|vision_eos|>{% elif 'text' in content %}"
    "{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}")


def tiny_config(vocab: str = "tiny", *, text_layers: int = 2, vision_depth: int = 2, audio_layers: int = 2,
                text_heads: int = 4) -> dict:
    """A 4.x-style full-model config.json with a tiny thinker (reference section 5.2). ``text_heads``: 4 (head_dim
    16, the test suite's) or 2 (head_dim 32, the smallest MLX can quantise: scripts/make_tiny_checkpoints.py); the
    M-RoPE sections keep the released 2 : 3 : 3 split of the head's half."""
    if text_heads not in (2, 4):
        raise ValueError(f"text_heads must be 2 or 4, not {text_heads}")
    half = 64 // text_heads // 2
    mrope = [half // 4, 3 * half // 8, 3 * half // 8]
    base = TINY_BASE if vocab == "tiny" else 151643
    vocab_size = TINY_VOCAB if vocab == "tiny" else REAL_VOCAB
    ids = {c: base + i for i, (c, _) in enumerate(SPECIAL_TOKENS)}
    thinker = {
        "model_type": "qwen2_5_omni_thinker",
        "architectures": ["Qwen2_5OmniThinkerForConditionalGeneration"],
        "audio_token_index": ids["<|AUDIO|>"], "image_token_index": ids["<|IMAGE|>"],
        "video_token_index": ids["<|VIDEO|>"], "audio_start_token_id": ids["<|audio_bos|>"],
        "audio_end_token_id": ids["<|audio_eos|>"], "vision_start_token_id": ids["<|vision_bos|>"],
        "vision_end_token_id": ids["<|vision_eos|>"], "vision_token_id": ids["<|vision_pad|>"],
        "bos_token_id": ids["<|im_start|>"], "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"],
        "position_id_per_seconds": 25, "seconds_per_chunk": 2, "user_token_id": 872, "tie_word_embeddings": False,
        "text_config": {
            "model_type": "qwen2_5_omni_text", "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": text_layers, "num_attention_heads": text_heads, "num_key_value_heads": 2,
            "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
            "rope_scaling": {"mrope_section": mrope, "rope_type": "default", "type": "default"},
            "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 28,
        },
        "vision_config": {
            "model_type": "qwen2_5_omni_vision_encoder", "depth": vision_depth, "hidden_size": 32,
            "intermediate_size": 64, "num_heads": 2, "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2,
            "temporal_patch_size": 2, "window_size": 56, "out_hidden_size": 64,
            "fullatt_block_indexes": [vision_depth - 1], "hidden_act": "silu",
        },
        "audio_config": {
            "model_type": "qwen2_5_omni_audio_encoder", "num_mel_bins": 128, "encoder_layers": audio_layers,
            "encoder_attention_heads": 2, "encoder_ffn_dim": 64, "d_model": 32, "n_window": 100,
            "max_source_positions": 1500, "output_dim": 64, "activation_function": "gelu",
        },
    }
    return {"architectures": ["Qwen2_5OmniModel"], "model_type": "qwen2_5_omni", "enable_audio_output": False,
            "torch_dtype": "float32", "thinker_config": thinker}


def thinker_weight_shapes(thinker: dict) -> dict[str, tuple[int, ...]]:
    """Every thinker tensor of a released checkpoint (names without ``thinker.``) and its Hugging Face shape."""
    c = ModelConfig.from_dict(thinker)
    t, v, a = c.text_config, c.vision_config, c.audio_config
    s: dict[str, tuple[int, ...]] = {}
    h, hd = t.hidden_size, t.head_dim
    q, kv = t.num_attention_heads * hd, t.num_key_value_heads * hd
    s["model.embed_tokens.weight"] = (t.vocab_size, h)
    for i in range(t.num_hidden_layers):
        p = f"model.layers.{i}."
        s[p + "input_layernorm.weight"] = s[p + "post_attention_layernorm.weight"] = (h,)
        for name, out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            s[p + f"self_attn.{name}.weight"], s[p + f"self_attn.{name}.bias"] = (out, h), (out,)
        s[p + "self_attn.o_proj.weight"] = (h, q)
        s[p + "mlp.gate_proj.weight"] = s[p + "mlp.up_proj.weight"] = (t.intermediate_size, h)
        s[p + "mlp.down_proj.weight"] = (h, t.intermediate_size)
    s["model.norm.weight"] = (h,)
    if not c.tie_word_embeddings:
        s["lm_head.weight"] = (t.vocab_size, h)

    d, vi = v.hidden_size, v.intermediate_size
    s["visual.patch_embed.proj.weight"] = (d, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
    for i in range(v.depth):
        p = f"visual.blocks.{i}."
        s[p + "norm1.weight"] = s[p + "norm2.weight"] = (d,)
        for name in ("q", "k", "v", "proj"):
            s[p + f"attn.{name}.weight"], s[p + f"attn.{name}.bias"] = (d, d), (d,)
        for name, shape in (("gate_proj", (vi, d)), ("up_proj", (vi, d)), ("down_proj", (d, vi))):
            s[p + f"mlp.{name}.weight"], s[p + f"mlp.{name}.bias"] = shape, (shape[0],)
    m = d * v.spatial_merge_size ** 2
    s["visual.merger.ln_q.weight"] = (d,)
    s["visual.merger.mlp.0.weight"], s["visual.merger.mlp.0.bias"] = (m, m), (m,)
    s["visual.merger.mlp.2.weight"], s["visual.merger.mlp.2.bias"] = (v.out_hidden_size, m), (v.out_hidden_size,)

    e, f = a.d_model, a.encoder_ffn_dim
    s["audio_tower.conv1.weight"], s["audio_tower.conv1.bias"] = (e, a.num_mel_bins, 3), (e,)
    s["audio_tower.conv2.weight"], s["audio_tower.conv2.bias"] = (e, e, 3), (e,)
    for i in range(a.encoder_layers):
        p = f"audio_tower.layers.{i}."
        for name in ("q_proj", "v_proj", "out_proj"):
            s[p + f"self_attn.{name}.weight"], s[p + f"self_attn.{name}.bias"] = (e, e), (e,)
        s[p + "self_attn.k_proj.weight"] = (e, e)
        for name in ("self_attn_layer_norm", "final_layer_norm"):
            s[p + f"{name}.weight"], s[p + f"{name}.bias"] = (e,), (e,)
        s[p + "fc1.weight"], s[p + "fc1.bias"] = (f, e), (f,)
        s[p + "fc2.weight"], s[p + "fc2.bias"] = (e, f), (e,)
    s["audio_tower.ln_post.weight"], s["audio_tower.ln_post.bias"] = (e,), (e,)
    s["audio_tower.proj.weight"], s["audio_tower.proj.bias"] = (a.output_dim, e), (a.output_dim,)
    s["audio_tower.audio_bos_eos_token.weight"] = (2, a.output_dim)
    return s


def draw(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """One random parameter: embeddings N(0, 1), norm weights 1 + N(0, 0.2), biases N(0, 0.2), weights
    N(0, 1/fan_in)."""
    is_norm = any(k in name for k in ("norm", "ln_q", "ln_post"))
    if "embed_tokens" in name or "audio_bos_eos_token" in name:
        x = rng.standard_normal(shape)
    elif name.endswith("bias"):
        x = 0.2 * rng.standard_normal(shape)
    elif is_norm:
        x = 1.0 + 0.2 * rng.standard_normal(shape)
    else:
        x = rng.standard_normal(shape) / np.sqrt(int(np.prod(shape[1:])))
    return x.astype(np.float32)


def write_tokenizer(dst: Path, tokenizer_dir: Path, vocab: str) -> None:
    """Qwen2 BPE files (all of them, or the first 1000 tokens and the merges among them) and the Omni
    special tokens in ``tokenizer_config.json``."""
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
    added = {str(base + i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                             "single_word": False, "special": special}
             for i, (c, special) in enumerate(SPECIAL_TOKENS)}
    cfg = {"add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added, "bos_token": None,
           "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
           "errors": "replace", "model_max_length": 32768, "split_special_tokens": False,
           "tokenizer_class": "Qwen2Tokenizer", "chat_template": CHAT_TEMPLATE,
           "image_token": "<|IMAGE|>", "audio_token": "<|AUDIO|>", "video_token": "<|VIDEO|>",
           "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
           "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"}
    with open(dst / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)


PREPROCESSOR_CONFIG = {
    "processor_class": "Qwen2_5OmniProcessor", "image_processor_type": "Qwen2VLImageProcessor",
    "feature_extractor_type": "WhisperFeatureExtractor", "min_pixels": 3136, "max_pixels": 12845056,
    "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711], "do_convert_rgb": True, "do_normalize": True,
    "do_rescale": True, "do_resize": True, "rescale_factor": 0.00392156862745098, "resample": 3,
    "feature_size": 128, "sampling_rate": 16000, "n_fft": 400, "hop_length": 160, "chunk_length": 300,
    "n_samples": 4800000, "nb_max_frames": 30000, "dither": 0.0, "padding_side": "right", "padding_value": 0.0,
    "return_attention_mask": True,
}


def make_tiny_checkpoint(dst, *, tokenizer_dir, vocab: str = "tiny", seed: int = 0, prefix: bool = True,
                         extra_keys: bool = True, speech: bool = False, **sizes) -> Path:
    """Write a random tiny Qwen2.5-Omni checkpoint to ``dst`` (a folder) and return its path.

    ``tokenizer_dir``: a folder with the Qwen2 ``vocab.json`` + ``merges.txt`` (tests/data/tokenizers/qwen2).
    ``vocab``: "tiny" (1,024 embedding rows, special tokens at 1000..1021) or "real" (151,936 rows, the real
    tokenizer and ids). ``prefix`` / ``extra_keys``: the released layout (``thinker.`` names, talker and
    token2wav weights); turn them off for a bare-thinker checkpoint. ``speech``: a complete tiny talker and
    token2wav (``talker_config`` / ``token2wav_config``, every ``talker.*`` / ``token2wav.*`` weight and a
    ``spk_dict.pt`` with two voices, written as ``torch.save`` lays it out), so that the spoken path runs.
    ``sizes``: text_layers, vision_depth, audio_layers, text_heads.
    """
    from safetensors.numpy import save_file

    if vocab not in ("tiny", "real"):
        raise ValueError(f"vocab must be 'tiny' or 'real', not {vocab!r}")
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    config = tiny_config(vocab, **sizes)
    if not prefix:  # a bare thinker, as transformers' save_pretrained of the thinker writes it
        config = dict(config["thinker_config"])
    rng = np.random.default_rng(seed)
    thinker = config.get("thinker_config", config)
    pre = "thinker." if prefix else ""
    tensors = {pre + k: draw(k, shape, rng) for k, shape in thinker_weight_shapes(thinker).items()}
    if speech:
        if not prefix:
            raise ValueError("speech=True needs the released layout (prefix=True)")
        config.update(tiny_speech_config(vocab))
        tensors.update(speech_tensors(config, rng))
        write_speakers(dst / "spk_dict.pt", config, rng)
    elif extra_keys:
        tensors["talker.model.embed_tokens.weight"] = rng.standard_normal((16, 8)).astype(np.float32)
        tensors["talker.codec_head.weight"] = rng.standard_normal((16, 8)).astype(np.float32)
        tensors["token2wav.code2wav_dit_model.input_embed.proj.weight"] = rng.standard_normal((8, 4)).astype(
            np.float32)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with open(dst / "config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    with open(dst / "preprocessor_config.json", "w", encoding="utf-8") as f:
        json.dump(PREPROCESSOR_CONFIG, f, indent=2)
    write_tokenizer(dst, Path(tokenizer_dir), vocab)
    return dst


# --- speech: talker + token2wav -----------------------------------------------------------------------------------

TINY_CODEC_VOCAB = 40  # codes 0..31 are speech, 32.. the talker's specials: a random talker stops after ~20 codes
TINY_SPEAKERS = ("Chelsie", "Ethan")
BIGVGAN_GAIN = 0.8  # the random vocoder's residual stack: at 1.0, ~75 % of samples saturate at +-1; at 0.8, none (std 0.18)


def tiny_speech_config(vocab: str = "tiny") -> dict:
    """``talker_config`` and ``token2wav_config`` of a tiny speaking checkpoint (released field names)."""
    real = vocab == "real"
    base = TINY_BASE if not real else 151643
    ids = {c: base + i for i, (c, _) in enumerate(SPECIAL_TOKENS)}
    text_pad, text_bos, text_eos = (151859, 151860, 151861) if real else (900, 901, 902)
    talker = {
        "model_type": "qwen2_5_omni_talker", "architectures": ["Qwen2_5OmniTalkerModel"],
        "vocab_size": TINY_CODEC_VOCAB, "embedding_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
        "rope_scaling": {"mrope_section": [2, 3, 3], "rope_type": "default", "type": "default"},
        "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 28,
        "tts_codec_pad_token_id": 32, "tts_codec_start_token_id": 33, "tts_codec_end_token_id": 34,
        "tts_codec_mask_token_id": 36, "tts_text_pad_token_id": text_pad, "tts_text_start_token_id": text_bos,
        "tts_text_end_token_id": text_eos,
        "audio_token_index": ids["<|AUDIO|>"], "image_token_index": ids["<|IMAGE|>"],
        "video_token_index": ids["<|VIDEO|>"], "audio_start_token_id": ids["<|audio_bos|>"],
        "audio_end_token_id": ids["<|audio_eos|>"], "vision_start_token_id": ids["<|vision_bos|>"],
        "vision_end_token_id": ids["<|vision_eos|>"], "position_id_per_seconds": 25, "seconds_per_chunk": 2,
        "spatial_merge_size": 2,
    }
    token2wav = {
        "model_type": "qwen2_5_omni_token2wav",
        "dit_config": {
            "model_type": "qwen2_5_omni_dit", "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 2,
            "head_dim": 16, "ff_mult": 2, "emb_dim": 16, "block_size": 4, "look_ahead_layers": [2],
            "look_backward_layers": [0, 3], "repeats": 2, "num_embeds": TINY_CODEC_VOCAB, "mel_dim": 80,
            "dropout": 0.0, "enc_emb_dim": 24, "enc_dim": 16, "enc_channels": [16, 16, 16, 16, 48],
            "enc_kernel_sizes": [5, 3, 3, 3, 1], "enc_dilations": [1, 2, 3, 4, 1], "enc_attention_channels": 8,
            "enc_res2net_scale": 2, "enc_se_channels": 8,
        },
        "bigvgan_config": {
            "model_type": "qwen2_5_omni_bigvgan", "mel_dim": 80, "upsample_initial_channel": 64,
            "resblock_kernel_sizes": [3, 7, 11], "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]],
            "upsample_rates": [5, 3, 2, 2, 2, 2], "upsample_kernel_sizes": [11, 7, 4, 4, 4, 4],
        },
    }
    return {"enable_audio_output": True, "talker_config": talker, "token2wav_config": token2wav}


def talker_weight_shapes(talker: dict) -> dict[str, tuple[int, ...]]:
    """Every talker tensor (names without ``talker.``) and its Hugging Face shape."""
    from .talker import TalkerConfig

    c = TalkerConfig.from_dict(talker)
    h, hd = c.hidden_size, c.head_dim
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    s = {"thinker_to_talker_proj.weight": (h, c.embedding_size), "thinker_to_talker_proj.bias": (h,),
         "model.embed_tokens.weight": (c.vocab_size, c.embedding_size), "model.norm.weight": (h,),
         "codec_head.weight": (c.vocab_size, h)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        s[p + "input_layernorm.weight"] = s[p + "post_attention_layernorm.weight"] = (h,)
        for name, out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            s[p + f"self_attn.{name}.weight"], s[p + f"self_attn.{name}.bias"] = (out, h), (out,)
        s[p + "self_attn.o_proj.weight"] = (h, q)
        s[p + "mlp.gate_proj.weight"] = s[p + "mlp.up_proj.weight"] = (c.intermediate_size, h)
        s[p + "mlp.down_proj.weight"] = (h, c.intermediate_size)
    return s


def token2wav_weight_shapes(token2wav: dict) -> dict[str, tuple[int, ...]]:
    """Every token2wav tensor (names without ``token2wav.``) and its Hugging Face shape (builds the MLX module
    to enumerate them, so this imports MLX)."""
    from .token2wav import Token2Wav, hf_token2wav_shapes

    return hf_token2wav_shapes(Token2Wav.from_dict(token2wav))


def draw_speech(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Talker / token2wav parameters: embeddings N(0, 1), RMSNorm weights 1 + N(0, 0.2), biases and the
    SnakeBeta log-parameters N(0, 0.2), other weights N(0, 1/fan_in)."""
    last = name.rsplit(".", 1)[-1]
    if "embed_tokens" in name or "codec_embed" in name:
        x = rng.standard_normal(shape)
    elif name.endswith("layernorm.weight") or name.endswith("model.norm.weight"):
        x = 1.0 + 0.2 * rng.standard_normal(shape)
    elif last in ("bias", "alpha", "beta"):
        x = 0.2 * rng.standard_normal(shape)
    else:
        x = rng.standard_normal(shape) / np.sqrt(int(np.prod(shape[1:])))
        if "bigvgan" in name and "conv_pre" not in name:
            x *= BIGVGAN_GAIN
    return x.astype(np.float32)


def speech_tensors(config: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    out = {f"talker.{k}": draw_speech(k, s, rng) for k, s in talker_weight_shapes(config["talker_config"]).items()}
    out.update({f"token2wav.{k}": draw_speech(k, s, rng)
                for k, s in token2wav_weight_shapes(config["token2wav_config"]).items()})
    return out


def write_speakers(path: Path, config: dict, rng: np.random.Generator) -> None:
    """``spk_dict.pt`` with :data:`TINY_SPEAKERS`: a speaker vector, a 60-frame reference mel (natural-log
    magnitudes around -5) and a text-bos token each."""
    from .speakers import write_torch_zip

    dit = config["token2wav_config"]["dit_config"]
    bos0 = config["talker_config"]["tts_text_end_token_id"] + 1 if config["talker_config"][
        "tts_text_end_token_id"] < 1000 else 151870
    voices = {name: {"cond": rng.standard_normal((1, dit["enc_emb_dim"])).astype(np.float32),
                     "ref_mel": (-5 + rng.standard_normal((1, 60, dit["mel_dim"]))).astype(np.float32),
                     "bos_token": bos0 + i}
              for i, name in enumerate(TINY_SPEAKERS)}
    write_torch_zip(path, voices)
