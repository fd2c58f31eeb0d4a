"""What recall costs a question (issue 30): the store's scoring (one extra prefill of the question plus the bound
over every stored unit), the re-rotation of the retained keys, the copy of the recalled K/V into the cache and the
release after the answer, against the answer's own time, on a shape-true model (bench/shape_models.py).

Two sessions stream the same units side by side (OmniTide, the model's watermarks): one without recall, one with a
store; each then answers the same questions, one at a time, alternating between the two. Per question the JSON
holds the recall record (``session.last_recall()``) and the wall time of the whole answer in both sessions; the
summary gives medians and the cost's share of the answer.

    python -m omnitide_mlx.bench.recall --shape minicpm-o-4.5 --units 12 --questions 5 --json docs/img/recall-cost.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..session import OmniSession
from .shape_models import ShapeTrueModel

_FRAME = np.zeros((28, 28, 3), dtype=np.uint8)  # validated by the engine, then ignored by the random-unit adapter
_SECOND = np.zeros(16000, dtype=np.float32)
COST_KEYS = ("probe_ms", "score_ms", "rerotate_ms", "copy_ms", "release_ms")


def run(shape: str, layers: int, units: int, questions: int, max_tokens: int, recall: str,
        recall_tokens: int | None, kv_bits: int | None = None, policy: str = "omnitide") -> dict:
    model = ShapeTrueModel(shape, layers=layers, setting="paper")  # the paper's units (MiniCPM-o 4.5: 672 tokens)
    quant = {"kv_bits": kv_bits} if kv_bits else {}
    plain = OmniSession(model, policy=policy, **quant)
    with_recall = OmniSession(model, policy=policy, recall=recall, recall_tokens=recall_tokens, **quant)
    for t in range(units):
        for s in (plain, with_recall):
            s.push(frame=_FRAME, audio=_SECOND, t=float(t))
    rows = []
    question = " ".join(["w"] * 12)
    for s in (plain, with_recall):  # warm-up: the first answer compiles and sizes buffers; not timed
        "".join(s.ask(question, max_tokens=max_tokens))
    for i in range(questions):
        row = {"question": i}
        for name, s in (("plain", plain), ("recall", with_recall)):
            t0 = time.perf_counter()
            "".join(s.ask(question, max_tokens=max_tokens))
            row[f"{name}_answer_ms"] = (time.perf_counter() - t0) * 1000
        rec = with_recall.last_recall()
        row.update({k: rec.get(k, 0.0) for k in COST_KEYS}, recalled_tokens=rec["tokens"], uids=rec["uids"],
                   candidates=rec["candidates"])
        row["cost_ms"] = sum(row[k] for k in COST_KEYS)
        rows.append(row)
    med = {k: statistics.median(r[k] for r in rows) for k in (*COST_KEYS, "cost_ms", "plain_answer_ms",
                                                             "recall_answer_ms", "recalled_tokens")}
    stats = with_recall.stats()
    return {
        "command": "python -m omnitide_mlx.bench.recall " + " ".join(
            [f"--shape {shape}", f"--policy {policy}", f"--layers {layers}", f"--units {units}",
             f"--questions {questions}",
             f"--max-tokens {max_tokens}", f"--recall {recall}"]
            + ([f"--recall-tokens {recall_tokens}"] if recall_tokens else []) + ([f"--kv-bits {kv_bits}"] if kv_bits
                                                                                 else [])),
        "shape": shape, "policy": policy, "layers": layers, "units": units, "max_tokens": max_tokens,
        "watermarks": [with_recall.policy.high, with_recall.policy.low],
        "tokens_per_unit": model.profile.media_unit_tokens,
        "store": {k: v for k, v in stats["recall"].items() if k != "answers"},
        "rows": rows, "median": med,
        "cost_share_of_answer": med["cost_ms"] / med["recall_answer_ms"],
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "mlx": mx.__version__, "device": str(mx.default_device()), "git": _git()},
    }


def _git() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return "unknown"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="minicpm-o-4.5")
    p.add_argument("--policy", default="omnitide", help="fifo drops whole units from the start, so the store fills "
                   "in a short stream (OmniPick first trims units to their sinks)")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--units", type=int, default=12)
    p.add_argument("--questions", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--recall", default="1GiB")
    p.add_argument("--recall-tokens", type=int, default=None)
    p.add_argument("--kv-bits", type=int, choices=[4, 8], default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    out = run(a.shape, a.layers, a.units, a.questions, a.max_tokens, a.recall, a.recall_tokens, a.kv_bits, a.policy)
    text = json.dumps(out, indent=1)
    if a.json:
        Path(a.json).write_text(text, encoding="utf-8")
    print(json.dumps({"median": out["median"], "cost_share_of_answer": out["cost_share_of_answer"]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
