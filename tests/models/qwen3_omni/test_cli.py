"""``omnitide stream`` on a tiny Qwen3-Omni checkpoint (written by its family record), run as a user runs it:
ten seconds of video with sound, a question at 3 s, an answer, the stream's stats."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO
from omnitide_mlx.models.family import get_family


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return get_family("qwen3_omni").write_tiny(tmp_path_factory.mktemp("q3cli") / "tiny")


def test_stream_answers_a_question_about_a_video(checkpoint, media_dir, tmp_path):
    out = tmp_path / "out.json"
    args = ["stream", "--model", checkpoint, "--video", media_dir / "video_10s_av.mp4", "--ask", "3:What?",
            "--max-tokens", 4, "--json", out]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "omnitide_mlx", *map(str, args)], capture_output=True, text=True,
                       timeout=300, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert "[3s] Q: What?" in r.stdout and "Traceback" not in r.stderr
    d = json.loads(out.read_text())
    assert [(a["t"], a["question"]) for a in d["answers"]] == [(3.0, "What?")]
    assert isinstance(d["answers"][0]["answer"], str)
    media = [u for u in d["updates"] if u["kind"] == "media"]
    assert len(media) == 10 and d["stats"]["evictions"] == 0
    # every second after the first is the same frame + audio unit (the first also opens the user turn)
    assert len({u["tokens"] for u in media[1:] if u["t"] != 3.0}) == 1
