"""Run a benchmark under several retention settings, resumably, and write results and tables.

``<out>/run.json`` says what the run is (benchmark, model, data, prompt and sampling); each setting has a folder
``<out>/<setting key>/`` with ``items.jsonl`` (one line per finished video / event) and the benchmark's
official-format output. ``<out>/results.json`` and ``<out>/table.md`` summarise the settings of the last
invocation. Rerun the same command to resume: finished items are skipped; a new policy or watermark just adds a
folder.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import livesports, streamingbench, svbench
from .policies import PolicySetting
from .store import ItemLog, open_run
from .streams import check_videos

BENCHMARKS = {"streamingbench": streamingbench, "svbench": svbench, "livesports": livesports}
DEFAULT_MAX_TOKENS = {"streamingbench": 8, "svbench": 128, "livesports": 32}
LABELS = {"streamingbench": "StreamingBench %", "svbench": "SVBench", "livesports": "LiveSports-3K-CC"}


@dataclass
class RunOptions:
    benchmark: str
    model: str
    data: Path
    out: Path
    settings: list[PolicySetting]
    videos: Path | None = None
    tasks: list[str] | None = None  # StreamingBench task files (real, omni, sqa, proactive)
    system_prompt: str | None = None
    max_tokens: int | None = None
    interval: float = 5.0  # LiveSports: seconds between commentary steps
    limit: int | None = None  # first N items only (a smoke run; 0 checks the dataset and videos only)
    skip_missing: bool = False
    overwrite: bool = False
    model_name: str = "omnitide"  # the key StreamingBench's output stores answers under
    media: Any = None  # a core.stream_units.MediaSetting (--preset / --max-pixels / ...); None: the model's default
    extra: dict = field(default_factory=dict)

    def run_config(self) -> dict:
        """What must match for a rerun to resume into the same folder."""
        return {"kind": "benchmark", "benchmark": self.benchmark, "model": self.model, "data": str(self.data),
                "videos": str(self.videos) if self.videos else None, "tasks": self.tasks,
                "system_prompt": self.system_prompt, "max_tokens": self.tokens, "interval": self.interval,
                "model_name": self.model_name,
                **({"media": self.media.to_json()} if self.media is not None else {})}  # old folders stay valid

    @property
    def tokens(self) -> int:
        return self.max_tokens or DEFAULT_MAX_TOKENS[self.benchmark]


def load_items(opts: RunOptions, log: Callable[[str], None] = print) -> list:
    """The dataset's items with their videos checked (a missing dataset, file or video fails here, before any
    model is loaded)."""
    bench = BENCHMARKS[opts.benchmark]
    if not opts.data.is_dir():
        from .streams import DatasetError

        raise DatasetError(f"dataset folder {opts.data} does not exist")
    items = bench.load(opts.data, opts.videos, opts.tasks) if bench is streamingbench else \
        bench.load(opts.data, opts.videos)
    items = check_videos(items, opts.skip_missing, log)
    return items[:opts.limit] if opts.limit is not None else items


def _run_one(bench, session, item, opts: RunOptions) -> dict:
    if bench is livesports:
        return livesports.run_item(session, item, max_tokens=opts.tokens, interval=opts.interval)
    return bench.run_item(session, item, max_tokens=opts.tokens)


def run_benchmark(opts: RunOptions, *, model=None, log: Callable[[str], None] = print) -> dict:
    """Stream every item under every setting (skipping finished ones), then score and write outputs."""
    from ..session import OmniSession

    bench = BENCHMARKS[opts.benchmark]
    items = load_items(opts, log)
    out = open_run(opts.out, opts.run_config(), overwrite=opts.overwrite)
    if model is None and any(not ItemLog(out / s.key / "items.jsonl").done() >= {i.id for i in items}
                             for s in opts.settings):
        from ..models import load

        t0 = time.perf_counter()
        model = load(opts.model)
        log(f"loaded {opts.model} in {time.perf_counter() - t0:.1f} s")
    for s in opts.settings:
        items_log = ItemLog(out / s.key / "items.jsonl")
        todo = [i for i in items if i.id not in items_log.done()]
        if len(todo) < len(items):
            log(f"{s.key}: {len(items) - len(todo)} of {len(items)} items already done")
        for n, item in enumerate(todo):
            t0 = time.perf_counter()
            session = OmniSession(model, system_prompt=opts.system_prompt, policy=s.build(), media=opts.media,
                                  **s.session_kwargs())
            record = _run_one(bench, session, item, opts)
            record["tokens_per_unit"] = session.stats()["tokens_per_unit"]  # by span kind, at the media setting
            record["seconds"] = time.perf_counter() - t0
            items_log.append(item.id, record)
            log(f"{s.key}: {item.id} done in {record['seconds']:.1f} s ({n + 1}/{len(todo)})")
    return summarize(opts, items)


def _records(opts: RunOptions, s: PolicySetting, items: list) -> list[dict]:
    done = ItemLog(opts.out / s.key / "items.jsonl").records()
    return [done[i.id] for i in items if i.id in done]


def summarize(opts: RunOptions, items: list) -> dict:
    """Score every setting, write its official-format output, ``results.json`` and ``table.md``."""
    bench = BENCHMARKS[opts.benchmark]
    rows = []
    for s in opts.settings:
        records = _records(opts, s, items)
        setting_dir = opts.out / s.key
        if bench is streamingbench:
            metrics = streamingbench.score(records)
            files = streamingbench.write_official(setting_dir, opts.data, opts.tasks, records, opts.model_name)
        elif bench is svbench:
            metrics = svbench.score(records, setting_dir / "judge.json")
            files = svbench.write_official(setting_dir, records)
        else:
            metrics = livesports.score(records, setting_dir / "judge.jsonl")
            files = livesports.write_official(setting_dir, records)
        rows.append({"setting": s.to_json(), "label": s.label, "watermarks": s.watermarks, "items": len(records),
                     "items_total": len(items), "metrics": metrics, "headline": bench.headline(metrics),
                     "seconds": sum(r.get("seconds", 0.0) for r in records),
                     "evictions": sum(r["stream"]["evictions"] for r in records),
                     "outputs": [str(f.relative_to(opts.out)) for f in files]})
    results = {"benchmark": opts.benchmark, "model": opts.model, "data": str(opts.data), "rows": rows}
    (opts.out / "results.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    (opts.out / "table.md").write_text(render_table(results), encoding="utf-8")
    return results


def render_table(results: dict) -> str:
    """One benchmark run: a row per setting."""
    bench = results["benchmark"]
    head = ["policy", "watermarks", LABELS[bench]]
    extra: list[tuple[str, Callable[[dict], str]]] = []
    if bench == "streamingbench":
        tasks = sorted({t for r in results["rows"] for t in r["metrics"].get("by_task", {})})
        for t in tasks:
            extra.append((t, lambda m, t=t: f"{m['by_task'][t]['accuracy']:.1f}" if t in m.get("by_task", {}) else "-"))
        if any("proactive" in r["metrics"] for r in results["rows"]):
            extra.append(("proactive time / answer %", lambda m: "-" if "proactive" not in m else
                          f"{m['proactive']['time_accuracy']:.1f} / {m['proactive']['answer_accuracy']:.1f}"))
    elif bench == "svbench":
        extra.append(("token F1 (proxy)", lambda m: "-" if m["proxy_token_f1"] is None else
                      f"{m['proxy_token_f1']:.1f}"))
    head += [name for name, _ in extra] + ["items", "evictions", "seconds"]
    lines = [f"{LABELS[bench]}: {results['model']} on {results['data']}", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results["rows"]:
        cells = [r["label"], r["watermarks"], r["headline"]] + [f(r["metrics"]) for _, f in extra]
        cells += [f"{r['items']}/{r['items_total']}", str(r["evictions"]), f"{r['seconds']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    if bench != "streamingbench":
        lines += ["", "Scores come from the benchmark's GPT-4 judge: run it on each setting's output and save its "
                  "result as `<setting>/judge.json` (SVBench) or `<setting>/judge.jsonl` (LiveSports); until then the "
                  "cell shows '-' (SVBench: the token-F1 proxy in parentheses)."]
    return "\n".join(lines) + "\n"


def paper_table(runs: list[dict]) -> str:
    """Several runs (one per benchmark and model) as the paper's table 2: a row per policy, a column per model,
    each cell "StreamingBench / SVBench / LiveSports" ("-" where a run or a judge score is missing)."""
    models = list(dict.fromkeys(r["model"] for r in runs))
    order = ["streamingbench", "svbench", "livesports"]
    cells: dict[tuple[str, str], dict[str, str]] = {}
    labels: dict[str, str] = {}
    for run in runs:
        for row in run["rows"]:
            key = row["setting"]["key"]
            labels[key] = f"{row['label']} {row['watermarks']}" if row["watermarks"] != "-" else row["label"]
            cells.setdefault((key, run["model"]), {})[run["benchmark"]] = row["headline"]
    lines = ["| Method | " + " | ".join(Path(m).name for m in models) + " |", "|---|" + "---|" * len(models)]
    for key, label in labels.items():
        row = [" / ".join(cells.get((key, m), {}).get(b, "-") for b in order) for m in models]
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    return ("Each cell: StreamingBench % / SVBench (judge, 0-100) / LiveSports-3K-CC (judge win rate %).\n\n"
            + "\n".join(lines) + "\n")


def refresh_judges(out: Path, results: dict) -> dict:
    """Re-read judge outputs saved in the setting folders after the run (SVBench ``judge.json``, LiveSports
    ``judge.jsonl``) into the rows' metrics and headlines."""
    bench = results["benchmark"]
    if bench not in ("svbench", "livesports"):
        return results
    for row in results["rows"]:
        d = out / row["setting"]["key"]
        if bench == "svbench" and (d / "judge.json").is_file():
            row["metrics"]["judge_overall"] = svbench.read_judge(d / "judge.json")
        if bench == "livesports" and (d / "judge.jsonl").is_file():
            row["metrics"]["judge_win_rate"] = livesports.read_judge(d / "judge.jsonl")
        row["headline"] = BENCHMARKS[bench].headline(row["metrics"])
    return results
