#!/usr/bin/env python3
"""Builds assets/media/spoken_questions_10s.flac: the soundtrack for the bundled clip (video_10s_av.mp4) with two
spoken questions, for `omnitide stream --voice` (README, docs/usage.md) and the spoken-turn tests.

espeak-ng (voice en-us, 160 words/min) speaks each question; sox resamples it to 16 kHz; the questions are placed
at their times over quiet noise (-60 dBFS RMS, fixed seed) and the result is written as 16-bit FLAC. Needs
espeak-ng and sox (scripts/setup.sh --dev installs both on Debian). The committed file was made by this script.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import soundfile as sf

RATE = 16000
SECONDS = 10.0
QUESTIONS = [(0.8, "What colour is the background?"), (5.2, "Which word is written on the screen?")]


def speak(text: str, workdir: Path) -> np.ndarray:
    raw, out = workdir / "raw.wav", workdir / "16k.wav"
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "160", "-w", str(raw), text], check=True)
    subprocess.run(["sox", str(raw), "-r", str(RATE), "-c", "1", "-b", "16", str(out)], check=True)
    audio, rate = sf.read(out, dtype="float32")
    assert rate == RATE
    return audio


def main(path: str = "assets/media/spoken_questions_10s.flac") -> int:
    rng = np.random.default_rng(0)
    track = (rng.standard_normal(int(SECONDS * RATE)) * 10 ** (-60 / 20)).astype(np.float32)
    with tempfile.TemporaryDirectory() as d:
        for at, text in QUESTIONS:
            speech = speak(text, Path(d))
            a = int(at * RATE)
            track[a:a + speech.size] += speech[:track.size - a]
    sf.write(path, np.clip(track, -1, 1), RATE, subtype="PCM_16")
    print(f"wrote {path}: {SECONDS:g} s, questions at " + ", ".join(f"{t:g} s" for t, _ in QUESTIONS))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
