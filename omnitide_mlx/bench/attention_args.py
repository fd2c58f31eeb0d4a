"""``omnitide bench attention``: dense full-context attention against tile-skip attention over the KV layouts that
OmniPick + native / OmniPage / eager produce at no-slide checkpoints (paper 7.1: 4K-64K history tokens).

For each checkpoint the core simulator streams the model profile's units (one a second, paper table 1) until the
no-slide history reaches it; the three layouts follow the same retention plans. Then, for one layer of the model's
real attention shape, in one process:

- prefill: the next unit (the profile's unit size) is allocated into each layout and attends over the active
  64-slot pages; "full" attends the same chunk over the whole no-slide history (causal inside the chunk);
- decode: one token allocated into each layout attends over the active 32-slot subblocks; "full" over the history.

Dense "full" is the faster of two measured formulations: the reference kernel on a contiguous layout (one slice,
causal block skipping) and ``mx.fast.scaled_dot_product_attention`` (query blocks, bottom-right causal mask).
The *limit* of a row is the speedup skipping allows: keys a query visits under dense attention over keys in the
active tiles; prefill counts the chunk's own causal keys, (T + 1) / 2 per query on average, on both sides.
OmniPage rows also carry migration time: the layout's latest migration before the checkpoint, executed with the
cache's real ``migrate`` on one layer, times the layout's migrations per update so far (its mean cost per update).
The prefill figure with it added is what the OmniPage goal uses (one migration check per update, after its
prefill; decode steps run between migrations and pay none).
"""
# This module is the command's help and flags, apart from the benchmark (bench/attention.py for MLX, torch/bench.py
# for PyTorch) because it imports no array framework: ``omnitide bench attention --backend torch`` loads no MLX.

from __future__ import annotations

import argparse

from ..models.family import profiles
from . import HELP as _LISTING

HELP = _LISTING["attention"]
DESCRIPTION = __doc__.split("\n\n", 1)[1] + """
example:
  omnitide bench attention --shape qwen2.5-omni-7b --history 4096,8192,16384,32768,65536 \\
      --json out.json --plot out.png
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", default="qwen2.5-omni-7b", choices=sorted(profiles()),
                   help="model profile: attention shape, unit size, token rates (default qwen2.5-omni-7b)")
    from ..commands.options import add_media_arguments

    add_media_arguments(p)
    p.add_argument("--history", default="4096,8192,16384,32768,65536",
                   help="comma-separated no-slide checkpoints in tokens (default 4096,...,65536)")
    p.add_argument("--policy", default="omnipick", help="retention policy for the layouts (default omnipick)")
    p.add_argument("--high", type=int, default=None, help="high watermark (default: the profile's)")
    p.add_argument("--low", type=int, default=None, help="low watermark (default: the profile's)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                   help="K/V and query dtype (default float32: on the CPU only float32 matmul uses BLAS)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per row (default: by duration)")
    p.add_argument("--sdpa-max-history", type=int, default=16384,
                   help="also time mx.fast SDPA for dense prefill up to this history (it is always timed for decode)")
    p.add_argument("--path", choices=["auto", "reference", "vector", "gather", "dense"], default="auto",
                   help="MLX: the tile-skip rows' attention path; auto (default) = the dispatcher's choice "
                        "(reference off Metal), else forced (vector: the Metal kernel; gather / dense: fused SDPA)")
    p.add_argument("--kv-bits", type=int, choices=[4, 8], default=None,
                   help="also time every tile-skip row on K/V quantised to this many bits (side by side), and report "
                        "KV bytes per token and the KV a long simulated stream holds")
    p.add_argument("--kv-group-size", type=int, choices=[32, 64, 128], default=64, help="with --kv-bits (default 64)")
    p.add_argument("--kv-held-tokens", type=int, default=220000,
                   help="with --kv-bits: the simulated stream's length for the KV-held figures (0: skip)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", default=None, help="write the result JSON here")
    p.add_argument("--plot", default=None, help="write a PNG plot here (needs matplotlib)")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")

