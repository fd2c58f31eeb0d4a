"""The Mac check (``scripts/mac_check.sh``): everything the attention kernels need to prove on an Apple GPU, in one run.

1. ``pytest tests/metal`` (the Metal kernels and the fused paths against the reference on the GPU);
2. ``omnitide doctor`` (every path's self-test, timing, versions; its JSON is kept);
3. ``omnitide bench attention`` for both benchmark shapes with every path forced in turn (``vector``, ``gather``,
   ``dense``, ``reference``) and with the dispatcher's own choice (``auto``), dense fused SDPA timed as the baseline at
   every checkpoint.

It writes ``mac_check.json`` (every row of every run, the cost model's predictions, the steps' outcomes) and
``mac_check.md``: per shape, checkpoint, phase and layout, each path's median ms and speedup over dense, the path
that wins and by how much (second best / best), the winner's ratio to the key-count limit, what the dispatcher
chose and what the cost model predicted (docs/benchmarks.md, "On an Apple GPU", describes the format). ``--dry``
runs the same on any machine with the reference path only (what CI runs, on small checkpoints).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SHAPES = ("qwen2.5-omni-7b", "minicpm-o-4.5")
HISTORIES = (4096, 8192, 16384, 32768, 65536)
FORCED = ("vector", "gather", "dense", "reference")
REPO = Path(__file__).resolve().parents[2]


def _step(cmd: list[str], timeout: int) -> dict:
    """Run one command from the repository root; keep its exit status and the tail of its output."""
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, "HF_HUB_OFFLINE": "1"})
        rc, out = r.returncode, (r.stdout + r.stderr)
    except subprocess.TimeoutExpired as e:
        rc, out = 124, f"timed out after {timeout} s\n{e.stdout or ''}"
    return {"cmd": " ".join(cmd), "rc": rc, "s": round(time.perf_counter() - t0, 1),
            "tail": "\n".join(str(out).strip().splitlines()[-15:])}


def summarize(runs: dict, predictions: dict) -> list[dict]:
    """One entry per (shape, history, phase, layout): every path's measurement, the winner and its margin, the
    dispatcher's choice, the model's prediction. ``runs[shape][path]`` is a bench result; ``predictions[shape]``
    attention_predict rows."""
    out = []
    for shape, by_path in runs.items():
        pred = {(p["history"], p["phase"], p["layout"]): p for p in predictions.get(shape, [])}
        keys = []
        for res in by_path.values():
            for r in res["rows"]:
                k = (r["history"], r["phase"], r["layout"])
                if r["layout"] != "full" and k not in keys:
                    keys.append(k)
        for k in keys:
            entry = {"shape": shape, "history": k[0], "phase": k[1], "layout": k[2], "paths": {}}
            for path, res in by_path.items():
                rows = {(r["history"], r["phase"], r["layout"]): r for r in res["rows"]}
                r, full = rows.get(k), rows.get((k[0], k[1], "full"))
                if r is None:
                    continue
                entry["limit"] = r["limit"]
                entry["active_slots"] = r["active_slots"]
                entry["paths"][path] = {"impl": r["impl"], "median_ms": r["median_ms"],
                                        "full_ms": full["median_ms"] if full else None,
                                        "full_impl": full["impl"] if full else None,
                                        "speedup_vs_full": r["speedup_vs_full"],
                                        "ratio_to_limit": r["ratio_to_limit"]}
            forced = {p: v for p, v in entry["paths"].items() if p != "auto"}
            if forced:
                order = sorted(forced, key=lambda p: forced[p]["median_ms"])
                best = order[0]
                entry["winner"] = best
                entry["margin"] = (round(forced[order[1]]["median_ms"] / forced[best]["median_ms"], 3)
                                   if len(order) > 1 else None)
                entry["winner_ratio_to_limit"] = forced[best]["ratio_to_limit"]
            auto = entry["paths"].get("auto")
            if auto and forced:
                entry["auto_choice"] = auto["impl"]
                entry["auto_vs_winner"] = round(auto["median_ms"] / forced[entry["winner"]]["median_ms"], 3)
            p = pred.get(k)
            if p:
                entry["predicted_choice"] = p["choice"]
                entry["predicted_ms"] = p["predicted_ms"]
                entry["predicted_ratio_to_limit"] = p["ratio_to_limit"]
            out.append(entry)
    return out


def markdown(result: dict) -> str:
    paths = result["paths"]
    head = ("| shape | history | phase | layout | limit | " + " | ".join(f"{p} ms (x)" for p in paths)
            + " | winner (margin) | winner / limit | dispatcher | predicted |")
    lines = [f"# Mac check: {result['machine']}", "",
             f"mode: {'dry (reference only)' if result['dry'] else 'full'}; dtype {result['dtype']}; "
             f"media setting {result.get('setting') or 'default'}; "
             f"commit {result['versions'].get('git')}; mlx {result['versions'].get('mlx')}; "
             f"device {result['versions'].get('device')}", ""]
    for s in result["steps"]:
        lines.append(f"- `{s['cmd']}`: exit {s['rc']} in {s['s']} s")
    lines += ["", "Per row: median ms of one layer and speedup over dense fused attention (x); the winner among the "
              "forced paths and by how much it beats the second (margin); the winner's speedup as a fraction of "
              "the key-count limit; the dispatcher's choice (auto) and its time over the winner's; the cost model's "
              "predicted winner.", "", head, "|" + "---|" * (head.count("|") - 1)]
    for e in result["summary"]:
        cells = []
        for p in paths:
            v = e["paths"].get(p)
            cells.append(f"{v['median_ms']:.3f} ({v['speedup_vs_full']:.2f}x)" if v else "-")
        margin = f" ({e['margin']:.2f}x)" if e.get("margin") else ""
        auto = f"{e['auto_choice']} ({e['auto_vs_winner']:.2f})" if "auto_choice" in e else "-"
        lines.append(f"| {e['shape']} | {e['history']} | {e['phase']} | {e['layout']} | {e.get('limit', 0):.2f}x | "
                     + " | ".join(cells) + f" | {e.get('winner', '-')}{margin} | "
                     f"{e.get('winner_ratio_to_limit', 0):.2f} | {auto} | {e.get('predicted_choice', '-')} |")
    return "\n".join(lines) + "\n"


def run_check(out_dir: str | os.PathLike, *, dry: bool, shapes=SHAPES, histories=HISTORIES, dtype: str | None = None,
              reps: int | None = None, tests: bool = True, doctor: bool = True, setting: str | None = "paper",
              log=print) -> dict:
    import mlx.core as mx

    from ..kernels import dispatch
    from . import attention, attention_predict
    from .common import versions

    metal = dispatch.metal_device()
    if not dry and not metal:
        raise SystemExit("mac_check: no Metal GPU is MLX's default device; use --dry off a Mac")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = dtype or ("float16" if metal else "float32")
    paths = ("reference",) if dry else FORCED + ("auto",)
    steps = []
    if tests:
        log("mac_check: pytest tests/metal ...")
        steps.append(_step([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/metal"], 1800))
    if doctor:
        log("mac_check: omnitide doctor ...")
        cmd = [sys.executable, "-m", "omnitide_mlx", "doctor", "--json", str(out / "doctor.json")]
        steps.append(_step(cmd + (["--dtypes", "float16"] if dry else []), 900))
    runs, predictions = {}, {}
    for shape in shapes:
        runs[shape] = {}
        for path in paths:
            log(f"mac_check: bench attention {shape} --path {path} ...")
            runs[shape][path] = attention.run_bench(shape, list(histories), dtype=getattr(mx, dtype), reps=reps,
                                                    sdpa_max_history=max(histories), path=path, setting=setting)
        predictions[shape] = attention_predict.predictions(shape, list(histories), setting=setting,
                                                           dtype_bytes=4 if dtype == "float32" else 2)
    v = versions()
    result = {"machine": v.get("cpu") if not metal else _gpu_name(), "dry": dry, "dtype": dtype, "setting": setting,
              "paths": list(paths),
              "histories": list(histories), "versions": v, "steps": steps, "runs": runs,
              "predictions": predictions, "summary": summarize(runs, predictions)}
    (out / "mac_check.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "mac_check.md").write_text(markdown(result))
    return result


def _gpu_name() -> str:
    import mlx.core as mx

    try:
        return str(mx.metal.device_info().get("device_name") or mx.metal.device_info().get("architecture"))
    except Exception:  # noqa: BLE001
        return "Apple GPU"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="scripts/mac_check.sh", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="output folder (default mac_check_out/<UTC time>)")
    p.add_argument("--dry", action="store_true", help="reference path only (runs anywhere)")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--history", default=",".join(map(str, HISTORIES)), help="checkpoints (default 4K-64K)")
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default=None,
                   help="default float16 on a Mac, float32 elsewhere")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per row (default: by duration)")
    p.add_argument("--setting", default="paper",
                   help="media setting that sizes the units (default paper: 2,333 / 675-token units; 'default')")
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--skip-doctor", action="store_true")
    a = p.parse_args(argv)
    from ..core.layout_checkpoints import parse_histories
    from ..models.family import profiles

    PROFILES = profiles()

    shapes = [s.strip() for s in a.shapes.split(",") if s.strip()]
    bad = [s for s in shapes if s not in PROFILES]
    try:
        histories = parse_histories(a.history)
    except ValueError as e:
        p.error(str(e))
    if bad or not shapes:
        p.error(f"--shapes: choose from {sorted(PROFILES)}")
    out = a.out or os.path.join("mac_check_out", time.strftime("%Y%m%d-%H%M%S", time.gmtime()))
    result = run_check(out, dry=a.dry, shapes=shapes, histories=histories, dtype=a.dtype, reps=a.reps,
                       tests=not a.skip_tests, doctor=not a.skip_doctor,
                       setting=None if a.setting == "default" else a.setting)
    print(markdown(result))
    print(f"wrote {out}/mac_check.json and {out}/mac_check.md", file=sys.stderr)
    return 0 if all(s["rc"] == 0 for s in result["steps"]) else 1


if __name__ == "__main__":
    sys.exit(main())
