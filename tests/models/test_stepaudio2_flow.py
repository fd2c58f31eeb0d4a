"""The MLX StepAudio2 token2wav flow against the official minicpmo-utils 1.0.7 flow (scripts/golden/stepaudio2_flow.py).

Golden data: a tiny flow.yaml in the official format, float16-exact random weights under the official key names, a
fixed noise buffer, the official offline mel, the streaming chunks (setup_cache + 6 chunks of 12 + 3 tokens + a
final chunk, each followed by Token2wav's two trims) and the caches after each call. Tolerance: 1e-4 absolute on
mels whose values reach about 7 (measured: offline ~1e-5, streaming ~1e-5).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from omnitide_mlx.models.loading import CheckpointError
from omnitide_mlx.models.stepaudio2.config import (
    flow_yaml_text, load_flow_config, parse_flow_yaml, released_config,
)
from omnitide_mlx.models.stepaudio2.flow import (
    flow_from_weights, load_flow, trim_conformer_cache, trim_estimator_cache,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "stepaudio2"
TOL = 1e-4


@pytest.fixture(scope="module")
def golden():
    return mx.load(str(DATA / "flow_golden.safetensors")), json.loads((DATA / "flow_golden.json").read_text())


@pytest.fixture(scope="module")
def flow(golden):
    g, _ = golden
    model = flow_from_weights(load_flow_config(DATA), mx.load(str(DATA / "flow_weights.safetensors")))
    model.decoder.set_noise(g["noise"])
    return model


def _stream(flow, g, meta):
    n, pf = meta["n_timesteps"], meta["prompt_frames"]
    pt = g["prompt_tokens"]
    cache = flow.setup_cache(mx.concatenate([pt, pt[:, :3]], axis=1), g["prompt_mel"], g["spk"], n)
    shapes = [{k: tuple(v.shape) for k, v in cache.items()}]
    mels = []
    for a, b, last in meta["windows"]:
        mel, cache = flow.inference_chunk(g["tokens"][:, a:b], g["spk"], cache, last, n)
        cache = trim_conformer_cache(trim_estimator_cache(cache, pf), pf, flow.cfg.encoder.num_blocks)
        mels.append(mel)
        shapes.append({k: tuple(v.shape) for k, v in cache.items()})
    return mels, cache, shapes


@pytest.fixture(scope="module")
def streamed(flow, golden):
    return _stream(flow, *golden)


def _maxdiff(a, b):
    return float(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).max())


# ------------------------------------------------------------------------------------------------ config


def test_official_format_flow_yaml_parses():
    cfg = load_flow_config(DATA / "flow.yaml")
    assert (cfg.input_size, cfg.output_size, cfg.spk_embed_dim, cfg.vocab_size) == (32, 80, 192, 64)
    e, d = cfg.encoder, cfg.decoder
    assert (e.num_blocks, e.num_up_blocks, e.attention_heads, e.linear_units, e.pre_lookahead_len) == (2, 2, 2, 64, 3)
    assert (d.inference_cfg_rate, d.estimator.depth, d.estimator.hidden_size, d.estimator.head_dim) == (0.7, 2, 32, 16)
    assert parse_flow_yaml(flow_yaml_text(cfg)) == cfg  # what the tiny builder writes reads back the same


def test_released_sizes_and_foreign_entries_parse_without_running_anything():
    text = flow_yaml_text(released_config())
    assert parse_flow_yaml(text) == released_config()
    text = text.replace("vocab_size: 6561", "vocab_size: !ref <codebook>")
    text = ("__set_seed: !apply:torch.manual_seed [1986]\ncodebook: 6561\n"
            "hift: !new:cosyvoice.hifigan.generator.CausalHiFTGenerator\n    in_channels: 80\n" + text)
    assert parse_flow_yaml(text) == released_config()


@pytest.mark.parametrize("edit, match", [
    (("flow: !new:cosyvoice2.flow.flow.CausalMaskedDiffWithXvec", "flow: !new:os.system"), "must be a"),
    (("key_bias: true", "key_bias: true\n        use_cnn_module: true"), "use_cnn_module"),
    (("pos_enc_layer_type: rel_pos_espnet", "pos_enc_layer_type: abs_pos"), "pos_enc_layer_type"),
    (("in_channels: 320", "in_channels: 240"), "in_channels"),
    (("flow:", "flow: !!python/object/apply:os.system ['true']\nx:"), "not valid YAML"),
])
def test_bad_flow_yaml_is_refused_with_the_reason(edit, match):
    text = (DATA / "flow.yaml").read_text().replace(*edit)
    with pytest.raises(CheckpointError, match=match):
        parse_flow_yaml(text)


# ------------------------------------------------------------------------------------------------ parity


def test_offline_mel_matches_official(flow, golden):
    g, meta = golden
    mel = flow.inference(g["tokens"], g["prompt_tokens"], g["prompt_mel"][0], g["spk"][0], meta["n_timesteps"])
    assert mel.shape == g["offline_mel"].shape == (1, 80, 160)
    assert _maxdiff(mel, g["offline_mel"]) < TOL


def test_streaming_chunks_match_official(streamed, golden):
    g, meta = golden
    mels, _, _ = streamed
    assert [m.shape[2] for m in mels] == meta["chunk_frames"]
    assert _maxdiff(mx.concatenate(mels, axis=2), g["stream_mel"]) < TOL


def test_cache_shapes_after_each_trim_match_official(streamed, golden):
    _, meta = golden
    n = meta["n_timesteps"]
    _, _, shapes = streamed
    assert len(shapes) == len(meta["cache_shapes_after_each_call"])
    for ours, theirs in zip(shapes, meta["cache_shapes_after_each_call"]):
        for k in ("conformer_cnn_cache", "conformer_att_cache"):
            assert ours[k] == tuple(theirs[k]), k
        for k in ("estimator_cnn_cache", "estimator_att_cache"):  # official: 16 scratch rows, n_timesteps used
            assert theirs[k][0] == 16 and ours[k] == (n, *theirs[k][1:]), k
    # both trims acted: the caches stop at prompt + 100 frames
    assert max(s["estimator_att_cache"][4] for s in shapes) == meta["prompt_frames"] + meta["history"]
    assert shapes[-1]["conformer_att_cache"][3] == meta["prompt_frames"] + meta["history"]


def test_final_cache_values_match_official(streamed, golden):
    g, meta = golden
    n = meta["n_timesteps"]
    _, cache, _ = streamed
    for k in ("conformer_cnn_cache", "conformer_att_cache", "estimator_cnn_cache"):
        assert _maxdiff(cache[k], g[k]) < TOL, k
    assert _maxdiff(cache["estimator_att_cache"][n - 1], g["estimator_att_cache_last_step"]) < TOL
    for k, (total, abs_total) in meta["cache_sums"].items():
        a = np.asarray(cache[k], dtype=np.float64)
        assert abs(a.sum() - total) < 1e-6 * abs_total and abs(np.abs(a).sum() - abs_total) < 1e-6 * abs_total, k


def test_streaming_is_not_the_offline_result(flow, streamed, golden):
    """The official offline path attends over the whole utterance (no chunk mask: "chunk training strategy should
    not be open-sourced"), streaming only over the past and the chunk's lookahead: they differ from the first chunk
    on, by about the mel's own scale (measured in docs/models/minicpmo.md)."""
    g, meta = golden
    mels, _, _ = streamed
    offline = flow.inference(g["tokens"], g["prompt_tokens"], g["prompt_mel"], g["spk"], meta["n_timesteps"])
    first = mels[0].shape[2]
    assert _maxdiff(mels[0], offline[:, :, :first]) > 0.1


# ------------------------------------------------------------------------------------------------ errors


def test_non_final_chunk_needs_more_than_the_lookahead(flow, golden):
    g, meta = golden
    pt = g["prompt_tokens"]
    cache = flow.setup_cache(mx.concatenate([pt, pt[:, :3]], axis=1), g["prompt_mel"], g["spk"], 1)
    with pytest.raises(ValueError, match="more than 3"):
        flow.inference_chunk([1, 2, 3], g["spk"], cache, last_chunk=False, n_timesteps=1)
    with pytest.raises(ValueError, match="outside"):
        flow.inference_chunk([1, 2, 3, 99], g["spk"], cache, last_chunk=False, n_timesteps=1)
    with pytest.raises(ValueError, match="setup_cache"):
        flow.inference_chunk([1, 2, 3, 4], g["spk"], {}, n_timesteps=1)
    with pytest.raises(ValueError, match="steps"):
        flow.inference_chunk([1, 2, 3, 4], g["spk"], cache, n_timesteps=2)
    with pytest.raises(ValueError, match="mel frames"):
        flow.setup_cache(pt, g["prompt_mel"], g["spk"], 1)


def test_missing_and_unexpected_weights_are_named(tmp_path):
    w = dict(mx.load(str(DATA / "flow_weights.safetensors")))
    w.pop("encoder.encoders.1.self_attn.pos_bias_u")
    w["decoder.estimator.extra.weight"] = mx.zeros((2,))
    with pytest.raises(CheckpointError, match=r"(?s)missing keys.*pos_bias_u.*unexpected keys.*extra\.weight"):
        flow_from_weights(load_flow_config(DATA), w)


def test_folder_without_safetensors_points_at_the_converter(tmp_path, monkeypatch):
    from omnitide_mlx.models.stepaudio2 import weights

    (tmp_path / "flow.yaml").write_text((DATA / "flow.yaml").read_text())
    with pytest.raises(CheckpointError, match="neither flow.safetensors nor flow.pt"):
        load_flow(tmp_path)
    (tmp_path / "flow.pt").write_bytes(b"not opened")
    monkeypatch.setattr(weights, "torch_available", lambda: False)
    with pytest.raises(CheckpointError, match="omnitide convert --token2wav"):
        load_flow(tmp_path)


def test_noise_too_short_is_an_error(golden):
    g, meta = golden
    model = flow_from_weights(load_flow_config(DATA), mx.load(str(DATA / "flow_weights.safetensors")))
    model.decoder.set_noise(g["noise"][:, :, :50])
    with pytest.raises(ValueError, match="noise holds 50 frames"):
        model.inference(g["tokens"], g["prompt_tokens"], g["prompt_mel"], g["spk"], 1)


# ------------------------------------------------------------------------------------------------ converter


def test_converter_round_trip_pt_to_safetensors(tmp_path):
    torch = pytest.importorskip("torch")
    from omnitide_mlx.torch.token2wav_convert import Token2wavConvertError, convert_token2wav

    w = mx.load(str(DATA / "flow_weights.safetensors"))
    state = {k: torch.from_numpy(np.asarray(v.astype(mx.float32))) for k, v in w.items()}
    torch.save(state, tmp_path / "flow.pt")
    torch.save({"generator.conv_pre.weight": torch.randn(4, 80, 5)}, tmp_path / "hift.pt")
    torch.save({"generator.conv_post.bias": torch.randn(18)}, tmp_path / "hift_original.pt")
    (tmp_path / "flow.yaml").write_text((DATA / "flow.yaml").read_text())
    written = convert_token2wav(tmp_path)
    assert sorted(p.name for p, _ in written) == ["flow.safetensors", "hift.safetensors",
                                                  "hift_original.safetensors"]
    back = mx.load(str(tmp_path / "flow.safetensors"))
    assert set(back) == set(state) and all(np.array_equal(np.asarray(back[k]), state[k].numpy()) for k in state)
    assert mx.load(str(tmp_path / "hift.safetensors"))["generator.conv_pre.weight"].shape == (4, 80, 5)
    assert convert_token2wav(tmp_path) == []  # kept unless overwrite
    load_flow(tmp_path)  # and the MLX loader takes the converted file

    (tmp_path / "flow.pt").unlink()
    torch.save({"model": {"w": torch.zeros(1)}}, tmp_path / "flow.pt")
    with pytest.raises(Token2wavConvertError, match="not named tensors"):
        convert_token2wav(tmp_path, overwrite=True)
    (tmp_path / "empty").mkdir()
    with pytest.raises(Token2wavConvertError, match="none of"):
        convert_token2wav(tmp_path / "empty")
    with pytest.raises(Token2wavConvertError, match="no token2wav folder"):
        convert_token2wav(tmp_path / "absent")


def test_convert_cli_token2wav(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    from omnitide_mlx.cli import main

    torch.save({"w": torch.ones(2, 3)}, tmp_path / "flow.pt")
    assert main(["convert", "--token2wav", str(tmp_path)]) == 0
    assert "flow.safetensors (1 tensors)" in capsys.readouterr().out
    assert mx.load(str(tmp_path / "flow.safetensors"))["w"].shape == (2, 3)
    assert main(["convert", "--token2wav", str(tmp_path), "--mlx-path", str(tmp_path / "o")]) == 2
    assert main(["convert", "--mlx-path", str(tmp_path / "o")]) == 2  # --model still required without --token2wav
