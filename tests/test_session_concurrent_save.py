"""Two processes saving sessions to one folder at once (issue 32 item 12): before, the loser got a raw
``OSError: Directory not empty`` and left a ``.NAME.old-PID-...`` folder behind. Now every save succeeds and the
folder always ends up holding one whole saved session (the last to land), with nothing left beside it."""

import os
import subprocess
import sys
import time

import pytest

from conftest import REPO

SAVER = r"""
import sys, time
import numpy as np
from omnitide_mlx import OmniSession

model, target, start, n, tag = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
s = OmniSession(model, system_prompt=f"saver {tag}")
s.push(audio=np.zeros(16000, np.float32))
s.flush()
time.sleep(max(0.0, start - time.time()))
for _ in range(n):
    s.save(target)
print("ok")
"""


@pytest.mark.slow
def test_two_processes_saving_to_one_folder(tiny_checkpoints, tmp_path):
    target = tmp_path / "sess"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    start = time.time() + 12  # both loaded by then: the saves overlap
    procs = [subprocess.Popen([sys.executable, "-c", SAVER, str(tiny_checkpoints["qwen"]), str(target), str(start),
                               "60", tag], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for tag in ("a", "b")]
    results = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0 and out.strip() == "ok" and "Traceback" not in err, err
    assert sorted(q.name for q in tmp_path.iterdir()) == ["sess"]  # no .sess.old-* / .sess.saving-* left
    from omnitide_mlx import OmniSession

    restored = OmniSession.restore(target)
    assert restored.system_prompt in ("saver a", "saver b")
    assert restored.stats()["units"] >= 1
