"""The figure of ``omnitide simulate --plot``: drawn from the simulator's result JSON (``SimResult.to_json()``), so
the pure core (``core/sim.py``) never imports matplotlib. matplotlib is imported inside the function (the ``plot``
extra)."""

from __future__ import annotations

import numpy as np

_COLORS = {"native": "#c0504d", "omnipage": "#4f81bd", "eager": "#9bbb59"}


def plot_result(result: dict, path: str) -> None:
    """Span against useful cells over time per layout (paper figure 8), active pages over time (what a
    tile-skipping kernel reads), final useful / waste bars with the peak span (figure 12), and cells moved."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = result["layouts"]
    fig, axes = plt.subplots(2, 2, figsize=(15, 9), gridspec_kw={"width_ratios": [2.2, 1]})
    first = next(iter(layouts.values()))["series"]
    ax = axes[0, 0]
    ax.plot([r["t"] for r in first], [r["retained_cells"] for r in first], color="black", lw=1.0, ls="--",
            label="retained (useful) cells")
    for name, lay in layouts.items():
        ser = lay["series"]
        ax.plot([r["t"] for r in ser], [r["physical_span"] for r in ser], color=_COLORS.get(name), lw=1.1,
                label=f"{name}{'' if lay['migration'] == name else ' (' + lay['migration'] + ')'}: physical span, "
                      f"mean {lay['mean']['physical_span']:.0f}")
    ax.set_ylabel("KV slots after each update")
    ax.set_title(f"{result['profile']} / {result['policy']}: physical span vs useful cells")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)

    ax = axes[1, 0]
    for name, lay in layouts.items():
        ser = lay["series"]
        ax.plot([r["t"] for r in ser], [r["active_pages"] for r in ser], color=_COLORS.get(name), lw=1.1,
                label=f"{name}: mean {lay['mean']['active_pages']:.1f}")
    ax.set_xlabel("stream time (s)")
    ax.set_ylabel(f"active {result.get('page_size', 64)}-slot pages")
    ax.set_title("tiles a tile-skipping kernel reads")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)

    ax = axes[0, 1]
    names = list(layouts)
    useful = [layouts[n]["final"]["retained_cells"] for n in names]
    span = [layouts[n]["final"]["physical_span"] for n in names]
    waste = [sp - u for sp, u in zip(span, useful)]
    peak = [layouts[n]["peak"]["peak_span"] for n in names]
    x = np.arange(len(names))
    ax.bar(x, useful, color="#7f7f7f", label="useful cells")
    ax.bar(x, waste, bottom=useful, color=[_COLORS.get(n, "#999") for n in names], alpha=0.6,
           label="span waste (holes)")
    for i, (sp, u) in enumerate(zip(span, useful)):
        ax.text(i, sp, f"{sp}\n({sp / max(u, 1):.2f}x)", ha="center", va="bottom", fontsize=8)
    ax.plot(x, peak, "k-o", lw=1, ms=4, label="cumulative peak span")
    top = max(peak + span) * 1.3
    ax.set_ylim(0, top)
    ax.set_xticks(x, names)
    ax.set_ylabel("KV slots")
    ax.set_title(f"final layout (t = {first[-1]['t']:.0f} s)")
    ax.legend(fontsize=8, loc="upper right")

    ax = axes[1, 1]
    for name, lay in layouts.items():
        ser = lay["series"]
        ax.plot([r["t"] for r in ser], [r["moved_cells_total"] for r in ser], color=_COLORS.get(name), lw=1.3,
                label=f"{name}: {lay['moved_cells_total']} cells")
    ax.set_xlabel("stream time (s)")
    ax.set_ylabel("cells moved (cumulative)")
    ax.set_title("migration cost")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
