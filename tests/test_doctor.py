"""``omnitide doctor`` run as a user would (so CI runs it): every kernel self-test passes here (the Metal kernels in
the emulator when clang++ is present), the timing rows and the model check are in the JSON, the report is short;
bad flags fail before anything runs; a broken kernel makes the doctor say so and exit 1."""

import json

import pytest
from test_cli import omnitide

from omnitide_mlx.commands import doctor
from omnitide_mlx.kernels import fused
from omnitide_mlx.kernels import selftest


def test_doctor_runs_and_reports(tiny_checkpoints, tmp_path):
    out = tmp_path / "doctor.json"
    r = omnitide("doctor", "--json", out, "--dtypes", "float16", "--model", tiny_checkpoints["qwen"])
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads(out.read_text())
    paths = {(t["path"], t["tile"]) for t in d["self_tests"]}
    assert {("reference", 64), ("gather", 64), ("dense", 64)} <= paths
    if d["emulator_note"] is None:  # clang++ present: the Metal kernels ran in the emulator
        assert {("vector", 64), ("vector", 32), ("page_compact", 0)} <= paths
    assert all(t["ok"] for t in d["self_tests"])
    assert [t["phase"] for t in d["timing"]] == ["prefill", "decode"]
    assert all(m is not None and m > 0 for t in d["timing"] for m in t["measured_ms"].values())
    assert d["model"]["ok"] and d["model"]["units"][0]["tokens"] > 0
    assert "all checks passed" in r.stdout and "model " in r.stdout
    assert len(r.stdout.splitlines()) < 25 and d["report"].strip() == r.stdout.strip()


def test_bad_flags_fail_before_anything_runs(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    r = omnitide("doctor", "--dtypes", "int8", "--json", a_file / "dir.json",
                 "--model", "missing-model")
    assert r.returncode == 2 and not r.stdout
    for msg in ("--dtypes: choose from", f"--json {a_file / 'dir.json'}: {a_file} is not a folder",
                "--model: no such checkpoint"):
        assert msg in r.stderr


def test_a_broken_kernel_fails_the_doctor(monkeypatch):
    """The fused paths with their masks dropped (holes and the future visible): their self-tests fail against the
    reference, the reference still passes against float64, and the report says so."""
    monkeypatch.setattr(fused, "_mask", lambda *a: None)
    result = doctor.doctor(dtypes=["float32"], emulator=False, timing=False)
    assert not result["ok"]
    failed = [t["path"] for t in result["self_tests"] if not t["ok"]]
    assert failed == ["gather", "dense"]
    text = doctor.report(result)
    assert "reference    tile 64  float64 numpy: float32 ok" in text and "gather       tile 64" in text
    assert "float32 FAIL" in text and "SOME CHECKS FAILED" in text
    selftest.reset()


@pytest.fixture(autouse=True)
def _auto_kernels(monkeypatch):
    monkeypatch.delenv("OMNITIDE_KERNELS", raising=False)
