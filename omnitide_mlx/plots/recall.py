"""The recall study's figure: accuracy per policy at each watermark pair, and accuracy by delay (how many units
after the fact was stated it was asked about), from a study's ``results.json`` (docs/quality.md section 3)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["plot_recall"]


def _rate(pair) -> float:
    correct, n = pair
    return correct / n if n else float("nan")


def plot_recall(doc: dict, path: str | Path, title: str | None = None) -> bool:
    """Write the figure to ``path``; False where matplotlib is not installed (the JSON and table stay the record)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = doc["summary"]
    if not rows:
        raise ValueError("the study has no settings to plot")
    full = [r for r in rows if r["watermarks"] == "-"]
    marks = sorted({r["watermarks"] for r in rows if r["watermarks"] != "-"}, key=lambda m: -int(m.split("/")[0]))
    labels = list(dict.fromkeys(r["label"] for r in rows if r["watermarks"] != "-"))
    delays = sorted({int(d) for r in rows for d in r["by_delay"]})
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.6))
    width = 0.8 / max(1, len(marks))
    for j, mk in enumerate(marks):
        ys = []
        for lab in labels:
            r = next((r for r in rows if r["label"] == lab and r["watermarks"] == mk), None)
            ys.append(_rate((r["correct"], r["questions"])) if r else float("nan"))
        xs = [i + (j - (len(marks) - 1) / 2) * width for i in range(len(labels))]
        bars = ax.bar(xs, [100 * y for y in ys], width, label=f"watermarks {mk}", color=f"C{j}")
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    for r in full:
        ax.axhline(100 * _rate((r["correct"], r["questions"])), color="k", lw=1, ls="--",
                   label=f"{r['label']} (full context)")
    ax.set_xticks(range(len(labels)), labels, rotation=20, fontsize=8)
    ax.set_ylabel("questions answered correctly (%)")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    styles = {m: s for m, s in zip(marks, ("-", "--", ":", "-."))}
    for i, lab in enumerate(labels):
        for mk in marks:
            r = next((r for r in rows if r["label"] == lab and r["watermarks"] == mk), None)
            if r is None:
                continue
            ys = [100 * _rate(r["by_delay"].get(str(d), r["by_delay"].get(d, (0, 0)))) for d in delays]
            bx.plot(delays, ys, styles[mk], marker="o", ms=3, color=f"C{i}", label=f"{lab} {mk}")
    for r in full:
        ys = [100 * _rate(r["by_delay"].get(str(d), r["by_delay"].get(d, (0, 0)))) for d in delays]
        bx.plot(delays, ys, "-", marker="s", ms=3, color="k", label=r["label"])
    bx.set_xticks(delays)
    bx.set_xlabel("delay (units between the fact and the question)")
    bx.set_ylabel("correct (%)")
    bx.set_ylim(0, 100)
    bx.grid(alpha=0.3)
    bx.legend(fontsize=6, ncol=2)
    cfg = doc.get("config", {})
    fig.suptitle(title or (f"Recall on SmolLM2-135M-Instruct: style {cfg.get('style', 'log')}"
                           f"{', question + reply before each probe' if cfg.get('qa') else ''}, seed "
                           f"{cfg.get('seed')}, {cfg.get('episodes')} episodes"), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
