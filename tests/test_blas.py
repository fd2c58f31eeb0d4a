"""The fast BLAS without help (issue 32): on Linux the mlx-cpu wheel brings the reference BLAS, 20x slower than
OpenBLAS at the 3B shape; ``import omnitide_mlx`` loads the system's OpenBLAS into the global symbol scope before
MLX is imported, so every entry point (the CLI, the server, the demo, a user's own program) gets it without
``scripts/blas_env.sh``. ``omnitide doctor`` says which BLAS MLX uses."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

PROBE = ("import json, omnitide_mlx, mlx.core as mx; from omnitide_mlx.blas import blas_info; "
         "mx.eval(mx.ones((4, 4), stream=mx.cpu) @ mx.ones((4, 4), stream=mx.cpu)); print(json.dumps(blas_info()))")


def _probe(**env):
    e = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # as a user runs it: no blas_env.sh
    e.update(PYTHONPATH=str(REPO), **env)
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=e, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="macOS: Accelerate, nothing to load")
def test_import_loads_openblas_before_mlx():
    from omnitide_mlx.blas import find_openblas

    if find_openblas() is None:
        pytest.skip("no OpenBLAS on this machine (apt-get install libopenblas0-pthread)")
    info = _probe()
    assert info["in_use"].startswith("OpenBLAS") and info["loaded"] == find_openblas(), info
    off = _probe(OMNITIDE_BLAS="reference")
    assert off["in_use"].startswith("reference") and off["loaded"] is None, off


def test_doctor_reports_the_blas():
    e = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    r = subprocess.run([sys.executable, "-m", "omnitide_mlx", "doctor", "--no-timing", "--no-emulator", "--dtypes",
                        "float32", "--json", "-"], capture_output=True, text=True, timeout=120, cwd=REPO,
                       env={**e, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("BLAS"))
    assert ("OpenBLAS" in line or "reference" in line or "Accelerate" in line), line
