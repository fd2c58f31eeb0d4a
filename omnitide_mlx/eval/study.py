"""The retention study on real weights: SmolLM2-135M-Instruct reads a streamed log and recalls facts from it.

Each episode is a building's log streamed one segment (unit) at a time: ``[MM:SS]`` time tag (boundary tokens),
four sentences (text), a newline (boundary). Most sentences are distractors (who walked where); a few state a fact
with a distinct key ("Note: The wifi password is falcon."). From the middle of the stream on, at checkpoints, the
session is asked about facts stated earlier: the question goes in as a user turn with the start of the answer
("What is the wifi password?" / "The wifi password is"), through the session's own bounded OmniCache, and the
model's next-token logits over the episode's fact words pick its answer (chance: one in the number of facts).
The probe is taken back out afterwards (probe.py), so every policy sees the same stream and the same questions.

The same episodes run under every policy and watermark; each record says whether the answer was right, whether the
fact's answer token was still in the cache, and how old the fact was. The model's KV is the session's bounded
cache throughout: nothing is recomputed from text.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .policies import PolicySetting

SYSTEM_PROMPT = ("You are a helpful assistant. You read a live log of a building, a few lines at a time, and answer "
                 "questions about it.")

KEYS = ["the wifi password", "the code word for the vault", "the name of the visiting ship",
        "the password of the staff printer", "the nickname of the new robot", "the secret ingredient of the soup",
        "the call sign of the night guard", "the codename of the project", "the name of the office cat",
        "the password for the back door", "the theme of the party", "the name of the meeting room"]
WORDS = ["falcon", "tiger", "river", "maple", "copper", "violet", "lemon", "anchor", "rocket", "marble", "canyon",
         "velvet", "harbor", "pepper", "cobalt", "orchid", "thunder", "walnut", "salmon", "ginger", "silver",
         "crystal", "meadow", "comet", "lantern"]  # one token each (with a leading space) in SmolLM2's vocabulary
SUBJECTS = ["A courier", "The night guard", "Someone", "A technician", "Two visitors", "The cleaning crew",
            "A delivery driver", "The receptionist", "An electrician", "A student", "The janitor", "A tourist"]
ACTIONS = ["walks past the loading dock", "checks the boiler in the basement", "waits by the elevator",
           "carries a box up the stairs", "signs in at the front desk", "opens a window on the second floor",
           "drinks coffee in the kitchen", "fixes a flickering light in the hallway", "reads a newspaper in the lobby",
           "locks the side entrance", "waters the plants near the stairs", "talks on the phone in the corridor",
           "restocks the printer with paper", "sweeps the parking lot", "looks at the map by the entrance",
           "leaves through the main gate"]


@dataclass
class Fact:
    key: str  # "the wifi password"
    word: str  # "falcon"
    unit: int  # index of the stream unit that states it

    @property
    def sentence(self) -> str:
        return f"Note: {self.key[0].upper()}{self.key[1:]} is {self.word}."

    @property
    def question(self) -> str:
        return f"What is {self.key}?"

    @property
    def answer_prefix(self) -> str:
        return f"{self.key[0].upper()}{self.key[1:]} is"


@dataclass
class Question:
    after_unit: int  # asked once units 0 .. after_unit are streamed
    fact: int  # index into Episode.facts


@dataclass
class Episode:
    index: int
    units: list[str]
    facts: list[Fact]
    questions: list[Question]


def make_episode(index: int, seed: int = 0, units: int = 24, facts: int = 8, first_question: int = 8,
                 question_every: int = 2, questions_per_checkpoint: int = 3, sentences: int = 4) -> Episode:
    """A reproducible episode: ``units`` segments of ``sentences`` sentences, ``facts`` of them facts at random
    units; questions at every ``question_every``-th unit from ``first_question`` on about facts already stated
    (the oldest not yet asked, the rest at random)."""
    if facts > min(len(KEYS), len(WORDS)):
        raise ValueError(f"at most {min(len(KEYS), len(WORDS))} facts per episode")
    if not 0 < first_question < units:
        raise ValueError("first_question must lie inside the episode")
    rng = random.Random(seed * 1_000_003 + index)
    keys, words = rng.sample(KEYS, facts), rng.sample(WORDS, facts)
    fact_units = sorted(rng.sample(range(units - 1), facts))
    fact_list = [Fact(k, w, u) for k, w, u in zip(keys, words, fact_units)]
    by_unit = {f.unit: f for f in fact_list}
    texts = []
    for u in range(units):
        minutes, seconds = divmod(10 * u, 60)
        picks = rng.sample(range(len(SUBJECTS) * len(ACTIONS)), sentences)
        parts = [f"{SUBJECTS[x // len(ACTIONS)]} {ACTIONS[x % len(ACTIONS)]}." for x in picks]
        if u in by_unit:
            parts[rng.randrange(sentences)] = by_unit[u].sentence
        texts.append(f"[{minutes:02d}:{seconds:02d}] " + " ".join(parts))
    questions: list[Question] = []
    asked: set[int] = set()
    for p in range(first_question, units, question_every):
        known = [i for i, f in enumerate(fact_list) if f.unit < p]
        if not known:
            continue
        fresh = [i for i in known if i not in asked]
        chosen = fresh[:1]
        rest = [i for i in known if i not in chosen]
        chosen += rng.sample(rest, min(len(rest), questions_per_checkpoint - len(chosen)))
        for i in sorted(chosen, key=lambda i: fact_list[i].unit):
            questions.append(Question(p, i))
            asked.add(i)
    return Episode(index, texts, fact_list, questions)


@dataclass
class ProbeRecord:
    """One question under one setting."""

    episode: int
    setting: str
    after_unit: int
    fact_unit: int
    age_units: int  # units streamed after the fact's unit
    age_tokens: int  # tokens streamed after the fact's unit
    answer: str
    predicted: str
    correct: bool  # the right word scored highest among the episode's fact words
    exact: bool  # the right word is the top token of the whole vocabulary
    retained: bool  # the fact's answer token was in the KV cache when asked
    cache_tokens: int  # tokens in the cache when asked


def run_episode(model, tokenizer, episode: Episode, setting: PolicySetting,
                system_prompt: str = SYSTEM_PROMPT) -> list[ProbeRecord]:
    """Stream ``episode`` through an OmniSession with ``setting``'s policy; answer its questions by probing."""
    from ..session import OmniSession
    from .probe import RetentionRecorder, context_unit_ids, probe_logits, question_ids

    recorder = RetentionRecorder(setting.build())
    session = OmniSession((model, tokenizer), system_prompt=system_prompt, policy=recorder)
    candidates: dict[str, int] = {}
    for f in episode.facts:
        ids = tokenizer.encode(" " + f.word)
        if len(ids) != 1:
            raise ValueError(f"fact word {f.word!r} is {len(ids)} tokens in this vocabulary; the study needs one")
        candidates[f.word] = ids[0]
    answer_index: dict[int, tuple[int, int]] = {}  # unit index -> (uid, token index of the answer word)
    unit_tokens: list[int] = []
    by_unit = {f.unit: f for f in episode.facts}
    pending = sorted(episode.questions, key=lambda q: q.after_unit)
    out: list[ProbeRecord] = []
    for u, text in enumerate(episode.units):
        ids = context_unit_ids(session, text) if u in by_unit else None
        rec = session.push(text=text)[0]
        unit_tokens.append(rec.tokens)
        if ids is not None:
            word_id = candidates[by_unit[u].word]
            answer_index[u] = (rec.uid, len(ids) - 1 - ids[::-1].index(word_id))
        while pending and pending[0].after_unit == u + 1:
            q = pending.pop(0)
            fact = episode.facts[q.fact]
            logits = probe_logits(session, question_ids(session, fact.question, fact.answer_prefix))
            scores = {w: float(logits[i]) for w, i in candidates.items()}
            predicted = max(scores, key=scores.get)
            uid, index = answer_index[fact.unit]
            out.append(ProbeRecord(
                episode=episode.index, setting=setting.key, after_unit=q.after_unit, fact_unit=fact.unit,
                age_units=u - fact.unit, age_tokens=int(sum(unit_tokens[fact.unit + 1:])), answer=fact.word,
                predicted=predicted, correct=predicted == fact.word,
                exact=int(np.argmax(logits)) == candidates[fact.word],
                retained=recorder.retained(uid, index), cache_tokens=session.history.total_tokens))
    return out


# --- summaries ----------------------------------------------------------------------------------------------------
AGE_BUCKETS = ((0, 400, "< 400"), (400, 800, "400-800"), (800, 10**9, ">= 800"))


def _pct(hits: int, n: int) -> str:
    return f"{100 * hits / n:.1f}" if n else "-"


@dataclass
class SettingSummary:
    setting: str
    label: str
    watermarks: str
    questions: int
    correct: int
    exact: int
    retained: int
    correct_when_retained: tuple[int, int]
    correct_when_evicted: tuple[int, int]
    by_age: dict[str, tuple[int, int]] = field(default_factory=dict)  # bucket -> (correct, n)
    mean_cache_tokens: float = 0.0
    seconds: float = 0.0


def summarize(settings: list[PolicySetting], records: dict[str, list[dict]],
              seconds: dict[str, float] | None = None) -> list[SettingSummary]:
    out = []
    for s in settings:
        rows = records.get(s.key, [])
        ret = [r for r in rows if r["retained"]]
        ev = [r for r in rows if not r["retained"]]
        by_age = {}
        for lo, hi, name in AGE_BUCKETS:
            b = [r for r in rows if lo <= r["age_tokens"] < hi]
            by_age[name] = (sum(r["correct"] for r in b), len(b))
        out.append(SettingSummary(
            setting=s.key, label=s.label, watermarks=s.watermarks, questions=len(rows),
            correct=sum(r["correct"] for r in rows), exact=sum(r["exact"] for r in rows),
            retained=len(ret), correct_when_retained=(sum(r["correct"] for r in ret), len(ret)),
            correct_when_evicted=(sum(r["correct"] for r in ev), len(ev)), by_age=by_age,
            mean_cache_tokens=float(np.mean([r["cache_tokens"] for r in rows])) if rows else 0.0,
            seconds=(seconds or {}).get(s.key, 0.0)))
    return out


def paired_counts(records: dict[str, list[dict]], a: str, b: str) -> tuple[int, int]:
    """Questions ``a`` answered right and ``b`` wrong, and the reverse (same episodes, same questions)."""
    key = lambda r: (r["episode"], r["after_unit"], r["fact_unit"])  # noqa: E731
    ra = {key(r): r["correct"] for r in records.get(a, [])}
    rb = {key(r): r["correct"] for r in records.get(b, [])}
    common = ra.keys() & rb.keys()
    return sum(ra[k] and not rb[k] for k in common), sum(rb[k] and not ra[k] for k in common)


def render_markdown(summaries: list[SettingSummary], records: dict[str, list[dict]], config: dict) -> str:
    lines = [f"Episodes: {config['episodes']} x {config['units']} units, {config['facts']} facts each "
             f"(chance {100 / config['facts']:.1f} %); model: {config['model']}.", ""]
    lines += ["| policy | watermarks | accuracy % | top-1 of vocab % | fact still cached % | acc. when cached | "
              "acc. when evicted | mean cache tokens | questions |",
              "|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        lines.append(f"| {s.label} | {s.watermarks} | {_pct(s.correct, s.questions)} | {_pct(s.exact, s.questions)} "
                     f"| {_pct(s.retained, s.questions)} | {_pct(*s.correct_when_retained)} "
                     f"(n={s.correct_when_retained[1]}) | {_pct(*s.correct_when_evicted)} "
                     f"(n={s.correct_when_evicted[1]}) | {s.mean_cache_tokens:.0f} | {s.questions} |")
    lines += ["", "Accuracy % by the fact's age (tokens streamed since it was stated):", "",
              "| policy | watermarks | " + " | ".join(f"age {name}" for *_, name in AGE_BUCKETS) + " |",
              "|---|---|" + "---|" * len(AGE_BUCKETS)]
    for s in summaries:
        cells = [f"{_pct(*s.by_age[name])} (n={s.by_age[name][1]})" for *_, name in AGE_BUCKETS]
        lines.append(f"| {s.label} | {s.watermarks} | " + " | ".join(cells) + " |")
    picks = [s for s in summaries if s.setting.startswith("omnipick")]
    if picks:
        lines += ["", "Paired with OmniPick at the same watermarks (questions only OmniPick got right / only the "
                  "other policy got right):", ""]
        for p in picks:
            marks = p.setting.split("@")[-1] if "@" in p.setting else ""
            for s in summaries:
                if s is p or (marks and not (s.setting.endswith("@" + marks) or s.setting == "full")):
                    continue
                if s.setting.startswith("omnipick"):
                    continue
                won, lost = paired_counts(records, p.setting, s.setting)
                lines.append(f"- {p.label} {p.watermarks} vs {s.label} {s.watermarks}: +{won} / -{lost}")
    return "\n".join(lines) + "\n"


# --- the whole study ------------------------------------------------------------------------------------------------
@dataclass
class StudyConfig:
    model: str
    episodes: int = 2
    units: int = 24
    facts: int = 8
    seed: int = 0
    first_question: int = 8
    question_every: int = 2
    questions_per_checkpoint: int = 3
    sentences: int = 4

    def to_json(self) -> dict:
        return asdict(self)


def run_study(config: StudyConfig, settings: list[PolicySetting], out: str | Path, *, model=None,
              overwrite: bool = False, log=print) -> dict:
    """Run every setting on every episode (skipping pairs already in ``out``); write ``results.json`` and
    ``table.md``; return the results. ``model`` is a loaded ``(model, tokenizer)`` (default: load the GGUF)."""
    import json

    from .store import ItemLog, open_run

    out = open_run(out, {"kind": "retention-study", **config.to_json()}, overwrite=overwrite)
    episodes = [make_episode(i, config.seed, config.units, config.facts, config.first_question,
                             config.question_every, config.questions_per_checkpoint, config.sentences)
                for i in range(config.episodes)]
    if model is None:
        from ..models.llama_gguf import load_gguf

        model = load_gguf(config.model)
    lm, tokenizer = model
    records: dict[str, list[dict]] = {}
    seconds: dict[str, float] = defaultdict(float)
    for s in settings:
        items = ItemLog(out / s.key / "items.jsonl")
        for ep in episodes:
            item = f"episode-{ep.index}"
            if item not in items.done():
                t0 = time.perf_counter()
                rows = [asdict(r) for r in run_episode(lm, tokenizer, ep, s)]
                items.append(item, {"probes": rows, "seconds": time.perf_counter() - t0})
                acc = sum(r["correct"] for r in rows) / max(1, len(rows))
                log(f"{s.key:<34} episode {ep.index}: {acc:6.1%} of {len(rows)} in "
                    f"{time.perf_counter() - t0:5.1f} s")
        done = items.records()
        records[s.key] = [r for ep in episodes for r in done[f"episode-{ep.index}"]["probes"]]
        seconds[s.key] = sum(done[f"episode-{ep.index}"]["seconds"] for ep in episodes)
    summaries = summarize(settings, records, seconds)
    results = {"config": config.to_json(), "settings": [s.to_json() for s in settings],
               "summary": [asdict(s) for s in summaries]}
    (out / "results.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    (out / "table.md").write_text(render_markdown(summaries, records, config.to_json()), encoding="utf-8")
    return results
