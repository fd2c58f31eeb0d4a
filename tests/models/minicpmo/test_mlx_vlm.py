"""Parity with mlx-vlm 0.7.10's ``minicpmo`` on fresh random tiny configs, on the paths where mlx-vlm agrees with
the official code: the SigLIP tower + resampler on unsliced images (grids without bucket edge cases), Whisper +
projector + pooling on audio of up to 1 s (or with the chunk mask off), the Qwen3 LLM, and weight sanitising
from the official layout. (mlx-vlm has no slicing, no 1 s chunk mask, float32 arange buckets, no streaming.)

mlx-vlm is a test-only dependency installed without its dependency tree (``pip install --no-deps
mlx-vlm==0.7.10``); its package ``__init__`` imports its server and converter (requests, fastapi, ...), so only
the ``models`` subpackage is imported here.
"""

import importlib
import importlib.metadata
import importlib.machinery
import importlib.util
import sys

import mlx.core as mx
import numpy as np
import pytest

from omnitide_mlx.models.minicpmo.config import ModelConfig
from omnitide_mlx.models.minicpmo.model import Model
from omnitide_mlx.models.minicpmo.tiny import random_weights, tiny_config, to_official_layout

from ._helpers import max_diff

TOL = 2e-5


def mlx_vlm_minicpmo():
    try:
        version = importlib.metadata.version("mlx-vlm")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("mlx-vlm is not installed (test-only: pip install --no-deps mlx-vlm==0.7.10)")
    if version != "0.7.10":
        pytest.skip(f"parity is pinned to mlx-vlm 0.7.10 (found {version})")
    if "mlx_vlm" not in sys.modules:
        try:
            importlib.import_module("mlx_vlm")
        except ImportError:  # the package __init__ needs the server's dependencies: load its models only
            spec = importlib.util.find_spec("mlx_vlm")
            stub = importlib.util.module_from_spec(importlib.machinery.ModuleSpec(
                "mlx_vlm", None, is_package=True))
            stub.__path__ = list(spec.submodule_search_locations)
            sys.modules["mlx_vlm"] = stub
    return importlib.import_module("mlx_vlm.models.minicpmo")


CONFIGS = {
    "tiny": dict(vocab_size=512, query_num=16, rope_scaling={"type": "default", "mrope_section": [8, 4, 4]},
                 vision_config={"image_size": 70}),
    "wider": dict(vocab_size=640, query_num=8, hidden_size=256, intermediate_size=384, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                  rope_scaling={"type": "default", "mrope_section": [16, 8, 8]},
                  vision_config={"hidden_size": 64, "intermediate_size": 80, "num_hidden_layers": 3,
                                 "num_attention_heads": 2, "image_size": 98},
                  audio_config={"d_model": 64, "encoder_layers": 3, "encoder_attention_heads": 8,
                                "encoder_ffn_dim": 256}),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request):
    vlm = mlx_vlm_minicpmo()
    cfg = tiny_config(**CONFIGS[request.param])
    ours = Model(ModelConfig.from_dict(cfg))
    official = {k: mx.array(v) for k, v in to_official_layout(random_weights(ours, seed=11)).items()}
    ours.load_weights(list(ours.sanitize(official).items()), strict=True)
    theirs = vlm.Model(vlm.ModelConfig.from_dict(cfg))
    theirs.load_weights(list(theirs.sanitize(dict(official)).items()), strict=True)
    mx.eval(ours.parameters(), theirs.parameters())
    return cfg, ours, theirs


def _image(rng, h, w):
    """A normalised image of h x w patches in the official layout (3, 14, h*w*14)."""
    x = rng.standard_normal((3, h * 14, w * 14)).astype(np.float32)
    return x.reshape(3, h, 14, w, 14).transpose(0, 2, 1, 3, 4).reshape(3, 14, h * w * 14)


@pytest.mark.parametrize("grid", [(4, 5), (3, 6), (2, 2), (5, 3)])
def test_vision_and_resampler(pair, grid):
    cfg, ours, theirs = pair
    x = _image(np.random.default_rng(sum(grid)), *grid)
    got = ours.vision_embeddings([x], [grid])
    ref = theirs.get_vision_embedding([[x]], [np.array([grid])])[0]
    assert got.shape == ref.shape == (1, cfg["query_num"], cfg["hidden_size"])
    assert max_diff(got, ref) < TOL


@pytest.mark.parametrize("frames, chunk", [(100, 1.0), (60, 1.0), (250, -1)])
def test_audio_tokens(pair, frames, chunk):
    _, ours, theirs = pair
    feats = np.random.default_rng(frames).standard_normal((1, 80, frames)).astype(np.float32)
    got = ours.audio_embeddings(feats, [[frames]], chunk_length=chunk)[0]
    ref = theirs.get_audio_embedding(mx.array(feats), [[frames]])[0][0]
    assert got.shape == ref.shape
    assert max_diff(got, ref) < TOL


def test_merged_forward_and_incremental_decode(pair):
    cfg, ours, theirs = pair
    rng = np.random.default_rng(5)
    q = cfg["query_num"]
    ids = np.concatenate([[11, 12], [400], np.zeros(q, int), [401], [13, 404], np.zeros(10, int), [405],
                          [14, 15, 16]]).astype(np.int32)[None]
    image_bound = [np.array([[3, 3 + q]])]
    audio_bounds = [np.array([[6 + q, 16 + q]])]
    px = _image(rng, 4, 5)
    feats = rng.standard_normal((1, 80, 100)).astype(np.float32)
    got = ours(ids, pixel_values=[[px]], tgt_sizes=[np.array([[4, 5]])], image_bound=image_bound,
               audio_features=feats, audio_feature_lens=[[100]], audio_bounds=audio_bounds)
    ref = theirs(mx.array(ids), pixel_values=[[px]], tgt_sizes=[np.array([[4, 5]])], image_bound=image_bound,
                 audio_features=mx.array(feats), audio_feature_lens=[[100]], audio_bounds=audio_bounds).logits
    assert max_diff(got, ref) < TOL
    embeds = ours.embed_inputs(ids, [[px]], [np.array([[4, 5]])], image_bound, feats, [[100]], audio_bounds)
    lm = ours.language_model
    cache = lm.make_cache()
    t = embeds.shape[1]
    steps = [lm(embeds[:, :t - 3], cache=cache)] + [lm(embeds[:, i:i + 1], cache=cache) for i in range(t - 3, t)]
    assert max_diff(mx.concatenate(steps, axis=1), ref) < TOL


def test_sanitize_names_agree(pair):
    _, ours, theirs = pair
    from mlx.utils import tree_flatten

    ours_names = {k for k, _ in tree_flatten(ours.parameters())}
    theirs_names = {k for k, _ in tree_flatten(theirs.parameters())}
    # mlx-vlm splits the resampler's fused in_proj into q/k/v; every other name is shared
    fused = {"resampler.attn.in_proj_weight", "resampler.attn.in_proj_bias"}
    split = {f"resampler.attn.{p}_proj.{w}" for p in "qkv" for w in ("weight", "bias")}
    assert ours_names - fused == theirs_names - split
