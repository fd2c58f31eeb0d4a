"""The run's text: one log line per update row, and the Markdown tables of docs/benchmarks.md."""

from __future__ import annotations


def _row_line(r: dict) -> str:
    return (f"  {r['checkpoint']:>6} {r['policy']:<13} update {r['update_ms']:>9.1f} ms "
            f"(cpu {r['update_cpu_ms']:>9.1f})"
            f"  attention {r['attention_ms']:>9.1f} ms  maintenance {r['maintenance_ms']:>7.1f} ms  "
            f"retained {r['retained_cells']:>6} span {r['physical_span']:>6}")


def markdown(result: dict) -> str:
    """The tables of docs/benchmarks.md: checkpoints, then sessions."""
    lines = ["| checkpoint (no-slide) | policy | update ms (CPU ms) | speedup (CPU) | FLOP limit | ratio (CPU) "
             "| attention ms | attn speedup | key limit | ratio | maintenance ms | retained / span / active slots "
             "| peak span | peak memory MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r["kind"] != "update":
            continue
        lim = r.get("flop_limit")
        lines.append(
            f"| {r['checkpoint']} ({r['full_context_tokens']}) | {r['policy']} | {r['update_ms']:.0f} "
            f"({r['update_cpu_ms']:.0f}) | {r.get('speedup', 0):.2f}x ({r.get('cpu_speedup', 0):.2f}x) | "
            f"{lim:.2f}x | {r.get('ratio_to_limit', 0):.2f} ({r.get('cpu_ratio_to_limit', 0):.2f}) | "
            f"{r['attention_ms']:.0f} | {r.get('attention_speedup', 0):.2f}x | {r.get('key_limit', 0):.2f}x | "
            f"{r.get('attention_ratio_to_limit', 0):.2f} | {r['maintenance_ms']:.1f} | "
            f"{r['retained_cells']} / {r['physical_span']} / {r['active_slots']} | {r['peak_span']} | "
            f"{r['peak_memory_bytes'] / 1e6:.0f} |")
    lines += ["", "| policy | session s (CPU s) | speedup (CPU) | FLOP limit | ratio | prefill s | decode s "
              "| maintenance s (share) | retained / span / peak span | KV MB (real model, fp16) | peak memory MB |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r["kind"] != "session":
            continue
        lines.append(f"| {r['policy']} | {r['session_s']:.1f} ({r['session_cpu_s']:.1f}) | "
                     f"{r.get('speedup', 0):.2f}x ({r.get('cpu_speedup', 0):.2f}x) | {r.get('flop_limit', 0):.2f}x | "
                     f"{r.get('ratio_to_limit', 0):.2f} | {r['prefill_s']:.1f} | "
                     f"{r['decode_s']:.1f} | {r['maintenance_s']:.3f} ({100 * r['maintenance_share']:.2f} %) | "
                     f"{r['retained_cells']} / {r['physical_span']} / {r['peak_span']} | "
                     f"{r['kv_bytes_real_model'] / 1e6:.0f} | {r['peak_memory_bytes'] / 1e6:.0f} |")
    kq = result.get("goals", {}).get("kv_quant")
    if kq:
        lines += ["", "| checkpoint | quantised | float | update ms (ratio) | attention ms (ratio) "
                  "| KV MB allocated (ratio) | KV MB real model, retained (ratio) |", "|---|---|---|---|---|---|---|"]
        for e in kq["checkpoints"]:
            lines.append(f"| {e['checkpoint']} | {e['variant']} | {e['float']} | {e['update_ms'][0]:.0f} / "
                         f"{e['update_ms'][1]:.0f} ({e['update_ms_ratio']:.2f}) | {e['attention_ms'][0]:.0f} / "
                         f"{e['attention_ms'][1]:.0f} ({e['attention_ms_ratio']:.2f}) | "
                         f"{e['kv_bytes'][0] / 1e6:.1f} / {e['kv_bytes'][1] / 1e6:.1f} ({e['kv_bytes_ratio']:.3f}) | "
                         f"{e['kv_bytes_real_model'][0] / 1e6:.1f} / {e['kv_bytes_real_model'][1] / 1e6:.1f} "
                         f"({e['kv_bytes_real_model_ratio']:.3f}) |")
        lines += ["", "| quantised | float | session s (ratio) | prefill attention s (ratio) | decode attention s "
                  "(ratio) | KV MB allocated at the end (ratio) |", "|---|---|---|---|---|---|"]
        for e in kq["sessions"]:
            def pair(k, scale=1.0, fmt=".2f"):
                if k not in e:
                    return "-"
                return (f"{e[k][0] / scale:{fmt}} / {e[k][1] / scale:{fmt}} "
                        f"({e[k + '_ratio'] if e[k + '_ratio'] is not None else float('nan'):.2f})")
            lines.append(f"| {e['variant']} | {e['float']} | {pair('session_s')} | {pair('prefill_attention_s')} | "
                         f"{pair('decode_attention_s')} | {pair('kv_bytes', 1e6, '.1f')} |")
    return "\n".join(lines)
