"""KV held in a simulated long Qwen2.5-Omni-7B stream at float16, 8-bit and 4-bit KV (issue 16's memory goal).

The core simulator streams the profile's units (no model) under OmniTide (OmniPick + OmniPage, watermarks 2500 /
1800) until the no-slide history reaches ``--tokens``; the page table is then read three ways (retained cells,
slots in active pages, allocated capacity) and priced at each precision's bytes per token, scales and biases
included (omnitide_mlx/bench/kv_quant.py). Both media settings: the paper's (2,333-token units) and the default
(official long-video processing). Usage (docs/benchmarks.md, Quantised KV):

    python scripts/kv_quant_held.py --tokens 220000 --json docs/img/kv-quant-held-qwen2.5-omni-7b-220k.json
"""

import argparse
import json
import sys

from omnitide_mlx.bench.kv_quant import kv_held
from omnitide_mlx.models.stream_units import resolve_profile

PRECISIONS = [(None, None), (8, 64), (4, 64), (4, 128), (4, 32)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="qwen2.5-omni-7b")
    p.add_argument("--tokens", type=int, default=220000)
    p.add_argument("--high", type=int, default=2500)
    p.add_argument("--low", type=int, default=1800)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    out = {}
    for preset in ("paper", "default"):
        held = kv_held(resolve_profile(a.profile, preset), a.tokens, PRECISIONS, high=a.high, low=a.low)
        out[preset] = dict(held, preset=preset)
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
