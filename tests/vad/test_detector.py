"""UtteranceDetector: onset, hangover, minimum speech, the cap, flush, odd rates, bad input, save / restore.

The speech is the bundled recording (assets/media/speech_16k.wav): "Hello." fills about 0.06-0.58 s of it, then
0.35 s of pause; its first 3.6 s hold no pause longer than that.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile as sf
from hypothesis import given, settings
from hypothesis import strategies as st

from omnitide_mlx.vad.detector import SpeechEvent, UtteranceDetector, VADConfig
from omnitide_mlx.vad.silero import SileroVAD

SR = 16000


@pytest.fixture(scope="module")
def model():
    return SileroVAD.load()


@pytest.fixture(scope="module")
def speech(media_dir):
    audio, sr = sf.read(media_dir / "speech_16k.wav", dtype="float32")
    assert sr == SR
    return audio


def _sil(seconds: float) -> np.ndarray:
    return np.zeros(int(round(seconds * SR)), np.float32)


def _run(model, audio, config=None, chunk=None, rate=SR) -> list[SpeechEvent]:
    d = UtteranceDetector(config or VADConfig(), model=model)
    events = []
    step = chunk or audio.size
    for i in range(0, audio.size, step):
        events += d.feed(audio[i:i + step], rate)
    return events + d.flush()


def _check_well_formed(events: list[SpeechEvent]):
    """Starts and ends alternate; each end closes its start; times are ordered and never in the future."""
    for i, e in enumerate(events):
        assert e.kind == ("start" if i % 2 == 0 else "end")
        assert e.t_start <= e.decided_at + 1e-9
        if e.kind == "end":
            assert e.t_start == events[i - 1].t_start
            assert e.t_start < e.t_end <= e.decided_at + 1e-9
        if i >= 2 and e.kind == "start":
            assert e.t_start >= events[i - 1].t_end - 1e-9


def test_onset_end_and_hangover(model, speech):
    hello = speech[:int(0.6 * SR)]
    cfg = VADConfig(min_speech_s=0.1, hangover_s=0.5, speech_pad_s=0.03)
    events = _run(model, np.concatenate([_sil(1.0), hello, _sil(1.5)]), cfg)
    _check_well_formed(events)
    start, end = events
    assert (start.kind, start.reason, end.kind, end.reason) == ("start", "onset", "end", "silence")
    assert 1.0 <= start.t_start <= 1.1  # speech starts about 1.06 s, padded 30 ms
    assert 0.1 <= start.decided_at - start.t_start <= 0.1 + 0.03 + 0.064  # min speech, pad, chunk rounding
    assert 1.55 <= end.t_end <= 1.65
    assert 0.5 <= end.decided_at - (end.t_end - 0.03) <= 0.5 + 0.064  # the hangover counts from the last speech
    # silence shorter than the hangover keeps one utterance; longer splits it
    two = np.concatenate([_sil(0.5), hello, _sil(0.25), hello, _sil(1.0)])
    assert len(_run(model, two, cfg)) == 2
    assert len(_run(model, two, VADConfig(hangover_s=0.15))) == 4
    # a longer hangover moves the decision, not the utterance's end
    late = _run(model, np.concatenate([_sil(1.0), hello, _sil(1.5)]), VADConfig(hangover_s=1.0))
    assert abs(late[1].t_end - end.t_end) < 1e-9 and late[1].decided_at - end.decided_at == pytest.approx(0.5, abs=0.04)


def test_min_speech(model, speech):
    hello = np.concatenate([_sil(0.5), speech[:int(0.6 * SR)], _sil(1.0)])  # about 0.5 s of voiced speech
    assert len(_run(model, hello, VADConfig(min_speech_s=0.3))) == 2
    assert _run(model, hello, VADConfig(min_speech_s=0.8)) == []
    assert _run(model, _sil(3.0)) == []


def test_cap_splits_a_user_who_never_stops(model, speech):
    talk = np.concatenate([_sil(0.5), speech[:int(3.6 * SR)], _sil(1.0)])
    events = _run(model, talk, VADConfig(max_utterance_s=1.0))
    _check_well_formed(events)
    reasons = [(e.kind, e.reason) for e in events]
    assert reasons[:3] == [("start", "onset"), ("end", "cap"), ("start", "cap")]
    assert reasons[-1] == ("end", "silence")
    caps = [e for e in events if e.reason == "cap"]
    for end, nxt in zip(caps[0::2], caps[1::2]):  # the next piece starts exactly at the cut: nothing falls between
        assert end.t_end == nxt.t_start == end.decided_at
        assert end.t_end - end.t_start == pytest.approx(1.0, abs=0.033)
    # without the cap: one utterance
    assert len(_run(model, talk)) == 2


def test_flush_ends_an_open_utterance_and_stream_goes_on(model, speech):
    d = UtteranceDetector(model=model)
    events = d.feed(np.concatenate([_sil(0.5), speech[:int(2.0 * SR) + 123]]), SR)
    assert [e.kind for e in events] == ["start"] and d.in_speech
    end = d.flush()
    assert [(e.kind, e.reason) for e in end] == [("end", "flush")] and not d.in_speech
    assert end[0].t_end <= end[0].decided_at == pytest.approx(d.stream_time, abs=1e-3)
    assert d.stream_time == pytest.approx(2.5 + 123 / SR)
    assert d.flush() == []
    # after a flush the rate may change; stream time carries on
    more = d.feed(np.concatenate([_sil(0.5), speech[:int(0.6 * SR)], _sil(1.0)])[::2].copy(), 8000)
    more += d.flush()
    assert [e.kind for e in more] == ["start", "end"] and more[0].t_start > 2.5 + 0.4


def _to_rate(audio: np.ndarray, rate: int) -> np.ndarray:
    """The 16 kHz signal at another rate, independently of the detector's resampler (linear interpolation up, a
    moving average then decimation down)."""
    if rate < SR:
        k = SR // rate
        return np.convolve(audio, np.ones(k) / k, mode="same")[::k].astype(np.float32)
    t = np.arange(int(audio.size * rate / SR)) * SR / rate
    return np.interp(t, np.arange(audio.size), audio).astype(np.float32)


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000])
def test_odd_sample_rates(model, speech, rate):
    clip = np.concatenate([_sil(1.0), speech[:int(0.6 * SR)], _sil(1.2), speech[:int(0.6 * SR)], _sil(1.0)])
    ref = _run(model, clip)
    got = _run(model, _to_rate(clip, rate), chunk=int(rate * 0.02) + 7, rate=rate)  # odd 20 ms-ish chunks
    _check_well_formed(got)
    assert [(e.kind, e.reason) for e in got] == [(e.kind, e.reason) for e in ref] and len(ref) == 4
    for a, b in zip(got, ref):
        assert abs(a.t_start - b.t_start) <= 0.07 and abs(a.decided_at - b.decided_at) <= 0.07


@settings(max_examples=8)
@given(st.lists(st.one_of(st.just(0), st.integers(1, 200), st.integers(200, 4000)), min_size=1, max_size=40)
       .filter(lambda sizes: sum(sizes) >= 300 * len(sizes)))  # empty and tiny chunks among them, in seconds
def test_any_chunking_gives_the_same_events(model, speech, sizes):
    clip = np.concatenate([_sil(0.7), speech[:int(0.6 * SR)], _sil(0.8), speech[int(0.9 * SR):int(2.5 * SR)],
                           _sil(0.9)])
    ref = _run(model, clip, VADConfig(hangover_s=0.4))
    d = UtteranceDetector(VADConfig(hangover_s=0.4), model=model)
    events, i, k = [], 0, 0
    while i < clip.size:
        n = sizes[k % len(sizes)]
        before = d.stream_time
        events += d.feed(clip[i:i + n], SR)  # zero-length chunks included
        assert d.stream_time == pytest.approx(before + min(n, clip.size - i) / SR)
        i, k = i + n, k + 1
    events += d.flush()
    assert len(events) == len(ref) == 4
    for a, b in zip(events, ref):
        assert a.kind == b.kind and a.reason == b.reason
        assert a.t_start == pytest.approx(b.t_start) and a.decided_at == pytest.approx(b.decided_at)


def test_bad_input_is_refused_before_any_change(model, speech):
    d = UtteranceDetector(model=model)
    d.feed(speech[:int(1.3 * SR)], SR)
    before = json.dumps(_jsonable(d.state_dict()))
    bad = speech[:1000].copy()
    bad[500] = np.nan
    for audio, rate, match in [
        (bad, SR, "NaN or inf"),
        (np.full(100, np.inf, np.float32), SR, "NaN or inf"),
        (np.zeros((100, 2), np.float32), SR, "mono"),
        (np.zeros((1, 2, 3), np.float32), SR, "mono"),
        ((np.zeros(100) * 32767).astype(np.int16), SR, "float samples"),
        ([0.0] * 100, SR, "NumPy array"),
        (np.zeros(100, np.float32), 0, "sample_rate"),
        (np.zeros(100, np.float32), 44100.0, "sample_rate"),
        (np.zeros(100, np.float32), 44100, "changed from 16000 to 44100"),
    ]:
        with pytest.raises(ValueError, match=match):
            d.feed(audio, rate)
        assert json.dumps(_jsonable(d.state_dict())) == before
    assert d.feed(np.zeros(0, np.float32), SR) == []
    assert d.feed(np.zeros((10, 1), np.float64), SR) == []  # (n, 1) float64 is mono audio
    with pytest.raises(ValueError, match="threshold"):
        VADConfig(threshold=1.5)
    with pytest.raises(ValueError, match="neg_threshold"):
        VADConfig(threshold=0.5, neg_threshold=0.6)
    with pytest.raises(ValueError, match="max_utterance_s"):
        VADConfig(max_utterance_s=0.01)
    with pytest.raises(ValueError, match="finite"):
        VADConfig(hangover_s=float("nan"))


def _jsonable(state: dict) -> dict:
    def conv(v):
        if isinstance(v, np.ndarray):
            return {"array": v.tolist(), "dtype": str(v.dtype)}
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v
    return conv(state)


def _from_json(state) -> dict:
    if isinstance(state, dict) and set(state) == {"array", "dtype"}:
        return np.asarray(state["array"], state["dtype"])
    if isinstance(state, dict):
        return {k: _from_json(v) for k, v in state.items()}
    return state


@pytest.mark.parametrize("rate", [16000, 44100])
@pytest.mark.parametrize("cut_s", [1.06, 1.9, 2.33])  # before the start is decided, in speech, in the silence
def test_state_dict_round_trip(model, speech, rate, cut_s):
    clip = np.concatenate([_sil(1.0), speech[:int(0.6 * SR)], _sil(0.3), speech[:int(0.6 * SR)], _sil(1.0)])
    clip = _to_rate(clip, rate)
    cut = int(cut_s * rate)
    a = UtteranceDetector(VADConfig(hangover_s=0.5), model=model)
    first = a.feed(clip[:cut], rate)
    saved = json.loads(json.dumps(_jsonable(a.state_dict())))  # through JSON, as a session file would hold it
    b = UtteranceDetector(model=model)  # another config: the saved one wins
    b.load_state_dict(_from_json(saved))
    assert b.config == a.config and b.stream_time == a.stream_time and b.in_speech == a.in_speech
    rest_a, rest_b = [], []
    for i in range(cut, clip.size, 777):
        rest_a += a.feed(clip[i:i + 777], rate)
        rest_b += b.feed(clip[i:i + 777], rate)
    rest_a += a.flush()
    rest_b += b.flush()
    assert rest_a == rest_b
    assert len(first + rest_a) == 2  # the gap is shorter than the hangover: one utterance


def test_load_state_dict_refuses_garbage(model):
    d = UtteranceDetector(model=model)
    before = d.state_dict()
    for bad in [{}, {"version": 99}, {**before, "phase": "talking"}, {**before, "h": np.zeros(3)}]:
        with pytest.raises(ValueError):
            d.load_state_dict(bad)
    assert d.stream_time == 0 and not d.in_speech


def test_reset_forgets_everything(model, speech):
    clip = np.concatenate([_sil(0.5), speech[:int(0.6 * SR)], _sil(1.0)])
    d = UtteranceDetector(model=model)
    d.push_reference(speech[:SR], SR, 0.2)
    d.feed(np.concatenate([_sil(0.3), speech[:int(1.0 * SR)]]), 44100)  # mid-utterance, another rate
    assert d.in_speech
    d.reset()
    assert d.stream_time == 0 and not d.in_speech
    assert d.feed(clip, SR) + d.flush() == _run(model, clip)  # as a fresh detector, at 16 kHz


def test_candidate_events_report_a_possible_onset_at_once(model, speech):
    """candidates=True: the first chunk over the threshold is reported ("candidate"), then either the confirmed
    "start" or "dropped"; without it the events are start / end only, as before."""
    audio = np.concatenate([_sil(0.5), speech[:SR * 2], _sil(1.0)])
    with_c = UtteranceDetector(model=model, candidates=True).feed(audio, SR)
    plain = UtteranceDetector(model=model).feed(audio, SR)
    assert [e.kind for e in plain] == [e.kind for e in with_c if e.kind in ("start", "end")]
    first = with_c[0]
    assert first.kind == "candidate" and with_c[1].kind in ("start", "dropped")
    start = next(e for e in with_c if e.kind == "start")
    assert first.decided_at < start.decided_at and first.decided_at - first.t_start <= 0.064
