"""The ``omnitide`` command, in the style of mlx-lm: one module per subcommand under ``commands/``.

Each command module provides ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``; heavy
imports stay inside ``run`` so that ``omnitide --help`` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings

# name -> module; a module is listed here once its command works
COMMANDS: dict[str, str] = {
    "bench": "omnitide_mlx.commands.bench",
    "convert": "omnitide_mlx.commands.convert",
    "doctor": "omnitide_mlx.commands.doctor",
    "duplex": "omnitide_mlx.commands.duplex",
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
    show = warnings.showwarning
    warnings.showwarning = _own_warnings_as_messages(f"omnitide {args.command}", show)
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        warnings.showwarning = show


def _own_warnings_as_messages(prog: str, show):
    """A ``warnings.showwarning`` that prints this package's own warnings (RetentionWarning, KernelFallbackWarning,
    ...) as ``<prog>: warning: <message>``: they point at their caller's line, which for a command is runpy's
    (``<frozen runpy>:88: RetentionWarning: ...``). Other warnings go to ``show`` unchanged."""

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if not category.__module__.startswith("omnitide_mlx"):
            return show(message, category, filename, lineno, file, line)
        print(f"{prog}: warning: {message}", file=file if file is not None else sys.stderr, flush=True)

    return showwarning


if __name__ == "__main__":
    sys.exit(main())
