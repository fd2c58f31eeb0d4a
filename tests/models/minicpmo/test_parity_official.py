"""Parity with the official MiniCPM-o 4.5 PyTorch code on the tiny fixture (every array of
tests/data/fixtures/minicpmo45-tiny), float32."""

import mlx.core as mx
import numpy as np
import pytest

from omnitide_mlx.models.minicpmo.audio import WhisperStreamCache
from omnitide_mlx.models.minicpmo.processor import MiniCPMOProcessor, TextTokenizer, build_tokenizer
from omnitide_mlx.models.minicpmo.resampler import sincos_2d
from omnitide_mlx.models.minicpmo.vision import bucket_ids, torch_arange_f32

from ._helpers import max_diff

TOL = 1e-5


def by_patch(chw: np.ndarray, p: int = 14) -> np.ndarray:
    """The official reshape_by_patch, written independently of the processor: output[c, kh, l*p + kw] is
    pixel (kh, kw) of patch l (row-major over the patch grid)."""
    c, hh, ww = chw.shape
    h, w = hh // p, ww // p
    out = np.zeros((c, p, h * w * p), dtype=chw.dtype)
    for i in range(h):
        for j in range(w):
            lidx = i * w + j
            out[:, :, lidx * p:(lidx + 1) * p] = chw[:, i * p:(i + 1) * p, j * p:(j + 1) * p]
    return out


@pytest.fixture(scope="module")
def inputs(golden):
    g = golden
    return dict(input_ids=g["input_ids"], pixel_values=[[by_patch(g["pixel_values"])]], tgt_sizes=[g["tgt_sizes"]],
                image_bound=[g["image_bound"]], audio_features=g["audio_features"],
                audio_feature_lens=[g["audio_feature_lens"]], audio_bounds=[g["audio_bounds"]])


def test_processor_reshape_by_patch_is_the_official_layout(golden):
    proc = MiniCPMOProcessor.__new__(MiniCPMOProcessor)
    proc.patch_size = 14
    x = golden["pixel_values"]
    np.testing.assert_array_equal(proc.reshape_by_patch(x), by_patch(x))


def test_bucket_ids_reproduce_torch_for_every_side_length(fixture_dir, official_extra):
    table = np.load(fixture_dir / "torch_siglip_bucket_ids_n70_nb1to140.npy")
    for nb in range(1, 141):
        np.testing.assert_array_equal(bucket_ids(nb, 70), table[nb, :nb], err_msg=f"nb={nb}")
    extra = official_extra["siglip_bucket_ids_70"]
    for nb in range(1, 71):
        np.testing.assert_array_equal(bucket_ids(nb, 70), extra[nb, :nb])
    # the cases where exact integer arithmetic differs from torch must come out as torch's, not (k*70)//nb
    assert any(not np.array_equal(bucket_ids(nb, 70), (np.arange(nb) * 70) // nb) for nb in (25, 49, 50))


def test_torch_arange_emulation_matches_torch():
    torch = pytest.importorskip("torch")
    for start, end, step in [(1 / 70, 1.0, 1 / 70), (0.0, 1 - 1e-6, 1 / 77), (0.0, 1 - 1e-6, 1 / 133),
                             (1 / 5, 1.0, 1 / 5), (0.0, 1 - 1e-6, 1 / 350)]:
        np.testing.assert_array_equal(torch_arange_f32(start, end, step),
                                      torch.arange(start, end, step).numpy())


def test_resampler_sincos_table(golden):
    # float32 arguments up to 69 rad: numpy's SIMD sin/cos (and einsum's FMA use) vary by CPU, and one ulp of the
    # argument (7.6e-6) moves the value by as much; bit-equal on the machine that made the golden, 1.9e-6 on another
    assert max_diff(sincos_2d(128, 70, 70), golden["resampler_pos_embed"]) <= 1e-5


def test_vision_tower(fixture_model, golden, official):
    px = mx.array(by_patch(golden["pixel_values"])[None])
    out = fixture_model.vision_tower(px, np.array([[4, 5]]))
    assert max_diff(out, official["vision_tower_out"]) < TOL


def test_resampler(fixture_model, golden, official):
    out = fixture_model.vision_embeddings([by_patch(golden["pixel_values"])], [[4, 5]])
    assert max_diff(out, official["resampler_out"]) < TOL


def test_multi_slice_padded_batch(fixture_model, official_extra):
    slices = [by_patch(official_extra[f"slice_img_{i}"]) for i in range(4)]
    out = fixture_model.vision_embeddings(slices, official_extra["slice_tgt_sizes"])
    assert max_diff(out, official_extra["slice_resampler_out"]) < TOL
    # batching is exact per slice: one slice alone gives the same rows
    alone = fixture_model.vision_embeddings(slices[3:], official_extra["slice_tgt_sizes"][3:])
    assert max_diff(alone[0], out[3]) < TOL


def test_drop_vision_last_layer_changes_the_tower(fixture_dir, fixture_config, golden, official):
    from omnitide_mlx.models.loading import load_safetensors, load_weights_strict
    from omnitide_mlx.models.minicpmo.config import ModelConfig
    from omnitide_mlx.models.minicpmo.model import Model

    cfg = dict(fixture_config, drop_vision_last_layer=True)
    model = Model(ModelConfig.from_dict(cfg))
    assert len(model.vision_tower.encoder.layers) == 1
    weights = model.sanitize(load_safetensors(fixture_dir))  # drops vpm.encoder.layers.1.*
    assert not any(k.startswith("vision_tower.encoder.layers.1.") for k in weights)
    load_weights_strict(model, weights)
    out = model.vision_tower(mx.array(by_patch(golden["pixel_values"])[None]), np.array([[4, 5]]))
    assert max_diff(out, official["vision_tower_out"]) > 1e-2


@pytest.mark.parametrize("chunk, key", [(-1, "audio_tokens_full"), (1.0, "audio_tokens_chunk1s")])
def test_audio_tokens_one_second(fixture_model, golden, official, chunk, key):
    out = fixture_model.audio_embeddings(golden["audio_features"], [golden["audio_feature_lens"]], chunk)
    assert out[0].shape == (10, 128)
    assert max_diff(out[0], official[key]) < TOL


def test_audio_encoder_output(fixture_model, golden):
    out = fixture_model.audio_tower(mx.array(golden["audio_features"]))
    assert max_diff(out, golden["audio_encoder_out"]) < TOL


@pytest.mark.parametrize("chunk, key", [(-1, "long_audio_tokens_full"), (1.0, "long_audio_tokens_chunk1s")])
def test_long_audio_chunk_mask(fixture_model, official, chunk, key):
    out = fixture_model.audio_embeddings(official["long_audio_features"], [[250]], chunk)
    assert out[0].shape == (25, 128)
    assert max_diff(out[0], official[key]) < TOL


def test_streamed_audio_with_context_equals_offline_chunked(fixture_model, official):
    feats = official["long_audio_features"]
    cache = WhisperStreamCache()
    t0, cache = fixture_model.audio_embeddings_streaming(feats[:, :, 0:102], cache, 0, 2)
    t1, cache = fixture_model.audio_embeddings_streaming(feats[:, :, 98:202], cache, 2, 2)
    assert cache.length == 100
    out = mx.concatenate([t0, t1])
    assert max_diff(out, official["long_audio_tokens_stream2x1s_ctx"]) < TOL
    assert max_diff(out, official["long_audio_tokens_chunk1s"][:20]) < TOL


def test_streamed_audio_without_context(fixture_model, official):
    feats = official["long_audio_features"]
    cache = WhisperStreamCache()
    t0, cache = fixture_model.audio_embeddings_streaming(feats[:, :, 0:100], cache)
    t1, cache = fixture_model.audio_embeddings_streaming(feats[:, :, 100:200], cache)
    assert max_diff(mx.concatenate([t0, t1]), official["long_audio_tokens_stream2x1s"]) < TOL


def test_merged_embeddings_and_logits(fixture_model, inputs, official):
    embeds = fixture_model.embed_inputs(**inputs)
    assert max_diff(embeds, official["inputs_embeds"]) < TOL
    logits = fixture_model(**inputs)
    assert logits.shape == (1, 38, 512)
    assert max_diff(logits, official["logits"]) < TOL


def test_forward_accepts_torch_tensors(fixture_model, inputs, official):
    torch = pytest.importorskip("torch")
    t = {k: (torch.from_numpy(np.asarray(v)) if isinstance(v, np.ndarray) else
             [[torch.from_numpy(s) for s in v[0]]] if k == "pixel_values" else [torch.from_numpy(np.asarray(v[0]))])
         for k, v in inputs.items()}
    assert max_diff(fixture_model(**t), official["logits"]) < TOL


def test_incremental_decode_equals_full_forward(fixture_model, inputs, official):
    embeds = fixture_model.embed_inputs(**inputs)
    lm = fixture_model.language_model
    cache = lm.make_cache()
    parts = [lm(embeds[:, :35], cache=cache)]
    for i in range(35, 38):
        parts.append(lm(embeds[:, i:i + 1], cache=cache))
    assert max_diff(mx.concatenate(parts, axis=1), official["logits"]) < TOL


def test_mel_features_match_the_official_processor(data_dir, fixture_dir):
    d = np.load(fixture_dir / "official_mel.npz")
    tok = TextTokenizer(build_tokenizer(data_dir / "tokenizers" / "minicpm-o-4_5"))
    proc = MiniCPMOProcessor(tok)
    feats, lens = proc.audio_features([d["sine2.5s_sig"], d["noise1.3s_odd_sig"]])
    np.testing.assert_array_equal(lens, [250, 131])
    assert max_diff(feats[0, :, :250], d["sine2.5s_feat"][0]) < 2e-5
    assert max_diff(feats[1, :, :131], d["noise1.3s_odd_feat"][0]) < 2e-5
    assert (feats[1, :, 131:] == 0).all()  # zero-padded batch, as the official pad_sequence


def test_positions_with_a_gap_equal_cached_calls(fixture_model, inputs):
    """One call with per-token positions (a gap, as after an eviction) equals two cached calls at those starts."""
    lm = fixture_model.language_model
    embeds = fixture_model.embed_inputs(**inputs)
    pos = np.concatenate([np.arange(0, 20), np.arange(31, 49)])
    one = lm(embeds, positions=pos)
    cache = lm.make_cache()
    two = mx.concatenate([lm(embeds[:, :20], cache=cache, positions=0),
                          lm(embeds[:, 20:], cache=cache, positions=31)], axis=1)
    assert max_diff(one, two) < TOL
    assert max_diff(one, lm(embeds)) > 1e-3  # the positions matter
