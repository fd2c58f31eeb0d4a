"""Writing a benchmark's result where its command line asked (imports no array framework: the torch bench uses it)."""

from __future__ import annotations

import json
from typing import Callable


def write_outputs(result: dict, args, *, markdown: Callable[[dict], str],
                  plot: Callable[[dict, str], None] | None = None) -> None:
    """``--json`` (the whole result), ``--plot`` (where the benchmark has one) and ``--markdown`` (printed)."""
    if getattr(args, "json_path", None):
        with open(args.json_path, "w") as fh:
            json.dump(result, fh, indent=1)
    if plot is not None and getattr(args, "plot", None):
        plot(result, args.plot)
    if getattr(args, "markdown", False):
        print(markdown(result))


def bar_plot(result: dict, rows: list[tuple[str, str, bool]], title: str, path: str) -> None:
    """One bar chart per measure (MLX, and PyTorch where it ran): the speech benches' figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(3.2 * len(rows), 3.2))
    for ax, (label, key, higher) in zip(axes, rows):
        names = ["MLX"] + (["PyTorch"] if "torch" in result else [])
        vals = [result["mlx"][key]] + ([result["torch"][key]] if "torch" in result else [])
        ax.bar(names, vals, color=["#2a7", "#c55"][:len(vals)])
        ax.set_title(label + (" (higher is better)" if higher else " (lower is better)"), fontsize=8)
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:g}", ha="center", va="bottom", fontsize=8)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
