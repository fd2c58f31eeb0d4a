"""Shared fixtures: one random tiny checkpoint in the released layout, loaded by the port and by transformers."""

import numpy as np
import pytest

from omnitide_mlx.models import load
from omnitide_mlx.models.qwen2_5_omni.tiny import make_tiny_checkpoint


@pytest.fixture(scope="session")
def qwen_tokenizer_dir(data_dir):
    return data_dir / "tokenizers" / "qwen2"


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory, qwen_tokenizer_dir):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen25omni") / "tiny", tokenizer_dir=qwen_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny(tiny_ckpt):
    """(model, processor) of the tiny checkpoint, loaded through omnitide_mlx.load."""
    return load(tiny_ckpt)


@pytest.fixture(scope="session")
def hf_thinker(tiny_ckpt):
    """transformers' thinker on the same folder (float32, eager-free default attention)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, Qwen2_5OmniThinkerForConditionalGeneration

    cfg = AutoConfig.from_pretrained(tiny_ckpt).thinker_config
    model, info = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(
        tiny_ckpt, config=cfg, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), f"transformers did not load the tiny checkpoint cleanly: {info}"
    return model.eval()
