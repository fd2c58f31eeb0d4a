"""The omnitide CLI and the live demo run as a user would: on the bundled clip, with tiny checkpoints of both
models, every policy; bad input gives a clear message and a non-zero exit."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO

POLICIES = ["omnitide", "omnipick", "full", "fifo", "token", "streamingllm", "h2o", "eager"]


def omnitide(*args, timeout=300):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "omnitide_mlx", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["qwen", "minicpmo"])
@pytest.mark.parametrize("policy", POLICIES)
def test_stream_answers_at_the_asked_times_and_kv_stays_under_high(tiny_checkpoints, media_dir, tmp_path, model,
                                                                    policy):
    high, low = 420, 300
    out = tmp_path / "out.json"
    r = omnitide("stream", "--model", tiny_checkpoints[model], "--video", media_dir / "video_10s_av.mp4",
                 "--seconds", 5, "--ask", "2:What colour is the background?", "--ask", "4:What did you hear?",
                 "--policy", policy, "--high", high, "--low", low, "--max-tokens", 4, "--stats", "--json", out)
    assert r.returncode == 0, r.stderr
    # questions are asked when the stream reaches their time: after the updates of the seconds before it
    lines = r.stdout.splitlines()
    order = []
    for ln in lines:
        if m := re.match(r"\[(\d+(?:\.\d+)?)s\] Q:", ln):
            order.append(("q", float(m.group(1))))
        elif m := re.match(r"\[\s*(\d+(?:\.\d+)?)s\] media", ln):
            order.append(("u", float(m.group(1))))
    media_t = [t for kind, t in order if kind == "u"]
    assert media_t == [0.0, 1.0, 2.0, 3.0, 4.0]
    for q_time in (2.0, 4.0):
        i = order.index(("q", q_time))
        assert all(t < q_time for kind, t in order[:i] if kind == "u")
        assert all(t >= q_time for kind, t in order[i + 1:] if kind == "u")
    d = json.loads(out.read_text())
    assert d["policy"] == policy and d["model"] == str(tiny_checkpoints[model])
    assert [(a["t"], a["question"]) for a in d["answers"]] == [(2.0, "What colour is the background?"),
                                                               (4.0, "What did you hear?")]
    assert all(isinstance(a["answer"], str) for a in d["answers"])
    for u in d["updates"]:
        assert set(u) >= {"t", "retained_cells", "physical_span", "active_pages", "kv_bytes", "update_ms"}
        if policy != "full":
            assert u["retained_cells"] <= high
    if policy == "full":
        assert d["updates"][-1]["retained_cells"] > high
    assert "retained cells" in r.stderr  # the KV summary


def test_kv_budget_and_generate(tiny_checkpoints, media_dir, tmp_path):
    out = tmp_path / "o.json"
    r = omnitide("stream", "--model", tiny_checkpoints["minicpmo"], "--audio", media_dir / "speech_16k.wav",
                 "--seconds", 3, "--kv-budget", "256KiB", "--ask", "3:Summarise.", "--max-tokens", 3, "--json", out)
    assert r.returncode == 0, r.stderr
    stats = json.loads(out.read_text())["stats"]
    slots = (256 << 10) // stats["kv_bytes_per_token"] // 64 * 64  # whole pages: the buffers' ceiling
    assert stats["high"] == slots - 2 * 64 and stats["kv_bytes"] <= 256 << 10
    img = tmp_path / "frame.png"
    import cv2

    cv2.imwrite(str(img), np.full((64, 96, 3), 200, np.uint8))
    r = omnitide("generate", "--model", tiny_checkpoints["qwen"], "--image", img, "--audio",
                 media_dir / "tone_440_1s_16k.wav", "--prompt", "Describe it.", "--max-tokens", 4)
    assert r.returncode == 0, r.stderr
    assert "Generation:" in r.stderr and "Peak memory" in r.stderr


def test_help_lists_every_command():
    r = omnitide("--help")
    assert r.returncode == 0
    for cmd in ["stream", "generate", "convert", "simulate", "bench"]:
        assert cmd in r.stdout
    r = omnitide("stream", "--help")
    assert "--kv-budget" in r.stdout and "--temp" in r.stdout and "T:QUESTION" in r.stdout


def test_bench_lists_each_benchmarks_help_and_adds_its_flags_when_chosen():
    """``omnitide bench`` lists the benchmarks from bench.HELP without importing their modules: each line must be
    the module's own HELP; a chosen benchmark gets its description and flags."""
    import importlib

    from omnitide_mlx.bench import ARGUMENTS, BENCHMARKS, HELP

    assert set(HELP) == set(BENCHMARKS)
    for name, module in BENCHMARKS.items():
        mod = importlib.import_module(module)
        assert HELP[name] == mod.HELP
        if name in ARGUMENTS:  # the lighter module is what the benchmark module itself exposes
            light = importlib.import_module(ARGUMENTS[name])
            assert (mod.HELP, mod.DESCRIPTION, mod.add_arguments) == (light.HELP, light.DESCRIPTION,
                                                                       light.add_arguments)
    r = omnitide("bench", "--help")
    assert r.returncode == 0 and all(line[:40] in " ".join(r.stdout.split()) for line in HELP.values())
    r = omnitide("bench", "attention", "--help")
    assert r.returncode == 0 and "--sdpa-max-history" in r.stdout and "--backend" in r.stdout
    assert "The *limit* of a row" in r.stdout
    r = omnitide("bench", "stream", "--help")
    assert r.returncode == 0 and "--checkpoints" in r.stdout and "--backend" not in r.stdout
    r = omnitide("bench", "attention", "--device", "cpu")
    assert r.returncode == 2 and "--device applies to --backend torch" in r.stderr


def test_bad_inputs_exit_non_zero_with_a_clear_message(tiny_checkpoints, media_dir, tmp_path):
    qwen = tiny_checkpoints["qwen"]
    video = media_dir / "video_10s_av.mp4"
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(bytes(range(256)) * 50)
    noise = tmp_path / "noise.wav"
    noise.write_bytes(b"RIFF not really a wav file")
    broken = tmp_path / "broken"
    broken.mkdir()
    from safetensors.numpy import load_file, save_file

    for f in qwen.iterdir():
        if f.suffix != ".safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(qwen / "model.safetensors"))
    weights.pop(next(k for k in weights if k.endswith("mlp.down_proj.weight")))
    save_file(weights, str(broken / "model.safetensors"))
    cases = [
        (["--model", qwen, "--video", tmp_path / "missing.mp4"], "does not exist"),
        (["--model", qwen, "--video", junk], "junk.mp4"),
        (["--model", qwen, "--audio", noise], "noise.wav"),
        (["--model", "nobody/no-such-omni-model", "--video", video], "no-such-omni-model"),
        (["--model", broken, "--video", video, "--seconds", 1], "missing keys"),
        (["--model", qwen, "--video", video, "--ask", "soon:what?"], "T:QUESTION"),
    ]
    for args, message in cases:
        r = omnitide("stream", *args)
        assert r.returncode != 0, (args, r.stdout)
        assert message in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr, r.stderr


@pytest.mark.slow
def test_live_demo_runs_headless_on_a_file(tiny_checkpoints, media_dir):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    args = ["--model", tiny_checkpoints["minicpmo"], "--source", media_dir / "video_10s_av.mp4", "--seconds", 3,
            "--no-realtime", "--ask", "2:What do you see?", "--max-tokens", 4, "--high", 200, "--low", 120]
    r = subprocess.run([sys.executable, "examples/live_demo.py", *map(str, args)],
                       capture_output=True, text=True, timeout=300, env=env, cwd=REPO, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    assert "Q: What do you see?" in r.stdout
    assert r.stderr.count("kv ") >= 3  # the live KV footprint, one line per update
    assert "evictions" in r.stderr


def test_stream_with_quantised_kv(tiny_checkpoints, media_dir, tmp_path):
    """``--kv-bits 4`` runs the bundled clip with evictions and a migration; the KV per token counts packed values,
    scales and biases; the saved session restores its quantised cache. A head_dim the group does not divide (the
    tiny Qwen's 16) and a torch run with --kv-bits get clear errors."""
    out, sess = tmp_path / "o.json", tmp_path / "sess"
    r = omnitide("stream", "--model", tiny_checkpoints["minicpmo"], "--video", media_dir / "video_10s_av.mp4",
                 "--seconds", 5, "--ask", "2:What colour?", "--high", 200, "--low", 120, "--max-tokens", 3,
                 "--kv-bits", 4, "--kv-group-size", 32, "--kv-keep-sinks-full", "--json", out,
                 "--save-session", sess, "--quiet")
    assert r.returncode == 0, r.stderr
    stats = json.loads(out.read_text())["stats"]
    meta = json.loads((sess / "session.json").read_text())
    layers, kv_heads, head_dim = 2, 2, 32  # the tiny MiniCPM-o's LLM
    scale_bytes = {"float32": 4, "float16": 2, "bfloat16": 2}[meta["kv_dtype"]]
    assert stats["kv_bytes_per_token"] == 2 * layers * kv_heads * (head_dim // 2 + 2 * (head_dim // 32) * scale_bytes)
    assert stats["evictions"] >= 1 and stats["retained_cells"] <= 200
    from omnitide_mlx.cache import OmniCache

    cache = OmniCache.load(sess / "kv.safetensors")
    assert (cache.kv_bits, cache.kv_group_size, cache.keep_sinks_full) == (4, 32, True)
    assert cache.table.retained == stats["retained_cells"]
    r = omnitide("stream", "--model", tiny_checkpoints["qwen"], "--audio", media_dir / "tone_440_1s_16k.wav",
                 "--kv-bits", 4, "--quiet")
    assert r.returncode == 1 and "kv_group_size 64 does not divide head_dim 16" in r.stderr
    r = omnitide("stream", "--model", tiny_checkpoints["qwen"], "--audio", media_dir / "tone_440_1s_16k.wav",
                 "--kv-keep-sinks-full", "--quiet")
    assert r.returncode == 1 and "--kv-keep-sinks-full goes with --kv-bits" in r.stderr
    r = omnitide("stream", "--backend", "torch", "--model", tiny_checkpoints["qwen"], "--audio",
                 media_dir / "tone_440_1s_16k.wav", "--kv-bits", 8, "--quiet")
    assert r.returncode == 1 and "float K/V only" in r.stderr
