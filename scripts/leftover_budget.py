"""The leftover-budget rule measured in the simulator: mean retained tokens right after each trim, and what older
units keep by span kind at the end, with OmniPick's section 5.1 steps alone and with ``leftover="audio+text"``.

    PYTHONPATH=. .venv/bin/python scripts/leftover_budget.py > docs/img/leftover-budget.json

240 s streams, a question every 30 s, seed 0, each model's default watermarks, at the default and the paper setting.
"""

import argparse
import collections
import json
import platform
import sys

import numpy as np

from omnitide_mlx.commands.options import media_setting
from omnitide_mlx.core.pick import make_policy
from omnitide_mlx.core.profiles import StreamSpec
from omnitide_mlx.core.sim import Simulator
from omnitide_mlx.models.stream_units import resolve_profile


def measure(profile_name: str, preset: str | None, leftover: str | None) -> dict:
    prof = resolve_profile(profile_name, media_setting(argparse.Namespace(
        preset=preset, max_pixels=None, max_slice_nums=None, frame_size=None)))
    policy = make_policy("omnitide", profile=prof, leftover=leftover)
    sim = Simulator(prof, policy, StreamSpec(240, question_every=30, seed=0))
    res = sim.run(progress=False, series_every=1).to_json()
    after = [e["retained_cells"] for e in res["layouts"]["native"]["series"] if e["trimmed"]]  # right after trims
    newest = {u.uid for u in sim.history if u.kind.value != "system"}
    newest = set(sorted(newest)[-3:])
    kinds: collections.Counter = collections.Counter()
    for u in sim.history:
        if u.kind.value != "system" and u.uid not in newest:
            for s in u.spans:
                kinds[s.kind.value] += s.length
    return {"profile": profile_name, "setting": preset or "default", "leftover": leftover or "off",
            "high": policy.high, "low": policy.low, "tokens_per_unit": prof.media_unit_tokens, "trims": len(after),
            "mean_tokens_after_trim": round(float(np.mean(after)), 1) if after else None,
            "older_units_kept_by_kind_at_end": dict(kinds),
            "mean_retained_after_first_trim": res["layouts"]["native"]["after_first_trim"]["mean"]["retained_cells"],
            "mean_span_after_first_trim": {k: v["after_first_trim"]["mean"]["physical_span"]
                                           for k, v in res["layouts"].items()}}


def main() -> None:
    rows = [measure(p, s, lo) for s in (None, "paper") for p in ("qwen2.5-omni-3b", "qwen2.5-omni-7b", "minicpm-o-4.5")
            for lo in (None, "audio+text")]
    for r in rows:
        print(f"{r['profile']:<16} {r['setting']:<8} leftover={r['leftover']:<10} low {r['low']:>5}: "
              f"{r['mean_tokens_after_trim']} tokens after a trim", file=sys.stderr)
    print(json.dumps({"command": "PYTHONPATH=. .venv/bin/python scripts/leftover_budget.py",
                      "machine": f"{platform.machine()} {platform.system()}, python {platform.python_version()}",
                      "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
