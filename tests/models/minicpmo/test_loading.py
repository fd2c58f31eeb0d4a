"""Loading MiniCPM-o 4.5 checkpoints: the released layout (local folder or Hub id through the local cache),
clear failures on corrupted folders and config mismatches, and `omnitide convert` round trips."""

import json
import os
import shutil

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from omnitide_mlx.cli import main as cli_main
from omnitide_mlx.models import load
from omnitide_mlx.models.loading import CheckpointError
from omnitide_mlx.models.minicpmo import Model

from ._helpers import max_diff


def _copy(src, dst, link_weights=True):
    """A copy of a checkpoint folder; the weights are hard-linked unless they will be rewritten."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name == "model.safetensors" and link_weights:
            os.link(f, dst / f.name)
        else:
            shutil.copy2(f, dst / f.name)
    return dst


def _rewrite_weights(folder, edit):
    from safetensors.numpy import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    for k, v in changes.items():
        if isinstance(v, dict):
            cfg[k] = {**cfg.get(k, {}), **v}
        else:
            cfg[k] = v
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def media_inputs(tiny):
    _, proc = tiny
    rng = np.random.default_rng(7)
    img = Image.fromarray(rng.integers(0, 256, (200, 300, 3), dtype=np.uint8))
    audio = (0.1 * rng.standard_normal(24000)).astype(np.float32)
    return proc("<|im_start|>user\n<image>./</image>\n<audio>./</audio>Describe both.<|im_end|>\n"
                "<|im_start|>assistant\n", images=[img], audios=[audio])


@pytest.fixture(scope="module")
def float_logits(tiny, media_inputs):
    model, _ = tiny
    return np.array(model(**media_inputs))


def test_released_layout_loads(tiny_dir, tiny):
    model, proc = tiny
    assert isinstance(model, Model)
    assert (tiny_dir / "tokenizer.json").stat().st_size == 0  # rebuilt from vocab.json + merges.txt
    assert len(proc.tokenizer) == 151748
    assert model.config.query_num == 64 and len(model.vision_tower.encoder.layers) == 2
    spec = model.kv_spec()
    assert (spec.num_layers, spec.kv_heads, spec.head_dim, spec.position_axes) == (2, 2, 32, 1)
    assert spec.rope.base == 1e6 and not spec.rope.traditional


def test_checkpoint_with_tts_and_dropped_vision_layer(tmp_path, tiny_dir, tiny, media_inputs, float_logits):
    """A release with the TTS weights and drop_vision_last_layer=true: the TTS is ignored and so is the last
    SigLIP layer (built neither officially nor here)."""
    ckpt = _copy(tiny_dir, tmp_path / "tts", link_weights=False)
    _rewrite_weights(ckpt, lambda t: t.update({"tts.emb_text.weight": np.zeros((4, 8), np.float32),
                                               "tts.head_code.0.parametrizations.weight.original0":
                                                   np.zeros((4, 1), np.float32)}))
    model, _ = load(ckpt, dtype=mx.float32)
    np.testing.assert_array_equal(np.array(model(**media_inputs)), float_logits)
    _edit_config(ckpt, drop_vision_last_layer=True)
    model, _ = load(ckpt, dtype=mx.float32)
    assert len(model.vision_tower.encoder.layers) == 1
    assert max_diff(model(**media_inputs), float_logits) > 1e-3


def test_hub_id_through_the_local_cache(tmp_path, monkeypatch, tiny_dir):
    import huggingface_hub.constants as hub_constants

    repo = tmp_path / "hub" / "models--tiny-org--minicpmo-tiny"
    rev = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    _copy(tiny_dir, repo / "snapshots" / rev)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, proc = load("tiny-org/minicpmo-tiny")
    assert model.config.text.hidden_size == 128 and proc.tokenizer.token_id("<unit>") == 151683
    with pytest.raises(CheckpointError, match="not in the local Hugging Face cache"):
        load("tiny-org/not-downloaded")


def test_missing_key_is_listed(tmp_path, tiny_dir):
    bad = _copy(tiny_dir, tmp_path / "missing", link_weights=False)
    _rewrite_weights(bad, lambda t: t.pop("apm.layers.1.self_attn.q_proj.bias"))
    with pytest.raises(CheckpointError, match=r"missing keys \(1\):\n  audio_tower.layers.1.self_attn.q_proj.bias"):
        load(bad)


def test_wrong_shape_is_listed(tmp_path, tiny_dir):
    bad = _copy(tiny_dir, tmp_path / "shape", link_weights=False)

    def edit(t):
        t["resampler.kv_proj.weight"] = t["resampler.kv_proj.weight"][:, :16]

    _rewrite_weights(bad, edit)
    with pytest.raises(CheckpointError, match=r"resampler.kv_proj.weight: checkpoint \(128, 16\), config expects "
                                              r"\(128, 48\)"):
        load(bad)


def test_unexpected_key_is_listed(tmp_path, tiny_dir):
    bad = _copy(tiny_dir, tmp_path / "extra", link_weights=False)
    _rewrite_weights(bad, lambda t: t.update({"vpm.encoder.layers.5.mlp.fc1.weight": np.zeros((2, 2), np.float32)}))
    with pytest.raises(CheckpointError, match=r"unexpected keys \(1\):\n  vision_tower.encoder.layers.5.mlp.fc1"):
        load(bad)


@pytest.mark.parametrize("changes, pattern", [
    ({"num_hidden_layers": 3}, r"missing keys \(\d+\):\n  language_model.model.layers.2"),
    ({"audio_config": {"encoder_ffn_dim": 256}}, r"audio_tower.layers.0.fc1.weight: checkpoint \(128, 32\), "
                                                 r"config expects \(256, 32\)"),
    ({"vision_config": {"image_size": 140}}, r"position_embedding.weight: checkpoint \(25, 48\), config expects "
                                             r"\(100, 48\)"),
    ({"hidden_size": 192, "head_dim": 48}, "hidden_size 192 is not a multiple of 128"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn' is not supported"),
    ({"vocab_size": 1000}, "the tokenizer has 151748 tokens but vocab_size is 1000"),
])
def test_config_mismatch_fails_clearly(tmp_path, tiny_dir, changes, pattern):
    bad = _copy(tiny_dir, tmp_path / "config")
    _edit_config(bad, **changes)
    if "vocab_size" in changes:  # make the weights agree so the tokenizer check is what fails
        bad.joinpath("model.safetensors").unlink()
        _rewrite_weights_from(tiny_dir, bad, lambda t: t.update({
            "llm.model.embed_tokens.weight": t["llm.model.embed_tokens.weight"][:1000],
            "llm.lm_head.weight": t["llm.lm_head.weight"][:1000]}))
    with pytest.raises(CheckpointError, match=pattern):
        load(bad)


def _rewrite_weights_from(src, dst, edit):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})


def test_truncated_file_fails_clearly(tmp_path, tiny_dir):
    bad = _copy(tiny_dir, tmp_path / "truncated", link_weights=False)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors is not a readable safetensors file"):
        load(bad)


def test_pickle_weights_are_refused(tmp_path, tiny_dir):
    bad = _copy(tiny_dir, tmp_path / "pickle")
    (bad / "model.safetensors").rename(bad / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickle"):
        load(bad)


def test_missing_tokenizer_fails_clearly(tmp_path, tiny_dir):
    bad = _copy(tiny_dir, tmp_path / "notok")
    (bad / "merges.txt").unlink()
    with pytest.raises(CheckpointError, match="no usable tokenizer.json and lacks merges.txt"):
        load(bad)


@pytest.mark.slow  # about 10 s on 2 CPU cores (151,748-row embedding and head quantised, two loads)
def test_quantised_conversion_round_trips(tmp_path, tiny_dir, media_inputs, float_logits):
    out = tmp_path / "q8"
    assert cli_main(["convert", "--model", str(tiny_dir), "--mlx-path", str(out), "-q", "--q-bits", "8"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["omnitide_converted"] and cfg["quantization"]["bits"] == 8
    model, proc = load(out)
    attn = model.language_model.model.layers[0].self_attn
    assert type(attn.q_proj).__name__ == "QuantizedLinear"
    assert type(model.vision_tower.encoder.layers[0].self_attn.q_proj).__name__ == "Linear"
    assert type(model.audio_tower.layers[0].fc1).__name__ == "Linear"
    logits = np.array(model(**media_inputs))
    # the folder holds exactly the in-memory quantisation of the language model
    import mlx.nn as nn

    ref, _ = load(tiny_dir, dtype=mx.float32)
    nn.quantize(ref, group_size=64, bits=8, class_predicate=lambda p, m: hasattr(m, "to_quantized")
                and m.weight.shape[-1] % 64 == 0 and ref.quant_predicate(p, m))
    np.testing.assert_array_equal(logits, np.array(ref(**media_inputs)))
    diff = np.abs(logits - float_logits)
    # measured: max 0.115, mean 0.0093 (random N(0, 1) weights, logits of max |x| ~5)
    assert diff.max() < 0.2 and diff.mean() < 0.02, (diff.max(), diff.mean())
    assert proc.tokenizer.encode("hello <unit>") == [14990, 220, 151683]


def test_converted_float_folder_loads_without_sanitising(tmp_path, tiny_dir, media_inputs, float_logits):
    out = tmp_path / "f32"
    assert cli_main(["convert", "--model", str(tiny_dir), "--mlx-path", str(out), "--dtype", "float32"]) == 0
    model, _ = load(out)
    np.testing.assert_array_equal(np.array(model(**media_inputs)), float_logits)
