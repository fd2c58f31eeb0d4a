"""scripts/mac_check.sh in its dry mode (reference path only) as CI runs it: the steps run, the report has one row
per shape, checkpoint, phase and layout with the winner, its margin and its ratio to the limit, and the cost
model's prediction; the shell script's flags reach the module. Small shapes stand in for the real ones (the
benchmark at full size is minutes on a CPU)."""

import json
import os
import subprocess

import pytest

from conftest import REPO
from omnitide_mlx.bench import mac_check


@pytest.fixture
def small_shapes(monkeypatch):
    from omnitide_mlx.models import stream_units

    real = stream_units.get_profile
    small = {name: real(name).with_shape(q_heads=4, kv_heads=2, head_dim=32) for name in mac_check.SHAPES}
    monkeypatch.setattr(stream_units, "get_profile", lambda name: small.get(name) or real(name))


def test_dry_run_writes_the_report(tmp_path, small_shapes):
    res = mac_check.run_check(tmp_path, dry=True, histories=[1024], reps=1, log=lambda *a: None)
    assert [s["rc"] for s in res["steps"]] == [0, 0]  # tests/metal (skipped off a Mac), doctor
    assert json.loads((tmp_path / "doctor.json").read_text())["ok"]
    saved = json.loads((tmp_path / "mac_check.json").read_text())
    assert set(saved["runs"]) == set(mac_check.SHAPES) and saved["paths"] == ["reference"]
    summary = saved["summary"]
    assert {(e["shape"], e["phase"], e["layout"]) for e in summary} == {
        (s, ph, lay) for s in mac_check.SHAPES for ph in ("prefill", "decode") for lay in ("native", "omnipage", "eager")}
    for e in summary:
        assert e["winner"] == "reference" and e["margin"] is None
        assert e["winner_ratio_to_limit"] == e["paths"]["reference"]["ratio_to_limit"] > 0
        assert e["predicted_choice"] in ("vector", "gather", "dense")
    md = (tmp_path / "mac_check.md").read_text()
    assert "mode: dry (reference only)" in md and md.count("| qwen2.5-omni-7b | 1024 |") == 6


def test_summary_picks_the_winner_and_the_dispatchers_gap():
    def run(ms, impl):
        return {"rows": [{"history": 4096, "phase": "prefill", "layout": "full", "median_ms": 10.0, "impl": "sdpa",
                          "speedup_vs_full": 1.0, "ratio_to_limit": 1.0, "limit": 1.0, "active_slots": 9000},
                         {"history": 4096, "phase": "prefill", "layout": "omnipage", "median_ms": ms, "impl": impl,
                          "speedup_vs_full": 10.0 / ms, "ratio_to_limit": 10.0 / ms / 4, "limit": 4.0,
                          "active_slots": 2000}]}
    runs = {"s": {"vector": run(5.0, "vector"), "gather": run(2.5, "gather"), "dense": run(3.0, "dense"),
                  "auto": run(3.0, "dense")}}
    (e,) = mac_check.summarize(runs, {"s": [{"history": 4096, "phase": "prefill", "layout": "omnipage",
                                            "choice": "gather", "predicted_ms": {}, "ratio_to_limit": 0.9}]})
    assert e["winner"] == "gather" and e["margin"] == 1.2 and e["winner_ratio_to_limit"] == 1.0
    assert e["auto_choice"] == "dense" and e["auto_vs_winner"] == 1.2 and e["predicted_choice"] == "gather"


def test_the_script_refuses_a_full_run_without_a_gpu_and_checks_flags():
    import mlx.core as mx

    if mx.metal.is_available():
        pytest.skip("a Metal GPU is present")
    env = {**os.environ, "PYTHON": os.environ.get("PYTHON", __import__("sys").executable)}
    r = subprocess.run(["bash", "scripts/mac_check.sh", "--skip-tests", "--skip-doctor", "--out", "/tmp/x"],
                       cwd=REPO, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode != 0 and "use --dry off a Mac" in r.stderr
    r = subprocess.run(["bash", "scripts/mac_check.sh", "--dry", "--shapes", "nope"], cwd=REPO,
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "--shapes: choose from" in r.stderr
