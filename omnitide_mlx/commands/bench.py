"""``omnitide bench <benchmark>``: the benchmarks registered in ``omnitide_mlx.bench.BENCHMARKS``.

Benchmark modules are imported only when ``omnitide bench`` itself is chosen, so ``omnitide --help`` stays instant.
"""

from __future__ import annotations

import argparse
import importlib

HELP = ("benchmarks: 'attention' (dense vs tile-skip attention on the OmniPick layouts), 'stream' (the stream loop "
        "on shape-true models, every policy and mlx-lm's caches)")
DESCRIPTION = """Run a benchmark; each writes JSON (--json) and a plot (--plot).

example:
  omnitide bench attention --shape qwen2.5-omni-7b --history 4096,8192,16384,32768,65536 --json out.json --plot out.png
  omnitide bench attention --backend torch --device cuda --dtype float16 --history 4096,8192,16384,32768 --json t.json
  omnitide bench stream --shape qwen2.5-omni-3b --checkpoints 4096,8192,16384,32768 --json out.json --plot out.png
"""


# benchmarks with a PyTorch version (``--backend torch``); it reads the same flags plus ``--device``
TORCH_BENCHMARKS: dict[str, str] = {"attention": "omnitide_mlx.torch.bench"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from omnitide_mlx.bench import BENCHMARKS

    sub = p.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    for name, module in BENCHMARKS.items():
        mod = importlib.import_module(module)
        bp = sub.add_parser(name, help=mod.HELP, description=getattr(mod, "DESCRIPTION", mod.HELP),
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(bp)
        if name in TORCH_BENCHMARKS:
            bp.add_argument("--backend", choices=["mlx", "torch"], default="mlx",
                            help="mlx (default) or torch (PyTorch: flex / SDPA kernels; needs the torch extra)")
            bp.add_argument("--device", default=None, help="torch backend: cuda, cuda:N or cpu")
        bp.set_defaults(_bench_run=mod.run, _bench_name=name)
    p.set_defaults(_bench_parser=p)


def run(args: argparse.Namespace) -> int:
    if not getattr(args, "_bench_run", None):
        args._bench_parser.print_help()
        return 2
    if getattr(args, "backend", "mlx") == "torch":
        return int(importlib.import_module(TORCH_BENCHMARKS[args._bench_name]).run(args) or 0)
    if getattr(args, "device", None):
        args._bench_parser.error("--device applies to --backend torch")
    return int(args._bench_run(args) or 0)
