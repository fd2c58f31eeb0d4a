"""Late or missing validation in the session (issue 15, item 4): stream times, audio and frames that used to be
accepted or gave raw errors, sampling options out of range, and ``stop`` given as one string. Each bad call raises
a specific error before anything is computed and the session goes on unchanged."""

import mlx.core as mx
import numpy as np
import pytest

from omnitide_mlx.engine import Sampling
from omnitide_mlx.errors import MediaError, SamplingError
from omnitide_mlx.media import iter_chunks
from omnitide_mlx.session import OmniSession


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    from omnitide_mlx.models import load

    return load(tiny_checkpoints["qwen"])


@pytest.fixture(scope="module")
def chunks(media_dir):
    return [(c.frame[::4, ::4].copy(), c.audio, c.t) for c in iter_chunks(media_dir / "video_10s_av.mp4", seconds=3)]


@pytest.fixture
def session(model, chunks):
    s = OmniSession(model, policy="omnitide", high=300, low=200)
    s.push(frame=chunks[0][0], audio=chunks[0][1], t=0)
    return s


def _state(s):
    return s.history.to_json(), s.cache.retained, s.counters.units, s._audio_buf.size, len(s._waiting)


@pytest.mark.parametrize("t", [float("nan"), -1.0, float("inf"), "abc", "5", True, [1]])
def test_bad_stream_times_are_rejected(session, chunks, t):
    before = _state(session)
    with pytest.raises(MediaError, match="t must be"):
        session.push(frame=chunks[1][0], audio=chunks[1][1], t=t)
    assert _state(session) == before


@pytest.mark.parametrize("audio, match", [
    (lambda a: a.astype(np.complex64), "complex"),
    (lambda a: a * 1e6, "peak"),
    (lambda a: a * 0 - 1e6, "peak"),
    (lambda a: a.astype(object), "dtype"),
])
def test_bad_audio_is_rejected(session, chunks, audio, match):
    before = _state(session)
    with pytest.raises(MediaError, match=match):
        session.push(audio=audio(chunks[1][1]), t=1)
    assert _state(session) == before


def test_mlx_bfloat16_frames_and_audio_and_a_small_overshoot_are_accepted(session, chunks):
    """Before: numpy cannot take an MLX bfloat16 array, so a raw error came from the conversion."""
    frame = mx.array(chunks[1][0].astype(np.float32) / 255.0).astype(mx.bfloat16)
    audio = mx.array(chunks[1][1]).astype(mx.bfloat16)
    rec = session.push(frame=frame, audio=audio, t=1)
    assert [r.kind for r in rec] == ["media"]
    loud = chunks[2][1] / max(1e-6, float(np.abs(chunks[2][1]).max())) * 1.5  # a mixer's overshoot: clipped
    assert len(session.push(frame=chunks[2][0], audio=loud, t=2)) == 1


@pytest.mark.parametrize("kw", [dict(temp=-1), dict(top_p=2), dict(top_p=-0.5), dict(min_p=1.5), dict(top_k=-1),
                                dict(top_k=2.5), dict(max_tokens=0), dict(max_tokens=1.5), dict(max_tokens=True),
                                dict(temp=float("nan")), dict(repetition_penalty=0), dict(seed=-1),
                                dict(stop=[1]), dict(stop=[""]), dict(stop=5)])
def test_sampling_options_out_of_range_raise_at_ask(session, kw):
    before = _state(session)
    with pytest.raises(SamplingError):
        session.ask("Hello?", **kw)  # at the call, not at the first piece
    assert _state(session) == before


def test_stop_as_one_string_is_not_split_into_characters(model, chunks):
    """Before: ``stop="abc"`` became the stop strings "a", "b" and "c"."""
    assert Sampling(stop="abc").stop == ("abc",) and Sampling(stop=["ab", "c"]).stop == ("ab", "c")

    def fresh():
        s = OmniSession(model, policy="full")
        s.push(frame=chunks[0][0], audio=chunks[0][1], t=0)
        return s

    full = fresh().answer("Describe it.", max_tokens=12)
    assert full.strip()
    stop = full.strip()[0] + "\u2603\u2603"  # its first character is in the answer; the whole string is not
    assert fresh().answer("Describe it.", max_tokens=12, stop=stop) == full
