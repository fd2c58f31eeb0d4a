"""``omnitide bench attention``: dense full-context attention against tile-skip attention over the KV layouts that
OmniPick + native / OmniPage / eager produce at no-slide checkpoints (paper 7.1: 4K-64K history tokens).

The MLX side of the benchmark; what each row times, the *limit* of a row and the migration figures are the
command's description, in bench/attention_args.py (``omnitide bench attention --help``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import mlx.core as mx
import numpy as np

from ..core.layout_checkpoints import Checkpoint, checkpoint_simulator, parse_histories, record_checkpoints
from ..core.page import AllocClass, MigrationPlan, PageTable
from ..core.paged_cache import TABLE_ARRAYS, table_meta
from ..core.pick import make_policy
from ..models.stream_units import resolve_profile
from ..core.layout import LAYOUT_NAMES
from ..kernels import dispatch, plan_tiles, reference_attention, tile_skip_attention
from ..kernels import attention as attn
from ..kernels.cost import limit  # noqa: F401  (the key-count limit; one definition, shared with the cost model)
from .attention_args import DESCRIPTION, HELP, add_arguments  # noqa: F401  (the benchmark module's command line)
from .common import Timing, cache_flusher, load_average, time_interleaved, versions
from .report import write_outputs

PAPER_SPEEDUP = 12.72  # paper abstract: up to 12.72x attention-kernel speedup
RATIO_GOAL = 0.9  # every tile-skip row at least 0.9 of its limit
OMNIPAGE_GOAL = 0.885  # paper 7.4.2: OmniPage captures 88.5 % of eager's prefill gain over native
_NEW_UID = 1 << 40  # owner of the benchmark's own chunk (never a stream uid)


def checkpoints(profile, histories: list[int], *, policy: str = "omnipick", seed: int = 0,
                question_every: int = 30, **policy_kw) -> list[Checkpoint]:
    """Stream once through every checkpoint (ascending), all three layouts side by side."""
    sim = checkpoint_simulator(resolve_profile(profile), histories, policy=policy, seed=seed, question_every=question_every,
                               **policy_kw)
    return record_checkpoints(sim, histories)


# --- what one row times ---------------------------------------------------------------------------------------

def _random(shape, rng: np.random.Generator, dtype) -> mx.array:
    return mx.array(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)


def _contiguous_plan(keys: int, t: int, tile: int):
    """Dense layout: ``keys`` slots in order, the last ``t`` of them the new tokens."""
    cap = -(-keys // tile) * tile
    seq = np.full(cap, -1, dtype=np.int64)
    seq[:keys] = np.arange(keys)
    return plan_tiles(seq, np.arange(keys - t, keys), np.arange(cap // tile), tile), cap


def _sdpa_blocks(q: mx.array, k: mx.array, v: mx.array, keys: int, scale: float) -> mx.array:
    """Dense attention with mx.fast SDPA in query blocks (bounded score memory); causal bottom-right aligned."""
    _, hq, t, _ = q.shape
    if t == 1:
        return mx.fast.scaled_dot_product_attention(q, k[:, :, :keys], v[:, :, :keys], scale=scale)
    block = max(1, attn.SCORE_BUDGET // (hq * keys))
    outs = []
    for i0 in range(0, t, block):
        i1 = min(t, i0 + block)
        end = keys - t + i1
        outs.append(mx.fast.scaled_dot_product_attention(q[:, :, i0:i1], k[:, :, :end], v[:, :, :end], scale=scale,
                                                          mask="causal"))
    return mx.concatenate(outs, axis=2)


def _time_migration(table: PageTable, plan: MigrationPlan, kv_heads: int, head_dim: int, dtype, rng,
                    reps: int) -> Timing:
    """One layer's ``OmniCache.migrate`` for this plan, on a fresh copy of the pre-migration cache each time."""
    from ..cache import OmniCache
    from ..rope import RopeSpec

    cap = table.capacity
    keys = _random((1, kv_heads, cap, head_dim), rng, dtype)
    values = _random((1, kv_heads, cap, head_dim), rng, dtype)
    ts = table.state()
    arrays = {f"table.{n}": mx.array(np.asarray(ts[n], dtype=np.int32)) for n in TABLE_ARRAYS}
    proto = OmniCache(1, kv_heads, head_dim, RopeSpec(head_dim, 1e4), dtype, placement=table.placement)
    meta = dict(proto.meta_state, capacity=cap, table=table_meta(ts))
    samples = []
    for i in range(reps + 1):
        arrays["layers.0.keys"], arrays["layers.0.values"] = mx.array(keys), mx.array(values)
        cache = OmniCache.from_state(arrays, meta)
        mx.eval(cache.layers[0].keys, cache.layers[0].values)
        t0 = time.perf_counter()
        cache.migrate(plan)
        mx.synchronize()
        if i:  # the first run is a warm-up
            samples.append((time.perf_counter() - t0) * 1000)
    return Timing(statistics.median(samples), min(samples), max(samples), len(samples))


def bench_checkpoint(cp: Checkpoint, *, q_heads: int, kv_heads: int, head_dim: int, chunk: int,
                     dtype=mx.float32, sdpa_max_history: int = 16384, seed: int = 0, reps: int | None = None,
                     log=None, path: str = "auto", kv_quant: tuple[int, int] | None = None) -> list[dict]:
    """All rows of one checkpoint: full / native / omnipage / eager, prefill then decode. ``path``: the
    tile-skip rows' attention path (``auto``: the dispatcher's choice; else forced, kernels/dispatch.py).
    ``kv_quant`` = (bits, group): the tile-skip rows also time quantised K/V side by side."""
    rng = np.random.default_rng(seed)
    flush = cache_flusher()  # every call starts with cold caches, as a layer's attention does inside a model
    migration_ms = {}  # per layout: one layer's time for its latest migration (None: it never migrated)
    for name, mig in cp.migrations.items():
        migration_ms[name] = (_time_migration(mig[0], mig[1], kv_heads, head_dim, dtype, rng, reps or 5).median_ms
                              if mig and name != "native" else None)
    rows: list[dict] = []
    for phase, t in (("prefill", chunk), ("decode", 1)):
        for row in _bench_phase(cp, phase, t, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                                sdpa_max_history=sdpa_max_history, rng=rng, reps=reps, flush=flush,
                                migration_ms=migration_ms, path=path, kv_quant=kv_quant):
            rows.append(row)
            if log:
                log(row)
    return rows


def _quantised_calls(q, k, v, plans: dict, scale: float, kv_quant: tuple[int, int], head_dim: int, rng) -> dict:
    """Per layout, the same attention on K/V quantised to ``kv_quant`` = (bits, group): keys as written
    (``mx.quantized_matmul``) and keys with a pending shift each (deferred re-rotation: dequantise and rotate at read
    time; after evictions most kept keys have one)."""
    from ..kernels.quantized import KeyShift, quantize_rows, quantized_tile_skip_attention
    from ..rope import RopeSpec

    bits, group = kv_quant
    kq, vq = quantize_rows(k, group, bits), quantize_rows(v, group, bits)
    shift = KeyShift(rng.integers(1, 4096, k.shape[2]), RopeSpec(head_dim, 1e6).rotate_tokens)
    calls = {}
    for name, plan in plans.items():
        kw = dict(group_size=group, bits=bits)
        calls[f"{name}@q"] = (lambda plan=plan: quantized_tile_skip_attention(q, kq, vq, plan, scale, **kw))
        calls[f"{name}@q-shifted"] = (lambda plan=plan: quantized_tile_skip_attention(q, kq, vq, plan, scale,
                                                                                       shift=shift, **kw))
    mx.eval(kq, vq)
    return calls


def _bench_phase(cp: Checkpoint, phase: str, t: int, *, q_heads, kv_heads, head_dim, dtype, sdpa_max_history, rng,
                 reps, flush, migration_ms, path="auto", kv_quant=None) -> list[dict]:
    """The rows of one phase; its calls are timed interleaved (common.time_interleaved)."""
    scale = head_dim ** -0.5
    base = {"history": cp.history, "full_context_tokens": cp.full_context_tokens, "retained": cp.retained}
    q = _random((1, q_heads, t, head_dim), rng, dtype)
    calls, info = {}, {}
    # dense full-context baseline: the chunk over the whole no-slide history
    keys = cp.full_context_tokens + t
    dense_plan, cap = _contiguous_plan(keys, t, 64 if phase == "prefill" else 32)
    dk = _random((1, kv_heads, cap, head_dim), rng, dtype)
    dv = _random((1, kv_heads, cap, head_dim), rng, dtype)
    calls["full_reference"] = lambda: reference_attention(q, dk, dv, dense_plan, scale)
    if phase == "decode" or cp.full_context_tokens <= sdpa_max_history:
        calls["full_sdpa"] = lambda: _sdpa_blocks(q, dk, dv, keys, scale)
    # tile-skip over each layout, with the chunk (or the decoded token) allocated into it. All layouts read one K/V
    # buffer pair (padded to the largest capacity with free slots, which no tile covers): measured, a buffer of its
    # own made whichever layout allocated first ~3-4 % slower (memory placement, not the layout)
    tables = {}
    for name in LAYOUT_NAMES:
        table = cp.tables[name].copy()
        tables[name] = (table, table.allocate(t, _NEW_UID, AllocClass.RECENT_CONTEXT))
    shared = max(table.capacity for table, _ in tables.values())
    k = _random((1, kv_heads, shared, head_dim), rng, dtype)
    v = _random((1, kv_heads, shared, head_dim), rng, dtype)
    for name, (table, slots) in tables.items():
        tiles = table.active_pages() if phase == "prefill" else table.active_subblocks()
        tile = table.page_size if phase == "prefill" else table.subblock_size
        seq = np.full(shared, -1, dtype=np.int64)
        seq[: table.capacity] = table.seq
        plan = plan_tiles(seq, table.seq[slots], tiles, tile)
        if path == "auto":
            calls[name] = (lambda plan=plan: tile_skip_attention(q, k, v, scale=scale, plan=plan))
            impl = dispatch.choose(q, k, plan, scale)
        else:
            calls[name] = (lambda plan=plan: dispatch.run_path(path, q, k, v, plan, scale))
            impl = path
        info[name] = (plan, tile, table.stats(), impl)
    mx.eval(q, dk, dv, k, v)
    if kv_quant:
        calls.update(_quantised_calls(q, k, v, {n: info[n][0] for n in LAYOUT_NAMES}, scale, kv_quant, head_dim, rng))
    timings = time_interleaved(calls, reps, flush)
    ref, sdpa = timings["full_reference"], timings.get("full_sdpa")
    best, impl = (ref, "reference") if sdpa is None or ref.median_ms <= sdpa.median_ms else (sdpa, "sdpa")
    full_ms, full_cpu = best.median_ms, best.cpu_median_ms
    rows = [{**base, "phase": phase, "layout": "full", "chunk_tokens": t, "active_slots": keys, "tiles": None,
             "tile": None, "median_ms": round(full_ms, 3), "timing": best.to_json(), "impl": impl,
             "reference_ms": round(ref.median_ms, 3), "sdpa_ms": round(sdpa.median_ms, 3) if sdpa else None,
             "speedup_vs_full": 1.0, "limit": 1.0, "ratio_to_limit": 1.0, "cpu_speedup_vs_full": 1.0,
             "cpu_ratio_to_limit": 1.0}]
    for name in LAYOUT_NAMES:
        plan, tile, stats, impl = info[name]
        tm = timings[name]
        lim = limit(phase, keys, plan.active_slots, t)
        speed = full_ms / tm.median_ms
        row = {**base, "phase": phase, "layout": name, "chunk_tokens": t, "active_slots": plan.active_slots,
               "tiles": plan.n_tiles, "tile": tile, "physical_span": stats.physical_span,
               "median_ms": round(tm.median_ms, 3), "timing": tm.to_json(), "impl": impl,
               "speedup_vs_full": round(speed, 3), "limit": round(lim, 3), "ratio_to_limit": round(speed / lim, 3),
               "cpu_speedup_vs_full": round(full_cpu / tm.cpu_median_ms, 3),
               "cpu_ratio_to_limit": round(full_cpu / tm.cpu_median_ms / lim, 3)}
        mig = cp.migrations.get(name)
        if name != "native":
            row["last_migration_rows"] = int(mig[1].src.size) if mig else 0
            row["last_migration_ms"] = round(migration_ms[name] or 0.0, 3)
            row["migrations_per_update"] = round(cp.migration_rate[name], 4)
            row["migration_ms"] = round(row["last_migration_ms"] * cp.migration_rate[name], 3)
            if name == "omnipage":
                with_mig = tm.median_ms + (row["migration_ms"] if phase == "prefill" else 0.0)
                row["median_ms_with_migration"] = round(with_mig, 3)
        if kv_quant:  # the same call on quantised K/V, timed interleaved with it
            tq, ts = timings[f"{name}@q"], timings[f"{name}@q-shifted"]
            row["kv_quant"] = {"bits": kv_quant[0], "group_size": kv_quant[1], "median_ms": round(tq.median_ms, 3),
                               "shifted_median_ms": round(ts.median_ms, 3),
                               "ratio_to_float": round(tq.median_ms / tm.median_ms, 3),
                               "shifted_ratio_to_float": round(ts.median_ms / tm.median_ms, 3),
                               "timing": tq.to_json(), "shifted_timing": ts.to_json()}
        rows.append(row)
    return rows


# --- goals and reports ------------------------------------------------------------------------------------------

def goals(rows: list[dict]) -> dict:
    """The issue's goals, evaluated on the measured rows (wall-clock medians; CPU-time medians alongside)."""
    skip = [r for r in rows if r["layout"] != "full"]
    below = [{"history": r["history"], "phase": r["phase"], "layout": r["layout"],
              "ratio_to_limit": r["ratio_to_limit"], "cpu_ratio_to_limit": r.get("cpu_ratio_to_limit")}
             for r in skip if min(r["ratio_to_limit"], r.get("cpu_ratio_to_limit", 1e9)) < RATIO_GOAL]
    at32 = [r for r in skip if r["history"] == 32768]
    paper = [{"phase": r["phase"], "layout": r["layout"], "limit": r["limit"], "speedup": r["speedup_vs_full"],
              "cpu_speedup": r.get("cpu_speedup_vs_full"), "limit_allows": r["limit"] >= PAPER_SPEEDUP,
              "met": r["speedup_vs_full"] >= PAPER_SPEEDUP,
              "cpu_met": (r.get("cpu_speedup_vs_full") or 0) >= PAPER_SPEEDUP} for r in at32]
    share = []
    for phase in ("prefill", "decode"):
        for h in sorted({r["history"] for r in rows}):
            by = {r["layout"]: r for r in skip if r["phase"] == phase and r["history"] == h}
            if not set(LAYOUT_NAMES) <= set(by):
                continue
            mig = by["omnipage"].get("migration_ms", 0.0) if phase == "prefill" else 0.0
            entry = {"phase": phase, "history": h, "tiles": {n: by[n]["tiles"] for n in by}, "migration_ms": mig}
            for key, field_ in (("wall", "median_ms"), ("cpu", "cpu_median_ms")):
                get = (lambda r: r[field_]) if key == "wall" else (lambda r: r["timing"].get("cpu_median_ms"))
                nat, eag, omp = get(by["native"]), get(by["eager"]), get(by["omnipage"])
                if None in (nat, eag, omp):
                    continue
                omp += mig
                gain = nat - eag
                spread = max(by[n]["timing"]["max_ms"] - by[n]["timing"]["min_ms"] for n in by)
                entry[key] = {"native_ms": round(nat, 3), "omnipage_ms_with_migration": round(omp, 3),
                              "eager_ms": round(eag, 3), "eager_gain_ms": round(gain, 3),
                              "share": round((nat - omp) / gain, 3) if gain > 0 else None,
                              "gain_above_spread": gain > spread}
            share.append(entry)
    return {"ratio_goal": RATIO_GOAL, "rows_below_ratio_goal": below, "paper_speedup": PAPER_SPEEDUP,
            "at_32k": paper, "omnipage_goal": OMNIPAGE_GOAL, "omnipage_share": share}


def markdown(result: dict) -> str:
    """The measured table (docs/benchmarks.md)."""
    lines = ["| history (full ctx) | phase | layout | chunk | tiles x size | active slots | median ms | speedup "
             "| limit | ratio | CPU-time speedup (ratio) | migration ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        tiles = f"{r['tiles']} x {r['tile']}" if r["tiles"] is not None else "dense"
        mig = r.get("migration_ms")
        ms = f"{r['median_ms']:.2f}"
        if r["layout"] == "full":
            ms += f" ({r['impl']}; ref {r['reference_ms']:.2f}" + (f", sdpa {r['sdpa_ms']:.2f})" if r["sdpa_ms"]
                                                                   else ")")
        lines.append(f"| {r['history']} ({r['full_context_tokens']}) | {r['phase']} | {r['layout']} | "
                     f"{r['chunk_tokens']} | {tiles} | {r['active_slots']} | {ms} | {r['speedup_vs_full']:.2f}x | "
                     f"{r['limit']:.2f}x | {r['ratio_to_limit']:.2f} | "
                     f"{r.get('cpu_speedup_vs_full', 0):.2f}x ({r.get('cpu_ratio_to_limit', 0):.2f}) | "
                     f"{'' if mig is None else f'{mig:.2f}'} |")
    return "\n".join(lines)


def quant_markdown(result: dict) -> str:
    """Quantised K/V against float, side by side per checkpoint (rows of a run with --kv-bits)."""
    q = result["kv_quant"]
    lines = [f"| history | phase | layout | float ms | {q['bits']}-bit ms (ratio) | {q['bits']}-bit, keys shifted ms "
             "(ratio) |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "kv_quant" in r:
            k = r["kv_quant"]
            lines.append(f"| {r['history']} | {r['phase']} | {r['layout']} | {r['median_ms']:.2f} | "
                         f"{k['median_ms']:.2f} ({k['ratio_to_float']:.2f}) | {k['shifted_median_ms']:.2f} "
                         f"({k['shifted_ratio_to_float']:.2f}) |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Milliseconds and speedups per history: CPU time solid (robust on a shared machine), wall time faint."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"full": "black", "native": "#c0504d", "omnipage": "#4f81bd", "eager": "#9bbb59"}
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    for col, phase in enumerate(("prefill", "decode")):
        rows = [r for r in result["rows"] if r["phase"] == phase]
        hs = sorted({r["history"] for r in rows})

        def pick(name):
            return [next(r for r in rows if r["history"] == h and r["layout"] == name) for h in hs]

        ax = axes[0, col]
        for name in ("full",) + LAYOUT_NAMES:
            sel = pick(name)
            ax.plot(hs, [r["timing"].get("cpu_median_ms", r["median_ms"]) for r in sel], "o-", color=colors[name],
                    label=f"{name} (CPU time)")
            ax.plot(hs, [r["median_ms"] for r in sel], ".:", color=colors[name], alpha=0.35)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{result['shape']} {phase}: one layer, median ms (faint: wall)")
        ax.set_xlabel("no-slide history (tokens)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
        ax = axes[1, col]
        for name in LAYOUT_NAMES:
            sel = pick(name)
            ax.plot(hs, [r.get("cpu_speedup_vs_full", r["speedup_vs_full"]) for r in sel], "o-", color=colors[name],
                    label=f"{name} speedup (CPU time)")
            ax.plot(hs, [r["speedup_vs_full"] for r in sel], ".:", color=colors[name], alpha=0.35)
            ax.plot(hs, [r["limit"] for r in sel], "--", color=colors[name], lw=0.8, label=f"{name} limit")
        ax.axhline(PAPER_SPEEDUP, color="grey", lw=0.8, ls="-.", label="paper 12.72x")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{phase}: speedup over dense vs the skipping limit (faint: wall)")
        ax.set_xlabel("no-slide history (tokens)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_bench(shape: str, histories: list[int], *, policy: str = "omnipick", dtype=mx.float32,
              sdpa_max_history: int = 16384, seed: int = 0, reps: int | None = None, question_every: int = 30,
              log=None, setting=None, path: str = "auto", kv_quant: tuple[int, int] | None = None,
              kv_held_tokens: int = 0, **policy_kw) -> dict:
    """``setting``: the media setting (a MediaSetting or a preset name; default: the default setting) that sizes
    the stream's units."""
    prof = resolve_profile(shape, setting)
    load_before = load_average()
    t0 = time.perf_counter()
    cps = checkpoints(prof, histories, policy=policy, seed=seed, question_every=question_every, **policy_kw)
    rows: list[dict] = []
    for cp in cps:
        rows += bench_checkpoint(cp, q_heads=prof.q_heads, kv_heads=prof.kv_heads, head_dim=prof.head_dim,
                                 chunk=prof.media_unit_tokens, dtype=dtype, sdpa_max_history=sdpa_max_history,
                                 seed=seed, reps=reps, log=log, path=path, kv_quant=kv_quant)
    pol = make_policy(policy, profile=prof, **policy_kw)
    extra = {}
    if kv_quant:
        from .kv_quant import kv_bytes_per_token, kv_held

        bits, group = kv_quant
        extra["kv_quant"] = {
            "bits": bits, "group_size": group,
            "bytes_per_token": {"float16": kv_bytes_per_token(prof, None),
                                f"{bits}-bit": kv_bytes_per_token(prof, bits, group)},
            "held": kv_held(prof, kv_held_tokens, [(None, None), (8, group), (4, group)], policy="omnitide",
                            seed=seed, **policy_kw) if kv_held_tokens else None,
        }
    return {
        "shape": prof.name,
        "path": path,
        "versions": versions(),
        "attention_shape": {"q_heads": prof.q_heads, "kv_heads": prof.kv_heads, "head_dim": prof.head_dim,
                            "layers_timed": 1, "dtype": str(dtype).split(".")[-1]},
        "policy": pol.config(),
        "chunk_tokens": prof.media_unit_tokens, "units": prof.units.to_json(),
        "load_average": {"before": load_before, "after": load_average()},
        "wall_s": round(time.perf_counter() - t0, 1),
        "rows": rows,
        "goals": goals(rows),
        **extra,
    }


# --- command line (omnitide bench attention; flags: attention_args.py) ------------------------------------

def run(args: argparse.Namespace) -> int:
    try:
        histories = parse_histories(args.history)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    kw = {k: getattr(args, k) for k in ("high", "low") if getattr(args, k) is not None}
    path = getattr(args, "path", "auto")
    if path == "vector" and not dispatch.metal_device():
        print("--path vector: the Metal kernel needs an Apple GPU as MLX's default device", file=sys.stderr)
        return 2

    def log(r):
        print(f"  {r['history']:>6} {r['phase']:<7} {r['layout']:<8} {r['median_ms']:>10.2f} ms  "
              f"x{r['speedup_vs_full']:<7.2f} limit x{r['limit']:<7.2f} ratio {r['ratio_to_limit']:.2f} "
              f"(cpu x{r['cpu_speedup_vs_full']:.2f}, ratio {r['cpu_ratio_to_limit']:.2f})", flush=True)

    kv_quant = (args.kv_bits, args.kv_group_size) if getattr(args, "kv_bits", None) else None
    from ..commands.options import UsageError, media_setting

    try:
        setting = media_setting(args)
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2
    result = run_bench(args.shape, histories, setting=setting, policy=args.policy, dtype=getattr(mx, args.dtype),
                       sdpa_max_history=args.sdpa_max_history, seed=args.seed, reps=args.reps, log=log, path=path,
                       kv_quant=kv_quant, kv_held_tokens=getattr(args, "kv_held_tokens", 0), **kw)
    write_outputs(result, args, markdown=markdown, plot=plot)
    if result.get("kv_quant"):
        from .kv_quant import markdown as held_markdown

        print(quant_markdown(result))
        if result["kv_quant"]["held"]:
            print(held_markdown(result["kv_quant"]["held"]))
    g = result["goals"]
    print(f"rows below {RATIO_GOAL} of their limit: {len(g['rows_below_ratio_goal'])}; "
          f"wall {result['wall_s']} s; load {result['load_average']}")
    return 0
