"""Figures of ``omnitide bench stream`` (one PNG, six panels), drawn like the paper's:

(a) update latency at the no-slide checkpoints and (b) attention time profiled apart (figure 10); (c) KV layout at
the largest checkpoint: useful cells, span waste and the cumulative peak span (figure 12); (d) session stream-loop
time against StreamingBench accuracy, the accuracy taken from the paper's table 2 because random weights have none
(figure 13); (e) cumulative attention time under identical retention, native / OmniPage with its migrations /
eager without (figure 15); (f) peak memory per update over the session against the no-slide history.
"""

from __future__ import annotations

import numpy as np

from .names import LAYOUT_TRIO, MLX_LM_QUANT, PAPER_ACCURACY, split_variant

COLORS = {"full": "black", "fifo": "#8064a2", "token": "#f79646", "streamingllm": "#4bacc6", "h2o": "#7f7f7f",
          "omnipick": "#c0504d", "omnitide": "#4f81bd", "eager": "#9bbb59", "mlx_kvcache": "#404040",
          "mlx_rotating": "#b0a060"}
STYLE = {"mlx_kvcache": "--", "mlx_rotating": "--", MLX_LM_QUANT: "-."}
COLORS[MLX_LM_QUANT] = "#a05080"


def _color(name: str) -> str:
    """A quantised twin (omnitide_kv4) takes its float policy's colour, drawn dotted."""
    return COLORS[split_variant(name)[0]]


def _style(name: str) -> str:
    return ":" if split_variant(name)[1] else STYLE.get(name, "-")
LAYOUT_LABEL = {"omnipick": "native (OmniPick)", "omnitide": "OmniPage (OmniTide, + migration)",
                "eager": "eager (migration excluded)"}


def _checkpoint_panel(ax, rows, key, title, ylabel):
    for name in dict.fromkeys(r["policy"] for r in rows):
        sel = sorted((r for r in rows if r["policy"] == name), key=lambda r: r["checkpoint"])
        ax.plot([r["checkpoint"] for r in sel], [r[key] for r in sel], _style(name), marker="o", ms=3,
                color=_color(name), label=name, lw=1.6 if split_variant(name)[0] == "omnitide" else 1.0)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("no-slide checkpoint (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    upd = [r for r in rows if r["kind"] == "update"]
    sess = {r["policy"]: r for r in rows if r["kind"] == "session"}
    prof = {r["policy"]: r for r in rows if r["kind"] == "attention_session"}
    head = f"{result['shape']}, {result['layers']} layer(s), float32, CPU"
    # a row of checkpoint panels and a row of session panels; a run without one of them gets no empty row
    top, bottom = bool(upd), bool(sess) or set(LAYOUT_TRIO) <= set(prof)
    nrows = max(int(top) + int(bottom), 1)
    fig, grid = plt.subplots(nrows, 3, figsize=(19, 5.25 * nrows), squeeze=False)
    axes = {0: grid[0], 1: grid[nrows - 1]}

    if upd:
        _checkpoint_panel(axes[0][0], upd, "update_cpu_ms", f"(a) update latency, CPU time ({head})",
                          "ms per update (median)")
        _checkpoint_panel(axes[0][1], upd, "attention_cpu_ms", "(b) attention time, profiled apart (CPU time)",
                          "ms per update, all layers")
        for r in upd:  # the FLOP-count limit next to OmniTide's measured speedup
            if r["policy"] == "omnitide" and "flop_limit" in r:
                axes[0][0].annotate(f"{r['cpu_speedup']:.2f}x / limit {r['flop_limit']:.2f}x",
                                    (r["checkpoint"], r["update_cpu_ms"]), fontsize=7, color=COLORS["omnitide"],
                                    textcoords="offset points", xytext=(-10, -12))
                axes[0][1].annotate(f"{r['attention_cpu_speedup']:.1f}x / {r['key_limit']:.1f}x",
                                    (r["checkpoint"], r["attention_cpu_ms"]), fontsize=7,
                                    color=COLORS["omnitide"], textcoords="offset points", xytext=(-10, -12))

        ax = axes[0][2]
        last = max(r["checkpoint"] for r in upd)
        names = [n for n in ("fifo", "token", "streamingllm", "h2o", "omnipick", "omnitide", "eager", "mlx_rotating")
                 if any(r["policy"] == n and r["checkpoint"] == last for r in upd)]
        if names:  # the KV layout of the retention policies (the full baseline alone has none to compare)
            at = {r["policy"]: r for r in upd if r["checkpoint"] == last}
            useful = np.array([at[n]["retained_cells"] for n in names])
            span = np.array([at[n]["physical_span"] for n in names])
            peak = np.array([at[n]["peak_span"] for n in names])
            x = np.arange(len(names))
            ax.bar(x, useful, color="#7f7f7f", label="useful cells")
            ax.bar(x, span - useful, bottom=useful, color=[COLORS[n] for n in names], alpha=0.6,
                   label="physical-span waste (holes)")
            for i in range(len(names)):
                ax.text(i, span[i], f"{span[i]}\n({span[i] / max(useful[i], 1):.2f}x)", ha="center", va="bottom",
                        fontsize=7)
            ax.plot(x, peak, "k-o", lw=1, ms=3, label="cumulative peak span")
            ax.set_ylim(0, max(peak.max(), span.max()) * 1.3)
            ax.set_xticks(x, names, rotation=30, fontsize=8)
            ax.set_ylabel("KV cells after the update")
            ax.set_title(f"(c) KV layout at the {last}-token checkpoint", fontsize=10)
            ax.legend(fontsize=7, loc="upper left")
        else:
            ax.set_axis_off()

    if bottom:
        _session_row(axes[1], result, sess, prof)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _session_row(row, result: dict, sess: dict, prof: dict) -> None:
    """Panels (d)-(f): quality against session time, attention under identical retention, memory per update."""
    ax = row[0]
    acc = PAPER_ACCURACY.get(result["shape"], {})
    if sess:
        lo = min(acc.values()) - 4 if acc else 40
        for name, r in sess.items():
            y = acc.get(name)
            ax.scatter(r["session_cpu_s"], y if y is not None else lo, color=_color(name), s=40,
                       marker="o" if y is not None else "x")
            ax.annotate(name, (r["session_cpu_s"], y if y is not None else lo), fontsize=7,
                        textcoords="offset points", xytext=(4, 3))
        ax.axhspan(lo - 1.5, lo + 1.5, color="#eeeeee", zorder=0)
        ax.text(0.01, 0.02, "x: accuracy N/A (not in the paper's table 2)", transform=ax.transAxes, fontsize=7)
        if "full" in acc:
            ax.axhline(acc["full"], color="black", ls=":", lw=0.8)
        ax.invert_yaxis()
        ax.set_xlabel(f"session stream-loop CPU time, s ({next(iter(sess.values()))['units']} s of stream)")
        ax.set_ylabel("StreamingBench accuracy % (paper table 2, not measured here)")
        ax.set_title("(d) quality-efficiency (lower left is better)", fontsize=10)
        ax.grid(alpha=0.3)
    else:
        ax.set_visible(False)

    ax = row[1]
    if set(LAYOUT_TRIO) <= set(prof):
        for name in LAYOUT_TRIO:
            ser = prof[name]["series"]
            mig = np.array([e["migration_ms"] for e in ser]) if name == "omnitide" else 0.0
            pre = np.array([e["prefill_attention_ms"] for e in ser]) + mig
            dec = np.array([e["decode_attention_ms"] for e in ser])
            ev = [e["event"] + 1 for e in ser]
            ax.plot(ev, pre / 1000, "-", color=COLORS[name], label=f"prefill: {LAYOUT_LABEL[name]}")
            ax.plot(ev, dec / 1000, ":", color=COLORS[name], label="decode")
        g = result.get("goals", {}).get("omnipage_share_session", {})
        if g:
            pre = g["prefill"]
            text = (f"OmniPage share of eager's prefill gain: {pre['share']} (goal {g['goal']}); decode "
                    f"{g['decode']['share']}" if g.get("applicable") else
                    f"no gain to capture: eager visits {100 * (pre['eager_key_reduction'] or 0):.1f} % fewer prefill "
                    "keys than native")
            ax.text(0.02, 0.97, text, transform=ax.transAxes, fontsize=8, va="top")
        ax.set_xlabel("session event")
        ax.set_ylabel("cumulative attention time, s")
        ax.set_title("(e) attention under identical retention (OmniPick)", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="center left")
    else:
        ax.set_visible(False)

    ax = row[2]
    if sess:
        for name, r in sess.items():
            media = [e for e in r["series"] if e["kind"] == "media"]
            ax.plot([e["full_context_tokens"] for e in media], [e["peak_memory_bytes"] / 1e6 for e in media],
                    _style(name), marker=".", color=_color(name), label=name, lw=1.0)
        ax.set_xlabel("no-slide history (tokens)")
        ax.set_ylabel("peak memory of the update, MB (weights + KV + transient)")
        ax.set_title("(f) memory per update over the session", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    else:
        ax.set_visible(False)
