"""Config reading, the MoE layer rule, and checkpoint errors and layouts (released, bare thinker, 5.x fused
experts)."""

import json

import numpy as np
import pytest

from omnitide_mlx.models.loading import CheckpointError
from omnitide_mlx.models.qwen3_omni import load
from omnitide_mlx.models.qwen3_omni.config import ModelConfig, TextConfig
from omnitide_mlx.models.qwen3_omni.tiny import make_tiny_checkpoint, tiny_config


def test_released_defaults():
    """The dataclass defaults are the released 30B-A3B thinker's."""
    t = TextConfig()
    assert (t.num_hidden_layers, t.num_experts, t.num_experts_per_tok, t.num_attention_heads,
            t.num_key_value_heads, t.head_dim, t.mrope_section) == (48, 128, 8, 32, 4, 128, [24, 20, 20])
    c = ModelConfig()
    assert (c.audio_token_id, c.audio_start_token_id, c.position_id_per_seconds) == (151675, 151669, 13)


def test_sparse_layer_rule():
    t = TextConfig.from_dict(dict(tiny_config()["thinker_config"]["text_config"], decoder_sparse_step=2,
                                  mlp_only_layers=[3], num_hidden_layers=6))
    assert [t.is_sparse(i) for i in range(6)] == [False, True, False, False, False, True]


@pytest.mark.parametrize("change,match", [
    ({"mrope_section": [4, 2, 1]}, "mrope_section"),
    ({"interleaved": False}, "interleaved"),
    ({"shared_expert_intermediate_size": 64}, "shared expert"),
    ({"use_sliding_window": True}, "sliding-window"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
])
def test_unsupported_text_configs_are_refused(change, match):
    text = json.loads(json.dumps(tiny_config()["thinker_config"]["text_config"]))
    for k, v in change.items():
        if k in ("mrope_section", "interleaved"):
            text["rope_scaling"][k] = v
        else:
            text[k] = v
    with pytest.raises(CheckpointError, match=match):
        TextConfig.from_dict(text)


def test_other_model_type_is_refused_before_loading(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_omni"}))
    with pytest.raises(CheckpointError, match="not Qwen3-Omni"):
        load(tmp_path)


def test_bare_thinker_and_fused_expert_layouts_load_the_same(tmp_path, q3_tokenizer_dir, q3):
    """A bare-thinker folder, and one with transformers 5.x fused experts (``experts.gate_up_proj`` [E, 2I, H],
    ``experts.down_proj`` [E, H, I]), give the released folder's logits."""
    from safetensors.numpy import load_file, save_file

    model, proc = q3
    ids = proc("<|im_start|>user\nHello there<|im_end|>\n")["input_ids"]
    ref = np.array(model(ids))
    bare = make_tiny_checkpoint(tmp_path / "bare", tokenizer_dir=q3_tokenizer_dir, prefix=False)
    np.testing.assert_array_equal(np.array(load(bare)[0](ids)), ref)
    w = load_file(str(bare / "model.safetensors"))
    fused = {}
    for k, v in w.items():
        if ".mlp.experts." not in k:
            fused[k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k] = v
    for layer in (0, 2):
        p = f"model.layers.{layer}.mlp.experts."
        n = len({k.split(".")[5] for k in w if k.startswith(p)})
        fused[f"model.language_model.layers.{layer}.mlp.experts.gate_up_proj"] = np.stack(
            [np.concatenate([w[p + f"{e}.gate_proj.weight"], w[p + f"{e}.up_proj.weight"]]) for e in range(n)])
        fused[f"model.language_model.layers.{layer}.mlp.experts.down_proj"] = np.stack(
            [w[p + f"{e}.down_proj.weight"] for e in range(n)])
    save_file(fused, str(bare / "model.safetensors"))
    np.testing.assert_array_equal(np.array(load(bare)[0](ids)), ref)


def test_missing_expert_is_named(tmp_path, q3_tokenizer_dir):
    from safetensors.numpy import load_file, save_file

    ckpt = make_tiny_checkpoint(tmp_path / "t", tokenizer_dir=q3_tokenizer_dir)
    w = load_file(str(ckpt / "model.safetensors"))
    del w["thinker.model.layers.2.mlp.experts.3.up_proj.weight"]
    save_file(w, str(ckpt / "model.safetensors"))
    with pytest.raises(ValueError, match=r"experts \[3\] have no up_proj"):
        load(ckpt)
