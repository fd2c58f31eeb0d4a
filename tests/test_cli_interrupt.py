"""Ctrl-C during ``omnitide stream`` (issue 32 item 4): the stream stops at the next unit, ``--json`` is written
(marked interrupted, with everything answered and streamed so far) and ``--save-session`` holds a restorable
session, then the command exits 130. The restored session answers a question exactly as an uninterrupted stream
of the same seconds does (greedy)."""

import json
import os
import random
import signal
import subprocess
import sys

import pytest

from conftest import REPO


def _cli(*args):
    return [sys.executable, "-m", "omnitide_mlx", *map(str, args)]


@pytest.mark.slow
def test_sigint_at_a_random_second_writes_json_and_a_restorable_session(tiny_checkpoints, media_dir, tmp_path):
    seed = int(os.environ.get("OMNITIDE_TEST_SEED", random.randrange(1 << 30)))
    at = random.Random(seed).randint(1, 7)  # Ctrl-C once the update of this second is reported
    model, video = tiny_checkpoints["qwen"], media_dir / "video_10s_av.mp4"
    out, sess = tmp_path / "out.json", tmp_path / "sess"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    p = subprocess.Popen(_cli("stream", "--model", model, "--video", video, "--ask", "1:What is it?",
                              "-m", 6, "--json", out, "--save-session", sess, "--quiet", "--stats"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        seen = []
        for line in p.stderr:  # --stats: one line per update, on stderr
            seen.append(line)
            if line.split()[:2] == [f"{at}.0s", "media"]:
                break
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
        err = "".join(seen) + err
    finally:
        p.kill()
    assert p.returncode == 130, (seed, err)
    assert "interrupted" in err and "Traceback" not in err, (seed, err)
    d = json.loads(out.read_text())
    assert d["interrupted"] is True
    n = d["media"]["units"]
    assert at + 1 <= n < 10, (seed, n)
    assert [a["question"] for a in d["answers"]] == ["What is it?"]
    assert len([u for u in d["updates"] if u["kind"] == "media"]) == n
    assert d["stats"]["units"] >= n

    # the uninterrupted stream of the same n seconds, asked at its end; and the restored session asked the same
    ref = tmp_path / "ref.json"
    q = "What did you see and hear?"
    r = subprocess.run(_cli("stream", "--model", model, "--video", video, "--seconds", n, "--ask", "1:What is it?",
                            "--ask", f"{n}:{q}", "-m", 6, "--json", ref, "--quiet"),
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr
    want = json.loads(ref.read_text())["answers"]
    assert want[0]["answer"] == d["answers"][0]["answer"]  # the same stream up to the interrupt
    from omnitide_mlx import OmniSession

    restored = OmniSession.restore(sess)
    assert restored.stats()["units"] == d["stats"]["units"]
    got = "".join(restored.ask(q, max_tokens=6, temp=0.0))
    assert got == want[1]["answer"], seed

