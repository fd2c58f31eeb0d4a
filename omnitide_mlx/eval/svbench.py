"""SVBench (yzy-bupt/SVBench) dialogue chains, streamed through OmniSession; writes the answer files its judge reads.

Input: one JSON file per video (``Dialogue/Dialogue_EN/<video>.json`` in the released data, or any folder of them),
a list over the video's segments of ``{chain: {questions: [...], answers: [...]}, qac_timestamps_start,
qac_timestamps_end}`` (seconds; an empty object for a segment without a chain). Videos are found by name under
``--data`` or ``--videos`` (``Video/<video>.mp4`` in the release).

Protocol: the video streams once, a frame and a second of audio per unit; when the stream reaches the end of a
segment, that segment's questions are asked in order as a multi-turn dialogue (each answer stays in the history,
bounded only by the retention policy). Output per video, what ``evaluation/eval_chainQA_gpt4_gpt4o.py`` and
``eval_ConQA_gpt4_gpt4o.py`` read: a list over segments of ``{questions, gt_answers, answers}`` (``{}`` for an
empty segment), in ``<out>/<setting>/svbench_answers/<video>.json``.

The benchmark's score is that GPT-4 judge (0-10 per criterion; the paper reports it on a 0-100 scale). Locally we
report a lexical proxy, token F1 of each answer against its ground truth, clearly not the judge; put the judge's
output next to the answers (``<out>/<setting>/judge.json``) and the tables use its "Overall Evaluation" instead.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .streams import Ask, DatasetError, StreamItem, VideoFinder, clip_chunks, read_json, require, stream_and_ask

NAME = "svbench"
CHAIN_DIRS = ("Dialogue/Dialogue_EN", "Dialogue_EN", "Dialogue", ".")


@dataclass
class Segment:
    index: int
    start: float
    end: float
    questions: list[str]
    answers: list[str]


@dataclass
class SVItem(StreamItem):
    segments: list[Segment] = field(default_factory=list)
    n_segments: int = 0  # including empty ones (the answer file keeps every index)


def find_chain_dir(data: Path) -> Path:
    for sub in CHAIN_DIRS:
        d = data / sub
        if d.is_dir() and any(d.glob("*.json")):
            return d
    raise DatasetError(f"{data} holds no SVBench chain files (looked for *.json in "
                       f"{', '.join(str(data / s) for s in CHAIN_DIRS)})")


def load(data: Path, videos: Path | None = None) -> list[SVItem]:
    chain_dir = find_chain_dir(data)
    finder = VideoFinder(data, videos)
    items = []
    for path in sorted(chain_dir.glob("*.json")):
        raw = read_json(path, "SVBench chains")
        if not isinstance(raw, list):
            if isinstance(raw, dict) and not raw:
                continue
            raise DatasetError(f"{path}: expected a list of segments, got {type(raw).__name__}")
        item = SVItem(id=path.stem, video_ref=path.stem, video=finder.find(path.stem), n_segments=len(raw))
        for i, seg in enumerate(raw):
            if not seg:
                continue
            where = f"{path.name} segment {i}"
            chain = require(seg, "chain", dict, where)
            qs, ans = require(chain, "questions", list, where), require(chain, "answers", list, where)
            if len(qs) != len(ans) or not qs:
                raise DatasetError(f"{where}: {len(qs)} questions for {len(ans)} answers")
            start = float(require(seg, "qac_timestamps_start", (int, float), where))
            end = float(require(seg, "qac_timestamps_end", (int, float), where))
            if end < start:
                raise DatasetError(f"{where}: qac_timestamps_end {end} before qac_timestamps_start {start}")
            item.segments.append(Segment(i, start, end, [str(q) for q in qs], [str(a) for a in ans]))
        if item.segments:
            items.append(item)
    if not items:
        raise DatasetError(f"{chain_dir}: no segment with questions in any chain file")
    return items


def run_item(session, item: SVItem, max_tokens: int = 128) -> dict:
    def ask_segment(s, seg: Segment) -> dict:
        answers = [s.answer(q, max_tokens=max_tokens).strip() for q in seg.questions]
        return {"segment": seg.index, "asked_at": seg.end, "questions": seg.questions, "gt_answers": seg.answers,
                "answers": answers}

    asks = [Ask(seg.end, lambda s, seg=seg: ask_segment(s, seg)) for seg in item.segments]
    end = max(seg.end for seg in item.segments)
    records, stream = stream_and_ask(session, clip_chunks(item.video, 0.0, end), asks)
    return {"video": item.video_ref, "n_segments": item.n_segments, "segments": records, "stream": stream}


def token_f1(pred: str, gold: str) -> float:
    """SQuAD-style token F1 (lower-cased words): a lexical proxy, not SVBench's judge."""
    p, g = re.findall(r"\w+", pred.lower()), re.findall(r"\w+", gold.lower())
    common = sum((Counter(p) & Counter(g)).values())
    if not p or not g or not common:
        return 0.0
    prec, rec = common / len(p), common / len(g)
    return 2 * prec * rec / (prec + rec)


def score(records: list[dict], judge: Path | None = None) -> dict:
    segments = [seg for r in records for seg in r["segments"]]
    f1s = [token_f1(a, g) for seg in segments if not seg.get("past_end")  # asked after the video's end: not scored
           for a, g in zip(seg["answers"], seg["gt_answers"])]
    out = {"videos": len(records), "questions": len(f1s),
           "past_end_segments": sum(bool(seg.get("past_end")) for seg in segments),
           "proxy_token_f1": 100.0 * sum(f1s) / len(f1s) if f1s else None, "judge_overall": None}
    if judge is not None and judge.is_file():
        out["judge_overall"] = read_judge(judge)
    return out


def read_judge(path: Path) -> float | None:
    """Mean "Overall Evaluation" (0-10) of the official judge's output, times 10 (the paper's 0-100 scale)."""
    raw = json.loads(path.read_text(encoding="utf-8"))
    rows = raw if isinstance(raw, list) else [raw]
    vals = [r.get("scores", {}).get("Overall Evaluation") for r in rows if isinstance(r, dict)]
    vals = [v for v in vals if isinstance(v, (int, float))]
    return 10.0 * sum(vals) / len(vals) if vals else None


def headline(metrics: dict) -> str:
    if metrics.get("judge_overall") is not None:
        return f"{metrics['judge_overall']:.1f}"
    f1 = metrics.get("proxy_token_f1")
    return "-" if f1 is None else f"({f1:.1f} F1)"


def write_official(setting_dir: Path, records: list[dict]) -> list[Path]:
    """``svbench_answers/<video>.json``: per segment index ``{questions, gt_answers, answers}`` or ``{}``."""
    out_dir = setting_dir / "svbench_answers"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for r in records:
        segments: list[dict] = [{} for _ in range(r["n_segments"])]
        for seg in r["segments"]:
            segments[seg["segment"]] = {"questions": seg["questions"], "gt_answers": seg["gt_answers"],
                                        "answers": seg["answers"]}
        dst = out_dir / f"{r['video']}.json"
        dst.write_text(json.dumps(segments, indent=1, ensure_ascii=False), encoding="utf-8")
        written.append(dst)
    return written
