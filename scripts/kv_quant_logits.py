"""Logit deviation of a quantised KV cache against the float cache on one model (issue 16).

Streams the first seconds of the bundled clip through OmniSessions that differ only in their KV cache (float, 8-bit,
4-bit, 4-bit with the sinks in full precision), with low watermarks so that evictions and migrations happen, and
compares the logits each update ends on with the float cache's. Usage (docs/benchmarks.md, Quantised KV):

    python scripts/make_tiny_checkpoints.py ...   # or any local checkpoint whose head_dim the group divides
    python scripts/kv_quant_logits.py MODEL [--units 8] [--group 32] [--high 200 --low 120] [--json out.json]
"""

import argparse
import json
import sys

import mlx.core as mx
import numpy as np

from omnitide_mlx.media import iter_chunks
from omnitide_mlx.models import load
from omnitide_mlx.session import OmniSession


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--video", default="assets/media/video_10s_av.mp4")
    p.add_argument("--units", type=int, default=8)
    p.add_argument("--group", type=int, default=32)
    p.add_argument("--high", type=int, default=200)
    p.add_argument("--low", type=int, default=120)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    model, proc = load(a.model)
    chunks = list(iter_chunks(a.video, None))[: a.units]
    configs = [{}, dict(kv_bits=8, kv_group_size=a.group), dict(kv_bits=4, kv_group_size=a.group),
               dict(kv_bits=4, kv_group_size=a.group, kv_keep_sinks_full=True)]
    runs = []
    for cfg in configs:
        s = OmniSession((model, proc), policy="omnitide", high=a.high, low=a.low, **cfg)
        per = []
        for c in chunks:
            s.push(frame=c.frame, audio=c.audio, t=c.t)
            s.flush()
            per.append(np.array(s._last_logits.astype(mx.float32)))
        st = s.stats()
        runs.append((cfg, per, st["evictions"], st["kv_bytes_per_token"]))
    ref = runs[0][1]
    rows = []
    for cfg, per, ev, bpt in runs:
        d = [float(np.abs(x - y).max()) for x, y in zip(per, ref)]
        rows.append({"config": cfg or {"kv_bits": None}, "evictions": ev, "kv_bytes_per_token": bpt,
                     "max_abs_logit_diff": round(max(d), 5), "mean_max_abs_logit_diff": round(float(np.mean(d)), 5),
                     "top1_agreement": float(np.mean([x.argmax() == y.argmax() for x, y in zip(per, ref)]))})
    out = {"model": a.model, "units": len(chunks), "high": a.high, "low": a.low,
           "max_abs_logit": round(max(float(np.abs(y).max()) for y in ref), 4), "rows": rows}
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
