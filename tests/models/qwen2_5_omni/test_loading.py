"""Loading Qwen2.5-Omni checkpoints: released layout, bare thinker, 5.x config, Hub id through the local cache,
clear failures on corrupted folders, and `omnitide convert` round trips (quantised and cast)."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from omnitide_mlx.cli import main as cli_main
from omnitide_mlx.models import load
from omnitide_mlx.models.loading import CheckpointError
from omnitide_mlx.models.qwen2_5_omni.tiny import make_tiny_checkpoint

from ._util import prompt

# measured on the tiny random checkpoint (logits of std ~1.0, max ~4.5), image + audio + text prompt:
#   4-bit g64: max |d| 0.90, mean |d| 0.14, top-1 agreement 67 %;  8-bit g64: max 0.068, mean 0.0084, top-1 100 %
# (random N(0, 1) embeddings quantise badly; the bounds below leave ~50 % headroom)
Q4_MAX, Q4_MEAN = 1.5, 0.25
Q8_MAX, Q8_MEAN = 0.15, 0.02


@pytest.fixture(scope="module")
def media_inputs(tiny):
    _, proc = tiny
    rng = np.random.default_rng(7)
    img = rng.integers(0, 256, (84, 112, 3), dtype=np.uint8)
    audio = (0.1 * rng.standard_normal(48000)).astype(np.float32)
    return proc(prompt("<|vision_bos|><|IMAGE|><|vision_eos|><|audio_bos|><|AUDIO|><|audio_eos|>",
                       "Describe it in detail please."), images=[img], audio=[audio])


@pytest.fixture(scope="module")
def float_logits(tiny, media_inputs):
    model, _ = tiny
    return np.array(model(**media_inputs))


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_released_layout_loads_and_ignores_talker(tiny_ckpt, tiny):
    from safetensors import safe_open

    with safe_open(str(tiny_ckpt / "model.safetensors"), "np") as f:
        keys = list(f.keys())
    assert all(k.startswith(("thinker.", "talker.", "token2wav.")) for k in keys)
    assert any(k.startswith("talker.") for k in keys) and any(k.startswith("token2wav.") for k in keys)
    assert json.loads((tiny_ckpt / "config.json").read_text())["thinker_config"]["text_config"]["rope_scaling"]
    model, _ = tiny
    assert model.config.text_config.mrope_section == [2, 3, 3]
    assert model.config.vision_start_token_id == 1009 and not model.config.tie_word_embeddings


def test_bare_thinker_checkpoint_loads_the_same(tmp_path, qwen_tokenizer_dir, tiny, media_inputs, float_logits):
    bare = make_tiny_checkpoint(tmp_path / "bare", tokenizer_dir=qwen_tokenizer_dir, prefix=False, extra_keys=False)
    assert json.loads((bare / "config.json").read_text())["model_type"] == "qwen2_5_omni_thinker"
    model, _ = load(bare)
    np.testing.assert_array_equal(np.array(model(**media_inputs)), float_logits)


def test_transformers_5x_save_loads(tmp_path, tiny_ckpt, hf_thinker, media_inputs, float_logits):
    """save_pretrained of transformers 5.24 writes rope_parameters and bare names; both load."""
    out = tmp_path / "hf5"
    hf_thinker.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    assert "rope_parameters" in cfg["text_config"] and "rope_scaling" not in cfg["text_config"]
    for f in ("vocab.json", "merges.txt", "tokenizer_config.json", "preprocessor_config.json"):
        shutil.copy(tiny_ckpt / f, out / f)
    model, _ = load(out)
    np.testing.assert_allclose(np.array(model(**media_inputs)), float_logits, rtol=0, atol=1e-6)


def test_hub_id_through_the_local_cache(tmp_path, monkeypatch, tiny_ckpt):
    import huggingface_hub.constants as hub_constants

    repo = tmp_path / "hub" / "models--tiny-org--qwen25-omni-tiny"
    rev = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    shutil.copytree(tiny_ckpt, repo / "snapshots" / rev)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, proc = load("tiny-org/qwen25-omni-tiny")
    assert model.config.text_config.hidden_size == 64 and proc.token_ids["<|im_end|>"] == 1002
    with pytest.raises(CheckpointError, match="not in the local Hugging Face cache"):
        load("tiny-org/not-downloaded")


def _rewrite_weights(folder, edit):
    from safetensors.numpy import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_missing_key_is_listed(tmp_path, tiny_ckpt):
    bad = _copy(tiny_ckpt, tmp_path / "missing")
    _rewrite_weights(bad, lambda t: t.pop("thinker.model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(CheckpointError, match=r"missing keys \(1\):\n  language_model.model.layers.1.self_attn.k_proj"):
        load(bad)


def test_wrong_shape_is_listed(tmp_path, tiny_ckpt):
    bad = _copy(tiny_ckpt, tmp_path / "shape")

    def edit(t):
        t["thinker.visual.blocks.0.attn.q.weight"] = t["thinker.visual.blocks.0.attn.q.weight"][:16]

    _rewrite_weights(bad, edit)
    with pytest.raises(CheckpointError, match=r"visual.blocks.0.attn.q.weight: checkpoint \(16, 32\), config "
                                              r"expects \(32, 32\)"):
        load(bad)


def test_config_that_does_not_match_the_weights(tmp_path, tiny_ckpt):
    bad = _copy(tiny_ckpt, tmp_path / "config")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["thinker_config"]["text_config"]["num_hidden_layers"] = 3
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"missing keys \(\d+\):\n  language_model.model.layers.2"):
        load(bad)


def test_unexpected_key_is_listed(tmp_path, tiny_ckpt):
    bad = _copy(tiny_ckpt, tmp_path / "extra")
    _rewrite_weights(bad, lambda t: t.update({"thinker.visual.blocks.9.attn.q.weight": np.zeros((2, 2), np.float32)}))
    with pytest.raises(CheckpointError, match=r"unexpected keys \(1\):\n  visual.blocks.9.attn.q.weight"):
        load(bad)


def test_truncated_file_fails_clearly(tmp_path, tiny_ckpt):
    bad = _copy(tiny_ckpt, tmp_path / "truncated")
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors is not a readable safetensors file"):
        load(bad)


def test_pickle_weights_are_refused(tmp_path, tiny_ckpt):
    bad = _copy(tiny_ckpt, tmp_path / "pickle")
    (bad / "model.safetensors").rename(bad / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickle"):
        load(bad)


def test_bad_config_fails_clearly(tmp_path, tiny_ckpt):
    bad = _copy(tiny_ckpt, tmp_path / "mrope")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["thinker_config"]["text_config"]["rope_scaling"]["mrope_section"] = [2, 3, 4]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="mrope_section"):
        load(bad)


def _quantised_in_memory(ckpt, bits):
    import mlx.nn as nn

    model, _ = load(ckpt)
    nn.quantize(model, group_size=64, bits=bits,
                class_predicate=lambda p, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 64 == 0
                and model.quant_predicate(p, m))
    return model


@pytest.mark.parametrize("bits, max_bound, mean_bound", [(4, Q4_MAX, Q4_MEAN), (8, Q8_MAX, Q8_MEAN)])
def test_quantised_conversion_round_trips(tmp_path, tiny_ckpt, media_inputs, float_logits, bits, max_bound,
                                          mean_bound):
    out = tmp_path / f"q{bits}"
    assert cli_main(["convert", "--model", str(tiny_ckpt), "--mlx-path", str(out), "-q", "--q-bits", str(bits)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"]["bits"] == bits and cfg["quantization"]["group_size"] == 64
    model, proc = load(out)
    assert type(model.language_model.model.layers[0].self_attn.q_proj).__name__ == "QuantizedLinear"
    assert type(model.visual.blocks[0].attn.q).__name__ == "Linear"  # encoders stay in float
    logits = np.array(model(**media_inputs))
    # the folder holds exactly the in-memory quantisation
    np.testing.assert_array_equal(logits, np.array(_quantised_in_memory(tiny_ckpt, bits)(**media_inputs)))
    diff = np.abs(logits - float_logits)
    assert diff.max() < max_bound and diff.mean() < mean_bound, (diff.max(), diff.mean())
    assert proc.encode("hello world") == load(tiny_ckpt)[1].encode("hello world")


def test_dtype_conversion_round_trips(tmp_path, tiny_ckpt, media_inputs, float_logits):
    out = tmp_path / "f16"
    assert cli_main(["convert", "--model", str(tiny_ckpt), "--mlx-path", str(out), "--dtype", "float16"]) == 0
    model, _ = load(out)
    assert model.language_model.model.embed_tokens.weight.dtype == mx.float16
    logits = np.array(model(**media_inputs).astype(mx.float32))
    assert np.abs(logits - float_logits).max() < 0.05  # measured 0.0083 (fp16 end to end)


def test_convert_refuses_a_non_empty_destination(tmp_path, tiny_ckpt, capsys):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert cli_main(["convert", "--model", str(tiny_ckpt), "--mlx-path", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
