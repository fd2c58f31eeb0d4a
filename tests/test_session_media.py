"""Media end and lag through the Python API (issue 15, item 2 "Media silently dropped"): once audio flows, a frame
pushed without audio waits for its second of audio; frames that wait are queued, never overwritten, and when the
audio lags too far or has ended they become units with a second of silence (as `omnitide stream` streams frames
after a short audio file ends, media.MediaStream). Audio without frames becomes units without frames."""

import numpy as np
import pytest

from omnitide_mlx.engine import FRAME_WAIT_UNITS
from omnitide_mlx.media import SAMPLE_RATE, iter_chunks
from omnitide_mlx.session import OmniSession


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    from omnitide_mlx.models import load

    return load(tiny_checkpoints["qwen"])


@pytest.fixture(scope="module")
def chunks(media_dir):
    return [(c.frame[::4, ::4].copy(), c.audio, c.t) for c in iter_chunks(media_dir / "video_10s_av.mp4", seconds=8)]


class _Units:
    """Records what each media unit was built from: the real adapter, wrapped."""

    def __init__(self, session: OmniSession):
        self.seen: list[tuple] = []
        real = session.adapter.media_unit

        def media_unit(frame, audio, t, start):
            self.seen.append((None if frame is None else int(frame[0, 0, 0]), None if audio is None
                              else round(float(np.abs(audio).max()), 4), None if audio is None else audio.shape[0], t))
            return real(frame, audio, t, start)

        session.adapter.media_unit = media_unit


def _frame(k: int, like: np.ndarray) -> np.ndarray:
    """A frame told apart by its first pixel."""
    f = like.copy()
    f[0, 0, 0] = k
    return f


def _session(model):
    return OmniSession(model, policy="full")


def test_frames_pushed_without_audio_while_one_waits_are_all_streamed(model, chunks):
    """Before: the second frame overwrote the first one waiting for its audio (``_pending_frame``), which never
    became a unit; the push returned [] both times and nothing said a frame was lost."""
    s = _session(model)
    seen = _Units(s)
    s.push(frame=_frame(1, chunks[0][0]), audio=chunks[0][1], t=0)  # audio flows: frames now wait for theirs
    s.push(frame=_frame(2, chunks[1][0]), t=1)  # the microphone lags: waits
    s.push(frame=_frame(3, chunks[2][0]), t=2)  # waits too (queued behind frame 2, not over it)
    recs = s.push(audio=np.concatenate([chunks[1][1], chunks[2][1]]))  # the lagging audio arrives
    assert [r.kind for r in recs] == ["media", "media"]
    assert [x[0] for x in seen.seen] == [1, 2, 3]  # every frame in order, each with its own second of audio
    assert [x[2] for x in seen.seen] == [SAMPLE_RATE] * 3 and all(x[1] > 0 for x in seen.seen)
    assert [x[3] for x in seen.seen] == [0.0, 1.0, 2.0]
    st = s.stats()["media"]
    assert st["frames"] == 3 and st["audio_seconds"] == 3.0 and st["silence_seconds"] == 0.0
    assert st["frames_waiting"] == 0


def test_when_the_audio_ends_frames_still_become_units_with_silence(model, chunks):
    """The Python counterpart of `omnitide stream --video v.mp4 --audio short.wav`: after the audio ends, frames wait
    at most FRAME_WAIT_UNITS seconds for it, then stream with a second of silence; flush() streams the rest."""
    s = _session(model)
    seen = _Units(s)
    s.push(frame=_frame(0, chunks[0][0]), audio=chunks[0][1], t=0)
    n = FRAME_WAIT_UNITS + 3
    for k in range(1, n + 1):  # the audio has ended: frames only
        s.push(frame=_frame(k, chunks[k % len(chunks)][0]), t=float(k))
        assert s.stats()["media"]["frames_waiting"] == min(k, FRAME_WAIT_UNITS)
    assert [x[0] for x in seen.seen] == list(range(n - FRAME_WAIT_UNITS + 1))
    assert all(x[1] == 0.0 and x[2] == SAMPLE_RATE for x in seen.seen[1:])  # a second of silence each
    s.flush()
    assert [x[0] for x in seen.seen] == list(range(n + 1))  # none dropped
    assert [x[3] for x in seen.seen] == [float(k) for k in range(n + 1)]
    st = s.stats()["media"]
    assert st["frames"] == n + 1 and st["audio_seconds"] == 1.0 and st["silence_seconds"] == float(n)
    assert st["frames_waiting"] == 0


def test_audio_without_frames_still_streams(model, chunks):
    """The video ends first: each further second of audio becomes a unit without a frame."""
    s = _session(model)
    seen = _Units(s)
    s.push(frame=_frame(0, chunks[0][0]), audio=chunks[0][1], t=0)
    recs = s.push(audio=np.concatenate([c[1] for c in chunks[1:4]]))
    assert len(recs) == 3
    assert [x[0] for x in seen.seen] == [0, None, None, None]
    assert s.stats()["media"] == {"frames": 1, "audio_seconds": 4.0, "silence_seconds": 0.0, "frames_waiting": 0,
                                  "frames_replaced": 0}


def test_frames_pushed_with_audio_inside_one_second_keep_the_newest_and_say_so(model, chunks):
    """A frame pushed with half a second of audio and then another with the next half: one second, one unit, the
    newest frame (as documented); the replaced frame is counted, not silently gone."""
    s = _session(model)
    seen = _Units(s)
    a = chunks[0][1]
    s.push(frame=_frame(1, chunks[0][0]), audio=a[:8000])
    s.push(frame=_frame(2, chunks[0][0]), audio=a[8000:])
    assert [x[0] for x in seen.seen] == [2]
    assert s.stats()["media"]["frames_replaced"] == 1


def test_waiting_frames_survive_save_and_restore(model, chunks, tmp_path):
    s = _session(model)
    s.push(frame=_frame(1, chunks[0][0]), audio=chunks[0][1], t=0)
    s.push(frame=_frame(2, chunks[1][0]), t=1)
    s.push(frame=_frame(3, chunks[2][0]), t=2)
    r = OmniSession.restore(s.save(tmp_path / "sess"), model=model)
    assert r.stats()["media"] == s.stats()["media"]
    seen = _Units(r)
    r.push(audio=np.concatenate([chunks[1][1], chunks[2][1]]))
    assert [(x[0], x[3]) for x in seen.seen] == [(2, 1.0), (3, 2.0)]


def test_when_audio_comes_with_frames_again_the_frames_of_the_gap_stream_with_silence(model, chunks):
    """Frames pushed with audio, then one without (a gap in the audio), then with audio again: the gap's frame had
    no audio (silence), and the frames after it keep their own seconds (none taken for the newest-frame rule)."""
    s = _session(model)
    seen = _Units(s)
    s.push(frame=_frame(1, chunks[0][0]), audio=chunks[0][1], t=0)
    s.push(frame=_frame(2, chunks[1][0]), t=1)
    s.push(frame=_frame(3, chunks[2][0]), audio=chunks[2][1], t=2)
    s.push(frame=_frame(4, chunks[3][0]), audio=chunks[3][1], t=3)
    assert [(x[0], x[1] > 0, x[3]) for x in seen.seen] == [(1, True, 0.0), (2, False, 1.0), (3, True, 2.0),
                                                           (4, True, 3.0)]
    assert s.stats()["media"] == {"frames": 4, "audio_seconds": 3.0, "silence_seconds": 1.0, "frames_waiting": 0,
                                  "frames_replaced": 0}
