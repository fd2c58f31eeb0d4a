"""The PyTorch path never imports MLX (checked in a fresh interpreter), and the CLI reaches it:
``omnitide stream --backend torch`` and ``omnitide bench attention --backend torch``."""

import json
import subprocess
import sys
import textwrap

from torch_stream import DEVICE

NO_MLX_SCRIPT = textwrap.dedent("""
    import argparse, json, sys, tempfile
    from pathlib import Path

    import omnitide_mlx.torch  # noqa: F401
    from omnitide_mlx.commands import stream
    from omnitide_mlx.models.qwen2_5_omni.tiny import make_tiny_checkpoint
    from omnitide_mlx.torch import bench, cache, qwen2_5_omni, session  # noqa: F401

    root = Path(tempfile.mkdtemp())
    ckpt = make_tiny_checkpoint(root / "tiny", tokenizer_dir=sys.argv[1])
    p = argparse.ArgumentParser()
    stream.add_arguments(p)
    args = p.parse_args(["--model", str(ckpt), "--backend", "torch", "--device", sys.argv[3], "--video", sys.argv[2],
                         "--seconds", "3", "--high", "150", "--low", "100", "--ask", "2:What colour is it?",
                         "--max-tokens", "3", "--json", str(root / "out.json"), "--quiet"])
    assert stream.run(args) == 0
    out = json.loads((root / "out.json").read_text())
    result = bench.run_bench("minicpm-o-2.6", [700], device=sys.argv[3], kernels=("sdpa",), reps=1)
    loaded = sorted(m for m in sys.modules if m == "mlx" or m.startswith("mlx.") or m.startswith("mlx_"))
    print(json.dumps({"mlx_modules": loaded, "updates": len(out["updates"]), "answers": len(out["answers"]),
                      "backend": out["stats"]["backend"], "evictions": out["stats"]["evictions"],
                      "bench_rows": len(result["rows"])}))
""")


def test_the_torch_path_never_imports_mlx(data_dir, media_dir):
    r = subprocess.run([sys.executable, "-c", NO_MLX_SCRIPT, str(data_dir / "tokenizers" / "qwen2"),
                        str(media_dir / "video_10s_av.mp4"), str(DEVICE)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["mlx_modules"] == []
    # three media seconds and the question (the reply is not a streaming update)
    assert out["backend"] == "torch" and out["updates"] == 4 and out["answers"] == 1 and out["evictions"] >= 1
    assert out["bench_rows"] > 10


BENCH_NO_MLX_SCRIPT = textwrap.dedent("""
    import contextlib, io, json, sys

    from omnitide_mlx.cli import main

    help_text = io.StringIO()
    with contextlib.redirect_stdout(help_text):
        try:
            main(["bench", "attention", "--backend", "torch", "--help"])
        except SystemExit as e:
            assert e.code == 0, e.code
    assert "--sdpa-max-history" in help_text.getvalue() and "--device" in help_text.getvalue()
    rc = main(["bench", "attention", "--backend", "torch", "--device", sys.argv[1], "--shape", "minicpm-o-2.6",
               "--history", "700", "--reps", "1", "--json", sys.argv[2]])
    loaded = sorted(m for m in sys.modules if m == "mlx" or m.startswith("mlx.") or m.startswith("mlx_"))
    print(json.dumps({"rc": rc, "mlx_modules": loaded}))
""")


def test_the_bench_command_with_the_torch_backend_never_imports_mlx(tmp_path):
    """``omnitide bench attention --backend torch`` (its --help, then a run) through the CLI's own parser: the
    command imports a benchmark's module only once it is chosen, and the attention flags need no MLX."""
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-c", BENCH_NO_MLX_SCRIPT, str(DEVICE), str(out)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res == {"rc": 0, "mlx_modules": []}
    assert json.loads(out.read_text())["backend"] == "torch"


def test_cli_stream_and_bench_with_the_torch_backend(tiny_qwen, media_dir, tmp_path):
    from omnitide_mlx.cli import main

    out = tmp_path / "stream.json"
    assert main(["stream", "--model", str(tiny_qwen), "--backend", "torch", "--device", str(DEVICE), "--video",
                 str(media_dir / "video_10s_av.mp4"), "--seconds", "2", "--ask", "1:What is it?", "--max-tokens", "2",
                 "--json", str(out), "--quiet"]) == 0
    res = json.loads(out.read_text())
    assert res["stats"]["backend"] == "torch" and len(res["updates"]) == 3 and len(res["answers"]) == 1
    bench_out = tmp_path / "bench.json"
    assert main(["bench", "attention", "--backend", "torch", "--device", str(DEVICE), "--shape", "minicpm-o-2.6",
                 "--history", "700", "--reps", "1", "--json", str(bench_out)]) == 0
    res = json.loads(bench_out.read_text())
    assert res["backend"] == "torch" and {r["layout"] for r in res["rows"]} == {"full", "native", "ordered_suffix",
                                                                              "class_aware", "eager"}
    assert main(["stream", "--model", str(tiny_qwen), "--device", "cpu", "--video",
                 str(media_dir / "video_10s_av.mp4"), "--seconds", "1", "--quiet"]) == 2  # --device needs torch: a usage error before loading


def test_a_kv_budget_that_holds_no_unit_on_the_torch_backend_fails_after_loading(tiny_qwen, media_dir):
    """The torch backend checks --kv-budget against a unit only once the model is loaded (it must not import the
    MLX port's budget figures). Before: every chunk was skipped ('the media unit is 153 tokens; the KV budget ...'),
    the summary said `streamed 0 s: video 2 s, audio 2.0 s` (what was read) and the command exited 0. Now it says
    what became units and what was skipped and why, and exits 1."""
    from omnitide_mlx.models.budget import kv_need

    need = kv_need(tiny_qwen)
    budget = 192 * need.bytes_per_token  # three pages: the system prompt's and two for a unit of ~150 tokens
    r = subprocess.run([sys.executable, "-m", "omnitide_mlx", "stream", "--backend", "torch", "--device", str(DEVICE),
                        "--model", str(tiny_qwen), "--video", str(media_dir / "video_10s_av.mp4"), "--seconds", "2",
                        "--kv-budget", str(budget), "--no-progress"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "streamed 0 of 2 s: video 0 s, audio 0.0 s" in r.stderr, r.stderr
    assert "skipped 2 s (video 2 s, audio 2.0 s): the media unit is 153 tokens" in r.stderr, r.stderr
    assert "or raise kv_budget (and 1 other reason)" in r.stderr, r.stderr  # the later units: 150 tokens
    assert "nothing was streamed" in r.stderr and "Traceback" not in r.stderr, r.stderr
