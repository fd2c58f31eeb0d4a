"""Model shapes are declared once (the family records, models/<family>/family.py) and every reader takes them
from there; KV bytes per token have one definition (core/shapes.py)."""

import dataclasses

import pytest

from omnitide_mlx.core.shapes import ModelShape, kv_bytes_per_token
from omnitide_mlx.models.family import profiles, shapes

PROFILES = profiles()
SHAPES = shapes()


def test_every_profile_reads_its_shape_from_its_family_record():
    assert sorted(PROFILES) == sorted(SHAPES)
    for name, prof in PROFILES.items():
        s = SHAPES[name]
        assert prof.shape is s
        for f in ("family", "layers", "hidden", "intermediate", "q_heads", "kv_heads", "head_dim", "vocab",
                  "rope_theta"):
            assert getattr(prof, f) == getattr(s, f), (name, f)
        assert prof.kv_bytes_per_token == s.kv_bytes_per_token(prof.kv_dtype_bytes)


@pytest.mark.parametrize("name,kv_bytes", [("qwen2.5-omni-7b", 57_344), ("qwen2.5-omni-3b", 36_864),
                                           ("minicpm-o-4.5", 147_456), ("minicpm-o-2.6", 57_344)])
def test_kv_bytes_per_token_in_fp16_are_the_documented_figures(name, kv_bytes):
    # docs/models/qwen2_5_omni.md (7B 28 x 4 x 128, 3B 36 x 2 x 128); MiniCPM-o 4.5 36 x 8 x 128
    assert SHAPES[name].kv_bytes_per_token(2) == kv_bytes


def test_shapes_are_consistent_and_say_where_they_come_from():
    for s in SHAPES.values():
        assert s.q_heads % s.kv_heads == 0 and s.source
        if s.name.startswith("qwen2.5-omni"):  # Qwen2 configs carry no head_dim: hidden / heads
            assert s.head_dim * s.q_heads == s.hidden
    with pytest.raises(dataclasses.FrozenInstanceError):
        SHAPES["qwen2.5-omni-7b"].layers = 1  # type: ignore[misc]


def test_the_qwen_ports_config_defaults_are_the_7b_shape():
    # transformers' Qwen2_5OmniTextConfig defaults are the 7B values (shared/reference/qwen2_5_omni.md), and so are
    # the port's: a drift on either side shows here
    from omnitide_mlx.models.qwen2_5_omni.config import TextConfig

    c, s = TextConfig(), SHAPES["qwen2.5-omni-7b"]
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.vocab_size, c.rope_theta) == (s.layers, s.hidden, s.intermediate, s.q_heads, s.kv_heads,
                                                       s.head_dim, s.vocab, s.rope_theta)


def test_linear_macs_per_token():
    s = ModelShape("t", "minicpmo", layers=1, hidden=8, intermediate=16, q_heads=4, kv_heads=2, head_dim=2, vocab=10)
    assert s.linear_macs_per_token() == 8 * 8 + 2 * 8 * 4 + 8 * 8 + 3 * 8 * 16


def test_kv_bytes_per_token_float_and_quantised():
    assert kv_bytes_per_token(28, 4, 128, 2) == 57_344
    # 4-bit, groups of 64: 64 bytes of packed values plus a scale and a bias per group, fp16
    assert kv_bytes_per_token(28, 4, 128, 2, 4, 64) == 2 * 28 * 4 * (64 + 2 * 2 * 2)
    assert kv_bytes_per_token(28, 4, 128, 4, 8, 32) == 2 * 28 * 4 * (128 + 2 * 4 * 4)
    assert SHAPES["minicpm-o-4.5"].kv_bytes_per_token(2, 8, 128) == kv_bytes_per_token(36, 8, 128, 2, 8, 128)
