"""Configs of the released 3B and 7B models (4.x style) map to the right shapes, KV spec and checkpoint names,
without building weights (MLX arrays stay lazy)."""

import copy

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from omnitide_mlx.models.loading import CheckpointError, describe_mismatch
from omnitide_mlx.models.qwen2_5_omni import Model, ModelConfig
from omnitide_mlx.models.qwen2_5_omni.tiny import thinker_weight_shapes


def released_config(size: str) -> dict:
    """config.json of Qwen2.5-Omni-7B / -3B as released (4.x style), thinker part; numbers from the reference."""
    text = {"7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064),
            "3B": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                       num_key_value_heads=2, vocab_size=151936)}[size]
    out = text["hidden_size"]
    return {
        "architectures": ["Qwen2_5OmniModel"], "model_type": "qwen2_5_omni", "enable_audio_output": True,
        "thinker_config": {
            "model_type": "qwen2_5_omni_thinker", "audio_token_index": 151646, "image_token_index": 151655,
            "video_token_index": 151656, "audio_start_token_id": 151647, "audio_end_token_id": 151648,
            "vision_start_token_id": 151652, "vision_end_token_id": 151653, "vision_token_id": 151654,
            "position_id_per_seconds": 25, "seconds_per_chunk": 2, "user_token_id": 872,
            "text_config": dict(text, model_type="qwen2_5_omni_text", rms_norm_eps=1e-6, rope_theta=1000000.0,
                                rope_scaling={"mrope_section": [16, 24, 24], "rope_type": "default",
                                              "type": "default"},
                                max_position_embeddings=32768, use_sliding_window=False, hidden_act="silu",
                                tie_word_embeddings=False),
            "vision_config": {"model_type": "qwen2_5_omni_vision_encoder", "depth": 32, "embed_dim": 1280,
                              "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "in_chans": 3,
                              "patch_size": 14, "spatial_patch_size": 14, "spatial_merge_size": 2,
                              "temporal_patch_size": 2, "window_size": 112, "out_hidden_size": out,
                              "fullatt_block_indexes": [7, 15, 23, 31], "hidden_act": "silu", "tokens_per_second": 25},
            "audio_config": {"model_type": "qwen2_5_omni_audio_encoder", "num_mel_bins": 128, "encoder_layers": 32,
                             "encoder_attention_heads": 20, "encoder_ffn_dim": 5120, "d_model": 1280,
                             "n_window": 100, "max_source_positions": 1500, "output_dim": out,
                             "activation_function": "gelu"},
        },
        "talker_config": {"model_type": "qwen2_5_omni_talker"}, "token2wav_config": {},
    }


@pytest.mark.parametrize("size, layers, kv_heads, kv_bytes", [("7B", 28, 4, 57344), ("3B", 36, 2, 36864)])
def test_released_configs(size, layers, kv_heads, kv_bytes):
    cfg = released_config(size)
    c = ModelConfig.from_dict(cfg)
    assert c.text_config.head_dim == 128 and c.text_config.mrope_section == [16, 24, 24]
    assert c.vision_config.hidden_size == 1280 and c.vision_config.head_dim == 80
    assert c.vision_config.window_size // c.vision_config.spatial_merge_size // c.vision_config.patch_size == 4
    assert not c.tie_word_embeddings
    model = Model(c)
    spec = model.kv_spec()
    assert (spec.num_layers, spec.kv_heads, spec.head_dim, spec.position_axes) == (layers, kv_heads, 128, 3)
    assert spec.rope.base == 1e6 and spec.rope.dims == 128 and not spec.rope.traditional
    assert spec.bytes_per_token(mx.float16) == kv_bytes
    # the released tensor names and shapes (with thinker., talker weights alongside) are exactly what it expects
    ckpt = {"thinker." + k: mx.zeros(s) for k, s in thinker_weight_shapes(cfg["thinker_config"]).items()}
    ckpt["talker.codec_head.weight"] = mx.zeros((8, 8))
    expected = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    assert describe_mismatch(expected, model.sanitize(ckpt)) is None


def test_5x_rope_parameters_and_bare_thinker_config():
    thinker = copy.deepcopy(released_config("3B")["thinker_config"])
    text = thinker["text_config"]
    del text["rope_scaling"], text["rope_theta"]
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [8, 28, 28]}
    thinker["vision_config"]["rope_parameters"] = {"rope_type": "axial", "rope_theta": 10000.0}
    c = ModelConfig.from_dict(thinker)
    assert c.text_config.rope_theta == 500000.0 and c.text_config.mrope_section == [8, 28, 28]
    assert c.model_type == "qwen2_5_omni_thinker"


@pytest.mark.parametrize("edit, match", [
    (lambda t: t["text_config"].update(rope_scaling={"type": "yarn", "factor": 4.0}), "rope type"),
    (lambda t: t["text_config"].update(use_sliding_window=True), "sliding"),
    (lambda t: t["vision_config"].update(hidden_act="gelu"), "hidden_act"),
    (lambda t: t.pop("audio_config"), "no audio_config"),
])
def test_unsupported_configs_fail_clearly(edit, match):
    cfg = released_config("7B")
    edit(cfg["thinker_config"])
    with pytest.raises(CheckpointError, match=match):
        ModelConfig.from_dict(cfg)
