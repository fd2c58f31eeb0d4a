"""The recall study over quantised KV against the float run, question by question (docs/quality.md, Quantised KV).

Reads finished ``omnitide eval study`` folders (the float baseline first) with the same episodes, seed and style,
and prints, per setting, each run's accuracy, top-1-of-vocabulary rate and the paired count against the baseline
(questions only the baseline got right / only the quantised run got right; two-sided sign test):

    python scripts/kv_quant_recall.py docs/quality-results/recall docs/quality-results/recall-kv8 \\
        docs/quality-results/recall-kv4 docs/quality-results/recall-kv4-sinks docs/quality-results/recall-kv4-g32
"""

import json
import sys
from pathlib import Path

from omnitide_mlx.eval.study import paired_counts, sign_test

SAME = ("model", "units", "facts", "seed", "delays", "sentences", "style", "qa")


def load(folder: Path) -> tuple[dict, dict]:
    results = json.loads((folder / "results.json").read_text())
    records = {}
    for s in results["summary"]:
        rows = [json.loads(line)["record"]["probes"] for line in (folder / s["setting"] / "items.jsonl").open()]
        records[s["setting"]] = [p for r in rows for p in r]
    return results, records


def kv_name(config: dict) -> str:
    if config.get("kv_bits") is None:
        return "float32 (model dtype)"
    name = f"{config['kv_bits']}-bit, group {config['kv_group_size']}"
    return name + (", sinks full" if config.get("kv_keep_sinks_full") else "")


def main(argv=None) -> int:
    folders = [Path(a) for a in (argv if argv is not None else sys.argv[1:])]
    if len(folders) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    runs = [load(f) for f in folders]
    base_cfg, base_rec = runs[0][0]["config"], runs[0][1]
    for f, (res, _) in zip(folders, runs):
        diff = [k for k in SAME if str(res["config"].get(k)).split("/")[-1] != str(base_cfg.get(k)).split("/")[-1]]
        if diff:
            print(f"{f}: config differs from the baseline in {diff}", file=sys.stderr)
            return 1
    print("| setting | run | KV | accuracy % | top-1 of vocab % | fact still cached % | vs the first run: only it "
          "right / only this right (p) |")
    print("|---|---|---|---|---|---|---|")
    settings = [s["setting"] for s in runs[0][0]["summary"]  # the settings every run has
                if all(any(x["setting"] == s["setting"] for x in res["summary"]) for res, _ in runs)]
    for setting in settings:
        for f, (res, rec) in zip(folders, runs):
            s = next((x for x in res["summary"] if x["setting"] == setting), None)
            if s is None:
                continue
            n = s["questions"]
            won, lost = paired_counts({"a": base_rec[setting], "b": rec[setting]}, "a", "b")
            pair = "-" if rec is base_rec else f"{won} / {lost} (p = {sign_test(won, lost):.2g})"
            print(f"| {setting} | {f.name} | {kv_name(res['config'])} | {100 * s['correct'] / n:.1f} ({s['correct']}/{n}) | "
                  f"{100 * s['exact'] / n:.1f} | {100 * s['retained'] / n:.1f} | {pair} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
