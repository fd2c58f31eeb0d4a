"""The perplexity and drift experiments (eval/perplexity.py, eval/drift.py): the shipped text, scoring equal to an offline
forward, positions="keep" exact on a real decoder, and both CLI experiments end to end on a tiny GGUF (seconds)."""

from __future__ import annotations

import json

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("gguf")

from omnitide_mlx.cli import main  # noqa: E402
from omnitide_mlx.eval import perplexity as px  # noqa: E402
from omnitide_mlx.eval.policies import expand_settings  # noqa: E402
from omnitide_mlx.models.llama_gguf import load_gguf  # noqa: E402
from omnitide_mlx.models.llama_gguf.adapter import UNIT_TAG  # noqa: E402
from omnitide_mlx.models.llama_gguf.tiny import write_tiny_gguf  # noqa: E402


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", seed=3)


@pytest.fixture(scope="module")
def tiny(tiny_path):
    return load_gguf(tiny_path)


def test_the_shipped_text_and_its_units():
    verses = px.load_verses()
    assert len(verses) == 728 and verses[0] == ("1:1", "In the beginning God created the heaven and the earth.")
    assert verses[-1][0] == "26:35"
    units = px.make_units(verses)
    assert len(units) == 243 and units[1].startswith("[Gen 1:4] And God saw the light")
    assert all(UNIT_TAG.match(u) for u in units)


def _setting(spec: str, mark: str | None = None, system: bool = True) -> px.StreamSetting:
    return px.StreamSetting(expand_settings([spec], [mark] if mark else None)[0], system)


def test_scores_equal_an_offline_forward_of_the_same_tokens(tiny):
    """Full context: each unit's summed NLL equals the NLL of its text tokens in one offline forward."""
    model, tok = tiny
    units = px.make_units(px.load_verses())[:4]
    scores, session = px.stream_scores(model, tok, units, _setting("full"), max_tokens=10_000)
    ids = np.concatenate([session.adapter.system_unit(px.SYSTEM_PROMPT, 0).input_ids] +
                         [np.asarray(x) for x in _unit_ids(model, tok, units)])
    lm = model.language_model
    logits = lm(lm.embed_tokens(mx.array(ids))[None])[0]
    offset = session.history[0].length
    for s, u in zip(scores, session.history.stream_units):
        unit_ids = ids[offset:offset + u.length]
        start = next(sp.start for sp in u.spans if sp.kind.value == "text")
        want = px.token_nll(logits, ids, offset + start, offset + start + s.scored).sum()
        assert s.scored > 10 and s.nll == pytest.approx(want, rel=1e-4)
        assert len(unit_ids) == s.tokens
        offset += u.length


def _unit_ids(model, tok, units):
    from omnitide_mlx.session import OmniSession

    s = OmniSession((model, tok), policy="full", system_prompt=px.SYSTEM_PROMPT)
    out = []
    for u in units:
        out.append(px.prepared_unit(s, u).input_ids)
        s.push(text=u)
    return out


def test_keep_positions_equal_the_masked_full_cache_at_the_old_positions(tiny):
    """positions="keep" on a real decoder: right after the first eviction the bounded cache reads the next unit
    exactly as a full-context cache with the deleted tokens masked out and every kept key where it was written
    (later, kept tokens' deeper keys were themselves computed from a trimmed cache, and the two differ)."""
    from mlx_lm.models.cache import KVCache

    from omnitide_mlx.eval.probe import RetentionRecorder

    model, tok = tiny
    units = px.make_units(px.load_verses())[:6]
    recorder = RetentionRecorder(_setting("streamingllm:positions=keep,sink=4", "500/300").policy.build())
    bounded = px.scoring_session((model, tok), policy=recorder, system_prompt=px.SYSTEM_PROMPT)
    full = px.scoring_session((model, tok), policy="full", system_prompt=px.SYSTEM_PROMPT)
    for u in units[:-1]:
        bounded.push(text=u)
        full.push(text=u)
        if recorder.plans:
            break
    assert recorder.plans == 1
    offsets = dict(zip((u.uid for u in full.history), full.history.offsets()))
    kept = np.asarray([offsets[u.uid] + int(i) for u in bounded.history for i in recorder.kept[u.uid]])
    assert np.array_equal(bounded.history.positions()[0], kept)  # the gaps stayed
    assert (np.diff(kept) > 1).sum() == 1  # the sink, a gap, the window
    slots = full.cache.logical_slots()[kept]
    reference = []
    for layer in full.cache.layers:
        c = KVCache()
        c.update_and_fetch(layer.keys[:, :, mx.array(slots), :], layer.values[:, :, mx.array(slots), :])
        reference.append(c)
    prep = px.prepared_unit(bounded, units[-1])
    lm = model.language_model
    want = lm(prep.inputs_embeds[None], reference, mx.array(prep.positions[0]))[0]
    bounded.push(text=units[-1])
    np.testing.assert_allclose(np.array(bounded.backend.step_logits), np.array(want), atol=1e-4, rtol=1e-4)


def test_settings_cover_the_variants_in_priority_order():
    keys = [s.key for s in px.perplexity_settings(("512/368", "1024/736"))]
    assert keys[:6] == ["token@512-368", "token+positions=keep@512-368", "token@512-368+nosys", "omnipick@512-368",
                        "omnipick+positions=keep@512-368", "streamingllm+sink=4@512-368"]
    assert keys.count("full") == 1 and len(keys) == len(set(keys)) == 23
    variants = {s.key: s.variant for s in px.perplexity_settings(("512/368",))}
    assert variants["h2o+positions=keep@512-368"] == "b" and variants["streamingllm+sink=4@512-368+nosys"] == "c"
    assert {v for v in variants.values()} == {"-", "a", "b", "c"}


def test_perplexity_and_drift_commands_end_to_end(tiny_path, tmp_path):
    args = ["eval", "study", "--experiment", "perplexity", "--gguf", str(tiny_path), "--tokens", "1500",
            "--watermarks", "500/360"]
    assert main(args + ["--out", str(tmp_path / "a")]) == 0
    assert main(args + ["--out", str(tmp_path / "b")]) == 0
    a = json.loads((tmp_path / "a" / "results.json").read_text())
    b = json.loads((tmp_path / "b" / "results.json").read_text())
    for r in list(a["results"].values()) + list(b["results"].values()):
        r.pop("seconds")
    assert a["results"] == b["results"]  # deterministic
    res = a["results"]
    assert len(res) == 13 and res["full"]["evictions"] == 0 and res["token@500-360"]["evictions"] >= 2
    assert res["token+positions=keep@500-360"]["max_position"] > res["token@500-360"]["max_position"]
    assert all(r["tokens"] >= 1500 for k, r in res.items() if k != "full")
    assert "| b | token sliding | 500/360 | keep |" in (tmp_path / "a" / "table.md").read_text()
    # two worker processes (one BLAS thread each): the same streams, up to float rounding
    assert main(args + ["--out", str(tmp_path / "j"), "--jobs", "2"]) == 0
    j = json.loads((tmp_path / "j" / "results.json").read_text())["results"]
    assert list(j) == list(res)
    for key, r in res.items():
        assert {k: v for k, v in j[key].items() if not isinstance(v, float)} == \
               {k: v for k, v in r.items() if not isinstance(v, float)}, key
        assert j[key]["nll"] == pytest.approx(r["nll"], rel=1e-5), key
    for experiment in ("recall", "drift"):  # a usage error, the same for both, before the model loads
        assert main(["eval", "study", "--experiment", experiment, "--gguf", str(tiny_path), "--jobs", "2",
                     "--out", str(tmp_path / "d")]) == 2
    assert not (tmp_path / "d").exists()
    assert main(["eval", "study", "--experiment", "perplexity", "--gguf", str(tiny_path), "--policy", "h2o",
                 "--out", str(tmp_path / "c")]) == 1

    out = tmp_path / "drift"
    assert main(["eval", "study", "--experiment", "drift", "--gguf", str(tiny_path), "--units", "30",
                 "--watermarks", "300/300", "--checkpoints", "0,5,15", "--out", str(out)]) == 0
    doc = json.loads((out / "drift.json").read_text())
    assert doc["evictions"] >= 20 and [c["evictions"] for c in doc["checkpoints"]] == [0, 5, 15]
    first = doc["checkpoints"][0]  # before any eviction the recompute is the session's own history
    assert first["max_abs_logit_diff_float32"] < 1e-3 and first["max_abs_logit_diff_float16"] < 0.1
    for c in doc["checkpoints"]:
        assert abs(c["nll_float16"] - c["nll_float32"]) / c["scored"] < 0.05
    assert "| 15 |" in (out / "drift.md").read_text()


def test_perplexity_over_a_quantised_kv_cache(tmp_path):
    """--kv-bits runs the same streams over a quantised OmniCache: the run records it, the sessions hold packed
    K/V (so the NLL moves, a little at 8 bits, more at 4), and a float run's folder is not resumed into."""
    path = write_tiny_gguf(tmp_path / "hd32.gguf", seed=3, heads=2, kv_heads=1)  # head_dim 32: a group fits
    base = ["eval", "study", "--experiment", "perplexity", "--gguf", str(path), "--tokens", "600",
            "--watermarks", "300/200"]
    res = {}
    for name, extra in (("fp", []), ("kv8", ["--kv-bits", "8", "--kv-group-size", "32"]),
                        ("kv4", ["--kv-bits", "4", "--kv-group-size", "32"])):
        assert main(base + extra + ["--out", str(tmp_path / name)]) == 0
        doc = json.loads((tmp_path / name / "results.json").read_text())
        res[name] = doc
    assert "kv_bits" not in res["fp"]["config"]  # float runs keep the old config (old folders stay valid)
    assert res["kv4"]["config"]["kv_bits"] == 4 and res["kv4"]["config"]["kv_group_size"] == 32
    for key, r in res["fp"]["results"].items():
        d8 = abs(res["kv8"]["results"][key]["nll"] - r["nll"])
        d4 = abs(res["kv4"]["results"][key]["nll"] - r["nll"])
        assert res["kv4"]["results"][key]["evictions"] == r["evictions"]
        assert d8 < 0.05 and d4 < 0.5, (key, d8, d4)
    assert any(abs(res["kv4"]["results"][k]["nll"] - r["nll"]) > 1e-6 for k, r in res["fp"]["results"].items())
    # the float folder is not resumed into by a quantised run
    assert main(base + ["--kv-bits", "4", "--kv-group-size", "32", "--out", str(tmp_path / "fp")]) == 1
    assert main(base + ["--kv-keep-sinks-full", "--out", str(tmp_path / "x")]) == 1
    assert main(["eval", "study", "--experiment", "drift", "--gguf", str(path), "--kv-bits", "4",
                 "--out", str(tmp_path / "d")]) == 1


def test_recall_episode_over_a_quantised_kv_cache(tmp_path, monkeypatch):
    """The recall study's sessions take the quantised-KV keywords (StudyConfig.kv())."""
    from omnitide_mlx import session as session_mod
    from omnitide_mlx.eval import study

    seen = []

    class Recording(session_mod.OmniSession):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            seen.append(self.cache.kv_bits)

    path = write_tiny_gguf(tmp_path / "hd32.gguf", seed=3, heads=2, kv_heads=1)
    model, tok = load_gguf(path)
    cfg = study.StudyConfig(model=str(path), kv_bits=4, kv_group_size=32)
    assert cfg.to_json()["kv_bits"] == 4 and "kv_bits" not in study.StudyConfig(model="m").to_json()
    monkeypatch.setattr(session_mod, "OmniSession", Recording)
    ep = study.make_episode(0, seed=0, units=4, facts=1)
    try:
        study.run_episode(model, tok, ep, expand_settings(["full"], None)[0], kv=cfg.kv())
    except ValueError:  # a fact word longer than one token of the tiny vocabulary: the session exists already
        pass
    assert seen == [4]
