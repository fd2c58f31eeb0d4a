"""The limits of an update row: speedup over full context against the FLOP-count, key-count and cost-weighted
limits."""

from __future__ import annotations

from ..shape_models import ModelShape, update_flops
from .rows import UpdateLimits, UpdateRow


def add_limits(rows: list[UpdateRow], bench: ModelShape, real: ModelShape) -> None:
    """Per row (set as ``row.limits``): speedup over ``full`` at its checkpoint (wall and CPU time), the FLOP-count
    and key-count limits, and the ratios; also the limits the real model (all layers, real vocabulary) would have, and the *cost-weighted*
    limit: the speedup if each of the row's FLOPs cost what the same kind of FLOP (projections and MLP, or
    attention) cost in the full-context row, in CPU time - on a CPU attention FLOPs cost several times more than
    GEMM FLOPs, so time speedups exceed the FLOP-count limit."""
    by = {(r.checkpoint, r.policy): r for r in rows}
    for r in rows:
        full = by.get((r.checkpoint, "full"))
        if full is None:
            continue
        lim = full.flops / r.flops
        key_lim = full.keys_visited / r.keys_visited
        # looser: this row's queries read every active slot (no causal skipping inside the chunk), full context's
        # only the keys visible to them (the convention of the "about 2.35x" at 32K for the 3B shape)
        loose = full.flops / r.flops_all_active
        real_lim = (update_flops(real, real.layers, real.vocab, r.chunk_tokens, full.keys_visited)
                    / update_flops(real, real.layers, real.vocab, r.chunk_tokens, r.keys_visited))
        dense = update_flops(bench, bench.layers, bench.vocab, r.chunk_tokens, 0)  # all but attention
        full_att_flops = full.flops - dense
        full_dense_ms = full.update_cpu_ms - full.attention_cpu_ms - full.maintenance_ms
        # the same chunk's non-attention work as full context, plus this row's attention FLOPs at full's rate
        predicted = full_dense_ms + (r.flops - dense) * full.attention_cpu_ms / full_att_flops + r.maintenance_ms
        # an estimate from separately probed times: on a loaded machine the probed attention can exceed the
        # update's own time, and then there is no estimate (None) rather than a negative one
        cost_limit = round(full.update_cpu_ms / predicted, 4) if full_dense_ms > 0 and predicted > 0 else None
        speedup = round(full.update_ms / r.update_ms, 4)
        cpu_speedup = round(full.update_cpu_ms / r.update_cpu_ms, 4)
        attention_speedup = round(full.attention_ms / r.attention_ms, 4)
        attention_cpu_speedup = round(full.attention_cpu_ms / r.attention_cpu_ms, 4)
        r.limits = UpdateLimits(
            cpu_cost_limit=cost_limit,
            flop_limit=round(lim, 4), flop_limit_real_model=round(real_lim, 4),
            flop_limit_no_chunk_skip=round(loose, 4),
            speedup=speedup, cpu_speedup=cpu_speedup, key_limit=round(key_lim, 4),
            attention_speedup=attention_speedup, attention_cpu_speedup=attention_cpu_speedup,
            ratio_to_limit=round(speedup / lim, 4), cpu_ratio_to_limit=round(cpu_speedup / lim, 4),
            attention_ratio_to_limit=round(attention_speedup / key_lim, 4),
            attention_cpu_ratio_to_limit=round(attention_cpu_speedup / key_lim, 4),
            cpu_ratio_to_cost_limit=round(cpu_speedup / cost_limit, 4) if cost_limit else None,
        )
