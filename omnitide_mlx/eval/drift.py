"""Drift: float16 vs float32 KV, re-rotated after every eviction, against a float32 recompute.

One policy that trims after every unit streams the King James text (eval/perplexity.py's units and scoring) with
float32 and with float16 KV; at checkpoints a float32 oracle prefills the same kept tokens from scratch at their
shifted positions and scores the same next unit: the NLL the re-rotations cost after hundreds of evictions.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .perplexity import (
    SYSTEM_PROMPT,
    load_verses,
    make_units,
    prepared_unit,
    scoring_session,
    text_span,
    token_nll,
)


@dataclass
class DriftConfig:
    model: str
    units: int = 256  # one verse a unit: 211 evictions at 368/368
    per_unit: int = 1
    policy: str = "omnipick"  # keeps old units' tags for a long time, each re-rotated at every eviction
    high: int = 368
    low: int = 368  # high == low: every unit triggers a trim
    checkpoints: tuple[int, ...] = (1, 50, 100, 150, 200)  # after this many evictions
    window: int = 20

    def to_json(self) -> dict:
        d = asdict(self)
        d["checkpoints"] = list(self.checkpoints)
        return d


def _system_ids(session) -> list[int]:
    adapter = session.adapter
    meta, arrays = adapter.state()
    try:
        return [int(i) for i in adapter.system_unit(session.system_prompt, 0).input_ids]
    finally:
        adapter.load_state(meta, arrays)


def recompute_logits(session, kept_ids: list[int], kept_positions: np.ndarray, prep, dtype):
    """Logits of ``prep``'s tokens after ``kept_ids`` prefilled from scratch at ``kept_positions`` into a fresh
    cache of ``dtype`` (no eviction ever happened there): the oracle the bounded sessions are compared with."""
    import mlx.core as mx

    from ..cache import OmniCache

    cache = OmniCache.for_spec(session.adapter.kv_spec, dtype=dtype)
    cache.set_owner(0)
    ids = list(kept_ids) + [int(i) for i in prep.input_ids]
    pos = np.concatenate([np.asarray(kept_positions, dtype=np.int64).reshape(-1), prep.positions[0]])
    embeds = session.adapter.embed_tokens(ids)
    logits = session.model.language_model(embeds[None], cache, mx.array(pos))[0, len(kept_ids):]
    mx.eval(logits)
    return logits


def run_drift(config: DriftConfig, out: str | Path, *, model=None, overwrite: bool = False, log=print) -> dict:
    """Stream the same units through a float32-KV and a float16-KV session under a policy that trims after every
    unit; at each checkpoint compare both with float32 (and float16) recomputes of the same kept tokens at their
    shifted positions. Writes ``drift.json``, ``drift.md`` and ``drift.png``."""
    import mlx.core as mx

    from .policies import PolicySetting
    from .probe import RetentionRecorder
    from .store import open_run

    out = open_run(out, {"kind": "drift", **config.to_json()}, overwrite=overwrite)
    if model is None:
        from ..models.llama_gguf import load_gguf

        model = load_gguf(config.model)
    t0 = time.perf_counter()
    units = make_units(load_verses(), config.per_unit)[:config.units]
    setting = PolicySetting(config.policy, (), config.high, config.low)
    sessions, recorders = {}, {}
    for name, dtype in (("float32", mx.float32), ("float16", mx.float16)):
        recorders[name] = RetentionRecorder(setting.build())
        sessions[name] = scoring_session(model, system_prompt=SYSTEM_PROMPT, policy=recorders[name], kv_dtype=dtype)
    ref = sessions["float32"]
    ids_of = {ref.history[0].uid: _system_ids(ref)}
    rows, checks = [], []
    pending = sorted(set(config.checkpoints))
    for i, text in enumerate(units):
        prep = prepared_unit(ref, text)
        span = text_span(prep)
        evictions = ref.counters.evictions
        oracle = {}
        if pending and evictions >= pending[0]:
            while pending and evictions >= pending[0]:
                pending.pop(0)
            kept_index = recorders["float32"].kept
            kept = [int(x) for u in ref.history
                    for x in np.asarray(ids_of[u.uid])[kept_index.get(u.uid, np.arange(u.length))]]
            for name, dtype in (("float32", mx.float32), ("float16", mx.float16)):
                oracle[name] = recompute_logits(ref, kept, ref.history.positions(), prep, dtype)
        row = {"unit": i, "evictions_before": evictions, "cache_tokens": ref.history.total_tokens,
               "scored": span.length}
        logits = {}
        for name, s in sessions.items():
            rec = s.push(text=text)[0]
            if name == "float32":
                ids_of[rec.uid] = [int(x) for x in prep.input_ids]
            logits[name] = s.backend.step_logits
            row[f"nll_{name}"] = float(token_nll(s.backend.step_logits, prep.input_ids, span.start, span.end).sum())
            s.backend.step_logits = None
        if sessions["float16"].history.positions().tolist() != ref.history.positions().tolist():
            raise RuntimeError("the float16 and float32 sessions kept different tokens")
        if oracle:
            a, b = span.start - 1, span.end - 1
            chk = {"unit": i, "evictions": evictions, "cache_tokens": row["cache_tokens"]}
            for oname, olg in oracle.items():
                chk[f"nll_recompute_{oname}"] = float(token_nll(olg, prep.input_ids, span.start, span.end).sum())
            for name in sessions:
                chk[f"nll_{name}"] = row[f"nll_{name}"]
                chk[f"max_abs_logit_diff_{name}"] = float(mx.max(mx.abs(logits[name][a:b].astype(mx.float32)
                                                                          - oracle["float32"][a:b])).item())
            chk["max_abs_logit_diff_recompute_float16"] = float(mx.max(mx.abs(
                oracle["float16"][a:b] - oracle["float32"][a:b])).item())
            chk["scored"] = span.length
            checks.append(chk)
            log(f"after {evictions} evictions (unit {i}): " + ", ".join(
                f"{k} {v:.4g}" for k, v in chk.items() if k.startswith(("nll", "max_abs"))))
        rows.append(row)
    doc = {"config": config.to_json(), "units": rows, "checkpoints": checks,
           "evictions": ref.counters.evictions, "seconds": time.perf_counter() - t0,
           "summary": _drift_summary(rows, config.window)}
    (out / "drift.json").write_text(json.dumps(doc, indent=1), encoding="utf-8")
    (out / "drift.md").write_text(render_drift(doc), encoding="utf-8")
    plot_drift(doc, out / "drift.png")
    return doc


def _drift_summary(rows: list[dict], window: int) -> dict:
    wins = []
    for a in range(0, len(rows), window):
        w = rows[a:a + window]
        n = sum(r["scored"] for r in w)
        wins.append({"first_unit": w[0]["unit"], "evictions": w[-1]["evictions_before"],
                     "nll_float32": sum(r["nll_float32"] for r in w) / n,
                     "nll_float16": sum(r["nll_float16"] for r in w) / n})
    n = sum(r["scored"] for r in rows)
    return {"nll_float32": sum(r["nll_float32"] for r in rows) / n,
            "nll_float16": sum(r["nll_float16"] for r in rows) / n, "windows": wins}


def render_drift(doc: dict) -> str:
    c = doc["config"]
    lines = [f"{c['policy']} at {c['high']}/{c['low']} (a trim after every unit), {len(doc['units'])} units of "
             f"{c['per_unit']} verse(s), {doc['evictions']} evictions. NLL in nats per text token of the unit read "
             "at the checkpoint; logit differences against the float32 recompute.", "",
             "| evictions so far | cache tokens | NLL recompute fp32 | NLL recompute fp16 | NLL session fp32 | "
             "NLL session fp16 | max abs logit diff fp32 session | fp16 session | fp16 recompute |",
             "|---|---|---|---|---|---|---|---|---|"]
    for k in doc["checkpoints"]:
        n = k["scored"]
        lines.append(f"| {k['evictions']} | {k['cache_tokens']} | {k['nll_recompute_float32'] / n:.5f} "
                     f"| {k['nll_recompute_float16'] / n:.5f} | {k['nll_float32'] / n:.5f} | {k['nll_float16'] / n:.5f} "
                     f"| {k['max_abs_logit_diff_float32']:.2e} | {k['max_abs_logit_diff_float16']:.2e} "
                     f"| {k['max_abs_logit_diff_recompute_float16']:.2e} |")
    s = doc["summary"]
    lines += ["", f"Whole stream: mean NLL {s['nll_float32']:.5f} (float32 KV) vs {s['nll_float16']:.5f} "
              f"(float16 KV), difference {s['nll_float16'] - s['nll_float32']:+.5f} nats / token."]
    return "\n".join(lines) + "\n"


def plot_drift(doc: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    w = doc["summary"]["windows"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    x = [v["evictions"] for v in w]
    a1.plot(x, [v["nll_float16"] - v["nll_float32"] for v in w], "o-", label="float16 KV - float32 KV")
    a1.axhline(0, color="grey", lw=0.6)
    a1.set_xlabel("evictions so far")
    a1.set_ylabel("mean NLL difference per window (nats / token)")
    a1.legend(fontsize=8)
    ck = doc["checkpoints"]
    xs = [k["evictions"] for k in ck]
    for key, lab in (("max_abs_logit_diff_float32", "float32 session"), ("max_abs_logit_diff_float16",
                     "float16 session"), ("max_abs_logit_diff_recompute_float16", "float16 recompute")):
        a2.semilogy(xs, [max(k[key], 1e-9) for k in ck], "o-", label=lab)
    a2.set_xlabel("evictions so far")
    a2.set_ylabel("max |logit - float32 recompute|")
    a2.legend(fontsize=8)
    fig.suptitle("Drift of re-rotated keys (SmolLM2-135M, KJV Genesis)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
