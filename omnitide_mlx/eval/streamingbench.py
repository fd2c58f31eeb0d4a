"""StreamingBench (THUNLP-MT/StreamingBench) in its official files, streamed through OmniSession.

Files (in ``--data``, or its ``src/data`` / ``data``): ``questions_real.json``, ``questions_omni.json`` and
``questions_proactive.json`` are lists of entries ``{time, questions: [{task_type, question, time_stamp
"HH:MM:SS", answer "B", options ["A. ...", ...], required_ability}], video_categories, video_path}``;
``questions_sqa.json`` is a list of such lists, one per video (its questions refer to earlier ones). Proactive
questions carry ``ground_truth_time_stamp`` and ``ground_truth_output`` instead of options. The ``*_stream``
variants (questions grouped per video, each with its own ``time``) read the same way.

Protocol: each video streams once, a frame and a second of audio per unit, with history kept across its questions
(the paper's setting: retention bounds it, not a fixed context window); a question is asked when the stream has
covered its time stamp, as a multiple-choice prompt; the first character of the answer is scored against
``answer``. A proactive question is polled every second from its time stamp to ground truth + 4 s ("is it the
right time to output ...? yes or no"); after a yes the question itself is asked. It scores when the last answer
came within 2 s of the ground-truth time (time accuracy) and also contains ``ground_truth_output`` (answer
accuracy). Scores follow the official ``count.py``; the official-format output (the input files with each answer
under the model's name) is written too, so that ``count.py`` can be run on it.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from .streams import Ask, DatasetError, StreamItem, VideoFinder, clip_chunks, parse_hms, read_json, require, \
    stream_and_ask

NAME = "streamingbench"
TASK_FILES = {"real": "questions_real.json", "omni": "questions_omni.json", "sqa": "questions_sqa.json",
              "proactive": "questions_proactive.json"}
STREAM_FILES = {k: v.replace(".json", "_stream.json") for k, v in TASK_FILES.items()}
LETTERS = "ABCDEFGH"
MCQ_PROMPT = ("Answer the question about the video so far with the letter of the best option only.\n\n"
              "Question: {question}\n\nOptions:\n{options}\n\nThe best option is:")
PROACTIVE_POLL = "{question} Is it the right time to output \"{output}\"? Answer only yes or no."
PROACTIVE_TOLERANCE = 2.0  # seconds, as count.py
PROACTIVE_POLL_AFTER = 4.0  # polling stops at ground truth + 4 s, as the official evaluation


@dataclass
class SBQuestion:
    task: str  # real / omni / sqa / proactive
    task_type: str
    question: str
    time: float
    where: list[int]  # path to the question in its file: [entry, question] or [video, entry, question] (sqa)
    options: list[str] | None = None
    answer: str | None = None
    gt_time: float | None = None
    gt_output: str | None = None


@dataclass
class SBItem(StreamItem):
    task: str = ""
    questions: list[SBQuestion] = field(default_factory=list)


def find_files(data: Path, tasks: list[str] | None) -> dict[str, Path]:
    """The question file of each task, looked up in ``data``, ``data/src/data`` and ``data/data``."""
    wanted = tasks or list(TASK_FILES)
    for t in wanted:
        if t not in TASK_FILES:
            raise DatasetError(f"unknown StreamingBench task {t!r}; choose from {', '.join(TASK_FILES)}")
    found: dict[str, Path] = {}
    for t in wanted:
        for base in (data, data / "src" / "data", data / "data"):
            for name in (TASK_FILES[t], STREAM_FILES[t]):
                if (base / name).is_file() and t not in found:
                    found[t] = base / name
    if tasks:
        missing = [t for t in tasks if t not in found]
        if missing:
            raise DatasetError(f"{data}: no {', '.join(TASK_FILES[t] for t in missing)} (looked in {data}, "
                               f"{data / 'src' / 'data'}, {data / 'data'})")
    if not found:
        raise DatasetError(f"{data} holds no StreamingBench question file (expected any of "
                           f"{', '.join(TASK_FILES.values())}, in the folder or its src/data)")
    return found


def _entries(task: str, data, path: Path):
    """``(where_prefix, entry)`` for every entry of a file (sqa: a list per video)."""
    if not isinstance(data, list):
        raise DatasetError(f"{path}: expected a JSON list of entries, got {type(data).__name__}")
    for i, e in enumerate(data):
        if task == "sqa" and isinstance(e, list):
            for j, inner in enumerate(e):
                yield [i, j], inner
        else:
            yield [i], e


def _question(task: str, q: dict, where: list[int], path: Path) -> SBQuestion:
    at = f"{path.name} entry {where[:-1]} question {where[-1]}"
    out = SBQuestion(task=task, task_type=str(q.get("task_type", task)), where=where,
                     question=require(q, "question", str, at), time=parse_hms(require(q, "time_stamp", str, at), at))
    if task == "proactive":
        out.gt_time = parse_hms(require(q, "ground_truth_time_stamp", str, at), at)
        out.gt_output = str(require(q, "ground_truth_output", (str, int, float), at))
    else:
        options = require(q, "options", list, at)
        if not 2 <= len(options) <= len(LETTERS) or not all(isinstance(o, str) for o in options):
            raise DatasetError(f"{at}: options should be 2 to {len(LETTERS)} strings")
        out.options = options
        out.answer = require(q, "answer", str, at).strip()
        if out.answer not in LETTERS[:len(options)]:
            raise DatasetError(f"{at}: answer {out.answer!r} is not one of the option letters")
    return out


def load(data: Path, videos: Path | None = None, tasks: list[str] | None = None) -> list[SBItem]:
    """Every (task, video) pair with its questions in time order."""
    finder = VideoFinder(data, videos)
    items: dict[tuple[str, str], SBItem] = {}
    for task, path in find_files(data, tasks).items():
        raw = read_json(path, f"StreamingBench {task}")
        for prefix, entry in _entries(task, raw, path):
            where = f"{path.name} entry {prefix}"
            ref = require(entry, "video_path", str, where)
            questions = require(entry, "questions", list, where)
            key = (task, ref)
            if key not in items:
                items[key] = SBItem(id=f"{task}:{ref}", video_ref=ref, video=finder.find(ref, path.parent), task=task)
            for k, q in enumerate(questions):
                items[key].questions.append(_question(task, q, prefix + [k], path))
    for item in items.values():
        item.questions.sort(key=lambda q: q.time)
    if not items:
        raise DatasetError(f"{data}: the StreamingBench files hold no questions")
    return list(items.values())


def mcq_prompt(q: SBQuestion) -> str:
    opts = []
    for letter, o in zip(LETTERS, q.options):
        o = o.strip()
        opts.append(o if re.match(rf"^{letter}\s*[.)]", o) else f"{letter}. {o}")
    return MCQ_PROMPT.format(question=q.question.strip(), options="\n".join(opts))


def first_letter(response: str) -> str:
    """What count.py compares with the answer: the response's first character (leading blanks dropped)."""
    return response.strip()[:1]


def run_item(session, item: SBItem, max_tokens: int = 8) -> dict:
    """Stream the item's video, asking its questions on time; the record for items.jsonl."""
    asks: list[Ask] = []
    for q in item.questions:
        if q.task == "proactive":
            asks += _proactive_asks(q, max_tokens)
        else:
            asks.append(Ask(q.time, lambda s, q=q: _ask_mcq(s, q, max_tokens)))
    end = max(q.time if q.gt_time is None else q.gt_time + PROACTIVE_POLL_AFTER for q in item.questions)
    records, stream = stream_and_ask(session, clip_chunks(item.video, 0.0, end), asks)
    return {"task": item.task, "video": item.video_ref, "questions": records, "stream": stream}


def _ask_mcq(session, q: SBQuestion, max_tokens: int) -> dict:
    response = session.answer(mcq_prompt(q), max_tokens=max_tokens)
    pred = first_letter(response)
    return {"where": q.where, "task_type": q.task_type, "time": q.time, "answer": q.answer, "response": response,
            "pred": pred, "correct": pred == q.answer}


def _proactive_asks(q: SBQuestion, max_tokens: int) -> list[Ask]:
    """One poll per second from time stamp + 1 to ground truth + 4; the first yes asks the question and ends."""
    state = {"done": False, "dialog": []}
    last = int(q.gt_time + PROACTIVE_POLL_AFTER)
    first = int(q.time) + 1

    def poll(session, now: int) -> dict | None:
        if state["done"]:
            return None
        prompt = PROACTIVE_POLL.format(question=q.question.strip(), output=q.gt_output)
        reply = session.answer(prompt, max_tokens=4)
        state["dialog"] += [{"role": "user", "content": prompt, "time": now},
                            {"role": "assistant", "content": reply, "time": now}]
        answered = "yes" in reply.strip().lower()
        if answered:
            reply = session.answer(q.question.strip(), max_tokens=max(max_tokens, 16))
            state["dialog"] += [{"role": "user", "content": q.question, "time": now},
                                {"role": "assistant", "content": reply, "time": now}]
        if not answered and now < last:
            return None
        state["done"] = True
        last_turn = state["dialog"][-1]
        time_ok = abs(last_turn["time"] - q.gt_time) <= PROACTIVE_TOLERANCE
        return {"where": q.where, "task_type": q.task_type, "time": q.time, "gt_time": q.gt_time,
                "gt_output": q.gt_output, "answered": now if answered else False, "dialog_history": state["dialog"],
                "time_correct": time_ok, "answer_correct": time_ok and q.gt_output in last_turn["content"]}

    return [Ask(float(t), lambda s, t=t: poll(s, t), stamp=q.time) for t in range(first, max(first, last) + 1)]


# --- scores ----------------------------------------------------------------------------------------------------------
def score(records: list[dict]) -> dict:
    """Accuracy overall (multiple choice: real, omni, sqa), per task file and per task type; proactive time and
    answer accuracy, as count.py computes them."""
    by_task: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    by_type: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    pro = [0, 0, 0]
    past_end = 0
    for item in records:
        for q in item["questions"]:
            if q.get("past_end"):  # stamped after the video's end: not asked at its time, not scored
                past_end += 1
                continue
            if item["task"] == "proactive":
                pro[0] += 1
                pro[1] += bool(q["time_correct"])
                pro[2] += bool(q["answer_correct"])
                continue
            for bucket in (by_task[item["task"]], by_type[q["task_type"]]):
                bucket[0] += 1
                bucket[1] += bool(q["correct"])
    n = sum(v[0] for v in by_task.values())
    ok = sum(v[1] for v in by_task.values())
    out = {"accuracy": 100.0 * ok / n if n else None, "questions": n,
           "by_task": {k: {"accuracy": 100.0 * v[1] / v[0], "questions": v[0]} for k, v in sorted(by_task.items())},
           "by_task_type": {k: {"accuracy": 100.0 * v[1] / v[0], "questions": v[0]}
                            for k, v in sorted(by_type.items())}}
    if past_end:
        out["past_end"] = past_end
    if pro[0]:
        out["proactive"] = {"questions": pro[0], "time_accuracy": 100.0 * pro[1] / pro[0],
                            "answer_accuracy": 100.0 * pro[2] / pro[0]}
    return out


def headline(metrics: dict) -> str:
    a = metrics.get("accuracy")
    return "-" if a is None else f"{a:.1f}"


def write_official(setting_dir: Path, data: Path, tasks: list[str] | None, records: list[dict],
                   model_name: str) -> list[Path]:
    """The question files with each answer stored under ``model_name`` (count.py's input): the response text for
    multiple choice, ``{answered, dialog_history}`` for proactive questions."""
    out_dir = setting_dir / "streamingbench"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    by_task: dict[str, list[dict]] = defaultdict(list)
    for item in records:
        by_task[item["task"]] += item["questions"]
    for task, path in find_files(data, tasks).items():
        raw = json.loads(path.read_text(encoding="utf-8"))
        for q in by_task.get(task, []):
            node = raw
            for i in q["where"][:-1]:
                node = node[i]
            target = node["questions"][q["where"][-1]]
            if task == "proactive":
                target[model_name] = {"answered": q["answered"], "dialog_history": q["dialog_history"]}
            else:
                target[model_name] = q["response"].strip()
        dst = out_dir / path.name
        dst.write_text(json.dumps(raw, indent=1, ensure_ascii=False), encoding="utf-8")
        written.append(dst)
    return written
