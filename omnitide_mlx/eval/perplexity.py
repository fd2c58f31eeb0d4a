"""Perplexity over a long real text stream (StreamingLLM's figure-3 experiment, on OmniSession).

The King James text of Genesis 1-26 (public domain, shipped in ``eval/data``) streams into SmolLM2-135M-Instruct
three verses a unit: ``[Gen 1:1]`` (the unit's boundary tag), the verses (text), a newline (boundary). Every unit is
one prefill through the session's bounded OmniCache, and the same forward scores it: the negative log-likelihood of
each of its text tokens given the retained history and the unit so far, taken before retention runs on it. So a
unit is scored against exactly what the policy kept, and one forward per unit both scores and appends.

Settings compared (:func:`perplexity_settings`): full context (until the model's context length), and unit FIFO,
token sliding, StreamingLLM with 4 sinks, H2O and OmniPick at two watermark pairs, each (a) shifting kept tokens
to close the gaps with one float32 re-rotation (the engine's rule) and (b) keeping the old positions with the gaps
(``positions="keep"``); (c) a plain token window with no system prefix and no sinks at all, beside StreamingLLM's
4 sinks on the same prefix-less stream.

The drift experiment (eval/drift.py) streams the same text through the same scoring helpers.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .policies import PolicySetting

DATA = Path(__file__).parent / "data" / "kjv_genesis_1-26.txt"
SYSTEM_PROMPT = "You are a helpful assistant. You read a book aloud, a few verses at a time."


def load_verses(path: str | Path = DATA) -> list[tuple[str, str]]:
    """``(chapter:verse, text)`` per line of the shipped KJV file."""
    out = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines()):
        ref, _, text = line.partition(" ")
        if not (ref and text and ":" in ref):
            raise ValueError(f"{path} line {n + 1}: expected 'CHAPTER:VERSE text', got {line[:40]!r}")
        out.append((ref, text.strip()))
    return out


def make_units(verses: list[tuple[str, str]], per_unit: int = 3) -> list[str]:
    """``[Gen 1:1] verse verse verse``: one stream unit per ``per_unit`` verses; the tag is the unit's boundary."""
    return [f"[Gen {verses[i][0]}] " + " ".join(t for _, t in verses[i:i + per_unit])
            for i in range(0, len(verses), per_unit)]


# --- scoring through a session ----------------------------------------------------------------------------------

def scoring_session(model, **kwargs):
    """An OmniSession whose backend keeps the logits of every token of its last prefill
    (``session.backend.step_logits``): the stream is scored by the forward that appends it."""
    from ..session import MlxBackend, OmniSession

    class ScoringBackend(MlxBackend):
        step_logits = None

        def forward(self, model, cache, embeds, positions, *, hidden=False, extras=None):
            import mlx.core as mx

            from ..session import language_model_inputs

            pos = mx.array(positions if positions.shape[0] > 1 else positions[0])
            lm = model.language_model
            logits = lm(embeds[None], cache, pos, **language_model_inputs(lm.__call__, extras))[0]
            self.step_logits = logits
            return logits[-1], None

    return OmniSession(model, backend=ScoringBackend(), **kwargs)


class _NoSystemAdapter:
    """The text adapter with no system prefix: the session's first unit is an ordinary (evictable) user-turn
    opening, so a plain window keeps nothing of the stream's start (variant c: no sinks at all)."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def system_unit(self, prompt, start):
        from ..core.units import SpanKind, UnitKind

        unit = self._inner._unit(UnitKind.USER, [(SpanKind.BOUNDARY, list(self._inner.user_open))], start, "open")
        self._inner.turn_open = True
        return unit


class _NoSystemModel:
    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def stream_adapter(self, tokenizer, **kw):
        return _NoSystemAdapter(self._model.stream_adapter(tokenizer, **kw))


def prepared_unit(session, text: str):
    """The unit ``session.push(text=text)`` would prefill now (ids and spans), the adapter's state restored."""
    adapter = session.adapter
    meta, arrays = adapter.state()
    try:
        return adapter.context_unit(text, session.history.next_position())
    finally:
        adapter.load_state(meta, arrays)


def text_span(prepared):
    from ..core.units import SpanKind

    spans = [s for s in prepared.spans if s.kind is SpanKind.TEXT]
    if len(spans) != 1 or spans[0].start < 1:
        raise ValueError(f"a scored unit needs one text span after its tag, got {prepared.spans}")
    return spans[0]


def token_nll(logits, ids: np.ndarray, start: int, end: int) -> np.ndarray:
    """NLL (float64 numpy) of ``ids[start:end]``, each predicted by the logits row before it."""
    import mlx.core as mx

    from ..kernels.cpu_math import logsumexp_last

    lg = logits[start - 1:end - 1].astype(mx.float32)
    tgt = mx.array(np.asarray(ids[start:end], dtype=np.int32))
    picked = mx.take_along_axis(lg, tgt[:, None], axis=-1)[:, 0]
    nll = logsumexp_last(lg) - picked  # mx.logsumexp; 3x faster on the CPU (kernels/cpu_math.py)
    return np.array(nll).astype(np.float64)


@dataclass
class UnitScore:
    unit: int
    tokens: int  # tokens of the unit (tag, text, newline)
    scored: int  # its text tokens
    nll: float  # their summed NLL (nats)
    cache_tokens: int  # retained history the unit was read against
    max_position: int  # the largest position of the unit (grows past the model's context with "keep")
    evicted: int  # tokens the trim after this unit deleted


@dataclass(frozen=True)
class StreamSetting:
    """A policy setting plus whether the session has a system prefix (variant c has none)."""

    policy: PolicySetting
    system: bool = True

    @property
    def key(self) -> str:
        return self.policy.key + ("" if self.system else "+nosys")

    @property
    def positions(self) -> str:
        return str(dict(self.policy.overrides).get("positions", "shift"))

    @property
    def variant(self) -> str:
        if self.policy.name == "full":
            return "-"
        if not self.system:
            return "c"
        return "b" if self.positions == "keep" else "a"

    @property
    def label(self) -> str:
        names = {"full": "full context", "fifo": "unit FIFO", "token": "token sliding", "h2o": "H2O",
                 "streamingllm": "StreamingLLM", "omnipick": "OmniPick"}
        base = names.get(self.policy.name, self.policy.name)
        opts = {k: v for k, v in self.policy.overrides if k != "positions"}
        if self.policy.name == "streamingllm":
            base += f" ({opts.pop('sink', 2)} sinks)"
        if self.policy.name == "token" and not self.system:
            base = "plain window"
        if opts:
            base += " (" + ", ".join(f"{k}={v}" for k, v in opts.items()) + ")"
        return base

    def to_json(self) -> dict:
        return {**self.policy.to_json(), "system": self.system, "variant": self.variant, "key": self.key,
                "label": self.label}


def stream_scores(model, tokenizer, units: list[str], setting: StreamSetting, *, max_tokens: int,
                  kv_dtype=None, system_prompt: str = SYSTEM_PROMPT, context_length: int | None = None,
                  on_unit=None, kv: dict | None = None):
    """Stream ``units`` (until ``max_tokens`` are streamed, or the next unit would pass ``context_length``) through
    a session under ``setting``; score each unit before it is trimmed. Returns ``(scores, session)``."""
    m = model if setting.system else _NoSystemModel(model)
    session = scoring_session((m, tokenizer), system_prompt=system_prompt, policy=setting.policy.build(), kv_dtype=kv_dtype,
                  **(kv or {}))
    out: list[UnitScore] = []
    streamed = 0
    for i, text in enumerate(units):
        if streamed >= max_tokens:
            break
        prep = prepared_unit(session, text)
        if context_length is not None and session.history.total_tokens + prep.length > context_length:
            break
        if on_unit is not None:
            on_unit(i, session, prep)
        cache_tokens = session.history.total_tokens
        rec = session.push(text=text)[0]
        if rec.tokens != prep.length:
            raise RuntimeError(f"unit {i}: pushed {rec.tokens} tokens, prepared {prep.length}")
        span = text_span(prep)
        nll = token_nll(session.backend.step_logits, prep.input_ids, span.start, span.end)
        session.backend.step_logits = None
        out.append(UnitScore(i, prep.length, span.length, float(nll.sum()), cache_tokens,
                             int(prep.positions.max()), rec.evicted_tokens))
        streamed += prep.length
    return out, session


# --- the perplexity experiment ----------------------------------------------------------------------------------

BOUNDED = ("token", "omnipick", "streamingllm:sink=4", "fifo", "h2o")
DEFAULT_MARKS = ("512/368", "1024/736")  # the paper's low / high ratio (0.72)


def _with(spec: str, option: str) -> str:
    return spec + ("," if ":" in spec else ":") + option


def perplexity_settings(marks: tuple[str, ...] = DEFAULT_MARKS, keep_marks: tuple[str, ...] | None = None,
                        plain_marks: tuple[str, ...] | None = None) -> list[StreamSetting]:
    """Full context; every bounded policy at every pair in ``marks`` shifting (a); keeping positions (b) at
    ``keep_marks`` (default: all); the prefix-less plain window and StreamingLLM (c) at ``plain_marks`` (default:
    the first pair). Ordered by what the comparison needs first (a run stopped early has the most telling rows):
    per watermark pair, token sliding (a, b, c), OmniPick (a, b), StreamingLLM (a), then full context once, FIFO and
    H2O (a), StreamingLLM (c), and the remaining (b) rows."""
    from .policies import expand_settings

    keep_marks = marks if keep_marks is None else keep_marks
    plain_marks = marks[:1] if plain_marks is None else plain_marks

    def one(spec: str, mark: str, system: bool = True) -> StreamSetting:
        return StreamSetting(expand_settings([spec], [mark])[0], system)

    out: list[StreamSetting] = []
    for i, mk in enumerate(marks):
        keep, plain = mk in keep_marks, mk in plain_marks
        tok, pick, sllm, fifo, h2o = BOUNDED
        out.append(one(tok, mk))
        out += [one(_with(tok, "positions=keep"), mk)] if keep else []
        out += [one(tok, mk, system=False)] if plain else []
        out.append(one(pick, mk))
        out += [one(_with(pick, "positions=keep"), mk)] if keep else []
        out.append(one(sllm, mk))
        if i == 0:
            out.append(StreamSetting(expand_settings(["full"], None)[0]))
        out += [one(fifo, mk), one(h2o, mk)]
        out += [one(sllm, mk, system=False)] if plain else []
        out += [one(_with(p, "positions=keep"), mk) for p in (sllm, fifo, h2o)] if keep else []
    if not marks:
        out.append(StreamSetting(expand_settings(["full"], None)[0]))
    return out


@dataclass
class PerplexityConfig:
    model: str
    tokens: int = 20_000  # streamed tokens per bounded setting
    per_unit: int = 3  # verses per unit
    window: int = 10  # units per point of the NLL curves
    marks: tuple[str, ...] = DEFAULT_MARKS
    keep_marks: tuple[str, ...] | None = None
    plain_marks: tuple[str, ...] | None = None
    kv_bits: int | None = None  # quantised KV (8 or 4; None: the model's float dtype)
    kv_group_size: int = 64
    kv_keep_sinks_full: bool = False

    def to_json(self) -> dict:
        from .study import kv_json

        d = asdict(self)
        for k in ("marks", "keep_marks", "plain_marks"):
            d[k] = None if d[k] is None else list(d[k])
        return kv_json(d)

    def kv(self) -> dict:
        from .study import kv_session_kwargs

        return kv_session_kwargs(self)


def window_means(scores: list[dict], window: int) -> list[dict]:
    """Mean NLL per token over consecutive windows of ``window`` units (the curve's points)."""
    out = []
    for a in range(0, len(scores), window):
        w = scores[a:a + window]
        n = sum(s["scored"] for s in w)
        out.append({"first_unit": w[0]["unit"], "last_unit": w[-1]["unit"], "tokens_streamed": 0,
                    "nll": sum(s["nll"] for s in w) / n, "scored": n,
                    "mean_cache_tokens": float(np.mean([s["cache_tokens"] for s in w]))})
    return out


def summarize_stream(scores: list[dict], window: int, context_length: int) -> dict:
    """Overall and per-window mean NLL, and where a curve leaves the full-context level or blows up."""
    streamed = np.cumsum([s["tokens"] for s in scores]) if scores else np.zeros(0)
    wins = window_means(scores, window)
    for w in wins:
        w["tokens_streamed"] = int(streamed[w["last_unit"] - scores[0]["unit"]])
    n = sum(s["scored"] for s in scores)
    nll = sum(s["nll"] for s in scores) / n if n else float("nan")
    past = [s for s in scores if s["max_position"] >= context_length]
    before = [s for s in scores if s["max_position"] < context_length and s["cache_tokens"] > 0]
    mean = lambda rows: (sum(r["nll"] for r in rows) / sum(r["scored"] for r in rows)) if rows else None  # noqa
    return {"units": len(scores), "tokens": int(streamed[-1]) if scores else 0, "scored": n, "nll": nll,
            "ppl": float(np.exp(nll)) if n else None, "evictions": sum(1 for s in scores if s["evicted"]),
            "evicted_tokens": sum(s["evicted"] for s in scores),
            "mean_cache_tokens": float(np.mean([s["cache_tokens"] for s in scores])) if scores else 0.0,
            "max_position": max((s["max_position"] for s in scores), default=0),
            "nll_within_context": mean(before), "nll_past_context": mean(past),
            "first_unit_past_context": past[0]["unit"] if past else None, "windows": wins}


def _stream_one(model, config: PerplexityConfig, units: list[str], setting: StreamSetting,
                context_length: int | None) -> dict:
    """One setting's ``items.jsonl`` record (its scores, seconds and final cache size)."""
    t0 = time.perf_counter()
    limit = context_length if setting.policy.name == "full" else None
    scores, session = stream_scores(model[0], model[1], units, setting, max_tokens=config.tokens,
                                    context_length=limit, kv=config.kv())
    return {"scores": [asdict(x) for x in scores], "seconds": time.perf_counter() - t0,
            "context_length": context_length, "final_cache_tokens": session.history.total_tokens}


_WORKER: dict = {}


def _worker_start(config: PerplexityConfig) -> None:
    """A worker process of ``run_perplexity(jobs=N)``: load the model and the text once."""
    from ..models.llama_gguf import load_gguf

    model = load_gguf(config.model)
    _WORKER.update(model=model, units=make_units(load_verses(), config.per_unit), context_length=_context_length(model))


def _worker_stream(config: PerplexityConfig, setting: StreamSetting) -> dict:
    w = _WORKER
    return _stream_one(w["model"], config, w["units"], setting, w["context_length"])


def _run_in_workers(config: PerplexityConfig, todo: list[StreamSetting], jobs: int, finished) -> None:
    """Stream ``todo`` in ``jobs`` spawned processes, one BLAS thread each (the settings are independent, and two
    single-threaded streams get more done on two cores than one two-threaded one: 0.82 s a SmolLM2 unit against
    0.63 s). ``finished(setting, record)`` runs here, in this process, as each one ends."""
    import multiprocessing as mp
    import os
    from concurrent.futures import ProcessPoolExecutor, as_completed

    saved = {k: os.environ.get(k) for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    os.environ.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")  # read when a worker loads OpenBLAS
    try:
        # longest first (full context reads up to 8K keys, larger watermarks more), so no worker idles long at the end
        order = sorted(todo, key=lambda s: (s.policy.name != "full", -s.policy.high))
        with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn"), initializer=_worker_start,
                                 initargs=(config,)) as pool:
            futures = {pool.submit(_worker_stream, config, s): s for s in order}
            for f in as_completed(futures):
                finished(futures[f], f.result())
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_perplexity(config: PerplexityConfig, settings: list[StreamSetting], out: str | Path, *, model=None,
                   overwrite: bool = False, log=print, jobs: int = 1) -> dict:
    """Run every setting (skipping those already in ``out``); write ``results.json``, ``table.md`` and, with
    matplotlib, ``nll.png``. ``jobs`` > 1 streams that many settings at once in worker processes (each loads the
    model; ``model`` is then unused); every setting's record is the same as in one process up to float rounding."""
    from .store import ItemLog, open_run

    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be a positive integer, got {jobs!r}")
    out = open_run(out, {"kind": "perplexity", **config.to_json()}, overwrite=overwrite)
    logs = {s.key: ItemLog(out / s.key / "items.jsonl") for s in settings}
    todo = [s for s in settings if "stream" not in logs[s.key].done()]

    def finished(s: StreamSetting, record: dict) -> None:
        logs[s.key].append("stream", record)
        summ = summarize_stream(record["scores"], config.window, record["context_length"])
        log(f"{s.key:<44} NLL {summ['nll']:.4f} over {summ['tokens']} tokens, {summ['evictions']} evictions, "
            f"{record['seconds']:6.1f} s")

    if todo and jobs > 1:
        _run_in_workers(config, todo, min(jobs, len(todo)), finished)
    elif todo:
        if model is None:
            from ..models.llama_gguf import load_gguf

            model = load_gguf(config.model)
        units = make_units(load_verses(), config.per_unit)
        context_length = _context_length(model)
        for s in todo:
            finished(s, _stream_one(model, config, units, s, context_length))
    results = {}
    for s in settings:
        rec = logs[s.key].records()["stream"]
        summ = summarize_stream(rec["scores"], config.window, rec["context_length"])
        results[s.key] = {"setting": s.to_json(), "seconds": rec["seconds"], "context_length": rec["context_length"],
                          **summ}
    full = results.get("full")
    if full:  # the bounded settings on the stretch full context could read, for a like-for-like comparison
        last = full["units"]
        for key, r in results.items():
            rows = logs[key].records()["stream"]["scores"][:last]
            n = sum(x["scored"] for x in rows)
            r["nll_first_units_of_full"] = sum(x["nll"] for x in rows) / n if n else None
    doc = {"config": config.to_json(), "settings": [s.to_json() for s in settings], "results": results}
    (out / "results.json").write_text(json.dumps(doc, indent=1), encoding="utf-8")
    (out / "table.md").write_text(render_perplexity(doc), encoding="utf-8")
    plot_perplexity(doc, out / "nll.png")
    return doc


def _context_length(model) -> int:
    return int(getattr(model[0].config, "context_length", 0) or 1 << 30)


def _f(x, d=3):
    return "-" if x is None else f"{x:.{d}f}"


def render_perplexity(doc: dict) -> str:
    res = doc["results"]
    full = res.get("full")
    lines = ["| variant | policy | watermarks | positions | mean NLL | ppl | NLL on full's stretch | "
             "NLL before position 8192 | NLL after | evictions | mean cache tokens | tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, r in res.items():
        s = r["setting"]
        pos = "-" if s["name"] == "full" else dict(s["overrides"]).get("positions", "shift")
        lines.append(f"| {s['variant']} | {s['label']} | {'-' if s['name'] == 'full' else str(s['high']) + '/' + str(s['low'])} "
                     f"| {pos} | {_f(r['nll'])} | {_f(r['ppl'], 2)} | {_f(r.get('nll_first_units_of_full'))} "
                     f"| {_f(r['nll_within_context'])} | {_f(r['nll_past_context'])} | {r['evictions']} "
                     f"| {r['mean_cache_tokens']:.0f} | {r['tokens']} |")
    if full:
        lines += ["", f"Full context stops at {full['tokens']} tokens ({full['units']} units): the next unit would "
                  f"pass the model's context length. \"NLL on full's stretch\" compares every setting on those "
                  f"units."]
    return "\n".join(lines) + "\n"


def plot_perplexity(doc: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    res = doc["results"]
    marks = sorted({f"{r['setting']['high']}/{r['setting']['low']}" for r in res.values()
                    if r["setting"]["name"] != "full"}, key=lambda m: -int(m.split("/")[0]))
    fig, axes = plt.subplots(1, len(marks), figsize=(7 * len(marks), 4.8), sharey=True, squeeze=False)
    colours = {"fifo": "C0", "token": "C1", "streamingllm": "C2", "h2o": "C3", "omnipick": "C4", "full": "k"}
    for ax, mk in zip(axes[0], marks):
        for key, r in res.items():
            s = r["setting"]
            if s["name"] != "full" and f"{s['high']}/{s['low']}" != mk:
                continue
            x = [w["tokens_streamed"] for w in r["windows"]]
            y = [w["nll"] for w in r["windows"]]
            style = {"a": "-", "b": "--", "c": ":", "-": "-"}[s["variant"]]
            colour = colours.get(s["name"], "C5") if s["variant"] != "c" else ("C7" if s["name"] == "token" else "C8")
            ax.plot(x, y, style, color=colour, lw=1.4 if s["variant"] != "b" else 1.0,
                    label=f"{s['label']} ({s['variant']})" if s["variant"] != "-" else s["label"])
        ctx = next((r.get("context_length") for r in res.values() if r.get("context_length")), None)
        if ctx:  # where positions kept with gaps (b) pass the trained context
            ax.axvline(ctx, color="grey", lw=0.6)
            ax.annotate(f"context length {ctx}", (ctx, 0.02), xycoords=("data", "axes fraction"), fontsize=7,
                        color="grey", xytext=(3, 0), textcoords="offset points")
        ax.set_title(f"watermarks {mk}")
        ax.set_xlabel("tokens streamed")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    axes[0][0].set_ylabel(f"mean NLL per text token (window of {doc['config']['window']} units)")
    fig.suptitle("SmolLM2-135M-Instruct reading KJV Genesis through OmniSession\n(a) shift + re-rotate, "
                 "(b) keep positions (gaps), (c) no system prefix", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
