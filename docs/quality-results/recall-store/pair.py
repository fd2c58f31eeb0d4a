"""Paired sign tests of one setting against every other across run folders of the same episodes (same seed,
units and facts: the same questions): python pair.py SETTING FOLDER [FOLDER ...]"""
import json, sys, glob, os
from math import comb
def load(folder):
    out = {}
    for d in glob.glob(folder + "/*/items.jsonl"):
        key = os.path.basename(os.path.dirname(d))
        recs = []
        for line in open(d):
            recs += json.loads(line)["record"]["probes"]
        out[key] = {(r["episode"], r["fact_unit"], r["delay"]): r for r in recs}
    return out
def sign(w, l):
    n = w + l
    if not n: return 1.0
    return min(1.0, 2 * sum(comb(n, k) for k in range(min(w, l) + 1)) / 2 ** n)
a = sys.argv[1]
runs = {}
for f in sys.argv[2:]:
    runs.update(load(f))
for b in sorted(runs):
    if b == a: continue
    ra, rb = runs[a], runs[b]
    common = ra.keys() & rb.keys()
    w = sum(ra[k]["correct"] and not rb[k]["correct"] for k in common)
    l = sum(rb[k]["correct"] and not ra[k]["correct"] for k in common)
    acc = sum(rb[k]["correct"] for k in common) / len(common)
    print(f"{a} vs {b} ({acc:.1%}, n={len(common)}): +{w} / -{l} (p = {sign(w, l):.2g})")
r = runs[a]
print("mean recalled tokens", sum(x.get("recalled_tokens", 0) for x in r.values()) / len(r),
      "max", max(x.get("recalled_tokens", 0) for x in r.values()),
      "max cache+recalled", max(x["cache_tokens"] + x.get("recalled_tokens", 0) for x in r.values()))
