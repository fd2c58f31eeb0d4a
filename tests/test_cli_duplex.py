"""``omnitide duplex`` as a user runs it: a unit a second from the bundled clip on a tiny MiniCPM-o 4.5 checkpoint
biased to both listen and speak, each unit's decision printed and written to --json, speech into one wav, and the
ways a run is refused before the model loads."""

import json
import os
import subprocess
import sys
import wave

import pytest

from conftest import REPO


def omnitide(*args, timeout=300):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "omnitide_mlx", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


@pytest.fixture(scope="module")
def duplex_ckpt(tmp_path_factory):
    from omnitide_mlx.models.minicpmo.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("duplex_cli") / "tiny", seed=6, tts=True, duplex_bias=True)


@pytest.mark.slow
def test_duplex_prints_and_records_every_unit(duplex_ckpt, media_dir, tmp_path):
    out, wav = tmp_path / "units.json", tmp_path / "speech.wav"
    r = omnitide("duplex", "--model", duplex_ckpt, "--video", media_dir / "video_10s_av.mp4", "--seconds", 4,
                 "--greedy", "--json", out, "--speak", "--audio-out", wav)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 4 and all(("] listen" in x) or ("] speak" in x) for x in lines)
    doc = json.loads(out.read_text())
    assert [u["decision"] for u in doc["units"]] == [x.split("] ")[1].split()[0] for x in lines]
    assert [u["t"] for u in doc["units"]] == [0.0, 1.0, 2.0, 3.0]
    for u in doc["units"]:
        assert u["ids"][-1] == 151684  # </unit>
        assert (u["decision"] == "listen") == (u["ids"][0] == 151705)
        assert u["decision"] == "speak" or (u["text"] == "" and u["tts_tokens"] == 0)
    assert doc["summary"]["units"] == 4 and doc["summary"]["kv_length"] == doc["units"][-1]["kv_length"]
    with wave.open(str(wav)) as f:
        assert (f.getframerate(), f.getnchannels(), f.getsampwidth()) == (24000, 1, 2)
        assert f.getnframes() > 0


@pytest.mark.slow
def test_duplex_window_bounds_the_cache(duplex_ckpt, media_dir, tmp_path):
    out = tmp_path / "units.json"
    r = omnitide("duplex", "--model", duplex_ckpt, "--video", media_dir / "video_10s_av.mp4", "--seconds", 4,
                 "--greedy", "--window", "120:100", "--json", out)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["summary"]["dropped_units"] > 0
    assert all(u["kv_length"] <= 120 for u in doc["units"])


@pytest.mark.slow
def test_duplex_retention_policy(duplex_ckpt, media_dir, tmp_path):
    out = tmp_path / "units.json"
    r = omnitide("duplex", "--model", duplex_ckpt, "--video", media_dir / "video_10s_av.mp4", "--seconds", 4,
                 "--greedy", "--policy", "omnipick", "--high", "120", "--low", "100", "--json", out)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["summary"]["evicted_tokens"] > 0 and all(u["kv_length"] <= 120 for u in doc["units"])


@pytest.mark.parametrize("extra, message", [
    (["--window", "3:5"], "0 < LOW <= HIGH"),
    (["--window", "x"], "HIGH:LOW"),
    (["--speaker", "default"], "need --speak"),
    (["--policy", "omnipick", "--window", "300:200"], "give one"),
    (["--high", "300"], "need --policy"),
    (["--policy", "fifo", "--high", "100", "--low", "200"], "above --high"),
])
def test_bad_flags_are_usage_errors(duplex_ckpt, media_dir, extra, message):
    r = omnitide("duplex", "--model", duplex_ckpt, "--audio", media_dir / "video_10s_av.mp4", *extra)
    assert r.returncode == 2 and message in r.stderr


def test_missing_media_and_models_without_duplex(duplex_ckpt, tiny_checkpoints, media_dir, tmp_path):
    r = omnitide("duplex", "--model", duplex_ckpt, "--audio", tmp_path / "nope.wav")
    assert r.returncode == 1 and "nope.wav" in r.stderr
    r = omnitide("duplex", "--model", tiny_checkpoints["qwen"], "--video", media_dir / "video_10s_av.mp4",
                 "--seconds", 1)
    assert r.returncode == 1 and "no full-duplex mode" in r.stderr
