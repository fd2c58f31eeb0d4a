"""``omnitide bench <benchmark>``: the benchmarks registered in ``omnitide_mlx.bench.BENCHMARKS``.

A benchmark's module is imported only when that benchmark is chosen: its flags are added to its subcommand just
before argparse parses them, and ``run`` imports the MLX or the torch benchmark. So ``omnitide --help`` stays
instant, and ``omnitide bench attention --backend torch`` (help included) never imports MLX: the attention flags
come from bench/attention_args.py, which imports no array framework.
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


class _Benchmarks(argparse._SubParsersAction):
    """The benchmark subcommands: a chosen benchmark's flags are added when argparse reaches its name."""

    def __call__(self, parser, namespace, values, option_string=None):
        if values and values[0] in self.choices:
            _add_flags(values[0], self.choices[values[0]])
        super().__call__(parser, namespace, values, option_string)


def _add_flags(name: str, bp: argparse.ArgumentParser) -> None:
    """The benchmark's description and flags (from ``bench.ARGUMENTS`` when listed there, else its module)."""
    from omnitide_mlx.bench import ARGUMENTS, BENCHMARKS

    if getattr(bp, "_benchmark_flags", False):
        return
    mod = importlib.import_module(ARGUMENTS.get(name, BENCHMARKS[name]))
    bp.description = getattr(mod, "DESCRIPTION", mod.HELP)
    mod.add_arguments(bp)
    if name in TORCH_BENCHMARKS:
        bp.add_argument("--backend", choices=["mlx", "torch"], default="mlx",
                        help="mlx (default) or torch (PyTorch: flex / SDPA kernels; needs the torch extra)")
        bp.add_argument("--device", default=None, help="torch backend: cuda, cuda:N or cpu")
    bp._benchmark_flags = True


def add_arguments(p: argparse.ArgumentParser) -> None:
    from omnitide_mlx.bench import BENCHMARKS, HELP as LISTING

    sub = p.add_subparsers(dest="benchmark", metavar="BENCHMARK", action=_Benchmarks)
    for name in BENCHMARKS:
        bp = sub.add_parser(name, help=LISTING[name], formatter_class=argparse.RawDescriptionHelpFormatter)
        bp.set_defaults(_bench_name=name)
    p.set_defaults(_bench_parser=p)


def run(args: argparse.Namespace) -> int:
    from omnitide_mlx.bench import BENCHMARKS

    from .options import UsageError, check_output_file, check_plot_file

    name = getattr(args, "_bench_name", None)
    if not name:
        args._bench_parser.print_help()
        return 2
    try:  # an unusable output path fails before the benchmark runs, not after
        check_output_file(getattr(args, "json_path", None), "--json")
        check_plot_file(getattr(args, "plot", None), "--plot")
    except UsageError as e:
        args._bench_parser.error(str(e))
    if getattr(args, "backend", "mlx") == "torch":
        return int(importlib.import_module(TORCH_BENCHMARKS[name]).run(args) or 0)
    if getattr(args, "device", None):
        args._bench_parser.error("--device applies to --backend torch")
    return int(importlib.import_module(BENCHMARKS[name]).run(args) or 0)
