"""The echo gate with a simulated loudspeaker: the reply's own voice in the microphone starts nothing once the
player's audio is given as the reference, and the user talking over the reply still does."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf

from omnitide_mlx.vad.detector import UtteranceDetector, VADConfig
from omnitide_mlx.vad.silero import SileroVAD

SR, PLAY = 16000, 24000
REPLY_AT = 0.5


@pytest.fixture(scope="module")
def model():
    return SileroVAD.load()


@pytest.fixture(scope="module")
def audio(media_dir):
    speech, _ = sf.read(media_dir / "speech_16k.wav", dtype="float32")
    # "This is a short test of a streaming omni model." and "One, two, three, four, five." as the reply
    reply16 = np.concatenate([speech[int(0.9 * SR):int(3.8 * SR)], speech[int(7.0 * SR):]])
    t = np.arange(int(reply16.size * PLAY / SR)) * SR / PLAY
    played = np.interp(t, np.arange(reply16.size), reply16).astype(np.float32)  # what the player sends, 24 kHz
    user = speech[int(3.9 * SR):int(6.95 * SR)]  # "The capital of France is Paris." as the user's interruption
    return reply16, played, user


def _mic(reply16, delay_s, gain_db, n, user=None, user_at=None, seed=0):
    rng = np.random.default_rng(seed)
    mic = (rng.standard_normal(n) * 3e-4).astype(np.float32)  # a quiet room
    i = int((REPLY_AT + delay_s) * SR)
    tail = np.exp(-np.arange(int(0.1 * SR)) / 300.0) * rng.standard_normal(int(0.1 * SR)) * 0.03
    echo = np.convolve(reply16, np.concatenate([[1.0], tail]))[:n - i] * 10 ** (gain_db / 20)
    mic[i:i + echo.size] += echo
    if user is not None:
        j = int(user_at * SR)
        mic[j:j + user.size] += user
    return mic


def _run(model, mic, played=None, chunk=4000):
    d = UtteranceDetector(VADConfig(), model=model)
    if played is not None:
        d.push_reference(played, PLAY, REPLY_AT)
    events = []
    for i in range(0, mic.size, chunk):
        events += d.feed(mic[i:i + chunk], SR)
    return events + d.flush()


@pytest.mark.parametrize("delay_s,gain_db", [(0.02, -6.0), (0.15, -6.0), (0.08, -14.0)])
def test_own_voice_through_speakers_starts_nothing_with_the_reference(model, audio, delay_s, gain_db):
    reply16, played, _ = audio
    mic = _mic(reply16, delay_s, gain_db, int((REPLY_AT + 7.5) * SR))
    assert any(e.kind == "start" for e in _run(model, mic))  # without the reference the echo is "speech"
    assert _run(model, mic, played) == []


def test_user_barging_in_over_the_reply_is_heard(model, audio):
    reply16, played, user = audio
    user_at = REPLY_AT + 3.0
    mic = _mic(reply16, 0.06, -12.0, int((REPLY_AT + 7.5) * SR), user=user, user_at=user_at)
    starts = [e for e in _run(model, mic, played) if e.kind == "start"]
    alone = [e for e in _run(model, _mic(reply16, 0.06, -200.0, mic.size, user=user, user_at=user_at))
             if e.kind == "start"]  # the same user with headphones (no echo)
    assert len(alone) == 1 and user_at <= alone[0].decided_at <= user_at + 0.5
    assert len(starts) == 1 and 0 <= starts[0].decided_at - alone[0].decided_at <= 0.1
    assert starts[0].t_start >= user_at - 0.1


def test_reference_state_round_trip_and_bad_reference(model, audio):
    reply16, played, user = audio
    mic = _mic(reply16, 0.06, -12.0, int((REPLY_AT + 7.5) * SR), user=user, user_at=REPLY_AT + 3.0)
    a = UtteranceDetector(model=model)
    a.push_reference(played, PLAY, REPLY_AT)
    cut = int(2.0 * SR)
    a.feed(mic[:cut], SR)
    b = UtteranceDetector(model=model)
    b.load_state_dict(a.state_dict())
    rest_a = a.feed(mic[cut:], SR) + a.flush()
    rest_b = b.feed(mic[cut:], SR) + b.flush()
    assert rest_a == rest_b and [e.kind for e in rest_a] == ["start", "end"]
    for bad, rate, t, match in [(np.full(10, np.nan, np.float32), PLAY, 0.0, "NaN"),
                                (played[:100], PLAY, -1.0, "reference time"),
                                (played[:100], PLAY, float("inf"), "reference time"),
                                (played[:100], 100, 0.0, "sample_rate"),
                                (np.zeros((10, 2), np.float32), PLAY, 0.0, "mono")]:
        with pytest.raises(ValueError, match=match):
            a.push_reference(bad, rate, t)
