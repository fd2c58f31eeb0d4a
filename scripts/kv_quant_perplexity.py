"""The perplexity experiment over quantised KV against the float run, setting by setting (docs/quality.md, Quantised
KV). Reads finished ``omnitide eval study --experiment perplexity`` folders (the float run first) made with the same
tokens and watermarks, and prints each setting's NLL per token under each run and the change against the first:

    python scripts/kv_quant_perplexity.py docs/quality-results/perplexity-kvfloat docs/quality-results/perplexity-kv8 \\
        docs/quality-results/perplexity-kv4
"""

import json
import math
import sys
from pathlib import Path


def kv_name(config: dict) -> str:
    if config.get("kv_bits") is None:
        return "float32"
    return f"{config['kv_bits']}-bit g{config['kv_group_size']}" + (" sinks full" if config.get("kv_keep_sinks_full")
                                                                  else "")


def main(argv=None) -> int:
    folders = [Path(a) for a in (argv if argv is not None else sys.argv[1:])]
    if len(folders) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    docs = [json.loads((f / "results.json").read_text()) for f in folders]
    for f, d in zip(folders, docs):
        for k in ("tokens", "marks", "per_unit"):
            if d["config"].get(k) != docs[0]["config"].get(k):
                print(f"{f}: {k} differs from the first run", file=sys.stderr)
                return 1
    names = [kv_name(d["config"]) for d in docs]
    print("| setting | tokens scored | " + " | ".join(f"NLL {n}" for n in names) + " | "
          + " | ".join(f"change {n} (ppl x)" for n in names[1:]) + " |")
    print("|---|---|" + "---|" * (2 * len(names) - 1))
    for key, base in docs[0]["results"].items():
        if not all(key in d["results"] for d in docs):
            continue
        nll = [d["results"][key]["nll"] for d in docs]
        delta = [f"{x - nll[0]:+.4f} ({math.exp(x - nll[0]):.3f})" for x in nll[1:]]
        print(f"| {key} | {base['scored']} | " + " | ".join(f"{x:.4f}" for x in nll) + " | " + " | ".join(delta) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
