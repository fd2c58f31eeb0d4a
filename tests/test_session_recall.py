"""Recall (issue 30): evicted units go to a bounded store and come back for an answer.

The cache-level properties (a recalled unit's keys are its stored keys re-rotated to their new positions, up to
the store's quantisation) and the session's (everything recalled answers as full context does; positions, pages
and retained keys are as before once the answer has released the units; save / restore keeps the store) on the
tiny random Qwen2.5-Omni checkpoint with the real tokenizer."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnitide_mlx.cache import OmniCache
from omnitide_mlx.core.units import SpanKind, Unit, UnitKind
from omnitide_mlx.media import iter_chunks
from omnitide_mlx.recall import RecallStore
from omnitide_mlx.rope import RopeSpec
from omnitide_mlx.session import OmniSession

ROPE = RopeSpec(64, 10000.0)


def _rotate(x: mx.array, offset: int) -> np.ndarray:
    """``x`` [L, Hkv, n, D] rotated by ``offset`` positions (float32 numpy)."""
    layers, heads, n, d = x.shape
    flat = x.transpose(2, 0, 1, 3).reshape(n, layers * heads, d)
    y = ROPE.rotate_tokens(flat, np.full(n, offset))
    return np.array(y.reshape(n, layers, heads, d).transpose(1, 2, 0, 3))


@settings(max_examples=12, deadline=None)
@given(n=st.integers(1, 40), delta=st.integers(-300, 300), pending=st.integers(0, 50),
       store_bits=st.sampled_from([None, 8, 4]), kv_bits=st.sampled_from([None, 8]), seed=st.integers(0, 99))
def test_a_recalled_units_keys_are_its_stored_keys_rerotated(n, delta, pending, store_bits, kv_bits, seed):
    """Write a unit, shift it (a deferred shift in a quantised cache), store it, free it, readmit it ``delta``
    positions on: its keys are the written keys rotated by ``delta - pending``, its values the written values,
    within the store's (and a quantised cache's) rounding."""
    cache = OmniCache(2, 2, 64, ROPE, mx.float32, page_size=16, subblock_size=8, kv_bits=kv_bits)
    k = mx.random.normal((2, 2, n, 64), key=mx.random.key(seed))
    v = mx.random.normal((2, 2, n, 64), key=mx.random.key(seed + 1000))
    cache.set_owner(1)
    slots = cache.begin_step(n)
    for layer in cache.layers:
        layer.attend(mx.zeros((1, 2, n, 64)), k[layer.index][None], v[layer.index][None], 1.0)
    cache.end_step()
    if pending:
        cache.storage.rerotate(slots, np.full(n, pending), [0, 1])
    unit = Unit.build(1, UnitKind.MEDIA, [(SpanKind.AUDIO, n)], start_position=500)
    store = RecallStore(cache, 10**8, store_bits)
    store.capture(cache, unit, slots)
    cache.table.free(slots)
    entry = store.index.get(1)
    keys, values = store.rows(entry, delta)
    back = cache.readmit(1, entry.serials, keys, values)
    got_k, got_v = (np.array(a) for a in cache.storage.read_rows(back))
    want_k, want_v = _rotate(k, delta - pending), np.array(v)
    # 8-bit steps are range / 255 per group of 64 (twice when the cache is quantised too), 4-bit range / 15
    tol = {None: 1e-4, 8: 0.05, 4: 0.5}
    bound = tol[store_bits] + (tol[kv_bits] if kv_bits else 0)
    assert np.abs(got_k - want_k).max() <= bound * max(1.0, np.abs(want_k).max())
    assert np.abs(got_v - want_v).max() <= bound * max(1.0, np.abs(want_v).max())
    cache.table.validate()


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    from omnitide_mlx.models import load

    return load(tiny_checkpoints["qwen"])


@pytest.fixture(scope="module")
def chunks(media_dir):
    return [(c.frame[::4, ::4].copy(), c.audio, c.t) for c in iter_chunks(media_dir / "video_10s_av.mp4", seconds=6)]


def _stream(model, chunks, **kw) -> OmniSession:
    s = OmniSession(model, kv_dtype=mx.float32, **kw)
    for frame, audio, t in chunks:
        s.push(frame=frame, audio=audio, t=t)
    return s


def test_everything_recalled_answers_as_full_context(model, chunks):
    """FIFO drops whole units; with all of them recalled the cache holds what full context's does, at the same
    positions, so the question's logits and the greedy answer are full context's."""
    full = _stream(model, chunks, policy="full")
    fifo = _stream(model, chunks, policy="fifo", high=300, low=200, recall="10MB", recall_tokens=10_000)
    stored = [e.uid for e in fifo.recall.index]
    assert stored and len(fifo.history) < len(full.history)
    ids = fifo.adapter.tokenizer.encode(" What did you see?") if hasattr(fifo.adapter, "tokenizer") else [9, 8, 7]
    got, want = fifo.probe_logits(ids), full.probe_logits(ids)
    assert fifo.last_recall()["uids"] == stored
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)
    assert fifo.answer("What happened?", max_tokens=8) == full.answer("What happened?", max_tokens=8)
    rec = fifo.last_recall()
    assert rec["uids"] == stored and rec["t"] == [float(c[2]) for c in chunks[:len(stored)]]
    plain = _stream(model, chunks, policy="fifo", high=300, low=200)
    assert plain.answer("What happened?", max_tokens=8) != full.answer("What happened?", max_tokens=8) or \
        not np.allclose(plain.probe_logits(ids), want, atol=2e-4)  # recall made the difference


def test_release_restores_positions_pages_and_keys(model, chunks):
    s = _stream(model, chunks, policy="fifo", high=300, low=200, recall="10MB", recall_tokens=60)
    before = s.history.to_json()
    slots = np.concatenate([s.cache.slots_of_unit(u.uid) for u in s.history])
    keys = np.array(s.cache.storage.read_rows(slots)[0])
    s.probe_logits([5, 6, 7])
    rec = s.last_recall()
    assert rec["uids"] and rec["tokens"] <= 60 and rec["shift"] > 0
    assert s.history.to_json() == before
    s.cache.page_table.validate()
    s.cache.page_table.check_history(s.history)
    np.testing.assert_array_equal(np.concatenate([s.cache.slots_of_unit(u.uid) for u in s.history]), slots)
    np.testing.assert_allclose(np.array(s.cache.storage.read_rows(slots)[0]), keys, atol=1e-4)
    s.answer("And now?", max_tokens=3)
    assert s.last_recall()["uids"]
    for u, b in zip(s.history.to_json()["units"], before["units"]):
        assert u == b  # the units before the question kept their positions
    s.cache.page_table.validate()
    s.cache.page_table.check_history(s.history)
    stats = s.stats()["recall"]
    assert stats["units"] == len(s.recall.index) and stats["answers"][-1]["question"] == "And now?"
    assert {"probe_ms", "score_ms", "rerotate_ms", "copy_ms", "release_ms"} <= set(stats["answers"][-1])


def test_save_and_restore_keep_the_store(model, chunks, tmp_path):
    s = _stream(model, chunks, policy="fifo", high=300, low=200, recall="10MB")
    path = s.save(tmp_path / "sess")
    assert (path / "recall.safetensors").is_file()
    r = OmniSession.restore(path, model)
    assert r.recall.index.state() == s.recall.index.state()
    for uid, arrays in s.recall.arrays.items():
        for name, a in arrays.items():
            np.testing.assert_array_equal(np.array(r.recall.arrays[uid][name]), np.array(a))
    np.testing.assert_array_equal(r.probe_logits([3, 4]), s.probe_logits([3, 4]))
    assert r.last_recall()["uids"] == s.last_recall()["uids"]


def test_a_store_over_its_budget_forgets_the_oldest(model, chunks):
    s = _stream(model, chunks, policy="fifo", high=300, low=200, recall=40_000)
    assert s.recall.index.total_bytes <= 40_000 and s.recall.index.dropped > 0
    assert [e.uid for e in s.recall.index] == sorted(e.uid for e in s.recall.index)
    assert min(e.uid for e in s.recall.index) > 1  # the oldest went first


@pytest.mark.parametrize("kw, match", [
    ({"recall": "lots"}, "cannot read 'lots' as a size"),
    ({"recall": -5}, "positive size"),
    ({"recall_tokens": 100}, "set recall"),
    ({"recall": "1MB", "recall_tokens": 0}, "recall_tokens must be a positive int"),
    ({"recall": "1MB", "recall_bits": 3}, "recall_bits must be 8, 4 or None"),
])
def test_bad_recall_options_are_refused_before_the_model_loads(kw, match):
    with pytest.raises(ValueError, match=match):
        OmniSession("/nonexistent/model", **kw)


def test_under_a_kv_budget_recall_brings_back_only_what_fits(model, chunks):
    """The ceiling holds with recalled units in the cache: the question and its reply keep their room, and the
    units that would not fit stay in the store."""
    budget = 512 * 320  # 320 float32 tokens of the tiny model (512 bytes each)
    s = _stream(model, chunks, policy="fifo", kv_budget=budget, recall="10MB", recall_tokens=10_000)
    stored = sum(e.tokens for e in s.recall.index)
    peak = []
    s.on_update = lambda rec: peak.append(s.cache.capacity)
    s.answer("What happened?", max_tokens=6)
    rec = s.last_recall()
    assert 0 < rec["tokens"] < stored  # some, not all
    assert max(peak + [s.cache.capacity]) * 512 <= budget and s.stats()["kv_bytes"] <= budget
    s.cache.page_table.validate()
    s.cache.page_table.check_history(s.history)


def test_a_readmission_that_fails_leaves_the_session_as_it_was(model, chunks, monkeypatch):
    s = _stream(model, chunks, policy="fifo", high=300, low=200, recall="10MB", recall_tokens=10_000)
    before = s.history.to_json()
    slots = np.concatenate([s.cache.slots_of_unit(u.uid) for u in s.history])
    keys = np.array(s.cache.storage.read_rows(slots)[0])
    calls = []

    def failing(*a, **kw):  # the second unit's copy fails (out of memory, say)
        if calls:
            raise MemoryError("no room for the recalled rows")
        calls.append(1)
        return type(s.cache).readmit(s.cache, *a, **kw)

    monkeypatch.setattr(s.cache, "readmit", failing)
    with pytest.raises(MemoryError):
        s.probe_logits([5, 6])
    assert s.history.to_json() == before
    s.cache.page_table.validate()
    s.cache.page_table.check_history(s.history)
    np.testing.assert_allclose(np.array(s.cache.storage.read_rows(slots)[0]), keys, atol=1e-4)
    monkeypatch.undo()
    assert s.probe_logits([5, 6]).shape == s.probe_logits([5, 6]).shape and s.last_recall()["uids"]
