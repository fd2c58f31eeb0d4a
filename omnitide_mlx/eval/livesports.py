"""LiveSports-3K CC (showlab/livecc): live commentary of sports clips, streamed through OmniSession.

Input (in ``--data``): the CC track as ``LiveSports-3K-CC-val.csv`` / ``-test.csv`` (columns ``video_id, url,
event_id, begin, end, event_title, event_type, video, class`` and, in the val split, ``event_asr``), or the same
rows as JSON / JSONL. Videos are found from the ``video`` column or as ``<video_id>.<ext>`` under ``--data`` /
``--videos``.

Protocol: each event gets a session. Its title and the commentary before it (``event_asr``, when given) go in as
user text, then the clip from ``begin`` to ``end`` streams a frame and a second of audio per unit; every
``interval`` seconds the model is asked to continue the commentary (32 new tokens at most, repetition penalty 1.15,
as LiveCC's evaluation generates). The pieces joined are the event's ``pred``. Output: one JSON line per event,
``{video_id, event_id, begin, end, pred}``, in ``<out>/<setting>/livesports3kcc.jsonl``: the file the benchmark's
GPT-4o judge (``evaluation/livesports3kcc/llm_judge.py``) reads. The score is that judge's win rate against its
GPT-4o baseline; no local proxy stands in for it (the ground-truth commentary is not public). Put the judge's
output in ``<out>/<setting>/judge.jsonl`` and the tables show its win rate.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

from .streams import Ask, DatasetError, StreamItem, VideoFinder, clip_chunks, stream_and_ask

NAME = "livesports"
REQUIRED = ("video_id", "event_id", "begin", "end")
FIRST_PROMPT = "Comment on the game live, like a sports commentator, in one or two short sentences."
NEXT_PROMPT = "Continue the commentary."


@dataclass
class Event(StreamItem):
    video_id: str = ""
    event_id: int = 0
    begin: float = 0.0
    end: float = 0.0
    title: str = ""
    previous: str = ""  # event_asr: the commentary before the clip


def _rows(path: Path) -> list[dict]:
    try:
        if path.suffix.lower() == ".csv":
            with open(path, newline="", encoding="utf-8-sig") as f:
                return list(csv.DictReader(f))
        text = path.read_text(encoding="utf-8")
        if path.suffix.lower() == ".jsonl":
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        raw = json.loads(text)
    except (json.JSONDecodeError, csv.Error, UnicodeDecodeError) as e:
        raise DatasetError(f"{path}: cannot read it ({e})") from None
    if isinstance(raw, dict):  # {"val": [...], "test": [...]} or one split under a key
        raw = [r for v in raw.values() if isinstance(v, list) for r in v]
    if not isinstance(raw, list):
        raise DatasetError(f"{path}: expected a list of events")
    return raw


def find_files(data: Path) -> list[Path]:
    files = sorted(p for p in data.iterdir() if p.is_file() and p.suffix.lower() in (".csv", ".json", ".jsonl")
                   and "cc" in p.name.lower()) if data.is_dir() else []
    if not files:
        raise DatasetError(f"{data} holds no LiveSports-3K CC file (expected LiveSports-3K-CC-val.csv / -test.csv "
                           "or a .json / .jsonl with the same fields)")
    return files


def load(data: Path, videos: Path | None = None) -> list[Event]:
    finder = VideoFinder(data, videos)
    events: list[Event] = []
    seen: set[str] = set()
    for path in find_files(data):
        for n, row in enumerate(_rows(path)):
            where = f"{path.name} row {n + 1}"
            if not isinstance(row, dict):
                raise DatasetError(f"{where}: expected an object")
            missing = [k for k in REQUIRED if row.get(k) in (None, "")]
            if missing:
                raise DatasetError(f"{where}: missing {', '.join(missing)}")
            try:
                begin, end, event_id = float(row["begin"]), float(row["end"]), int(row["event_id"])
            except ValueError:
                raise DatasetError(f"{where}: begin / end / event_id are not numbers") from None
            if end <= begin:
                raise DatasetError(f"{where}: end {end} is not after begin {begin}")
            video_id = str(row["video_id"])
            key = f"{video_id}_{event_id}"
            if key in seen:
                continue
            seen.add(key)
            ref = str(row.get("video") or video_id)
            video = finder.find(ref, path.parent) or finder.find(video_id, path.parent)
            events.append(Event(id=key, video_ref=ref, video=video, video_id=video_id, event_id=event_id,
                                begin=begin, end=end, title=str(row.get("event_title") or ""),
                                previous=str(row.get("event_asr") or "")))
    if not events:
        raise DatasetError(f"{data}: the LiveSports-3K CC files hold no events")
    return events


def run_item(session, event: Event, max_tokens: int = 32, interval: float = 5.0) -> dict:
    context = []
    if event.title:
        context.append(f"This is a video titled \"{event.title}\".")
    if event.previous:
        context.append(f"The commentary so far:\n{event.previous}")
    if context:
        session.push(text="\n".join(context))
    steps: list[dict] = []

    def comment(s, t: float) -> dict:
        text = s.answer(NEXT_PROMPT if steps else FIRST_PROMPT, max_tokens=max_tokens,
                        repetition_penalty=1.15).strip()
        steps.append({"t": t, "text": text})
        return steps[-1]

    steps_n = max(1, int((event.end - event.begin) // interval))
    times = [min(event.end, event.begin + interval * (k + 1)) for k in range(steps_n)]
    asks = [Ask(t, lambda s, t=t: comment(s, t)) for t in times]
    _, stream = stream_and_ask(session, clip_chunks(event.video, event.begin, event.end), asks)
    pred = " ".join(s["text"] for s in steps if s["text"])
    return {"video_id": event.video_id, "event_id": event.event_id, "begin": event.begin, "end": event.end,
            "pred": pred, "steps": steps, "stream": stream}


def score(records: list[dict], judge: Path | None = None, baseline: str = "GPT-4o") -> dict:
    out = {"events": len(records), "mean_words": (sum(len(r["pred"].split()) for r in records) / len(records))
           if records else None, "judge_win_rate": None}
    if judge is not None and judge.is_file():
        out["judge_win_rate"] = read_judge(judge, baseline)
    return out


def read_judge(path: Path, baseline: str = "GPT-4o") -> float | None:
    """Win rate (%) from the official judge's lines ``{video_event_id, ab_winner, ba_winner}``: each event is
    judged twice (A/B swapped); a win is a verdict for neither the baseline nor a tie."""
    wins = total = 0
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        for k in ("ab_winner", "ba_winner"):
            total += 1
            wins += row.get(k) not in (baseline, "tie", None)
    return 100.0 * wins / total if total else None


def headline(metrics: dict) -> str:
    w = metrics.get("judge_win_rate")
    return "-" if w is None else f"{w:.1f}"


def write_official(setting_dir: Path, records: list[dict]) -> list[Path]:
    dst = setting_dir / "livesports3kcc.jsonl"
    with open(dst, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps({k: r[k] for k in ("video_id", "event_id", "begin", "end", "pred")},
                               ensure_ascii=False) + "\n")
    return [dst]
