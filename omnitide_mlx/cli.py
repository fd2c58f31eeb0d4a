"""The ``omnitide`` command, in the style of mlx-lm: one module per subcommand under ``commands/``.

Each command module provides ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``; heavy
imports stay inside ``run`` so that ``omnitide --help`` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> module; a module is listed here once its command works
COMMANDS: dict[str, str] = {
    "bench": "omnitide_mlx.commands.bench",
    "convert": "omnitide_mlx.commands.convert",
    "doctor": "omnitide_mlx.commands.doctor",
    "eval": "omnitide_mlx.commands.eval",
    "generate": "omnitide_mlx.commands.generate",
    "serve": "omnitide_mlx.commands.serve",
    "simulate": "omnitide_mlx.commands.simulate",
    "stream": "omnitide_mlx.commands.stream",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omnitide",
        description="Streaming omni-modal inference on MLX with bounded KV memory (OmniPick + OmniPage).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in COMMANDS.items():
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=mod.HELP, description=getattr(mod, "DESCRIPTION", mod.HELP),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
