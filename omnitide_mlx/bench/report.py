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
