"""Shared fixtures: one random tiny Qwen3-Omni checkpoint in the released layout, loaded by the port and by
transformers."""

import pytest

from omnitide_mlx.models.qwen3_omni import load
from omnitide_mlx.models.qwen3_omni.tiny import make_tiny_checkpoint


@pytest.fixture(scope="session")
def q3_tokenizer_dir(data_dir):
    return data_dir / "tokenizers" / "qwen2"


@pytest.fixture(scope="session")
def q3_ckpt(tmp_path_factory, q3_tokenizer_dir):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3omni") / "tiny", tokenizer_dir=q3_tokenizer_dir)


@pytest.fixture(scope="session")
def q3(q3_ckpt):
    """(model, processor) of the tiny checkpoint."""
    return load(q3_ckpt)


@pytest.fixture(scope="session")
def q3_hf(q3_ckpt):
    """transformers' thinker on the same folder (float32)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, Qwen3OmniMoeThinkerForConditionalGeneration

    cfg = AutoConfig.from_pretrained(q3_ckpt).thinker_config
    model, info = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(
        q3_ckpt, config=cfg, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), f"transformers did not load the tiny checkpoint cleanly: {info}"
    return model.eval()
