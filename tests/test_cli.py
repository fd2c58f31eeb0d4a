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
    args = ["stream", "--model", tiny_checkpoints[model], "--video", media_dir / "video_10s_av.mp4",
            "--seconds", 5, "--ask", "2:What colour is the background?", "--ask", "4:What did you hear?",
            "--policy", policy, "--high", high, "--low", low, "--max-tokens", 4, "--stats", "--json", out]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "omnitide_mlx", *map(str, args)], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=300, env=env, cwd=REPO)  # stats on stderr
    assert r.returncode == 0, r.stdout
    # questions are asked when the stream reaches their time: after the updates of the seconds before it
    lines = r.stdout.splitlines()
    order = []
    for ln in lines:
        if m := re.match(r"\[(\d+(?:\.\d+)?)s\] Q:", ln):
            order.append(("q", float(m.group(1))))
        elif m := re.match(r"\s*(\d+(?:\.\d+)?)s\s+media", ln):
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
    assert "tokens retained" in r.stdout  # the KV summary


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
            "--no-realtime", "--ask", "2:What do you see?", "--max-tokens", 4, "--high", 200, "--low", 120,
            "--temp", 0.7, "--top-p", 0.9, "--seed", 1, "--stop", "zzz"]
    r = subprocess.run([sys.executable, "examples/live_demo.py", *map(str, args)],
                       capture_output=True, text=True, timeout=300, env=env, cwd=REPO, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    assert "Q: What do you see?" in r.stdout and "A: " in r.stdout
    assert "retained" not in r.stdout  # the KV footprint goes to stderr, one line per update
    assert r.stderr.count("capacity") >= 4  # three seconds and the question
    assert "evictions" in r.stderr


def test_live_demo_checks_its_flags_before_loading(tiny_checkpoints, media_dir):
    """issue 15 (live demo): sampling flags accepted and checked like the CLI's, before the model loads."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for extra, message in ((["--top-p", "2"], "--top-p"), (["--high", "100", "--low", "200"], "above --high"),
                           (["--ask", "x:y"], "T:QUESTION")):
        r = subprocess.run([sys.executable, "examples/live_demo.py", "--model", tiny_checkpoints["minicpmo"],
                            "--source", media_dir / "video_10s_av.mp4", *extra], capture_output=True, text=True,
                           timeout=120, env=env, cwd=REPO, stdin=subprocess.DEVNULL)
        assert r.returncode == 2 and message in r.stderr and "loading" not in r.stderr, (extra, r.stderr)


def _main(capsys, *argv):
    """The CLI in this process (same code path as the command; argparse errors exit with status 2)."""
    from omnitide_mlx.cli import main

    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_every_flag_and_output_path_is_checked_before_the_model_loads(tiny_checkpoints, media_dir, tmp_path,
                                                                      capsys):
    """issue 15 item 4: these failed only after the model had loaded (or after the whole stream: --json,
    --save-session), or were accepted (--kv-budget 1e30, --temp -1, --top-p 2, --seconds -2)."""
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    base = ["stream", "--model", tiny_checkpoints["qwen"], "--video", media_dir / "video_10s_av.mp4"]
    cases = [
        (["-m", "0"], "--max-tokens"),
        (["--max-tokens", "-1"], "--max-tokens"),
        (["--high", "500", "--low", "600"], "--low 600 is above --high 500"),
        (["--low", "3000"], "give --high too"),
        (["--kv-budget", "lots"], "cannot read 'lots' as a size"),
        (["--kv-budget", "1e30"], "1 PiB"),
        (["--kv-budget", "0"], "not a positive size"),
        (["--kv-budget", "1MiB", "--low", "100"], "--low cannot be combined with --kv-budget"),
        (["--kv-budget", "1MiB", "--high", "100"], "give one of them"),
        (["--max-kv-size", "400", "--high", "100"], "give one of them"),
        (["--temp", "-1"], "--temp"),
        (["--temp", "nan"], "--temp"),
        (["--top-p", "2"], "--top-p"),
        (["--min-p", "-0.1"], "--min-p"),
        (["--top-k", "-3"], "--top-k"),
        (["--repetition-penalty", "0"], "--repetition-penalty"),
        (["--seconds", "-2"], "--seconds"),
        (["--ask", "soon:what?"], "T:QUESTION"),
        (["--ask", "5:"], "T:QUESTION"),
        (["--json", "/dev/null/out.json"], "is not a folder"),
        (["--json", tmp_path], "is a folder"),
        (["--save-session", a_file], "is a file"),
        (["--device", "cpu"], "--device applies to --backend torch"),
    ]
    for extra, message in cases:
        rc, out, err = _main(capsys, *base, *extra)
        assert rc not in (0, None), (extra, out, err)
        assert message in err, (extra, err)
        assert "loading" not in err and "Traceback" not in err, (extra, err)
    # a model that does not exist fails before the video is decoded, on a line of its own
    rc, _, err = _main(capsys, "stream", "--model", tmp_path / "nowhere", "--video", media_dir / "video_10s_av.mp4")
    assert rc == 1 and err.startswith("omnitide stream: no model folder at"), err


def test_ask_times_read_as_seconds_or_a_clock():
    from omnitide_mlx.commands.options import parse_questions, resolve_watermarks
    from argparse import Namespace

    assert parse_questions(["0:05:hi", "12.5:What?", "1:02:05:Who?", "5:10 apples?", "7:3:2 ratio?"]) == [
        (5.0, "hi"), (5.0, "10 apples?"), (7.0, "3:2 ratio?"), (12.5, "What?"), (3725.0, "Who?")]
    ns = lambda **kw: Namespace(**{"high": None, "low": None, "kv_budget": None, "max_kv_size": None, **kw})  # noqa
    assert resolve_watermarks(ns(high=100)) == (100, 72)  # --high alone: low keeps the paper's 1800/2500 ratio
    assert resolve_watermarks(ns(max_kv_size=4096)) == (4096, 2949)
    assert resolve_watermarks(ns(low=1000)) == (2500, 1000)
    assert resolve_watermarks(ns()) == (None, None)


def test_media_end_streams_the_rest_and_says_so(tiny_checkpoints, media_dir, tmp_path):
    """issue 15 item 2: a 1 s audio file with the 10 s clip streamed 2 of the 10 seconds while the progress bar
    said 10/10; now every second becomes a unit and the summary names what each track gave."""
    out = tmp_path / "o.json"
    r = omnitide("stream", "--model", tiny_checkpoints["qwen"], "--video", media_dir / "video_10s_av.mp4",
                 "--audio", media_dir / "tone_440_1s_16k.wav", "--high", 400, "--json", out)
    assert r.returncode == 0, r.stderr
    d = json.loads(out.read_text())
    assert [u["t"] for u in d["updates"] if u["kind"] == "media"] == [float(k) for k in range(10)]
    assert d["media"] == {"units": 10, "video_seconds": 10, "audio_seconds": 1.0, "silence_seconds": 9.0,
                          "skipped": {"units": 0, "video_seconds": 0, "audio_seconds": 0.0, "silence_seconds": 0.0,
                                      "reasons": []}}
    assert "streamed 10 s: video 10 s, audio 1.0 s (+ 9.0 s of silence)" in r.stderr
    assert "moov atom" not in r.stderr and "[mov," not in r.stderr


def test_answers_on_stdout_stats_on_stderr_and_a_questions_stats_before_its_answer(tiny_checkpoints, media_dir):
    """issue 15 item 8: the question's stats line landed between `A:` and the answer (on a terminal the bar's
    line clearing erased `A:`). Run with both streams into one pipe to see the order a terminal shows."""
    args = ["stream", "--model", tiny_checkpoints["qwen"], "--video", media_dir / "video_10s_av.mp4", "--seconds", 3,
            "--ask", "0:02:What colour?", "--max-tokens", 3, "--stats", "--high", 400,
            "--repetition-penalty", 1.1, "--top-p", 1.0, "--stop", "zzz"]  # mlx-lm's sampling flags
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    merged = subprocess.run([sys.executable, "-m", "omnitide_mlx", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, timeout=300, env=env, cwd=REPO)
    assert merged.returncode == 0, merged.stdout
    lines = merged.stdout.splitlines()
    q = next(i for i, ln in enumerate(lines) if ln.startswith("[2s] Q: What colour?"))
    assert re.match(r"\s+-\s+user\s+\d+", lines[q + 1]), lines[q:q + 3]  # the question's update, then its answer
    assert lines[q + 2].startswith("A: "), lines[q:q + 3]
    assert re.match(r"\s+2\.0s\s+media", lines[q + 3]), lines[q:q + 4]  # the next second streams after it
    header = next(ln for ln in lines if "retained MiB" in ln)
    assert "capacity MiB" in header
    split = omnitide(*args)
    assert split.returncode == 0, split.stderr
    assert "A: " in split.stdout and "Q: What colour?" in split.stdout
    assert "media" not in split.stdout and "retained" not in split.stdout  # stats and summary: stderr only
    assert "A: " not in split.stderr and "tokens retained" in split.stderr and "capacity" in split.stderr
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
    assert r.returncode == 2 and "head_dim 16" in r.stderr and "loading" not in r.stderr
    r = omnitide("stream", "--model", tiny_checkpoints["qwen"], "--audio", media_dir / "tone_440_1s_16k.wav",
                 "--kv-keep-sinks-full", "--quiet")
    assert r.returncode != 0 and "--kv-keep-sinks-full goes with --kv-bits" in r.stderr
    r = omnitide("stream", "--backend", "torch", "--model", tiny_checkpoints["qwen"], "--audio",
                 media_dir / "tone_440_1s_16k.wav", "--kv-bits", 8, "--quiet")
    assert r.returncode != 0 and "float K/V only" in r.stderr


def test_other_subcommands_check_flags_and_output_paths_first(tmp_path, capsys):
    """One set of checks across subcommands: bad numbers and unusable output paths fail before any work."""
    cases = [
        (["simulate", "--seconds", "-2"], "--seconds"),
        (["simulate", "--page-size", "0"], "--page-size"),
        (["simulate", "--seconds", "5", "--json", "/dev/null/sim.json"], "is not a folder"),
        (["simulate", "--seconds", "5", "--plot", tmp_path], "is a folder"),
        (["bench", "attention", "--json", "/dev/null/b.json"], "is not a folder"),
        (["eval", "streamingbench", "--data", tmp_path, "--model", "m", "--out", tmp_path, "-m", "0"],
         "--max-tokens"),
        (["eval", "livesports", "--data", tmp_path, "--model", "m", "--out", tmp_path, "--interval", "-5"],
         "--interval"),
    ]
    for argv, message in cases:
        rc, out, err = _main(capsys, *argv)
        assert rc == 2 and message in err, (argv, rc, err)
    rc, out, err = _main(capsys, "simulate", "--seconds", "20", "--no-progress")
    assert rc == 0 and "policy omnitide" in out


def test_convert_takes_mlx_lms_hf_path_and_shows_each_stage(tiny_checkpoints, tmp_path):
    r = omnitide("convert", "--hf-path", tiny_checkpoints["qwen"], "--mlx-path", tmp_path / "q", "-q")
    assert r.returncode == 0, r.stderr
    assert "loading" in r.stderr and "quantising and writing 4-bit (group 64) weights" in r.stderr
    assert r.stderr.count(" done in ") == 2 and "wrote 4-bit (group 64) MLX model" in r.stdout


@pytest.mark.parametrize("model", ["qwen", "minicpmo"])
def test_a_kv_budget_too_small_for_one_unit_fails_before_the_model_loads(tiny_checkpoints, media_dir, model):
    """Before: `--kv-budget` that cannot hold the system prompt next to one media unit was reported after the
    "loading ..." line (the session's watermarks or its first unit). Now it is checked from the checkpoint's files
    (KV bytes per token from config.json and the safetensors headers, the unit from the model's layout at the
    video's frame size) before anything loads; the message says what the budget holds and what it needs."""
    from omnitide_mlx.media import probe_video
    from omnitide_mlx.models.budget import kv_need

    ckpt = tiny_checkpoints[model]
    info = probe_video(media_dir / "video_10s_av.mp4")
    need = kv_need(ckpt, frame_size=(info.width, info.height))
    fits = 64 * -(-(64 + need.first_unit_tokens) // 64)  # the system prompt's page and one unit, in whole pages
    base = ["stream", "--model", ckpt, "--video", media_dir / "video_10s_av.mp4", "--seconds", 2, "--no-progress"]
    r = omnitide(*base, "--kv-budget", (fits - 64) * need.bytes_per_token)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "--kv-budget" in r.stderr and f"one media unit is {need.first_unit_tokens} tokens" in r.stderr, r.stderr
    assert f"give at least {max(fits, 192) * need.bytes_per_token} bytes" in r.stderr, r.stderr
    assert "loading" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = omnitide(*base, "--kv-budget", max(fits, 192) * need.bytes_per_token)  # the figure it asked for streams
    assert r.returncode == 0, (r.stdout, r.stderr)


def test_simulate_leftover_option(tmp_path, capsys):
    """``--leftover`` reaches OmniPick (recorded in the JSON); a bad kind or a non-OmniPick policy is a usage error."""
    out = tmp_path / "sim.json"
    rc, _, err = _main(capsys, "simulate", "--profile", "qwen2.5-omni-7b", "--seconds", "90", "--leftover",
                       "audio+text", "--json", out, "--no-progress")
    assert rc == 0, err
    assert json.loads(out.read_text())["policy_config"]["leftover"] == "audio+text"
    rc, _, err = _main(capsys, "simulate", "--seconds", "5", "--leftover", "video")
    assert rc == 2 and "leftover must name" in err
    rc, _, err = _main(capsys, "simulate", "--seconds", "5", "--policy", "fifo", "--leftover", "audio")
    assert rc == 2 and "leftover" in err


def test_a_stream_whose_every_chunk_is_rejected_fails_and_says_what_was_skipped(tiny_checkpoints, tmp_path):
    """Before: when the session rejected every chunk after the model loaded (here: frames of a 402x2 strip, which
    the Qwen processor refuses, aspect ratio over 200), the summary counted what was read from the file
    (`streamed 0 s: video 2 s, no audio track`) and the command exited 0 having streamed nothing. Now the summary
    counts what became units (the session's stats()["media"]) and what was skipped and why, and it exits 1."""
    import cv2

    strip = tmp_path / "strip.avi"
    writer = cv2.VideoWriter(str(strip), cv2.VideoWriter_fourcc(*"MJPG"), 1, (402, 2))
    for k in range(3):
        writer.write(np.full((2, 402, 3), 100 + 20 * k, np.uint8))
    writer.release()
    out = tmp_path / "o.json"
    r = omnitide("stream", "--model", tiny_checkpoints["qwen"], "--video", strip, "--no-progress", "--json", out)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "streamed 0 of 2 s: video 0 s, no audio track" in r.stderr, r.stderr
    assert "skipped 2 s (video 2 s): image aspect ratio 201 is over 200" in r.stderr, r.stderr
    assert "nothing was streamed" in r.stderr and "Traceback" not in r.stderr, r.stderr
    d = json.loads(out.read_text())  # the results are still written
    assert d["media"]["units"] == 0 and d["media"]["video_seconds"] == 0
    assert d["media"]["skipped"] == {"units": 2, "video_seconds": 2, "audio_seconds": 0.0, "silence_seconds": 0.0,
                                     "reasons": ["image aspect ratio 201 is over 200"]}


def test_the_sessions_own_warnings_read_as_the_commands_messages(tiny_checkpoints, media_dir):
    """issue 15 item 8 (output a person can read): `--high 100` streamed with a RetentionWarning printed as
    `<frozen runpy>:88: RetentionWarning: the low watermark ...` (the warning points at its caller's line, which
    for the command is runpy's). Now it is `omnitide stream: warning: ...`, on a line of its own."""
    r = omnitide("stream", "--model", tiny_checkpoints["qwen"], "--video", media_dir / "video_10s_av.mp4",
                 "--seconds", 1, "--high", 100, "--no-progress")
    assert r.returncode == 0, r.stderr
    # --high 100 is below the prefix plus one 146-token unit: the guard says so (before, it spoke of low only)
    assert "\nomnitide stream: warning: the high watermark (100 tokens) cannot hold" in r.stderr, r.stderr
    assert "runpy" not in r.stderr and "RetentionWarning" not in r.stderr, r.stderr
