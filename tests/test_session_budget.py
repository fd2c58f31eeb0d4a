"""KV budgets that are limits (issue 15, item 5): ``kv_budget`` is a hard ceiling on the cache's buffers, ``low``
is honoured with it, watermarks given with a policy instance are applied or refused (never ignored), one input
larger than the budget is rejected before it is computed, and a cache that grew for a large unit returns to its
bound."""

import numpy as np
import pytest

from omnitide_mlx.core.pick import OmniTide, UnitFIFO
from omnitide_mlx.errors import InputTooLargeError, MediaError
from omnitide_mlx.media import iter_chunks
from omnitide_mlx.session import OmniSession, kv_budget_bytes, watermarks_for_budget


@pytest.fixture(scope="module")
def models(tiny_checkpoints):
    from omnitide_mlx.models import load

    return {name: load(path) for name, path in tiny_checkpoints.items()}


@pytest.fixture(scope="module")
def chunks(media_dir):
    return [(c.frame, c.audio, c.t) for c in iter_chunks(media_dir / "video_10s_av.mp4", seconds=6)]


def _frames(chunks, k):
    """Small and full-size frames in turn: units of different sizes (48 and 150 tokens on the tiny Qwen)."""
    frame, audio, t = chunks[k % len(chunks)]
    return (frame if k % 3 == 2 else frame[::4, ::4].copy()), audio


@pytest.mark.parametrize("name", ["qwen", "minicpmo"])
@pytest.mark.parametrize("policy", ["omnitide", "fifo", "h2o", "token"])
def test_kv_budget_is_a_hard_ceiling_on_kv_bytes(models, chunks, name, policy):
    """Before: the watermark was the budget's token count, so a unit prefilled on top of it (and the cache's
    4-page growth step) went past it: --kv-budget 512KiB peaked at 640 KiB."""
    budget = 160 << 10 if name == "qwen" else 256 << 10
    peaks = []
    s = OmniSession(models[name], policy=policy, kv_budget=budget, on_update=lambda r: peaks.append(r.kv_bytes))
    for k in range(12):
        frame, audio = _frames(chunks, k)
        s.push(frame=frame, audio=audio, t=float(k))
        assert s.cache.nbytes <= budget
        if k % 4 == 3:
            s.answer(f"Question {k}?", max_tokens=12)
            assert s.cache.nbytes <= budget
        s.cache.page_table.check_history(s.history)
    assert max(peaks) <= budget and s.stats()["evictions"] > 0
    assert s.stats()["kv_bytes_retained"] == s.history.total_tokens * s.cache.bytes_per_token


def test_low_is_honoured_with_kv_budget(models):
    s = OmniSession(models["qwen"], policy="omnitide", kv_budget="512KiB", low=300)
    high, low = watermarks_for_budget(512 << 10, s.cache.bytes_per_token, low=300)
    assert (s.policy.high, s.policy.low) == (high, 300)
    with pytest.raises(ValueError, match="above the KV budget"):
        OmniSession(models["qwen"], policy="omnitide", kv_budget="512KiB", low=5000)
    with pytest.raises(ValueError, match="kv_budget sets the high watermark"):
        OmniSession(models["qwen"], policy="omnitide", kv_budget="512KiB", high=900)


def test_watermarks_with_a_policy_instance_are_applied_or_refused(models):
    """Before: high=, low= and kv_budget= were ignored without a word when policy= was an instance."""
    with pytest.raises(ValueError, match="instance"):
        OmniSession(models["qwen"], policy=OmniTide(high=2500, low=1800), high=400)
    with pytest.raises(ValueError, match="instance"):
        OmniSession(models["qwen"], policy=UnitFIFO(), low=100)
    mine = OmniTide(high=2500, low=1800, recent_units=3)
    s = OmniSession(models["qwen"], policy=mine, kv_budget="512KiB")
    high, low = watermarks_for_budget(512 << 10, s.cache.bytes_per_token)
    assert (s.policy.high, s.policy.low, s.policy.recent_units) == (high, low, 3)
    assert (mine.high, mine.low) == (2500, 1800)  # the caller's object is not changed
    with pytest.raises(ValueError, match="never evicts"):
        OmniSession(models["qwen"], policy="full", kv_budget="512KiB")


@pytest.mark.parametrize("value", ["lots", "1e30", "-1MiB", "nan", float("nan"), -5, 0, True, float("inf")])
def test_bad_kv_budgets_fail_before_the_model_loads(value):
    with pytest.raises(ValueError, match="budget|size"):
        OmniSession("/nonexistent/model", kv_budget=value)  # the model path would fail later, differently
    with pytest.raises(ValueError):
        kv_budget_bytes(value)


def test_a_question_larger_than_the_budget_is_rejected_untouched(models, chunks):
    """Before: a 100,000-character question was prefilled whole (55 s on the tiny model), evicted everything,
    itself included, and left the cache's capacity 33x larger."""
    question = "Please describe this. " * 4600  # about 100,000 characters
    for kw in (dict(kv_budget="512KiB"), dict(high=600, low=400)):
        s = OmniSession(models["qwen"], policy="omnitide", **kw)
        s.push(frame=chunks[0][0][::4, ::4].copy(), audio=chunks[0][1], t=0)
        before = (s.history.to_json(), s.cache.capacity, s.cache.retained, np.array(s._last_logits))
        with pytest.raises(InputTooLargeError, match="the question is .* tokens"):
            s.answer(question)
        with pytest.raises(InputTooLargeError, match="the text is"):
            s.push(text=question)
        assert (s.history.to_json(), s.cache.capacity, s.cache.retained) == before[:3]
        np.testing.assert_array_equal(np.array(s._last_logits), before[3])
        assert isinstance(s.answer("And now?", max_tokens=3), str)  # the session goes on
    s = OmniSession(models["qwen"], policy="omnitide", kv_budget="128KiB")
    with pytest.raises(InputTooLargeError, match="max_tokens"):  # the reply must fit too
        s.answer("Hi?", max_tokens=400)
    assert issubclass(InputTooLargeError, MediaError)


def test_capacity_returns_to_its_bound_after_a_large_unit(models, chunks):
    s = OmniSession(models["qwen"], policy="omnitide", high=300, low=200)
    s.adapter.frame_max_pixels *= 9  # the frame's own resolution, up to 1344x1344 (about 1,300 tokens)
    small = chunks[0][0][::4, ::4].copy()
    big = np.tile(chunks[1][0], (3, 3, 1))
    s.push(frame=small, audio=chunks[0][1], t=0)
    rec = s.push(frame=big, audio=chunks[1][1], t=1)[0]
    assert rec.tokens > 1000 and s.cache.capacity > s.capacity_bound()
    for k in range(2, 6):
        s.push(frame=small, audio=chunks[k][1], t=float(k))
    assert s.cache.capacity <= s.capacity_bound() < 1000
    s.cache.page_table.check_history(s.history)
    assert s.answer("Still fine?", max_tokens=4) is not None


@pytest.mark.parametrize("name", ["qwen", "minicpmo"])
def test_the_files_alone_give_the_sessions_bytes_per_token_and_unit(models, tiny_checkpoints, chunks, name):
    """What the CLI checks --kv-budget with before loading (models/budget.py: config.json, the safetensors headers,
    the unit layout) equals what the loaded session uses and builds for the bundled clip."""
    from omnitide_mlx.models.budget import kv_need

    frame, audio, _ = chunks[0]
    need = kv_need(tiny_checkpoints[name], frame_size=(frame.shape[1], frame.shape[0]))
    s = OmniSession(models[name], policy="full")
    assert need.bytes_per_token == s.cache.bytes_per_token
    first, second = (s.push(frame=c[0], audio=c[1], t=c[2])[0] for c in chunks[:2])
    assert (need.first_unit_tokens, need.unit_tokens) == (first.tokens, second.tokens)


@pytest.mark.parametrize("bits, group", [(8, 32), (8, 64), (4, 64), (4, 128)])
def test_quantised_bytes_per_token_as_the_cache_counts_them(bits, group):
    """--kv-bits in the pre-load check: the cache's own count (the tiny models' head_dim 16 is below MLX's smallest
    group, so a 7B-shaped spec)."""
    import mlx.core as mx

    from omnitide_mlx.cache import OmniCache
    from omnitide_mlx.models.base import KVSpec
    from omnitide_mlx.models.budget import kv_bytes_per_token
    from omnitide_mlx.rope import RopeSpec

    spec = KVSpec(num_layers=28, kv_heads=4, head_dim=128, rope=RopeSpec(128, 1e6), position_axes=3)
    for dtype, size in ((mx.bfloat16, 2), (mx.float32, 4)):
        cache = OmniCache.for_spec(spec, dtype=dtype, kv_bits=bits, kv_group_size=group)
        assert kv_bytes_per_token(28, 4, 128, size, bits, group) == cache.bytes_per_token \
            == spec.bytes_per_token(dtype, bits, group)
        cache.storage.grow(0, 64)  # the buffers themselves: packed values, scales and biases of 64 slots
        assert cache.nbytes == 64 * cache.bytes_per_token
    assert kv_bytes_per_token(28, 4, 128, 2) == spec.bytes_per_token()
    cache = OmniCache.for_spec(spec, dtype=mx.float16)
    cache.storage.grow(0, 64)
    assert cache.nbytes == 64 * spec.bytes_per_token(mx.float16)
