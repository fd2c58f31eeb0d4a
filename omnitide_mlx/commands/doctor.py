"""``omnitide doctor``: what this machine runs, whether every attention kernel works on it, and how fast.

Checks, in order: versions; the MLX device and memory; each attention path's self-test (kernels/selftest.py: the
Metal kernels on an Apple GPU; elsewhere the Metal kernels in tests/metal_check's CPU emulator when this is a source
checkout with clang++, the fused paths on the CPU, and the reference against float64); a quick timing of every path
that runs here on a small case of the Qwen2.5-Omni-7B attention shape, with the dispatcher's choice; with --model,
loading that checkpoint and streaming one unit (one second of silence and a grey frame). Writes a JSON (--json) and
prints a short report to paste into a bug report. Exit status 1 when a self-test or the model check failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
from pathlib import Path

HELP = "check this machine: versions, device, memory, each attention kernel's self-test and timing (--model: one unit)"
DESCRIPTION = __doc__.split("\n\n", 1)[1] + """
example:
  omnitide doctor                      # writes omnitide-doctor.json, prints the report
  omnitide doctor --model ./tiny-qwen --json doctor.json
"""

DTYPES = ("float16", "bfloat16", "float32")
HEAD_DIM = 128  # both benchmark shapes (and every supported model)
TIMING_SHAPE = ("qwen2.5-omni-7b", 28, 4, HEAD_DIM)
DEFAULT_JSON = "omnitide-doctor.json"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", dest="json_path", default=DEFAULT_JSON,
                   help="write the full result here (default omnitide-doctor.json; '-' for none)")
    p.add_argument("--model", default=None, help="also load this checkpoint and stream one unit")
    p.add_argument("--dtypes", default=",".join(DTYPES),
                   help="comma-separated K/V dtypes to self-test (default float16,bfloat16,float32)")
    p.add_argument("--no-emulator", action="store_true",
                   help="without a GPU, skip running the Metal kernels in the CPU emulator")
    p.add_argument("--no-timing", action="store_true", help="skip the attention timing")


def _check_args(args) -> list[str]:
    """Everything wrong with the flags, before anything is loaded."""
    errors = []
    dts = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in dts if d not in DTYPES]
    if bad or not dts:
        errors.append(f"--dtypes: choose from {', '.join(DTYPES)} (got {args.dtypes!r})")
    if args.json_path != "-":
        from .options import UsageError, check_output_file

        try:
            check_output_file(args.json_path, "--json")
        except UsageError as e:
            if args.json_path != DEFAULT_JSON:
                errors.append(str(e))
            else:  # the default file where doctor was started: the checks still run, the result is not saved
                print(f"omnitide doctor: cannot write {DEFAULT_JSON} in {Path.cwd()} (not writable): the full result "
                      "is not saved; give --json PATH for it", file=sys.stderr)
                args.json_path = "-"
    if args.model is not None and not Path(args.model).expanduser().exists() and "/" not in args.model:
        errors.append(f"--model: no such checkpoint {args.model!r}")
    return errors


def _memory() -> dict:
    import mlx.core as mx

    out = {"mlx_active_bytes": mx.get_active_memory(), "mlx_peak_bytes": mx.get_peak_memory(),
           "mlx_cache_bytes": mx.get_cache_memory()}
    try:
        out["total_bytes"] = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        out["total_bytes"] = None
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    out["available_bytes"] = int(line.split()[1]) * 1024
    except OSError:
        out["available_bytes"] = None  # macOS: no /proc; Metal reports its working set below
    return out


def _device() -> dict:
    import mlx.core as mx

    metal = bool(mx.metal.is_available())
    out = {"default": str(mx.default_device()), "metal": metal, "gpu_default": mx.default_device() == mx.gpu}
    if metal:
        try:
            info = mx.metal.device_info()
            out["metal_info"] = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in info.items()}
        except Exception as e:  # noqa: BLE001 (report, do not fail)
            out["metal_info_error"] = str(e)
    return out


def load_emulator():
    """tests/metal_check's emulator (``msl``) when this is a source checkout with clang++; else (None, reason)."""
    here = Path(__file__).resolve().parents[2] / "tests" / "metal_check" / "msl.py"
    if not here.exists():
        return None, "not a source checkout (tests/metal_check absent)"
    spec = importlib.util.spec_from_file_location("omnitide_msl", here)
    msl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(msl)
    if msl.find_clang() is None:
        return None, "no clang++ (scripts/setup.sh --dev installs it)"
    return msl, None


def self_tests(dtypes, *, emulator: bool = True) -> tuple[list[dict], str | None]:
    """Every path's self-test per dtype: (rows, why the Metal kernels were not run, or None)."""
    from ..kernels import attention, dispatch, selftest

    metal = dispatch.metal_device()
    rows = []
    note = None
    runs = [("reference", 64, "float64 numpy")]
    runs += [(p, 64, "metal" if metal else "cpu (MLX fallback, not the fused Metal kernel)")
             for p in ("gather", "dense")]
    metal_kernels = [("vector", 64), ("vector", 32), ("page_compact", 0)]  # page_compact: no tile
    msl = None
    if metal:
        runs += [(p, tile, "metal") for p, tile in metal_kernels]
    elif emulator:
        msl, note = load_emulator()
        if msl is not None:
            runs += [(p, tile, "emulated (tests/metal_check)") for p, tile in metal_kernels]
    else:
        note = "--no-emulator"
    for path, tile, where in runs:
        for dt in dtypes:
            if msl is not None and where.startswith("emulated"):
                with attention.metal_runner(lambda spec: msl.emulate(spec)[0]):
                    r = selftest.run_self_test(path, dt, HEAD_DIM, tile)
            else:
                r = selftest.run_self_test(path, dt, HEAD_DIM, tile)
            rows.append({**r.to_json(), "where": where})
    return rows, note


def timings(reps: int = 3) -> list[dict]:
    """Median ms of each path that runs here on a small case per phase (the 7B shape, one layer), the cost
    model's prediction for an Apple GPU next to it, and the dispatcher's choice."""
    from ..kernels import cost, dispatch

    shape, hq, hkv, d = TIMING_SHAPE
    metal = dispatch.metal_device()
    dtype = "float16" if metal else "float32"
    out = []
    for phase in ("prefill", "decode"):
        key = (phase, hq, hkv, d, dtype, 64 if phase == "prefill" else 32)
        q, k, v, plan = dispatch.calibration_case(key, queries=256 if metal else 64)
        paths = ["reference", "gather", "dense"] + (["vector"] if metal else [])
        case = dispatch.case_of(q, k, plan)
        row = {"shape": shape, "phase": phase, "dtype": dtype, "queries": int(q.shape[2]),
               "slots": plan.capacity, "active_slots": plan.active_slots, "measured_ms": {}, "predicted_ms": {}}
        for p in paths:
            try:
                row["measured_ms"][p] = round(dispatch.time_path(p, q, k, v, plan, d ** -0.5, reps), 3)
            except Exception as e:  # noqa: BLE001
                row["measured_ms"][p] = None
                row.setdefault("errors", {})[p] = f"{type(e).__name__}: {e}"[:500]
        for p in cost.PATHS:
            row["predicted_ms"][p] = round(cost.predict(p, case).ms, 4)
        row["dispatcher"] = dispatch.choose(q, k, plan, d ** -0.5)
        out.append(row)
    return out


def model_check(path: str) -> dict:
    """Load a checkpoint and stream one unit (one second of silence with a grey frame)."""
    import numpy as np

    from ..session import OmniSession

    out = {"model": path}
    try:
        t0 = time.perf_counter()
        session = OmniSession(path)
        out["load_s"] = round(time.perf_counter() - t0, 2)
        t0 = time.perf_counter()
        frame = np.full((224, 224, 3), 128, np.uint8)
        records = session.push(frame=frame, audio=np.zeros(16000, np.float32), sample_rate=16000, t=0.0)
        records += session.flush()
        out["unit_s"] = round(time.perf_counter() - t0, 2)
        out["units"] = [{"kind": r.kind, "tokens": r.tokens, "update_ms": round(r.update_ms, 1),
                         "kv_bytes": r.kv_bytes} for r in records]
        out["ok"] = bool(records) and all(r.tokens > 0 for r in records)
        if not out["ok"]:
            out["error"] = "no unit was streamed"
    except Exception as e:  # noqa: BLE001 (the report says what failed)
        out["ok"] = False
        out["error"] = f"{type(e).__name__}: {e}"[:2000]
    return out


def report(result: dict) -> str:
    """The short, paste-able report."""
    v, dev, mem = result["versions"], result["device"], result["memory"]
    gib = 1 << 30

    def size(b):
        return f"{b / gib:.1f} GiB" if b else "?"

    lines = [f"omnitide doctor: omnitide-mlx {v['omnitide_mlx']} (git {v.get('git') or '?'}), python {v['python']}, "
             f"mlx {v['mlx']}, numpy {v['numpy']}",
             f"machine: {v['platform']}; {v['cpu']}, {v['cpus']} CPUs",
             f"device: {dev['default']} (Metal {'available' if dev['metal'] else 'not available'}); memory "
             f"{size(mem.get('total_bytes'))} total, {size(mem.get('available_bytes'))} available"]
    if result.get("blas"):
        lines.append(f"BLAS (MLX's CPU backend): {result['blas']['in_use']}")
    if dev.get("metal_info"):
        mi = dev["metal_info"]
        lines.append(f"gpu: {mi.get('architecture', '?')}, recommended working set "
                     f"{size(mi.get('max_recommended_working_set_size'))}")
    lines.append(f"kernel self-tests (head dim {HEAD_DIM}; max error vs the reference):")
    by = {}
    for r in result["self_tests"]:
        by.setdefault((r["path"], r["tile"], r["where"]), []).append(r)
    for (path, tile, where), rs in by.items():
        cells = ", ".join(f"{r['dtype']} {'ok' if r['ok'] else 'FAIL'}"
                          f" ({r['max_error']:.1e})" if r["max_error"] is not None else
                          f"{r['dtype']} FAIL ({(r['error'] or '')[:60]})" for r in rs)
        lines.append(f"  {path:<12} tile {tile:<3} {where}: {cells}")
    if result.get("emulator_note"):
        lines.append(f"  (Metal kernels not run: {result['emulator_note']})")
    for t in result.get("timing", []):
        ms = "  ".join(f"{p} {m:.2f}" if m is not None else f"{p} failed" for p, m in t["measured_ms"].items())
        pred = "  ".join(f"{p} {m:.3f}" for p, m in t["predicted_ms"].items())
        lines.append(f"attention {t['phase']} ({t['shape']} shape, {t['queries']} queries, {t['active_slots']} of "
                     f"{t['slots']} slots active, {t['dtype']}), median ms: {ms}; dispatcher: {t['dispatcher']}")
        lines.append(f"  cost model for an Apple GPU (prediction): {pred}")
    if result.get("model"):
        m = result["model"]
        if m["ok"]:
            units = ", ".join(f"{u['kind']} {u['tokens']} tokens" for u in m["units"])
            lines.append(f"model {m['model']}: loaded in {m['load_s']} s, one unit streamed in {m['unit_s']} s "
                         f"({units})")
        else:
            lines.append(f"model {m['model']}: FAILED: {m['error']}")
    lines.append("result: " + ("all checks passed" if result["ok"] else "SOME CHECKS FAILED (see above)"))
    return "\n".join(lines)


def doctor(*, dtypes=DTYPES, model: str | None = None, emulator: bool = True, timing: bool = True) -> dict:
    from ..bench.common import versions

    from ..blas import blas_info

    result = {"versions": versions(), "device": _device(), "memory": _memory(), "blas": blas_info()}
    tests, note = self_tests(dtypes, emulator=emulator)
    result["self_tests"] = tests
    result["emulator_note"] = note
    if timing:
        result["timing"] = timings()
    if model is not None:
        result["model"] = model_check(model)
    result["ok"] = all(r["ok"] for r in tests) and (model is None or result["model"]["ok"])
    return result


def run(args: argparse.Namespace) -> int:
    errors = _check_args(args)
    if errors:
        for e in errors:
            print(f"omnitide doctor: {e}", file=sys.stderr)
        return 2
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    print("omnitide doctor: checking (self-tests, timing" + (", model" if args.model else "") + ") ...",
          file=sys.stderr, flush=True)
    result = doctor(dtypes=dtypes, model=args.model, emulator=not args.no_emulator, timing=not args.no_timing)
    result["system"] = platform.system()
    text = report(result)
    print(text)
    if args.json_path != "-":
        path = Path(args.json_path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({**result, "report": text}, indent=1, default=str))
        os.replace(tmp, path)
        print(f"(full result: {path})", file=sys.stderr)
    return 0 if result["ok"] else 1
