"""The retention study on real weights: SmolLM2-135M-Instruct reads a streamed log and recalls facts from it.

Each episode is a building's log streamed one segment (unit) at a time: ``[MM:SS]`` time tag (boundary tokens),
four sentences (text), a newline (boundary). Most sentences are distractors (who walked where); a few state a fact
with a distinct key ("Note: The wifi password is falcon."). Every fact is asked about 2, 8 and 16 units after it
was stated (when the episode lasts that long): the question goes in as a user turn with the start of the answer
("What is the wifi password?" / "The wifi password is"), through the session's own bounded OmniCache, and the
model's next-token logits over the episode's fact words pick its answer (chance: one in the number of facts).
The probe is taken back out afterwards (probe.py), so every policy sees the same stream and the same questions.

The same episodes run under every policy and watermark; each record says whether the answer was right, whether the
fact's answer token was still in the cache, and how old the fact was. The model's KV is the session's bounded
cache throughout: nothing is recomputed from text.
"""

from __future__ import annotations

import random
import re
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
    after_unit: int  # asked once units 0 .. after_unit - 1 are streamed
    fact: int  # index into Episode.facts
    delay: int  # units streamed since the fact's unit


@dataclass
class Episode:
    index: int
    units: list[str]
    facts: list[Fact]
    questions: list[Question]
    qa_after: tuple[int, ...] = ()  # a user question and the model's reply go in once these many units are streamed


# --- omni-style units: a boundary tag, a fixed-length block standing for the frame, a few speech tokens ----------
FRAME_TOKENS = 32  # the frame block's length (an omni unit's image span, scaled to this 135M text model)
UTTERANCES = ["Okay.", "Thanks, see you.", "Is anyone there?", "Hello again.", "Got it.", "One moment please.",
              "That is fine.", "I will be back soon."]
QA_QUESTION = "Briefly, what is happening in the building right now?"
_OMNI_UNIT = re.compile(r"^(\[[^\]\n]{1,40}\]) <frame>(.*?)</frame> ?(.*)$", re.S)


class OmniStyleAdapter:
    """The text adapter, with units written ``[tag] <frame>scene</frame> speech`` laid out like an omni unit: the tag
    (boundary), the scene as an IMAGE span of exactly ``frame_tokens`` tokens (its text repeated or cut to length),
    the speech as TEXT, the newline (boundary). OmniPick then keeps an older unit's tag, newline and first
    ``image_sink`` frame tokens, and its speech under the text budget, as it does on a real audiovisual stream."""

    def __init__(self, inner, frame_tokens: int = FRAME_TOKENS):
        self._inner = inner
        self.frame_tokens = frame_tokens

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def context_unit(self, text: str, start: int):
        from ..core.units import SpanKind, UnitKind

        m = _OMNI_UNIT.match(text)
        if not m:
            return self._inner.context_unit(text, start)
        inner = self._inner
        frame = inner.encode(" " + m.group(2).strip())
        frame = (frame * (self.frame_tokens // max(1, len(frame)) + 1))[:self.frame_tokens]
        runs = [] if inner.turn_open else [(SpanKind.BOUNDARY, list(inner.user_open))]
        runs += [(SpanKind.BOUNDARY, inner.encode(m.group(1))), (SpanKind.IMAGE, frame)]
        if m.group(3).strip():
            runs.append((SpanKind.TEXT, inner.encode(" " + m.group(3).strip())))
        runs.append((SpanKind.BOUNDARY, list(inner.newline)))
        unit = inner._unit(UnitKind.USER, runs, start, m.group(1))
        inner.turn_open = True
        return unit


class _OmniStyleModel:
    def __init__(self, model, frame_tokens: int = FRAME_TOKENS):
        self._model = model
        self._frame_tokens = frame_tokens

    def __getattr__(self, name):
        return getattr(self._model, name)

    def stream_adapter(self, tokenizer, **kw):
        return OmniStyleAdapter(self._model.stream_adapter(tokenizer, **kw), self._frame_tokens)


DELAYS = (2, 8, 16)


def make_episode(index: int, seed: int = 0, units: int = 24, facts: int = 10, delays: tuple[int, ...] = DELAYS,
                 sentences: int = 4, style: str = "log", qa: bool = False) -> Episode:
    """A reproducible episode: ``units`` segments of ``sentences`` sentences, ``facts`` of them facts at random
    units (each in a different unit). Every fact is asked about ``delay`` units after the unit stating it, for each
    delay that still falls inside the episode: the same short and long recalls for early and late facts."""
    if facts > min(len(KEYS), len(WORDS)):
        raise ValueError(f"at most {min(len(KEYS), len(WORDS))} facts per episode")
    if not delays or min(delays) < 1 or units - min(delays) < facts:
        raise ValueError(f"{units} units leave no room for {facts} facts asked {min(delays, default=0)} units later")
    rng = random.Random(seed * 1_000_003 + index)
    keys, words = rng.sample(KEYS, facts), rng.sample(WORDS, facts)
    fact_units = sorted(rng.sample(range(units - min(delays)), facts))
    fact_list = [Fact(k, w, u) for k, w, u in zip(keys, words, fact_units)]
    by_unit = {f.unit: f for f in fact_list}
    if style not in ("log", "omni"):
        raise ValueError(f"style must be 'log' or 'omni', got {style!r}")
    texts = []
    for u in range(units):
        minutes, seconds = divmod(10 * u, 60)
        picks = rng.sample(range(len(SUBJECTS) * len(ACTIONS)), sentences)
        parts = [f"{SUBJECTS[x // len(ACTIONS)]} {ACTIONS[x % len(ACTIONS)]}." for x in picks]
        if style == "omni":  # the scene is the frame, the fact (or a short utterance) is what is said
            speech = by_unit[u].sentence if u in by_unit else rng.choice(UTTERANCES)
            texts.append(f"[{minutes:02d}:{seconds:02d}] <frame>{' '.join(parts)}</frame> {speech}")
            continue
        if u in by_unit:
            parts[rng.randrange(sentences)] = by_unit[u].sentence
        texts.append(f"[{minutes:02d}:{seconds:02d}] " + " ".join(parts))
    questions = [Question(f.unit + 1 + d, i, d) for i, f in enumerate(fact_list) for d in delays
                 if f.unit + 1 + d <= units]
    questions.sort(key=lambda q: (q.after_unit, fact_list[q.fact].unit))
    # "after a question and reply": a user turn and its answer right before each shortest-delay probe
    qa_after = tuple(sorted({q.after_unit for q in questions if q.delay == min(delays)})) if qa else ()
    return Episode(index, texts, fact_list, questions, qa_after)


@dataclass
class ProbeRecord:
    """One question under one setting."""

    episode: int
    setting: str
    after_unit: int
    fact_unit: int
    delay: int  # units streamed after the fact's unit
    age_tokens: int  # tokens streamed after the fact's unit
    answer: str
    predicted: str
    correct: bool  # the right word scored highest among the episode's fact words
    exact: bool  # the right word is the top token of the whole vocabulary
    retained: bool  # the fact's answer token was in the KV cache when asked
    cache_tokens: int  # tokens in the cache when asked
    recalled: bool = False  # the fact's unit was brought back from the recall store for this question
    recalled_tokens: int = 0  # tokens brought back for this question (in the cache next to cache_tokens)


def run_episode(model, tokenizer, episode: Episode, setting: PolicySetting,
                system_prompt: str = SYSTEM_PROMPT, style: str = "log", kv: dict | None = None) -> list[ProbeRecord]:
    """Stream ``episode`` through an OmniSession with ``setting``'s policy; answer its questions by probing.
    ``style="omni"`` lays units out as omni units (:class:`OmniStyleAdapter`); the episode's ``qa_after`` units
    get a real user question and the model's greedy reply (12 tokens) pushed into the stream. ``kv``: the
    session's quantised-KV keywords (``kv_bits``, ``kv_group_size``, ``kv_keep_sinks_full``; default float KV)."""
    from ..session import OmniSession
    from .probe import RetentionRecorder, context_unit_ids, question_ids

    recorder = RetentionRecorder(setting.build())
    m = _OmniStyleModel(model) if style == "omni" else model
    session = OmniSession((m, tokenizer), system_prompt=system_prompt, policy=recorder, **(kv or {}),
                          **setting.session_kwargs())
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
        if u + 1 in episode.qa_after:
            for _ in session.ask(QA_QUESTION, max_tokens=12):
                pass
        while pending and pending[0].after_unit == u + 1:
            q = pending.pop(0)
            fact = episode.facts[q.fact]
            logits = session.probe_logits(question_ids(session, fact.question, fact.answer_prefix))
            recall = session.last_recall() if session.recall is not None else None
            scores = {w: float(logits[i]) for w, i in candidates.items()}
            predicted = max(scores, key=scores.get)
            uid, index = answer_index[fact.unit]
            out.append(ProbeRecord(
                episode=episode.index, setting=setting.key, after_unit=q.after_unit, fact_unit=fact.unit,
                delay=q.delay, age_tokens=int(sum(unit_tokens[fact.unit + 1:])), answer=fact.word,
                predicted=predicted, correct=predicted == fact.word,
                exact=int(np.argmax(logits)) == candidates[fact.word],
                retained=recorder.retained(uid, index), cache_tokens=session.history.total_tokens,
                recalled=recall is not None and uid in recall["uids"],
                recalled_tokens=recall["tokens"] if recall is not None else 0))
    return out


# --- summaries ----------------------------------------------------------------------------------------------------


def _pct(hits: int, n: int) -> str:
    return f"{100 * hits / n:.1f}" if n else "-"


def wilson_interval(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of a proportion, in percent."""
    if not n:
        return 0.0, 100.0
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return 100 * max(0.0, centre - half), 100 * min(1.0, centre + half)


def sign_test(won: int, lost: int) -> float:
    """Two-sided exact sign test on the discordant pairs of a paired comparison."""
    from math import comb

    n = won + lost
    if not n:
        return 1.0
    tail = sum(comb(n, k) for k in range(min(won, lost) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


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
    by_delay: dict[int, tuple[int, int]] = field(default_factory=dict)  # delay (units) -> (correct, n)
    mean_cache_tokens: float = 0.0
    seconds: float = 0.0


def summarize(settings: list[PolicySetting], records: dict[str, list[dict]],
              seconds: dict[str, float] | None = None) -> list[SettingSummary]:
    out = []
    for s in settings:
        rows = records.get(s.key, [])
        ret = [r for r in rows if r["retained"]]
        ev = [r for r in rows if not r["retained"]]
        by_delay = {}
        for d in sorted({r["delay"] for r in rows}):
            b = [r for r in rows if r["delay"] == d]
            by_delay[d] = (sum(r["correct"] for r in b), len(b))
        out.append(SettingSummary(
            setting=s.key, label=s.label, watermarks=s.watermarks, questions=len(rows),
            correct=sum(r["correct"] for r in rows), exact=sum(r["exact"] for r in rows),
            retained=len(ret), correct_when_retained=(sum(r["correct"] for r in ret), len(ret)),
            correct_when_evicted=(sum(r["correct"] for r in ev), len(ev)), by_delay=by_delay,
            mean_cache_tokens=float(np.mean([r["cache_tokens"] for r in rows])) if rows else 0.0,
            seconds=(seconds or {}).get(s.key, 0.0)))
    return out


def _mean_age(records: dict[str, list[dict]], delay: int) -> int:
    ages = [r["age_tokens"] for rows in records.values() for r in rows if r["delay"] == delay]
    return int(round(float(np.mean(ages)))) if ages else 0


def paired_counts(records: dict[str, list[dict]], a: str, b: str) -> tuple[int, int]:
    """Questions ``a`` answered right and ``b`` wrong, and the reverse (same episodes, same questions)."""
    key = lambda r: (r["episode"], r["fact_unit"], r["delay"])  # noqa: E731
    ra = {key(r): r["correct"] for r in records.get(a, [])}
    rb = {key(r): r["correct"] for r in records.get(b, [])}
    common = ra.keys() & rb.keys()
    return sum(ra[k] and not rb[k] for k in common), sum(rb[k] and not ra[k] for k in common)


def _with_and_without_recall(a: str, b: str) -> bool:
    """Whether settings ``a`` and ``b`` differ only in that one runs with a recall store."""
    plain = lambda k: re.sub(r"\+recall=\d+", "", k)  # noqa: E731
    return a != b and plain(a) == plain(b)


def render_markdown(summaries: list[SettingSummary], records: dict[str, list[dict]], config: dict) -> str:
    lines = [f"Episodes: {config['episodes']} x {config['units']} units, {config['facts']} facts each "
             f"(chance {100 / config['facts']:.1f} %); model: {config['model']}.", ""]
    lines += ["| policy | watermarks | accuracy % | 95 % CI | top-1 of vocab % | fact still cached % | "
              "acc. when cached | acc. when evicted | mean cache tokens | questions |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        lo, hi = wilson_interval(s.correct, s.questions)
        lines.append(f"| {s.label} | {s.watermarks} | {_pct(s.correct, s.questions)} | {lo:.0f}-{hi:.0f} "
                     f"| {_pct(s.exact, s.questions)} "
                     f"| {_pct(s.retained, s.questions)} | {_pct(*s.correct_when_retained)} "
                     f"(n={s.correct_when_retained[1]}) | {_pct(*s.correct_when_evicted)} "
                     f"(n={s.correct_when_evicted[1]}) | {s.mean_cache_tokens:.0f} | {s.questions} |")
    delays = sorted({d for s in summaries for d in s.by_delay})
    lines += ["", "Accuracy % by how many units after the fact the question came (tokens since the fact: mean):", "",
              "| policy | watermarks | " + " | ".join(f"{d} units (~{_mean_age(records, d)} tok)" for d in delays)
              + " |", "|---|---|" + "---|" * len(delays)]
    for s in summaries:
        cells = [f"{_pct(*s.by_delay[d])} (n={s.by_delay[d][1]})" if d in s.by_delay else "-" for d in delays]
        lines.append(f"| {s.label} | {s.watermarks} | " + " | ".join(cells) + " |")
    picks = [s for s in summaries if s.setting.startswith("omnipick")]
    if picks:
        lines += ["", "Paired with OmniPick at the same watermarks (questions only OmniPick got right / only the "
                  "other policy got right; two-sided sign test on those):", ""]
        for p in picks:
            marks = p.setting.split("@")[-1] if "@" in p.setting else ""
            for s in summaries:
                if s is p or (marks and not (s.setting.endswith("@" + marks) or s.setting == "full")):
                    continue
                if s.setting.startswith("omnipick") and not _with_and_without_recall(p.setting, s.setting):
                    continue
                won, lost = paired_counts(records, p.setting, s.setting)
                lines.append(f"- {p.label} {p.watermarks} vs {s.label} {s.watermarks}: +{won} / -{lost} "
                             f"(p = {sign_test(won, lost):.2g})")
    return "\n".join(lines) + "\n"


# --- the whole study ------------------------------------------------------------------------------------------------
def kv_json(d: dict) -> dict:
    """A config's JSON without the quantised-KV keys when the KV is float (run folders made before them stay
    valid)."""
    if d.get("kv_bits") is None:
        for k in ("kv_bits", "kv_group_size", "kv_keep_sinks_full"):
            d.pop(k, None)
    return d


def kv_session_kwargs(config) -> dict:
    """OmniSession keywords of a config's quantised KV ({} for float KV)."""
    if config.kv_bits is None:
        if config.kv_keep_sinks_full:
            raise ValueError("--kv-keep-sinks-full goes with --kv-bits")
        return {}
    return {"kv_bits": config.kv_bits, "kv_group_size": config.kv_group_size,
            "kv_keep_sinks_full": config.kv_keep_sinks_full}


@dataclass
class StudyConfig:
    model: str
    episodes: int = 2
    units: int = 24
    facts: int = 10
    seed: int = 0
    delays: tuple[int, ...] = DELAYS
    sentences: int = 4
    style: str = "log"  # "omni": units laid out as omni units (tag, frame block, speech)
    qa: bool = False  # a question and the model's reply before each shortest-delay probe
    kv_bits: int | None = None  # quantised KV (8 or 4; None: the model's float dtype)
    kv_group_size: int = 64
    kv_keep_sinks_full: bool = False

    def to_json(self) -> dict:
        d = asdict(self)
        d["delays"] = list(self.delays)
        if self.style == "log" and not self.qa:  # run folders made before these options stay valid
            d.pop("style")
            d.pop("qa")
        return kv_json(d)

    def kv(self) -> dict:
        return kv_session_kwargs(self)


def run_study(config: StudyConfig, settings: list[PolicySetting], out: str | Path, *, model=None,
              overwrite: bool = False, log=print) -> dict:
    """Run every setting on every episode (skipping pairs already in ``out``); write ``results.json`` and
    ``table.md``; return the results. ``model`` is a loaded ``(model, tokenizer)`` (default: load the GGUF)."""
    import json

    from .store import ItemLog, open_run

    identity = {k: v for k, v in config.to_json().items() if k != "episodes"}  # more episodes extend a run
    out = open_run(out, {"kind": "retention-study", **identity}, overwrite=overwrite)
    episodes = [make_episode(i, config.seed, config.units, config.facts, tuple(config.delays), config.sentences,
                             config.style, config.qa) for i in range(config.episodes)]
    logs = {s.key: ItemLog(out / s.key / "items.jsonl") for s in settings}
    if model is None and any(f"episode-{ep.index}" not in logs[s.key].done() for s in settings for ep in episodes):
        from ..models.llama_gguf import load_gguf

        model = load_gguf(config.model)
    records: dict[str, list[dict]] = {}
    seconds: dict[str, float] = defaultdict(float)
    for s in settings:
        items = logs[s.key]
        for ep in episodes:
            item = f"episode-{ep.index}"
            if item not in items.done():
                t0 = time.perf_counter()
                rows = [asdict(r) for r in run_episode(model[0], model[1], ep, s, style=config.style,
                                                       kv=config.kv())]
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
    from ..plots.recall import plot_recall

    plot_recall(results, out / "recall.png")
    return results
