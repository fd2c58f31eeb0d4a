"""Misuse of a live session from one thread or two (issue 15, item 1): calls made while a reply's iterator is open
queue or raise a clear error without touching state; no lock is held across a yield, so an abandoned reply blocks
nobody; closing (or dropping) a reply's iterator ends the reply cleanly."""

import gc
import threading
import time

import numpy as np
import pytest

from omnitide_mlx.errors import SessionBusyError, SessionError
from omnitide_mlx.media import iter_chunks
from omnitide_mlx.session import OmniSession


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    from omnitide_mlx.models import load

    return load(tiny_checkpoints["qwen"])


@pytest.fixture(scope="module")
def chunks(media_dir):
    return [(c.frame[::4, ::4].copy(), c.audio, c.t) for c in iter_chunks(media_dir / "video_10s_av.mp4", seconds=6)]


def _consistent(s: OmniSession) -> None:
    s.cache.page_table.check_history(s.history)
    assert s.stats()["retained_cells"] == s.history.total_tokens == s.cache.retained
    uids = [u.uid for u in s.history]
    assert uids == sorted(set(uids))


def _kinds(s: OmniSession) -> list[str]:
    return [u.kind.value for u in s.history]


def test_push_while_a_reply_is_open_in_the_same_thread_queues_until_the_reply_ends(model, chunks):
    """Before: the re-entrant lock let the push prefill a media unit inside the reply; the reply then reused its uid
    (UnitError: unit ids must increase: 3 after 3) and the next eviction found table and history disagreeing."""
    s = OmniSession(model, policy="omnitide", high=300, low=200)
    s.push(frame=chunks[0][0], audio=chunks[0][1], t=0)
    it = s.ask("What colour is the square?", max_tokens=6)
    next(it, None)
    assert s.push(frame=chunks[1][0], audio=chunks[1][1], t=1) == []  # queued: the reply is open
    assert _kinds(s) == ["system", "media", "user"]
    rest = list(it)
    assert isinstance(rest, list)
    assert _kinds(s) == ["system", "media", "user", "reply", "media"]  # processed when the reply ended
    assert s.history[-1].t == 1
    for frame, audio, t in chunks[2:]:  # evictions run on a consistent table
        s.push(frame=frame, audio=audio, t=t)
        _consistent(s)
    assert s.stats()["evictions"] > 0


def test_asking_again_in_the_same_thread_ends_the_open_reply(model, chunks):
    """A "stop and ask again" button: the new question ends the open reply where it is; the old iterator ends."""
    s = OmniSession(model, policy="omnitide", high=300, low=200)
    s.push(frame=chunks[0][0], audio=chunks[0][1], t=0)
    first = s.ask("First?", max_tokens=8)
    next(first, None)
    second = s.answer("Second?", max_tokens=4)
    assert isinstance(second, str)
    assert list(first) == []
    assert _kinds(s) == ["system", "media", "user", "reply", "user", "reply"]
    _consistent(s)
    for frame, audio, t in chunks[1:]:
        s.push(frame=frame, audio=audio, t=t)
        _consistent(s)


def test_an_abandoned_reply_blocks_neither_flush_nor_other_threads(model, chunks):
    s = OmniSession(model, policy="omnitide", high=300, low=200)
    s.push(frame=chunks[0][0], audio=chunks[0][1], t=0)
    it = s.ask("Hello?", max_tokens=8)
    next(it, None)  # ... and never read again, never closed
    done = []

    def other():
        s.push(audio=chunks[1][1][:8000], t=1)  # half a second: buffered
        done.append(s.flush())  # queued behind the open reply, not blocked by it
        done.append(s.stats())
        done.append(s.answer("Another?", max_tokens=3))  # ends the abandoned reply, then answers

    th = threading.Thread(target=other, daemon=True)
    th.start()
    th.join(timeout=60)
    assert not th.is_alive(), "another thread blocked on an abandoned reply"
    assert done[0] == [] and done[2] is not None
    assert _kinds(s) == ["system", "media", "user", "reply", "media", "user", "reply"]  # the flush ran first
    assert list(it) == []
    _consistent(s)


@pytest.mark.parametrize("how", ["close", "drop"])
def test_closing_or_dropping_a_reply_ends_it_cleanly(model, chunks, how):
    s = OmniSession(model, policy="omnitide", high=300, low=200)
    s.push(frame=chunks[0][0], audio=chunks[0][1], t=0)
    it = s.ask("Hello?", max_tokens=8)
    next(it, None)
    s.push(frame=chunks[1][0], audio=chunks[1][1], t=1)  # queued behind the reply
    if how == "close":
        it.close()
    else:
        del it
        gc.collect()
    assert _kinds(s) == ["system", "media", "user", "reply", "media"]
    _consistent(s)
    assert len(s.flush()) == 0 and s.answer("Again?", max_tokens=2) is not None


def test_save_while_a_reply_is_open_raises_without_touching_state(model, chunks, tmp_path):
    s = OmniSession(model, policy="omnitide", high=300, low=200)
    s.push(frame=chunks[0][0], audio=chunks[0][1], t=0)
    it = s.ask("Hello?", max_tokens=8)
    next(it, None)
    s.push(frame=chunks[1][0], audio=chunks[1][1], t=1)
    before = (s.history.to_json(), s.cache.retained)
    with pytest.raises(SessionBusyError, match="reply"):
        s.save(tmp_path / "sess")
    assert not (tmp_path / "sess").exists()
    assert (s.history.to_json(), s.cache.retained) == before
    it.close()
    s.save(tmp_path / "sess")
    r = OmniSession.restore(tmp_path / "sess", model=model)
    assert r.history.to_json() == s.history.to_json()


def test_calls_from_inside_on_update_queue_or_raise(model, chunks):
    """on_update runs while the session is busy: a push from it queues; a flush or ask from it would wait for
    itself, so it raises at once instead of deadlocking."""
    seen = []

    def on_update(rec):
        if rec.t == 0:
            seen.append(s.push(text="A note from the callback."))
            seen.append(s.stats()["units"])
            with pytest.raises(SessionError, match="on_update"):
                s.flush()
            with pytest.raises(SessionError, match="on_update"):
                next(s.ask("From the callback?"))

    s = OmniSession(model, policy="full", on_update=on_update)
    s.push(frame=chunks[0][0], audio=chunks[0][1], t=0)
    assert seen[0] == [] and seen[1] == 2
    assert _kinds(s) == ["system", "media", "user"]
    _consistent(s)


def test_producer_thread_keeps_pushing_while_replies_are_abandoned(model, chunks):
    """No unit lost or duplicated: every pushed second becomes exactly one media unit, in order."""
    s = OmniSession(model, policy="omnitide", high=300, low=200)
    errors = []
    n = 3 * len(chunks)

    def produce():
        try:
            for k in range(n):
                frame, audio, _ = chunks[k % len(chunks)]
                s.push(frame=frame, audio=audio, t=float(k))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    th = threading.Thread(target=produce, daemon=True)
    th.start()
    for i in range(4):
        it = s.ask(f"Question {i}?", max_tokens=6)
        next(it, None)
        if i % 2:
            it.close()
        # even i: left open; the next ask ends it
    th.join(timeout=120)
    assert not th.is_alive() and not errors
    s.flush()
    media_t = [r.t for r in s.records if r.kind == "media"]
    assert media_t == [float(k) for k in range(n)]
    _consistent(s)
    np.testing.assert_equal(s.counters.units, 1 + n + 2 * 4)


def test_the_consumer_is_not_made_the_producers_worker(model, chunks):
    """The engine soak asked 23 questions in 2,000 units instead of 100: when a reply ended, the consumer's thread
    processed the chunks queued meanwhile, and its settle loop went on with every chunk the producer pushed while it
    worked (the producer's push found the engine busy and returned at once), so the consumer became the producer's
    worker until the producer paused. Here the producer pushes one more chunk during each unit the consumer
    processes: the consumer must process only the chunks whose push() had returned and leave the others to their
    pushers (before: it processed all 8 media units, the 2 queued during the reply and the 6 pushed meanwhile)."""
    main = threading.current_thread().name
    trigger, pushed_back, done = threading.Event(), threading.Event(), threading.Event()
    pushed_back.set()
    units: list[tuple[str, str]] = []
    extra = {"left": 0}
    k = 0

    def on_update(rec):
        units.append((threading.current_thread().name, rec.kind))
        if threading.current_thread().name == main and extra["left"] and pushed_back.is_set():
            extra["left"] -= 1
            n = s.queued
            pushed_back.clear()
            trigger.set()  # the producer pushes now, while this thread works
            deadline = time.monotonic() + 10
            while s.queued == n and time.monotonic() < deadline:
                time.sleep(0.001)

    s = OmniSession(model, policy="omnitide", high=300, low=200, on_update=on_update)

    def produce():
        nonlocal k
        while not done.is_set():
            if trigger.wait(0.05):
                trigger.clear()
                s.push(frame=chunks[k % 6][0], audio=chunks[k % 6][1], t=float(k))
                k += 1
                pushed_back.set()

    th = threading.Thread(target=produce, name="producer", daemon=True)
    th.start()
    it = s.ask("What colour is the square?", max_tokens=4)
    next(it, None)
    for _ in range(2):  # queued while the reply is open: these push() calls return at once
        pushed_back.clear()
        trigger.set()
        assert pushed_back.wait(10)
    assert s.queued == 2
    extra["left"] = 6
    it.close()  # the reply ends; this thread settles what was queued
    deadline = time.monotonic() + 120
    while (s.queued or not pushed_back.is_set() or trigger.is_set()) and time.monotonic() < deadline:
        time.sleep(0.01)
    done.set()
    th.join(10)
    here = sum(1 for name, kind in units if name == main and kind == "media")
    assert here == 2, f"the consumer's thread processed {here} media units: {units}"
    assert [r.t for r in s.records if r.kind == "media"] == [float(x) for x in range(k)]
    assert k >= 3
    _consistent(s)


def test_a_probe_takes_the_engine_and_refuses_an_open_reply(model, chunks):
    """Before: the eval probe (eval/probe.py's probe_logits) ran outside the session's lock, so it ran in the middle
    of another thread's update, and with a reply open it fed its tokens under the reply's uid. Now it is a session
    method that waits for the engine, and an open reply raises SessionBusyError with nothing touched."""
    from omnitide_mlx.eval.probe import question_ids

    held, release = threading.Event(), threading.Event()

    def on_update(rec):
        if rec.t == 1:
            held.set()
            release.wait(10)

    s = OmniSession(model, policy="h2o", high=300, low=200, on_update=on_update)
    s.push(frame=chunks[0][0], audio=chunks[0][1], t=0)
    ids = question_ids(s, "What colour is the square?")
    alone = s.probe_logits(ids)
    np.testing.assert_array_equal(s.probe_logits(ids), alone)  # the probe left no trace
    pusher = threading.Thread(target=s.push, kwargs=dict(frame=chunks[1][0], audio=chunks[1][1], t=1))
    pusher.start()
    assert held.wait(10)
    done = []
    prober = threading.Thread(target=lambda: done.append(s.probe_logits(ids)))
    prober.start()
    prober.join(0.5)
    assert not done  # waits for the update that holds the engine
    release.set()
    pusher.join(10)
    prober.join(10)
    assert len(done) == 1 and len(s.history) == 3
    _consistent(s)
    it = s.ask("What colour is the square?", max_tokens=6)
    next(it, None)
    state = (s.history.to_json(), s.cache.page_table.state())
    with pytest.raises(SessionBusyError, match="reply is open"):
        s.probe_logits(ids)
    assert (s.history.to_json(), s.cache.page_table.state()) == state
    list(it)
    _consistent(s)
    assert s.probe_logits(ids).shape == alone.shape
