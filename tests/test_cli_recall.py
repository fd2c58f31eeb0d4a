"""``--recall SIZE`` as a user runs it: ``omnitide stream`` stores what OmniPick evicts (8-bit K/V at the tiny
MiniCPM-o's head dimension of 32), says which units an answer was given back (by stream time) on stderr and in the
--json report, and saves the store with the session; bad combinations are usage errors before the model loads."""

import json

from test_cli import omnitide

from omnitide_mlx.session import OmniSession


def test_stream_recalls_evicted_units_for_an_answer(tiny_checkpoints, media_dir, tmp_path):
    out, sess = tmp_path / "o.json", tmp_path / "sess"
    r = omnitide("stream", "--model", tiny_checkpoints["minicpmo"], "--video", media_dir / "video_10s_av.mp4",
                 "--seconds", 8, "--ask", "6:What did you see?", "--policy", "omnipick", "--high", 200, "--low", 120,
                 "--max-tokens", 3, "--recall", "8MB", "--recall-tokens", 200, "--json", out, "--save-session", sess,
                 "--quiet")
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    recalled = data["answers"][0]["recalled"]
    assert recalled["uids"] and 0 < recalled["tokens"] <= 200
    assert all(t < 6 for t in recalled["t"])  # units streamed before the question, by their stream time
    assert "(recalled the units at " in r.stderr and "recall: " in r.stderr
    stats = data["stats"]["recall"]
    assert stats["bits"] == 8 and stats["group_size"] == 32 and 0 < stats["bytes"] <= 8_000_000
    assert stats["answers"][0]["uids"] == recalled["uids"]
    restored = OmniSession.restore(sess)
    assert restored.recall.stats()["units"] == stats["units"] and restored.recall_tokens == 200


def test_recall_flags_are_checked_before_the_model_loads(tmp_path):
    r = omnitide("stream", "--model", tmp_path / "nope", "--video", "x.mp4", "--recall-tokens", 10)
    assert r.returncode == 2 and "--recall-tokens goes with --recall SIZE" in r.stderr
    r = omnitide("stream", "--model", tmp_path / "nope", "--video", "x.mp4", "--recall", "lots")
    assert r.returncode == 2 and "cannot read 'lots' as a size" in r.stderr
    r = omnitide("stream", "--model", tmp_path / "nope", "--video", "x.mp4", "--recall", "1GB", "--backend", "torch")
    assert r.returncode == 2 and "the torch backend has no evicted-unit store" in r.stderr
