"""The cost model's predictions for an Apple GPU at the attention benchmark's checkpoints (kernels/cost.py).

The layouts are exactly the ones ``omnitide bench attention`` times (same simulator, same chunk allocated into each
layout); every path is priced for one layer, against the fused dense baseline over the whole history. These are
predictions: no Mac has run the kernels yet. ``scripts/mac_check.sh`` measures the same rows on a Mac and reports
both side by side (bench/mac_check.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.page import AllocClass
from ..models.stream_units import resolve_profile
from ..core.layout import LAYOUT_NAMES
from ..kernels import cost
from ..kernels.attention import TilePlan, plan_tiles

_NEW_UID = 1 << 40  # bench/attention.py: the benchmark's own chunk


@dataclass
class LayoutCase:
    """One row of the benchmark: a layout at a checkpoint and phase, as a plan and as the cost model's case."""

    shape: str
    history: int
    full_context_tokens: int
    phase: str
    layout: str
    plan: TilePlan
    case: cost.Case
    full: cost.Case  # the dense baseline over the whole history
    limit: float

    @property
    def label(self) -> str:
        return f"{self.shape} {self.history} {self.phase} {self.layout}"


def layout_cases(shape: str, histories: list[int], *, dtype_bytes: int = 2, layouts=LAYOUT_NAMES,
                 policy: str = "omnipick", seed: int = 0, setting=None) -> list[LayoutCase]:
    """The benchmark's rows (both phases, every layout) at each checkpoint, ready to price or to run; ``setting``:
    the media setting that sizes the units (bench attention's ``setting``)."""
    from .attention import checkpoints

    prof = resolve_profile(shape, setting)
    hq, hkv, d = prof.q_heads, prof.kv_heads, prof.head_dim
    out = []
    for cp in checkpoints(prof, histories, policy=policy, seed=seed):
        for phase, t in (("prefill", prof.media_unit_tokens), ("decode", 1)):
            keys = cp.full_context_tokens + t
            full = cost.dense_case(keys, t, hq=hq, hkv=hkv, d=d, dtype_bytes=dtype_bytes,
                                   tile=64 if phase == "prefill" else 32)
            for name in layouts:
                table = cp.tables[name].copy()
                slots = table.allocate(t, _NEW_UID, AllocClass.RECENT_CONTEXT)
                tiles = table.active_pages() if phase == "prefill" else table.active_subblocks()
                tile = table.page_size if phase == "prefill" else table.subblock_size
                seq = np.asarray(table.seq, dtype=np.int64)
                plan = plan_tiles(seq, seq[slots], tiles, tile)
                case = cost.make_case(plan.key_np, plan.q_seq_np, plan.tiles, tile, hq=hq, hkv=hkv, d=d,
                                      dtype_bytes=dtype_bytes)
                out.append(LayoutCase(prof.name, cp.history, cp.full_context_tokens, phase, name, plan, case, full,
                                      cost.limit(phase, keys, plan.active_slots, t)))
    return out


def predictions(shape: str, histories: list[int], *, machine: cost.Machine = cost.DEFAULT_MACHINE,
                dtype_bytes: int = 2, layouts=LAYOUT_NAMES, setting=None) -> list[dict]:
    """Per row: predicted ms of every path and of the dense baseline, the cheapest, its speedup and its ratio to
    the key-count limit."""
    rows = []
    for lc in layout_cases(shape, histories, dtype_bytes=dtype_bytes, layouts=layouts, setting=setting):
        est = {p: cost.predict(p, lc.case, machine) for p in cost.PATHS}
        full = cost.predict("full", lc.full, machine)
        win = min(est, key=lambda p: est[p].ms)
        speed = full.ms / est[win].ms
        rows.append({"shape": lc.shape, "history": lc.history, "full_context_tokens": lc.full_context_tokens,
                     "phase": lc.phase, "layout": lc.layout, "chunk_tokens": lc.case.t,
                     "active_slots": lc.plan.active_slots, "tiles": lc.plan.n_tiles, "tile": lc.plan.tile,
                     "predicted_ms": {p: round(c.ms, 4) for p, c in est.items()}, "full_ms": round(full.ms, 4),
                     "choice": win, "speedup_vs_full": round(speed, 3), "limit": round(lc.limit, 3),
                     "ratio_to_limit": round(speed / lc.limit, 3), "case": lc.case.to_json()})
    return rows


def markdown(rows: list[dict], machine: cost.Machine = cost.DEFAULT_MACHINE) -> str:
    lines = [f"Predicted for {machine.name} ({machine.bandwidth_gbs:g} GB/s, {machine.peak_flops / 1e12:.1f} "
             "FP32 TFLOPS), one layer; *predictions, not measurements*.", "",
             "| shape | history | phase | layout | active slots | vector ms | gather ms | dense ms | full ms "
             "| choice | speedup | limit | ratio |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r["predicted_ms"]
        lines.append(f"| {r['shape']} | {r['history']} | {r['phase']} | {r['layout']} | {r['active_slots']} | "
                     f"{p['vector']:.3f} | {p['gather']:.3f} | {p['dense']:.3f} | {r['full_ms']:.3f} | "
                     f"{r['choice']} | {r['speedup_vs_full']:.2f}x | {r['limit']:.2f}x | "
                     f"{r['ratio_to_limit']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    """``python -m omnitide_mlx.bench.attention_predict``: print the predictions as Markdown (docs/benchmarks.md)."""
    import argparse

    from ..core.layout_checkpoints import parse_histories

    p = argparse.ArgumentParser(prog="python -m omnitide_mlx.bench.attention_predict", description=__doc__)
    p.add_argument("--shape", default="qwen2.5-omni-7b")
    p.add_argument("--history", default="4096,8192,16384,32768,65536")
    p.add_argument("--layouts", default=",".join(LAYOUT_NAMES))
    p.add_argument("--dtype-bytes", type=int, default=2, help="2: float16 / bfloat16 (default), 4: float32")
    p.add_argument("--machine", default="m2-max-38", choices=sorted(cost.MACHINES))
    p.add_argument("--setting", default=None, help="media setting preset (default: the default; 'paper': "
                   "the paper's 2,333 / 675-token units)")
    p.add_argument("--json", default=None, help="also write the rows here")
    a = p.parse_args(argv)
    m = cost.MACHINES[a.machine]
    rows = predictions(a.shape, parse_histories(a.history), machine=m, dtype_bytes=a.dtype_bytes,
                       layouts=tuple(x for x in a.layouts.split(",") if x), setting=a.setting)
    print(markdown(rows, m))
    if a.json:
        import json

        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
