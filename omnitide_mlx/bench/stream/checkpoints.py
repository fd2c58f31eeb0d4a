"""Updates at no-slide checkpoints (paper figure 10): each variant put in the state the core simulator reached
(synthetic K/V), then timed updates and attention probes, interleaved round by round."""

from __future__ import annotations

import gc
import statistics
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ...core.page import PageTable
from ...core.pick import make_policy
from ...core.profiles import StreamSpec
from ...core.sim import Simulator
from ...core.units import History
from ..common import Timing
from ..shape_models import ShapeTrueModel, update_flops
from .limits import add_limits
from .names import real_kv_bytes_per_token
from .rows import UpdateRow
from .variants import Variant, _now


@dataclass
class CheckpointState:
    """Where one policy's simulator stood when the no-slide history first reached a checkpoint."""

    checkpoint: int
    full_context_tokens: int
    table: PageTable
    history: History
    peak_span: int
    updates: int
    trims: int
    last_unit: int


def checkpoint_states(profile, policy: str, checkpoints: list[int], stream: StreamSpec) -> list[CheckpointState]:
    """Stream through the checkpoints (ascending) with the core simulator; the layout of the policy's own kind."""
    pol = make_policy(policy, profile=profile)
    sim = Simulator(profile, pol, stream, (pol.layout,))
    lt = next(iter(sim.layouts.values()))
    todo, out = sorted(checkpoints), []
    for event in stream.events():
        sim.step(event)
        while todo and sim.full_context_tokens >= todo[0]:
            out.append(CheckpointState(todo.pop(0), sim.full_context_tokens, lt.table.copy(),
                                       History(list(sim.history.units)), lt.peak_span, sim.updates, sim.trims,
                                       sim.history[-1].length))
        if not todo:
            return out
    raise RuntimeError(f"the stream ended before checkpoints {todo}")


def _timing(samples: list[float], cpu: list[float]) -> Timing:
    return Timing(statistics.median(samples), min(samples), max(samples), len(samples), statistics.median(cpu))


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def bench_checkpoints(model: ShapeTrueModel, variants: dict[str, Variant], checkpoints: list[int], stream: StreamSpec, *,
                      reps: int, attention_reps: int, seed: int, log) -> list[UpdateRow]:
    """Rows for every checkpoint and variant (``log``, when given, is called with each finished row): ``reps`` updates and ``attention_reps`` attention probes each,
    interleaved round by round (the round's first variant rotates)."""
    prof = model.profile
    chunk = prof.media_unit_tokens
    rng = np.random.default_rng(seed)
    by_retention = {}  # a quantised twin keeps what its float policy keeps: one simulation per retention
    for var in variants.values():
        if var.kind == "engine" and var.retention not in by_retention:
            by_retention[var.retention] = checkpoint_states(prof, var.retention, checkpoints, stream)
    states = {name: by_retention[var.retention] for name, var in variants.items() if var.kind == "engine"}
    full_states = by_retention.get("full") or checkpoint_states(prof, "full", checkpoints, stream)
    s = model.shape
    qkv = tuple(mx.array(rng.standard_normal((1, h, chunk, s.head_dim), dtype=np.float32))
                for h in (s.q_heads, s.kv_heads, s.kv_heads))
    mx.eval(qkv)
    rows = []
    warmed = False
    for ci, cp in enumerate(sorted(checkpoints)):
        fs = full_states[ci]
        for name, var in variants.items():
            if var.kind == "engine":
                st = states[name][ci]
                var.install(st.table, st.history, st.peak_span, rng)
            else:
                var.install(fs.full_context_tokens, fs.last_unit, fs.history.next_position(), rng)
        order = list(variants)
        if not warmed:  # unrecorded updates of one engine and one mlx-lm variant: the process's first allocations
            for kind in ("engine", "mlx_lm"):
                first = next((v for v in variants.values() if v.kind == kind), None)
                if first is not None:
                    first.media(float(fs.updates))
                    first.restore()
            warmed = True
        samples = {name: [] for name in order}
        probes = {name: [] for name in order}
        for r in range(reps):
            gc.collect()
            for name in order[r % len(order):] + order[:r % len(order)]:
                var = variants[name]
                var.restore()
                kv_before = var.kv_bytes
                active0 = mx.get_active_memory()
                mx.reset_peak_memory()
                t0, c0 = _now()
                var.media(float(fs.updates))
                t1, c1 = _now()
                peak = model.weights_bytes + kv_before + max(0, mx.get_peak_memory() - active0)
                cnt = var.counters()
                samples[name].append({"wall": (t1 - t0) * 1000, "cpu": (c1 - c0) * 1000,
                                      "prefill": cnt["prefill_ms"], "maintenance": cnt["maintenance_ms"],
                                      "peak": peak, "layout": var.layout(), "kv_before": kv_before,
                                      "migrated": cnt["migrated_cells"]})
                var.restore()
                if r < attention_reps:
                    probes[name].append(var.probe_attention(chunk, qkv))
                    var.restore()
        for name in order:
            sm, pr = samples[name], probes[name]
            lay = sm[-1]["layout"]
            fstate = states[name][ci] if name in states else fs
            var = variants[name]
            row = UpdateRow(
                policy=name, checkpoint=cp, full_context_tokens=fs.full_context_tokens, chunk_tokens=chunk,
                retention=var.retention, kv_bits=var.kv_bits, kv_group_size=var.kv_group_size,
                retained_before=(fstate.history.total_tokens if name in states
                                 else variants[name].layout()["retained_cells"]),
                active_slots=pr[0].active_slots, keys_visited=pr[0].keys_visited,
                flops=update_flops(s, s.layers, s.vocab, chunk, pr[0].keys_visited),
                flops_all_active=update_flops(s, s.layers, s.vocab, chunk, pr[0].active_slots * chunk),
                update_ms=round(statistics.median(x["wall"] for x in sm), 3),
                update_cpu_ms=round(statistics.median(x["cpu"] for x in sm), 3),
                prefill_ms=round(statistics.median(x["prefill"] for x in sm), 3),
                attention_ms=round(statistics.median(p.wall_ms for p in pr), 3),
                attention_cpu_ms=round(statistics.median(p.cpu_ms for p in pr), 3),
                maintenance_ms=round(statistics.median(x["maintenance"] for x in sm), 3),
                migrated_cells=sm[-1]["migrated"],
                timing=_timing([x["wall"] for x in sm], [x["cpu"] for x in sm]),
                attention_timing=_timing([p.wall_ms for p in pr], [p.cpu_ms for p in pr]),
                retained_cells=lay["retained_cells"], physical_span=lay["physical_span"],
                active_pages=lay["active_pages"], active_subblocks=lay["active_subblocks"],
                prefill_span=lay["prefill_span"],
                peak_span=max(fstate.peak_span if name in states else 0, lay["peak_span"]),
                kv_bytes=lay["kv_bytes"],
                kv_bytes_real_model=lay["retained_cells"] * real_kv_bytes_per_token(prof, var.kv_bits,
                                                                                    var.kv_group_size or 64),
                peak_memory_bytes=int(statistics.median(x["peak"] for x in sm)),
            )
            rows.append(row)
            if log:
                log(row)
        for var in variants.values():
            var.release()
        gc.collect()
    add_limits(rows, model.shape, model.real)
    return rows
