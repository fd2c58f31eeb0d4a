"""The espeak-ng test clips: questions where they were asked, labels, SNR, the command line."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import soundfile as sf

from omnitide_mlx.vad import testaudio
from omnitide_mlx.vad.testaudio import FRAME, SR, spoken_clip

pytestmark = pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="needs espeak-ng (scripts/setup.sh --dev)")


def test_questions_land_where_asked_over_noise_at_the_snr():
    clip = spoken_clip([(0.5, "What colour is the sky?"), (3.0, "Is it raining?")], duration_s=5.0,
                       background_kind="pink", snr_db=5.0, seed=3)
    assert clip.audio.dtype == np.float32 and clip.audio.size == 5 * SR
    (a0, b0), (a1, b1) = clip.spans
    assert 0.5 <= a0 < 0.6 and 1.2 < b0 < 2.8 and 3.0 <= a1 < 3.1 and b1 < 5.0
    assert clip.labels[int(1.0 * SR / FRAME)] and not clip.labels[int(2.9 * SR / FRAME)]
    speech = spoken_clip([(0.5, "What colour is the sky?"), (3.0, "Is it raining?")], duration_s=5.0).audio
    noise = clip.audio - speech
    lab = np.repeat(clip.labels, FRAME)
    snr = 10 * np.log10((speech[:lab.size][lab] ** 2).mean() / (noise ** 2).mean())
    assert snr == pytest.approx(5.0, abs=0.2)


def test_backgrounds_and_bad_requests():
    for kind in testaudio.BACKGROUNDS:
        bg = testaudio.background(kind, 1.0, seed=1)
        assert bg.size == SR and np.isfinite(bg).all()
        assert (np.sqrt((bg ** 2).mean()) == pytest.approx(0.1, rel=1e-3)) if kind != "silence" else not bg.any()
    with pytest.raises(ValueError, match="unknown background"):
        spoken_clip([(0.0, "hi")], background_kind="rain")
    with pytest.raises(ValueError, match="in order"):
        spoken_clip([(1.0, "one two three four"), (1.2, "five")])
    with pytest.raises(ValueError, match="after the clip"):
        spoken_clip([(0.5, "a long sentence that takes a while to say")], duration_s=1.0)
    with pytest.raises(ValueError, match="empty text"):
        testaudio.speak("  ")


def test_command_line(tmp_path, capsys):
    out = tmp_path / "q.wav"
    assert testaudio.main([str(out), "--question", "0.3:How old are you?", "--duration", "3"]) == 0
    info = json.loads(capsys.readouterr().out)
    audio, rate = sf.read(out, dtype="float32")
    assert rate == SR and audio.size == 3 * SR and info["questions"][0]["text"] == "How old are you?"
    assert 0.3 <= info["questions"][0]["start"] < 0.4
    with pytest.raises(SystemExit):
        testaudio.main([str(out), "--question", "soon:hello"])
