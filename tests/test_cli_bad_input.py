"""Bad input caught before anything loads or runs (issue 32 item 8 and the CLI's low items): each case failed late
(at the first question, after the whole stream, after loading, after the simulation) or with a traceback, or was
silently accepted. Each must now be a one-line message and exit 2, with nothing loaded."""

import os
import subprocess
import sys

import pytest

from conftest import REPO


def _main(capsys, *argv):
    from omnitide_mlx.cli import main

    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def _unwritable() -> str:
    """A folder nothing can be created in, even by root (os.access says yes there for root)."""
    return "/proc"


def _refused(capsys, argv, message):
    rc, out, err = _main(capsys, *argv)
    assert rc == 2, (argv, rc, out, err)
    assert message in err, (argv, err)
    assert "loading" not in err and "Traceback" not in err, (argv, err)
    assert len(err.strip().splitlines()) <= 2, (argv, err)  # argparse's usage line + the message at most
    return out, err


def test_stream_output_paths_and_flags_fail_before_loading(tiny_checkpoints, media_dir, tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    not_a_session = tmp_path / "photos"
    not_a_session.mkdir()
    (not_a_session / "holiday.jpg").write_bytes(b"\xff\xd8")
    base = ["stream", "--model", tiny_checkpoints["qwen"], "--video", media_dir / "video_10s_av.mp4"]
    for extra, message in [
        (["--stop", ""], "--stop"),
        (["--stop", "ok", "--stop", ""], "--stop"),
        (["--save-session", not_a_session], "is not a saved session"),
        (["--json", f"{_unwritable()}/out.json"], "not writable"),
        (["--save-session", f"{_unwritable()}/sess"], "not writable"),
        (["--speak", "--audio-out", a_file / "answers"], "is not a folder"),
        (["--speak", "--audio-out", f"{_unwritable()}/answers"], "not writable"),
        (["--speak", "--audio-out", ""], "--audio-out: empty path"),
        (["--audio-out", ""], "--audio-out needs --speak"),
    ]:
        _refused(capsys, base + extra, message)
    assert [p.name for p in not_a_session.iterdir()] == ["holiday.jpg"]  # untouched


def test_generate_refuses_an_empty_stop(tiny_checkpoints, media_dir, capsys):
    _refused(capsys, ["generate", "--model", tiny_checkpoints["qwen"], "--audio", media_dir / "tone_440_1s_16k.wav",
                      "--prompt", "Hi", "--stop", ""], "--stop")


def test_convert_to_a_file_fails_before_loading(tiny_checkpoints, tmp_path, capsys):
    a_file = tmp_path / "model.json"
    a_file.write_text("{}")
    _refused(capsys, ["convert", "--hf-path", tiny_checkpoints["qwen"], "--mlx-path", a_file], "is a file")
    _refused(capsys, ["convert", "--hf-path", tiny_checkpoints["qwen"], "--mlx-path", f"{_unwritable()}/m"],
             "not writable")


def test_plot_formats_are_checked_before_the_run(tmp_path, capsys):
    out, _ = _refused(capsys, ["simulate", "--seconds", "5", "--plot", tmp_path / "x.txt", "--no-progress"],
                      "--plot")
    assert "policy" not in out  # the simulation did not run
    _refused(capsys, ["bench", "stream", "--shape", "tiny", "--plot", tmp_path / "p.txt"], "--plot")
    _refused(capsys, ["bench", "attention", "--plot", tmp_path / "p"], "--plot")
    # a known format passes the check (the simulation then runs and writes it)
    rc, out, err = _main(capsys, "simulate", "--seconds", "5", "--plot", tmp_path / "x.svg", "--no-progress")
    assert rc == 0 and (tmp_path / "x.svg").is_file(), err


def test_eval_out_folder_is_checked_first(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for out, message in ((a_file, "is a file"), (f"{_unwritable()}/runs", "not writable")):
        _refused(capsys, ["eval", "streamingbench", "--data", tmp_path, "--model", "m", "--out", out], message)


def test_bench_stream_with_nothing_to_run_is_refused(capsys):
    _refused(capsys, ["bench", "stream", "--shape", "tiny", "--no-sessions", "--checkpoints", ""], "nothing to run")


@pytest.mark.slow
def test_bench_stream_without_sessions_or_retention_policies_still_plots(tmp_path, capsys):
    """`--no-sessions` with only the full baseline left the KV-layout panel without bars: numpy's zero-size max."""
    plot = tmp_path / "p.png"
    rc, out, err = _main(capsys, "bench", "stream", "--shape", "tiny", "--no-sessions", "--policies", "full",
                         "--checkpoints", "256", "--reps", "1", "--plot", plot)
    assert rc == 0 and plot.is_file() and "Traceback" not in err, err


def test_doctor_from_an_unwritable_folder(capsys):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "omnitide_mlx", "doctor", "--no-timing", "--no-emulator", "--dtypes", "float32"]
    r = subprocess.run(argv + ["--json", f"{_unwritable()}/d.json"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 2 and "--json" in r.stderr and "checking" not in r.stderr, r.stderr
    # the default file in an unwritable working folder: said at the start, the checks still run and report
    r = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=_unwritable(), timeout=120)
    assert "Traceback" not in r.stderr and r.returncode == 0, r.stderr
    assert "omnitide-doctor.json" in r.stderr.splitlines()[0] and "result:" in r.stdout


def test_live_demo_without_a_camera_fails_before_loading(tiny_checkpoints):
    """Before: "cannot open camera 0" from the capture thread after the model had loaded, then exit 0."""
    import cv2

    cap = cv2.VideoCapture(0)
    if cap.isOpened():
        cap.release()
        pytest.skip("this machine has a camera 0")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "examples/live_demo.py", "--model", tiny_checkpoints["qwen"], "--no-mic",
                        "--seconds", "2"], capture_output=True, text=True, timeout=120, env=env, cwd=REPO,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 1, r.stderr
    assert "cannot open camera 0" in r.stderr and "--source" in r.stderr and "loading" not in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_kv_group_size_without_kv_bits_is_refused(tiny_checkpoints, media_dir, capsys):
    _refused(capsys, ["stream", "--model", tiny_checkpoints["qwen"], "--audio", media_dir / "tone_440_1s_16k.wav",
                      "--kv-group-size", "32"], "--kv-group-size goes with --kv-bits")


def test_the_full_policy_summary_shows_no_watermarks():
    from omnitide_mlx.commands.stream import kv_summary

    s = {"retained_cells": 10, "kv_bytes_per_token": 4, "physical_span": 16, "active_pages": 1, "kv_bytes": 256,
         "units": 2, "evictions": 0, "evicted_tokens": 0, "migrations": 0, "migrated_cells": 0, "high": 2500,
         "low": 1800}
    assert kv_summary({**s, "policy": "full"}).endswith("policy full (no eviction)")
    assert kv_summary({**s, "policy": "fifo"}).endswith("policy fifo (high 2500, low 1800)")


def test_a_speaker_without_speak_is_refused(tiny_checkpoints):
    from omnitide_mlx import OmniSession

    s = OmniSession(tiny_checkpoints["qwen"])
    with pytest.raises(ValueError, match="speak=True"):
        s.ask("Hi", speaker="Chelsie")
    assert "".join(s.ask("Hi", max_tokens=2)) is not None  # the session is still usable


def test_a_question_past_the_end_of_the_stream_is_refused(tiny_checkpoints, media_dir, capsys):
    base = ["stream", "--model", tiny_checkpoints["qwen"], "--video", media_dir / "video_10s_av.mp4"]
    _refused(capsys, base + ["--ask", "60:q", "--seconds", "3"], "past the end")
    _refused(capsys, base + ["--ask", "1:00:q"], "past the end")


def test_live_demo_checks_its_speech_and_stop_flags_before_loading(tiny_checkpoints, media_dir, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    for extra, message in ((["--speak", "--audio-out", a_file / "answers"], "is not a folder"),
                           (["--speaker", "Ethan"], "--speaker needs --speak"),
                           (["--stop", ""], "--stop"),
                           (["--kv-group-size", "32"], "--kv-group-size goes with --kv-bits")):
        r = subprocess.run([sys.executable, "examples/live_demo.py", "--model", tiny_checkpoints["qwen"], "--source",
                            media_dir / "video_10s_av.mp4", *map(str, extra)], capture_output=True, text=True,
                           timeout=120, env=env, cwd=REPO, stdin=subprocess.DEVNULL)
        assert r.returncode == 2 and message in r.stderr and "loading" not in r.stderr, (extra, r.stderr)


def test_outputs_that_would_collide_are_refused(tiny_checkpoints, media_dir, tmp_path, capsys):
    """`--json X --save-session X` wrote the JSON, then the save met a file (a traceback after the stream); answers
    written into the session folder made the save refuse it."""
    base = ["stream", "--model", tiny_checkpoints["qwen"], "--video", media_dir / "video_10s_av.mp4"]
    sess = tmp_path / "sess"
    for extra in (["--json", sess, "--save-session", sess], ["--json", sess / "out.json", "--save-session", sess],
                  ["--speak", "--audio-out", sess, "--save-session", sess]):
        _refused(capsys, base + extra, "--save-session")
