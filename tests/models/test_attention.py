"""The attention plumbing every language model shares (models/attention.py)."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from omnitide_mlx.cache import OmniCache
from omnitide_mlx.models.attention import rope_at, sequential_positions
from omnitide_mlx.models.minicpmo.config import TextConfig
from omnitide_mlx.models.minicpmo.language import LanguageModel


def tiny_lm():
    mx.random.seed(0)
    lm = LanguageModel(TextConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=50, rope_theta=1e4))
    mx.eval(lm.parameters())
    return lm


def test_a_forward_that_fails_half_way_leaves_the_omnicache_as_it_was():
    lm = tiny_lm()
    cache = OmniCache.for_spec(lm_kv_spec(lm), dtype=mx.float32)
    cache.set_owner(0)
    x = mx.random.normal((1, 5, 64))
    lm(x, cache, np.arange(5))
    before = (cache.page_table.stats(), cache.page_table.seq.copy())

    original = type(lm.layers[1]).__call__

    def broken(self, *a, **k):
        raise RuntimeError("boom")

    type(lm.layers[1]).__call__ = broken
    try:
        with pytest.raises(RuntimeError, match="boom"):
            lm(x, cache, np.arange(5, 10))
    finally:
        type(lm.layers[1]).__call__ = original
    assert not cache.in_step
    assert cache.page_table.stats() == before[0]
    assert np.array_equal(cache.page_table.seq[: before[1].size], before[1])
    # and the cache goes on: the retried chunk gives what a fresh cache gives
    out = lm(x, cache, np.arange(5, 10))
    fresh = OmniCache.for_spec(lm_kv_spec(lm), dtype=mx.float32)
    fresh.set_owner(0)
    lm(x, fresh, np.arange(5))
    np.testing.assert_allclose(np.array(out), np.array(lm(x, fresh, np.arange(5, 10))), atol=1e-5)


def test_omnicache_mlx_lm_cache_and_no_cache_agree():
    lm = tiny_lm()
    x = mx.random.normal((1, 9, 64))
    full = lm(x, None, np.arange(9))
    kv = [KVCache() for _ in lm.layers]
    omni = OmniCache.for_spec(lm_kv_spec(lm), dtype=mx.float32)
    omni.set_owner(0)
    parts = {"kv": [], "omni": []}
    for a, b in ((0, 4), (4, 5), (5, 9)):
        parts["kv"].append(lm(x[:, a:b], kv, None))
        parts["omni"].append(lm(x[:, a:b], omni, np.arange(a, b)))
    for name, chunks in parts.items():
        np.testing.assert_allclose(np.array(mx.concatenate(chunks, axis=1)), np.array(full), atol=2e-5, err_msg=name)


def test_positions_and_rope_at():
    assert sequential_positions(None, 3, None) == 0
    assert sequential_positions(np.array([4, 5, 6]), 3, None) == 4
    gapped = sequential_positions([4, 9, 10], 3, None)
    assert isinstance(gapped, mx.array) and gapped.tolist() == [4, 9, 10]
    with pytest.raises(ValueError, match="positions"):
        sequential_positions([1, 2], 3, None)
    with pytest.raises(ValueError, match="explicitly"):
        sequential_positions(None, 3, OmniCache(1, 1, 8))
    x = mx.random.normal((1, 2, 3, 8))
    for traditional in (False, True):
        per_token = rope_at(x, mx.array([7, 8, 9]), 8, 1e4, traditional)
        offset = rope_at(x, 7, 8, 1e4, traditional)
        np.testing.assert_allclose(np.array(per_token), np.array(offset), atol=1e-5)


def lm_kv_spec(lm):
    from omnitide_mlx.models.base import KVSpec

    a = lm.args
    return KVSpec(a.num_hidden_layers, a.num_key_value_heads, a.head_dim, lm.rope_spec())
