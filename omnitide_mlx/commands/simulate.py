"""``omnitide simulate``: run a retention policy over a synthetic unit stream with the native, OmniPage and eager
KV layouts side by side, with no model, and report span, active tiles and cells moved."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HELP = "simulate OmniPick retention and KV layouts (native / OmniPage / eager) on a synthetic stream, no model"
DESCRIPTION = """Simulate a stream of one unit a second (a 1344x1344 frame plus a second of audio at the model's token
counts, paper table 1) with a question and a reply every N seconds. The policy trims the history above the high
watermark; the native, OmniPage and eager layouts follow the same plans side by side. Writes per-update records
(retained cells, physical span, active pages and subblocks, holes, cells moved, peak span, KV bytes) as JSON and
a plot like paper figures 8 and 12.

examples:
  omnitide simulate --profile qwen2.5-omni-7b --seconds 240 --json out.json --plot out.png
  omnitide simulate --profile minicpm-o-4.5 --seconds 86400 --series-every 60 --json day.json
  omnitide simulate --profile qwen2.5-omni-7b --policy streamingllm --migration ordered_suffix
"""

from ..core.layout import OMNIPAGE_MIGRATIONS
from .options import (POLICIES, UsageError, add_progress_argument, check_output_file, check_plot_file,  # noqa: F401
                      non_negative_int, positive_int)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from omnitide_mlx.models.family import profiles  # light: the family records, pure Python + numpy

    p.add_argument("--profile", default="qwen2.5-omni-7b", choices=sorted(profiles()),
                   help="model profile: token rates, unit layout, KV shape (default qwen2.5-omni-7b)")
    p.add_argument("--seconds", type=positive_int, default=240, help="stream length in seconds (default 240)")
    p.add_argument("--policy", choices=POLICIES, default="omnitide", help="retention policy (default omnitide)")
    p.add_argument("--high", type=positive_int, default=None,
                   help="high watermark in tokens (default: the profile's, paper figure 14: Qwen2.5-Omni-3B 5000, "
                        "7B 8000, MiniCPM-o 2500)")
    p.add_argument("--low", type=positive_int, default=None,
                   help="low watermark in tokens (default: the profile's: 3500 / 6000 / 1800)")
    p.add_argument("--recent-units", type=non_negative_int, default=None, help="OmniPick: newest units kept whole")
    p.add_argument("--image-sink", type=non_negative_int, default=None, help="OmniPick: sink prefix of older image spans")
    p.add_argument("--audio-sink", type=non_negative_int, default=None, help="OmniPick: sink prefix of older audio spans")
    p.add_argument("--slice-sink", type=non_negative_int, default=None, help="OmniPick: sink prefix of older image slices")
    p.add_argument("--text-budget", type=non_negative_int, default=None, help="OmniPick: shared budget for older text/replies")
    p.add_argument("--recent-count", choices=["media", "all"], default=None,
                   help="OmniPick: what --recent-units counts: media units, with the questions and replies after "
                        "them kept whole too (default), or every unit (the rule before issue 12)")
    p.add_argument("--leftover", default=None, metavar="KINDS",
                   help="OmniPick: give the budget left under --low to older units' spans of these kinds, in order "
                        "(e.g. audio+text; kinds: audio, text, image, slice; default off: the paper's section 5.1 "
                        "steps)")
    from .options import add_media_arguments

    add_media_arguments(p)
    p.add_argument("--migration", choices=list(OMNIPAGE_MIGRATIONS), default=OMNIPAGE_MIGRATIONS[0],
                   help="OmniPage migration: class_aware (tile-skipping kernels, the MLX path; default) or "
                        "ordered_suffix (span-traversing kernels)")
    p.add_argument("--tail-fill", choices=["on", "off"], default="on",
                   help="class_aware: also move the last pages' entries down into free slots when that shortens "
                        "the span by --min-gain-pages (on, our extension; off: the paper's letter)")
    p.add_argument("--min-gain-pages", type=positive_int, default=1,
                   help="ordered_suffix and tail fill: least span gain in pages (1)")
    p.add_argument("--page-size", type=positive_int, default=64, help="slots per page = attention tile (default 64)")
    p.add_argument("--subblock-size", type=positive_int, default=32, help="slots per subblock = decode tile (default 32)")
    p.add_argument("--question-every", type=non_negative_int, default=30,
                   help="a question and a reply every N seconds; 0 = never (default 30)")
    p.add_argument("--seed", type=int, default=0, help="stream seed: question and reply lengths (default 0)")
    p.add_argument("--series-every", type=positive_int, default=None,
                   help="keep every Nth update in the JSON series (default: all, or about 5000 points)")
    p.add_argument("--json", dest="json_path", default=None, help="write the result JSON here")
    p.add_argument("--plot", default=None, help="write the plot (PNG) here")
    add_progress_argument(p)
    p.add_argument("--check", action="store_true", help="validate every page table against the history each update")


def run(args: argparse.Namespace) -> int:
    from omnitide_mlx.core.page import LayoutError
    from omnitide_mlx.core.pick import RetentionError, make_policy
    from omnitide_mlx.core.profiles import ProfileError, StreamSpec
    from omnitide_mlx.core.sim import SimError, Simulator
    from omnitide_mlx.core.stream_units import watermark_guard
    from omnitide_mlx.models.stream_units import resolve_profile
    from omnitide_mlx.plots.simulate import plot_result

    from .options import UsageError, media_setting

    try:  # unusable output paths fail before the simulation, not after it
        check_output_file(args.json_path, "--json")
        check_plot_file(args.plot, "--plot")
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        profile = resolve_profile(args.profile, media_setting(args))
        kw = {k: v for k, v in (("high", args.high), ("low", args.low), ("recent_units", args.recent_units),
                                ("image_sink", args.image_sink), ("audio_sink", args.audio_sink),
                                ("slice_sink", args.slice_sink), ("text_budget", args.text_budget),
                                ("recent_count", args.recent_count), ("leftover", args.leftover))
              if v is not None}
        if "high" in kw and "low" not in kw:
            kw["low"] = min(kw["high"], profile.low)
        if "low" in kw and "high" not in kw:
            kw["high"] = max(kw["low"], profile.high)
        knobs = {"recent_units", "image_sink", "audio_sink", "slice_sink", "text_budget", "recent_count", "leftover"}
        if args.policy not in ("omnitide", "omnipick", "eager") and knobs & set(kw):
            print(f"error: {sorted(knobs & set(kw))} apply to omnipick / omnitide / eager only", file=sys.stderr)
            return 2
        policy = make_policy(args.policy, profile=profile, **kw)
        stream = StreamSpec(args.seconds, question_every=args.question_every, seed=args.seed)
        sim = Simulator(profile, policy, stream, migration=args.migration, page_size=args.page_size,
                        subblock_size=args.subblock_size, min_gain_pages=args.min_gain_pages, check=args.check,
                        tail_fill=args.tail_fill == "on")
    except (RetentionError, ProfileError, SimError, LayoutError, UsageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if hasattr(policy, "recent_units"):
        warning = watermark_guard(low=policy.low, system_tokens=profile.system_tokens,
                                  unit_tokens=profile.media_unit_tokens, recent_units=policy.recent_units,
                                  high=policy.high)
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
    n_updates = args.seconds + (2 * (args.seconds // args.question_every) if args.question_every else 0)
    every = args.series_every if args.series_every is not None else max(1, n_updates // 5000)
    progress = not args.no_progress and n_updates >= 2000
    result = sim.run(progress=progress, series_every=every).to_json()
    result["series_every"] = every

    lay = result["layouts"]
    kinds = ", ".join(f"{k} {n}" for k, n in profile.tokens_by_kind().items())
    print(f"{profile.display} at the {profile.units.setting.name} setting: {profile.media_unit_tokens} tokens a unit "
          f"({kinds})")
    print(f"{profile.display}, policy {result['policy']} (high {policy.high} / low {policy.low}), "
          f"{args.seconds} s, {result['updates']} updates, {result['trims']} trims, "
          f"{result['full_context_tokens']} tokens streamed, KV {profile.kv_bytes_per_token} B/token")
    print(f"{'layout':10} {'retained':>9} {'span':>7} {'pages':>6} {'subblk':>7} {'holes':>6} {'peak span':>10} "
          f"{'moved cells':>12} {'KV MiB':>8}")
    for name, d in lay.items():
        f = d["final"]
        print(f"{name:10} {f['retained_cells']:9d} {f['physical_span']:7d} {f['active_pages']:6d} "
              f"{f['active_subblocks']:7d} {f['holes']:6d} {d['peak']['peak_span']:10d} "
              f"{d['moved_cells_total']:12d} {f['kv_bytes'] / 2**20:8.1f}")
    steady = {n: d["after_first_trim"] for n, d in lay.items() if d["after_first_trim"]["updates"]}
    if steady:
        print(f"after the first trim ({next(iter(steady.values()))['updates']} updates): time-averaged / p95")
        print(f"{'layout':10} {'span':>15} {'pages':>13} {'subblocks':>13}")
        for name, st in steady.items():
            m, p = st["mean"], st["p95"]
            print(f"{name:10} {m['physical_span']:8.1f} / {p['physical_span']:<6.0f}{m['active_pages']:7.1f} / "
                  f"{p['active_pages']:<5.0f}{m['active_subblocks']:7.1f} / {p['active_subblocks']:<5.0f}")
    if "native" in lay and "omnipage" in lay and lay["native"]["final"]["physical_span"]:
        r = lay["omnipage"]["final"]["physical_span"] / lay["native"]["final"]["physical_span"]
        mode = lay["omnipage"]["migration"] + (", tail fill" if lay["omnipage"].get("tail_fill") else "")
        line = f"OmniPage ({mode}) final span = {r:.3f} x native"
        if "native" in steady and "omnipage" in steady and steady["native"]["mean"]["physical_span"]:
            line += (f"; mean span after the first trim = "
                     f"{steady['omnipage']['mean']['physical_span'] / steady['native']['mean']['physical_span']:.3f}"
                     " x native")
        print(line)
        if all(n in steady for n in ("native", "omnipage", "eager")):
            shares = []
            for key in ("active_pages", "active_subblocks"):
                n, o, e = (steady[x]["mean"][key] for x in ("native", "omnipage", "eager"))
                shares.append(f"{(n - o) / (n - e):.1%}" if n - e > 0 else "n/a")
            print(f"OmniPage's share of eager's reduction (after the first trim): active pages {shares[0]}, "
                  f"subblocks {shares[1]}; cells moved {lay['omnipage']['moved_cells_total']} against eager's "
                  f"{lay['eager']['moved_cells_total']}")
    if args.json_path:
        path = Path(args.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
        print(f"wrote {path}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("error: --plot needs matplotlib (pip install 'omnitide-mlx[plot]')", file=sys.stderr)
            return 1
        path = Path(args.plot)
        path.parent.mkdir(parents=True, exist_ok=True)
        plot_result(result, str(path))
        print(f"wrote {path}")
    return 0
