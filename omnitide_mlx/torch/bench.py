"""``omnitide bench attention --backend torch``: dense attention against attention over the OmniPick layouts, in
PyTorch (CUDA; the CPU works for a smoke run), at no-slide checkpoints (paper 7.1: 4K-32K history tokens).

The core simulator streams the model profile's units (one a second, paper table 1) until the no-slide history
reaches each checkpoint; four layouts follow the same retention plans: native (first fit, never moves), OmniPage
with the ordered-suffix migration (the CUDA default: it shortens the span that SDPA / FlashAttention walk), OmniPage
with the class-aware migration (fewer active pages: what block-sparse FlexAttention skips), and eager compaction
(the oracle). For one layer of the model's real attention shape:

- prefill: the next unit (the profile's unit size) is allocated into each layout and attends over it; "full"
  attends the same chunk over the whole no-slide history with SDPA and a lower-right causal mask (FlashAttention
  on CUDA when the dtype allows it);
- decode: one token, likewise.

Each layout row is timed with the ``flex`` kernel (a BlockMask from the page table; compiled on CUDA) and the
``sdpa`` kernel (SDPA over the physical span with a visibility mask). The layout's latest migration before the
checkpoint is executed with ``OmniTorchCache.migrate`` on one layer: its time, the bytes it moved, and on CUDA the
peak memory it allocated above the buffers (``torch.cuda.max_memory_allocated``): only the moved rows, never a
copy of the buffer.

Also runnable without the ``omnitide`` CLI: ``python -m omnitide_mlx.torch.bench --device cuda ...``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..core.layout import LAYOUT_NAMES, migration_variants
from ..core.layout_checkpoints import Checkpoint, checkpoint_simulator, parse_histories, record_checkpoints
from ..core.page import AllocClass, MigrationPlan, PageTable
from ..core.paged_cache import TABLE_ARRAYS, table_meta
from ..core.pick import make_policy
from ..models.family import profiles
from ..models.stream_units import resolve_profile
from ..bench.report import write_outputs
from ..core.sim import LayoutTrace
from .attention import attend, plan_step
from .cache import OmniTorchCache

HELP = "time dense attention against flex / SDPA attention on the OmniPick layouts, in PyTorch"
LAYOUTS = tuple(migration_variants())  # native, ordered_suffix, class_aware, eager: OmniPage once per mode
_NEW_UID = 1 << 40


def checkpoints(profile, histories: list[int], *, policy: str = "omnipick", seed: int = 0, question_every: int = 30,
                **policy_kw) -> list[Checkpoint]:
    """Stream once through every checkpoint (ascending), the four layouts side by side."""
    sim = checkpoint_simulator(resolve_profile(profile), histories, policy=policy, seed=seed, question_every=question_every,
                               layouts=LAYOUT_NAMES, migration="ordered_suffix", **policy_kw)
    sim.layouts["ordered_suffix"] = sim.layouts.pop("omnipage")
    table, planner = migration_variants()["class_aware"].build()
    table.allocate(sim.history[0].length, 0, AllocClass.MUST_KEEP)
    sim.layouts["class_aware"] = LayoutTrace("class_aware", table, planner, sim.profile.kv_bytes_per_token)
    return record_checkpoints(sim, histories, LAYOUTS)


# --- timing --------------------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn, device: torch.device, reps: int | None = None) -> dict:
    """Median wall time (ms) of ``fn`` after one warm-up call (which includes any compilation)."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    first = (time.perf_counter() - t0) * 1000
    reps = reps or (1 if first > 5000 else 3 if first > 500 else 7)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        samples.append((time.perf_counter() - t0) * 1000)
    return {"median_ms": round(statistics.median(samples), 4), "min_ms": round(min(samples), 4),
            "max_ms": round(max(samples), 4), "reps": reps, "first_ms": round(first, 2)}


def _dense(q, k, v, t: int) -> tuple[Any, str]:
    """Dense attention of the last ``t`` keys' queries over all keys: SDPA with a lower-right causal mask."""
    from torch.nn.attention.bias import causal_lower_right

    keys = k.shape[2]
    if t == 1:
        return (lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)), "sdpa"
    bias = causal_lower_right(t, keys)
    try:
        F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
        return (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)), "sdpa-causal-lr"
    except (RuntimeError, ValueError, NotImplementedError):  # older torch: no GQA with the causal bias
        g = q.shape[1] // k.shape[1]
        kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        return (lambda: F.scaled_dot_product_attention(q, kk, vv, attn_mask=bias)), "sdpa-causal-lr-repeated"


def _time_migration(table: PageTable, plan: MigrationPlan, kv_heads: int, head_dim: int, dtype, device,
                    reps: int) -> dict:
    """One layer's ``OmniTorchCache.migrate`` for this plan, on a fresh copy of the pre-migration cache each time;
    on CUDA also the peak memory allocated above the buffers."""
    cap = table.capacity
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(1, kv_heads, cap, head_dim, generator=gen).to(device=device, dtype=dtype)
    values = torch.randn(1, kv_heads, cap, head_dim, generator=gen).to(device=device, dtype=dtype)
    proto = OmniTorchCache(1, kv_heads, head_dim, None, dtype, device, placement=table.placement)
    ts = table.state()
    meta = dict(proto.meta_state, capacity=cap, table=table_meta(ts))
    arrays = {f"table.{n}": torch.as_tensor(np.asarray(ts[n], dtype=np.int32)) for n in TABLE_ARRAYS}
    samples, peak = [], None
    for i in range(reps + 1):
        arrays["layers.0.keys"], arrays["layers.0.values"] = keys.clone(), values.clone()
        cache = OmniTorchCache.from_state(arrays, meta, device=device)
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        t0 = time.perf_counter()
        cache.migrate(plan)
        _sync(device)
        if i:
            samples.append((time.perf_counter() - t0) * 1000)
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device) - base
        del cache
    row_bytes = 2 * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
    return {"migration_ms": round(statistics.median(samples), 4), "rows": int(plan.src.size),
            "moved_bytes": int(plan.src.size) * row_bytes, "buffer_bytes": cap * row_bytes,
            "peak_extra_bytes": peak}


def bench_checkpoint(cp: Checkpoint, *, q_heads: int, kv_heads: int, head_dim: int, chunk: int, dtype, device,
                     kernels: tuple[str, ...], seed: int = 0, reps: int | None = None, log=None) -> list[dict]:
    rng = torch.Generator().manual_seed(seed)
    scale = head_dim ** -0.5
    rows: list[dict] = []
    base = {"history": cp.history, "full_context_tokens": cp.full_context_tokens, "retained": cp.retained}

    def rand(*shape):
        return torch.randn(*shape, generator=rng).to(device=device, dtype=dtype)

    def emit(row):
        rows.append(row)
        if log:
            log(row)

    for phase, t in (("prefill", chunk), ("decode", 1)):
        q = rand(1, q_heads, t, head_dim)
        keys = cp.full_context_tokens + t
        k, v = rand(1, kv_heads, keys, head_dim), rand(1, kv_heads, keys, head_dim)
        fn, impl = _dense(q, k, v, t)
        full = time_call(fn, device, reps)
        emit({**base, "phase": phase, "layout": "full", "kernel": impl, "chunk_tokens": t, "active_slots": keys,
              "span": keys, **full, "speedup_vs_full": 1.0})
        del k, v
        for name in LAYOUTS:
            table = cp.tables[name].copy()
            slots = table.allocate(t, _NEW_UID, AllocClass.RECENT_CONTEXT)
            plan = plan_step(table.seq, table.seq[slots], table.page_size, device)
            kk, vv = rand(1, kv_heads, table.capacity, head_dim), rand(1, kv_heads, table.capacity, head_dim)
            stats = table.stats()
            for kernel in kernels:
                try:
                    tm = time_call(lambda: attend(kernel, q, kk, vv, plan, scale), device, reps)
                except Exception as e:  # a kernel that does not build here: recorded, the run goes on
                    emit({**base, "phase": phase, "layout": name, "kernel": kernel, "error": f"{type(e).__name__}: "
                          f"{str(e)[:300]}"})
                    continue
                emit({**base, "phase": phase, "layout": name, "kernel": kernel, "chunk_tokens": t,
                      "active_slots": plan.active_slots, "active_pages": int(plan.tiles.size), "span": plan.span,
                      "physical_span": stats.physical_span, **tm,
                      "speedup_vs_full": round(full["median_ms"] / tm["median_ms"], 3)})
            del kk, vv
    for name in LAYOUTS[1:]:
        mig = cp.migrations.get(name)
        row = {**base, "phase": "migration", "layout": name, "migrations_per_update": round(cp.migration_rate[name], 4)}
        if mig is not None:
            row.update(_time_migration(mig[0], mig[1], kv_heads, head_dim, dtype, device, reps or 5))
        emit(row)
    return rows


def versions(device: torch.device) -> dict:
    import transformers

    from .. import __version__

    out = {"omnitide_mlx": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
           "python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
           "device": str(device), "cuda": torch.version.cuda}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    return out


def run_bench(shape: str, histories: list[int], *, device, dtype=torch.float16, kernels=None, policy="omnipick",
              seed: int = 0, reps: int | None = None, log=None, setting=None, **policy_kw) -> dict:
    device = torch.device(device)
    kernels = tuple(kernels or (("flex", "sdpa") if device.type == "cuda" else ("sdpa",)))
    prof = resolve_profile(shape, setting)
    t0 = time.perf_counter()
    cps = checkpoints(prof, histories, policy=policy, seed=seed, **policy_kw)
    rows: list[dict] = []
    for cp in cps:
        rows += bench_checkpoint(cp, q_heads=prof.q_heads, kv_heads=prof.kv_heads, head_dim=prof.head_dim,
                                 chunk=prof.media_unit_tokens, dtype=dtype, device=device, kernels=kernels,
                                 seed=seed, reps=reps, log=log)
    return {"backend": "torch", "shape": prof.name, "versions": versions(device), "kernels": list(kernels),
            "attention_shape": {"q_heads": prof.q_heads, "kv_heads": prof.kv_heads, "head_dim": prof.head_dim,
                                "layers_timed": 1, "dtype": str(dtype).split(".")[-1]},
            "policy": make_policy(policy, profile=prof, **policy_kw).config(), "chunk_tokens": prof.media_unit_tokens,
            "units": prof.units.to_json(),
            "wall_s": round(time.perf_counter() - t0, 1), "rows": rows}


def markdown(result: dict) -> str:
    lines = ["| history (full ctx) | phase | layout | kernel | active slots | span | median ms | speedup |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r["phase"] == "migration" or "error" in r:
            continue
        lines.append(f"| {r['history']} ({r['full_context_tokens']}) | {r['phase']} | {r['layout']} | {r['kernel']} "
                     f"| {r['active_slots']} | {r['span']} | {r['median_ms']:.3f} | {r['speedup_vs_full']:.2f}x |")
    mig = [r for r in result["rows"] if r["phase"] == "migration" and "rows" in r]
    if mig:
        lines += ["", "| history | layout | rows moved | moved MB | buffer MB | peak extra MB | ms |",
                  "|---|---|---|---|---|---|---|"]
        for r in mig:
            peak = "" if r["peak_extra_bytes"] is None else f"{r['peak_extra_bytes'] / 2**20:.2f}"
            lines.append(f"| {r['history']} | {r['layout']} | {r['rows']} | {r['moved_bytes'] / 2**20:.2f} | "
                         f"{r['buffer_bytes'] / 2**20:.2f} | {peak} | {r['migration_ms']:.3f} |")
    return "\n".join(lines)


# --- command line -------------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``omnitide bench attention`` (same names), plus the device and kernels."""
    p.add_argument("--shape", default="qwen2.5-omni-7b", choices=sorted(profiles()))
    p.add_argument("--history", default="4096,8192,16384,32768", help="comma-separated no-slide checkpoints")
    p.add_argument("--policy", default="omnipick")
    p.add_argument("--high", type=int, default=None)
    p.add_argument("--low", type=int, default=None)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float16")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", default=None)
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    p.add_argument("--kernels", default=None, help="comma-separated: flex,sdpa,reference (default: flex,sdpa on "
                                                   "CUDA, sdpa elsewhere)")


def run(args: argparse.Namespace) -> int:
    try:
        histories = parse_histories(args.history)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    device = getattr(args, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
    kernels = getattr(args, "kernels", None)
    kernels = tuple(k.strip() for k in kernels.split(",")) if kernels else None
    kw = {k: getattr(args, k) for k in ("high", "low") if getattr(args, k, None) is not None}

    def log(r):
        if "error" in r:
            print(f"  {r['history']:>6} {r['phase']:<9} {r['layout']:<14} {r['kernel']:<8} ERROR {r['error']}",
                  flush=True)
        elif r["phase"] == "migration" and "rows" not in r:
            print(f"  {r['history']:>6} migration {r['layout']:<14} none yet", flush=True)
        elif r["phase"] == "migration":
            print(f"  {r['history']:>6} migration {r['layout']:<14} {r['rows']} rows {r['migration_ms']:.3f} ms, peak "
                  f"extra bytes {r['peak_extra_bytes']} (moved {r['moved_bytes']}, buffer {r['buffer_bytes']})",
                  flush=True)
        else:
            print(f"  {r['history']:>6} {r['phase']:<9} {r['layout']:<14} {r['kernel']:<8} {r['median_ms']:>10.3f} ms "
                  f"x{r['speedup_vs_full']:.2f}", flush=True)

    result = run_bench(args.shape, histories, device=device, dtype=getattr(torch, args.dtype), kernels=kernels,
                       policy=args.policy, seed=args.seed, reps=args.reps, log=log, **kw)
    write_outputs(result, args, markdown=markdown)
    print(f"wall {result['wall_s']} s on {result['versions']['device']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m omnitide_mlx.torch.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
