"""OmniSession end to end on tiny checkpoints of both models: streaming, retention, replies, save / restore,
bad input, and one producer with one consumer thread."""

import threading

import mlx.core as mx
import numpy as np
import pytest

from omnitide_mlx.errors import MediaError
from omnitide_mlx.media import iter_chunks
from omnitide_mlx.session import OmniSession, parse_bytes, watermarks_for_budget


@pytest.fixture(scope="module")
def models(tiny_checkpoints):
    from omnitide_mlx.models import load

    return {name: load(path) for name, path in tiny_checkpoints.items()}


@pytest.fixture(scope="module")
def chunks(media_dir):
    out = []
    for c in iter_chunks(media_dir / "video_10s_av.mp4", seconds=6):
        # a small frame keeps the tiny models' vision cost down; the layout per unit is unchanged
        out.append((c.frame[::4, ::4].copy(), c.audio, c.t))
    return out


@pytest.mark.parametrize("name", ["qwen", "minicpmo"])
@pytest.mark.parametrize("policy", ["omnitide", "omnipick", "full", "fifo", "token", "streamingllm", "h2o", "eager"])
def test_stream_then_ask_keeps_kv_under_the_high_watermark(models, chunks, name, policy):
    high, low = 300, 200
    s = OmniSession(models[name], policy=policy, high=high, low=low)
    for frame, audio, t in chunks:
        rec = s.push(frame=frame, audio=audio, t=t)[0]
        assert rec.kind == "media" and rec.t == t
        if policy != "full":
            assert rec.retained_cells <= high or len(s.history) <= 2
        s.cache.page_table.check_history(s.history)
    answer = s.answer("What colour is the square?", max_tokens=5)
    assert isinstance(answer, str)
    st = s.stats()
    assert st["retained_cells"] == s.history.total_tokens == s.cache.retained
    kinds = [u.kind.value for u in s.history]
    assert kinds[0] == "system" and kinds[-2:] == ["user", "reply"]
    if policy == "full":
        assert st["evictions"] == 0 and len(s.history) == len(chunks) + 3
    else:
        assert st["evictions"] > 0


@pytest.mark.parametrize("name", ["qwen", "minicpmo"])
def test_save_restore_continues_with_identical_logits_and_answers(models, chunks, tmp_path, name):
    s = OmniSession(models[name], policy="omnitide", high=300, low=200)
    for frame, audio, t in chunks[:4]:
        s.push(frame=frame, audio=audio, t=t)
    s.answer("Hello?", max_tokens=3)
    s.push(audio=chunks[4][1][:7000])  # less than a second: stays buffered across the save
    path = s.save(tmp_path / "sess")
    r = OmniSession.restore(path, model=models[name])
    assert r.history.to_json() == s.history.to_json()
    assert r.stats()["retained_cells"] == s.stats()["retained_cells"]
    for sess in (s, r):
        sess.push(frame=chunks[5][0], audio=chunks[4][1][7000:], t=5.0)
    np.testing.assert_array_equal(np.array(s._last_logits), np.array(r._last_logits))
    assert s.answer("What now?", max_tokens=6) == r.answer("What now?", max_tokens=6)
    np.testing.assert_array_equal(np.array(s._last_logits), np.array(r._last_logits))


def test_bad_chunks_are_rejected_before_the_cache_and_the_session_goes_on(models, chunks):
    s = OmniSession(models["qwen"], policy="omnitide", high=300, low=200)
    s.push(frame=chunks[0][0], audio=chunks[0][1], t=0)
    before = (s.history.to_json(), s.cache.retained, np.array(s._last_logits))
    bad = [
        dict(frame=np.zeros((8, 8, 2), np.uint8), audio=chunks[1][1]),
        dict(frame=chunks[1][0], audio=np.full(16000, np.nan, np.float32)),
        dict(audio=chunks[1][1], sample_rate=0),
        dict(text=""),
        dict(),
    ]
    for kw in bad:
        with pytest.raises(MediaError):
            s.push(**kw)
    assert (s.history.to_json(), s.cache.retained) == before[:2]
    np.testing.assert_array_equal(np.array(s._last_logits), before[2])
    s.push(frame=chunks[1][0], audio=chunks[1][1], t=1)
    assert len(s.history) == 3


def test_audio_in_pieces_at_another_rate_assembles_one_unit_per_second(models, chunks):
    from omnitide_mlx.models.audio_features import resample

    s = OmniSession(models["minicpmo"], policy="full")
    audio48 = resample(np.concatenate([c[1] for c in chunks[:3]]), 16000, 48000)
    recs = []
    s.push(frame=chunks[0][0])  # waits for its second of audio once audio flows... (no audio yet: a unit)
    for piece in np.array_split(audio48, 12):  # 0.25 s pieces at 48 kHz
        recs += s.push(audio=piece, sample_rate=48000)
    assert [r.kind for r in recs] == ["media"] * 3
    assert [u.kind.value for u in s.history] == ["system", "media", "media", "media", "media"]
    s.push(frame=chunks[3][0], audio=audio48[:24000], sample_rate=48000)  # half a second
    assert len(s.history) == 5
    assert len(s.flush()) == 1 and len(s.history) == 6


def test_one_producer_and_one_consumer_thread(models, chunks):
    s = OmniSession(models["minicpmo"], policy="omnitide", high=300, low=200)
    errors = []

    def produce():
        try:
            for k in range(3):
                for frame, audio, t in chunks:
                    s.push(frame=frame, audio=audio, t=t + 6 * k)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    producer = threading.Thread(target=produce)
    producer.start()
    answers = [s.answer(f"Question {i}?", max_tokens=4) for i in range(3)]
    producer.join()
    s.flush()
    assert not errors and len(answers) == 3
    media_units = s.counters.units - 1 - 2 * 3  # system, and a user + reply unit per question
    assert media_units == 3 * len(chunks)
    s.cache.page_table.check_history(s.history)
    assert s.stats()["retained_cells"] == s.history.total_tokens


def test_kv_budget_sets_watermarks_from_bytes_per_token(models):
    s = OmniSession(models["qwen"], policy="omnitide", kv_budget="1MiB")
    per_token = s.adapter.kv_spec.bytes_per_token(s.kv_dtype)
    slots = (1 << 20) // per_token // 64 * 64  # whole pages; high sits two pages under the ceiling
    assert s.policy.high == slots - 128 and s.policy.low == int(s.policy.high * 0.72)
    assert s.cache.max_capacity == slots
    assert parse_bytes("512MiB") == 512 << 20 and parse_bytes("2GB") == 2_000_000_000
    with pytest.raises(ValueError):
        parse_bytes("lots")
    with pytest.raises(ValueError):
        watermarks_for_budget(1000, 4096)


def test_text_pushed_as_context_becomes_a_unit(models):
    s = OmniSession(models["qwen"], policy="full")
    s.push(text="The meeting room is on the third floor.")
    assert [u.kind.value for u in s.history][-1] == "user"
    assert s.history[-1].spans[-1].kind.value in ("text", "boundary")
