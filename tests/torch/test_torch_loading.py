"""Loading Qwen2.5-Omni checkpoints with transformers for the PyTorch path: the released layout and a bare thinker
load to the same model; other models, MLX conversions, pickle-only folders and incomplete weights are refused with
the reason."""

import json
import shutil

import pytest
import torch
from safetensors.numpy import load_file, save_file
from torch_stream import DEVICE

from omnitide_mlx.models.loading import CheckpointError
from omnitide_mlx.models.qwen2_5_omni.tiny import make_tiny_checkpoint
from omnitide_mlx.torch.qwen2_5_omni import load


def test_bare_thinker_and_released_layout_load_the_same_weights(tiny_qwen, torch_qwen, data_dir, tmp_path):
    bare = make_tiny_checkpoint(tmp_path / "bare", tokenizer_dir=data_dir / "tokenizers" / "qwen2", prefix=False,
                                extra_keys=False)
    model, proc = load(bare, device=DEVICE, dtype=torch.float32)
    ref = torch_qwen[0].hf.state_dict()
    for name, value in model.hf.state_dict().items():
        assert torch.equal(value, ref[name]), name
    assert model.kv_spec() == torch_qwen[0].kv_spec() and proc.token_ids == torch_qwen[1].token_ids
    assert model.hf.config.text_config._attn_implementation == "omnitide"
    assert model.hf.config.vision_config._attn_implementation == "sdpa"


def test_refusals_say_why(tiny_qwen, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(tiny_qwen, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "model_type": "minicpmo"}))
    with pytest.raises(CheckpointError, match="runs Qwen2.5-Omni"):
        load(other)
    (other / "config.json").write_text(json.dumps({**cfg, "omnitide_converted": True}))
    with pytest.raises(CheckpointError, match="MLX weights"):
        load(other)
    (other / "config.json").write_text(json.dumps(cfg))
    weights = load_file(str(other / "model.safetensors"))
    del weights["thinker.model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="up_proj"):
        load(other)
    (other / "model.safetensors").unlink()
    (other / "pytorch_model.bin").write_bytes(b"never opened")
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load(other)
    with pytest.raises(CheckpointError, match="no model folder"):
        load(tmp_path / "missing")
