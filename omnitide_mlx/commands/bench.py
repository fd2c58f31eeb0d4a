"""``omnitide bench <benchmark>``: the benchmarks registered in ``omnitide_mlx.bench.BENCHMARKS``.

Benchmark modules are imported only when ``omnitide bench`` itself is chosen, so ``omnitide --help`` stays instant.
"""

from __future__ import annotations

import argparse
import importlib

HELP = "benchmarks: 'attention' (dense vs tile-skip attention on the OmniPick layouts)"
DESCRIPTION = """Run a benchmark; each writes JSON (--json) and a plot (--plot).

example:
  omnitide bench attention --shape qwen2.5-omni-7b --history 4096,8192,16384,32768,65536 --json out.json --plot out.png
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from omnitide_mlx.bench import BENCHMARKS

    sub = p.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    for name, module in BENCHMARKS.items():
        mod = importlib.import_module(module)
        bp = sub.add_parser(name, help=mod.HELP, description=getattr(mod, "DESCRIPTION", mod.HELP),
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(bp)
        bp.set_defaults(_bench_run=mod.run)
    p.set_defaults(_bench_parser=p)


def run(args: argparse.Namespace) -> int:
    if not getattr(args, "_bench_run", None):
        args._bench_parser.print_help()
        return 2
    return int(args._bench_run(args) or 0)
