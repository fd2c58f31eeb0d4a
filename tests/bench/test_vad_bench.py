"""``omnitide bench vad`` end to end on a small configuration: the JSON, the table, the plot, and scores that mean
something (Silero finds the questions in clean speech and nothing in silence)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="needs espeak-ng (scripts/setup.sh --dev)")


def test_bench_vad_small(tmp_path):
    out, png = tmp_path / "vad.json", tmp_path / "vad.png"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "omnitide_mlx", "bench", "vad", "--clips", "1", "--snr", "10",
                        "--backgrounds", "pink", "--no-echo", "--cost-seconds", "1", "--reps", "1", "--json", str(out),
                        "--plot", str(png), "--markdown"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| clean speech |" in r.stdout and "CPU ms per audio second" in r.stdout
    res = json.loads(out.read_text())
    assert png.stat().st_size > 10_000
    names = [c["name"] for c in res["conditions"]]
    assert names == ["clean speech", "silence", "pink only", "speech + pink 10 dB"]
    clean, silence = res["conditions"][0]["detectors"]["silero"], res["conditions"][1]["detectors"]["silero"]
    assert clean["f1"] > 0.9 and silence["false_positive_rate"] == 0
    lat = res["latency"]["silero"]
    assert lat["missed"] == 0 and lat["questions"] == 6 and 0.1 <= lat["onset_delay_median_s"] < 0.4
    assert 0.5 <= lat["end_delay_median_s"] < 0.9  # the 0.5 s hangover, and the chunk it ends on
    assert res["cost"]["rows"]["silero batch (NumPy route)"]["cpu_ms_per_audio_s"] > 0
    assert res["versions"]["silero-vad"]


def test_bench_vad_bad_flags():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "omnitide_mlx", "bench", "vad", "--clips", "0"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode != 0 and "--clips" in r.stderr
