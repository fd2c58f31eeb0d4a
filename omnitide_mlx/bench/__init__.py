"""Benchmarks behind ``omnitide bench <name>``: one module each (attention, stream), sharing common.py.

A benchmark module provides ``HELP``, optionally ``DESCRIPTION``, ``add_arguments(parser)`` and ``run(args)``.
"""

BENCHMARKS: dict[str, str] = {
    "attention": "omnitide_mlx.bench.attention",
    "stream": "omnitide_mlx.bench.stream",
}
