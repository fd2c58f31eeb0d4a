"""The bounded load test (``python -m omnitide_mlx.serve.loadtest``) against the shared server: concurrent sessions
on loopback for a fixed time, every unit accounted for, at the live rate and when clients overrun the queue."""

import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def loadtest(server, tmp_path, *args):
    out = tmp_path / "report.json"
    r = subprocess.run([sys.executable, "-m", "omnitide_mlx.serve.loadtest", "--url", server.url, "--json", str(out),
                        *args], capture_output=True, text=True, timeout=300, cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    return r, (json.loads(out.read_text()) if out.exists() else None)


def test_concurrent_sessions_lose_nothing(server, http, tmp_path):
    r, rep = loadtest(server, tmp_path, "--sessions", "3", "--seconds", "3", "--rate", "2", "--frame", "96x72")
    assert r.returncode == 0, r.stdout + r.stderr
    assert rep["sent"] >= 15 and rep["pushed"] == rep["sent"] and rep["lost"] == 0 and rep["errors"] == {}
    assert not rep["server_count_mismatch"]
    assert rep["throughput_units_per_s"] > 0 and rep["latency_ms"]["p50"] <= rep["latency_ms"]["p99"]
    assert all(c <= rep["high"] for c in rep["retained_cells_at_end"])  # bounded KV in every session
    assert "throughput" in r.stdout and "p99" in r.stdout
    assert http.get("/v1/sessions").json()["sessions"] == []  # the load test cleans up


def test_overrunning_clients_get_queue_full_and_still_lose_nothing(server, tmp_path):
    # as fast as possible with more in flight than the server queues (--max-queued 3)
    r, rep = loadtest(server, tmp_path, "--sessions", "2", "--seconds", "2", "--rate", "0", "--window", "6",
                      "--frame", "96x72")
    assert r.returncode == 0, r.stdout + r.stderr
    assert rep["lost"] == 0 and set(rep["errors"]) <= {"queue_full"} and rep["errors"].get("queue_full", 0) > 0
    assert rep["pushed"] + rep["errors"]["queue_full"] == rep["sent"] and not rep["server_count_mismatch"]
