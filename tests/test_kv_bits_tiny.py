"""``--kv-bits`` and the checkpoints' head sizes (issue 32 item 15): MLX quantises in groups of 32, 64 or 128 along
the head, so a head of 16 (the test suite's tiny Qwen) cannot be quantised. That is said before the model loads,
naming the head sizes that work; without --kv-group-size the group is the largest of 64 / 32 that divides the
head (MiniCPM-o's tiny head of 32); and the bundled tiny checkpoints (scripts/make_tiny_checkpoints.py) run every
feature, quantised KV included."""

import json
import os
import subprocess
import sys

from conftest import REPO


def omnitide(*args, timeout=300):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "omnitide_mlx", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def test_a_head_no_group_divides_fails_before_loading(tiny_checkpoints, media_dir):
    r = omnitide("stream", "--model", tiny_checkpoints["qwen"], "--audio", media_dir / "tone_440_1s_16k.wav",
                 "--kv-bits", 4, "--quiet")
    assert r.returncode == 2 and "loading" not in r.stderr, r.stderr
    assert "head_dim 16" in r.stderr and "multiple of 32" in r.stderr, r.stderr
    r = omnitide("stream", "--model", tiny_checkpoints["minicpmo"], "--audio", media_dir / "tone_440_1s_16k.wav",
                 "--kv-bits", 4, "--kv-group-size", 64, "--quiet")
    assert r.returncode == 2 and "loading" not in r.stderr and "--kv-group-size 32" in r.stderr, r.stderr


def test_the_default_group_fits_the_head(tiny_checkpoints, media_dir, tmp_path):
    out = tmp_path / "o.json"
    r = omnitide("stream", "--model", tiny_checkpoints["minicpmo"], "--audio", media_dir / "tone_440_1s_16k.wav",
                 "--kv-bits", 4, "--json", out, "--quiet")
    assert r.returncode == 0, r.stderr
    layers, kv_heads, head_dim = 2, 2, 32
    bpt = json.loads(out.read_text())["stats"]["kv_bytes_per_token"]
    assert bpt in [2 * layers * kv_heads * (head_dim // 2 + 2 * (head_dim // 32) * b) for b in (2, 4)]


def test_the_bundled_tiny_checkpoints_run_quantised_kv(media_dir, tmp_path):
    r = subprocess.run([sys.executable, "scripts/make_tiny_checkpoints.py", "--out", tmp_path], capture_output=True,
                       text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert r.returncode == 0, r.stderr
    for name in ("tiny-qwen2.5-omni", "tiny-minicpm-o-4.5"):
        r = omnitide("stream", "--model", tmp_path / name, "--video", media_dir / "video_10s_av.mp4", "--seconds", 2,
                     "--ask", "1:What is it?", "-m", 2, "--kv-bits", 4, "--quiet")
        assert r.returncode == 0, (name, r.stderr)
