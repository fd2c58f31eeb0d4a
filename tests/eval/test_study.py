"""The retention study: episodes, summaries, and a small run on the real SmolLM2 weights (where installed)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from omnitide_mlx.eval.policies import expand_settings, parse_policy_spec, parse_watermarks
from omnitide_mlx.eval.study import (make_episode, paired_counts, render_markdown, sign_test, summarize,
                                     wilson_interval)


def test_episodes_are_reproducible_and_ask_only_about_facts_already_stated():
    a, b = make_episode(0, seed=3), make_episode(0, seed=3)
    assert a == b and make_episode(1, seed=3) != a
    assert len(a.units) == 24 and len(a.facts) == 10
    for f in a.facts:
        assert f.sentence in a.units[f.unit]
        assert sum(f.sentence in u for u in a.units) == 1
        assert f.answer_prefix.lower().startswith(f.key)
    assert len({f.word for f in a.facts}) == 10 and len({f.key for f in a.facts}) == 10
    assert [q.after_unit for q in a.questions] == sorted(q.after_unit for q in a.questions)
    for i, f in enumerate(a.facts):  # every fact at every delay that fits in the episode
        want = [d for d in (2, 8, 16) if f.unit + 1 + d <= 24]
        assert [q.delay for q in a.questions if q.fact == i] == want and want[0] == 2
        assert all(q.after_unit == f.unit + 1 + q.delay for q in a.questions if q.fact == i)
    assert a.units[0].startswith("[00:00] ") and a.units[7].startswith("[01:10] ")
    with pytest.raises(ValueError):
        make_episode(0, facts=30)


def test_policy_and_watermark_specs():
    assert parse_policy_spec("omnipick:text_budget=64,recent_units=3") == \
        ("omnipick", (("recent_units", 3), ("text_budget", 64)))
    assert parse_watermarks(" 512 / 368 ") == (512, 368)
    with pytest.raises(ValueError, match="HIGH/LOW"):
        parse_watermarks("512-368")
    with pytest.raises(ValueError, match="unknown policy"):
        parse_policy_spec("lru")
    settings = expand_settings(["full", "omnipick:text_budget=64", "fifo"], ["512/368", "256/184"])
    assert [s.key for s in settings] == ["full", "omnipick+text_budget=64@512-368", "fifo@512-368",
                                         "omnipick+text_budget=64@256-184", "fifo@256-184"]
    assert settings[1].build().text_budget == 64 and settings[3].build().high == 256
    with pytest.raises(ValueError, match="recent_units"):
        expand_settings(["omnipick:recent_units=0"], None)


def test_recent_count_spec_reaches_the_policy():
    assert parse_policy_spec("omnipick:recent_count=all") == ("omnipick", (("recent_count", "all"),))
    (s,) = expand_settings(["omnipick:recent_count=all"], ["512/368"])
    assert s.key == "omnipick+recent_count=all@512-368" and s.build().recent_count == "all"
    with pytest.raises(ValueError, match="recent_count is one of media, all"):
        parse_policy_spec("omnipick:recent_count=text")


def _row(ep, unit, fact_unit, correct, retained, age):
    return {"episode": ep, "setting": "", "after_unit": unit, "fact_unit": fact_unit, "delay": unit - fact_unit - 1,
            "age_tokens": age, "answer": "a", "predicted": "a" if correct else "b", "correct": correct,
            "exact": False, "retained": retained, "cache_tokens": 100}


def test_interval_and_sign_test():
    lo, hi = wilson_interval(28, 40)
    assert (round(lo, 1), round(hi, 1)) == (54.6, 81.9)
    assert sign_test(6, 1) == pytest.approx(0.125) and sign_test(0, 0) == 1.0 and sign_test(3, 3) == 1.0


def test_summaries_count_what_the_records_say():
    settings = expand_settings(["full", "omnipick", "fifo"], ["512/368"])
    records = {"full": [_row(0, 10, 2, True, True, 900), _row(0, 10, 5, True, True, 300)],
               "omnipick@512-368": [_row(0, 10, 2, True, True, 900), _row(0, 10, 5, False, False, 300)],
               "fifo@512-368": [_row(0, 10, 2, False, False, 900), _row(0, 10, 5, True, True, 300)]}
    full, pick, fifo = summarize(settings, records)
    assert (full.correct, full.questions, full.retained) == (2, 2, 2)
    assert pick.correct_when_retained == (1, 1) and pick.correct_when_evicted == (0, 1)
    assert pick.by_delay == {4: (0, 1), 7: (1, 1)}
    assert paired_counts(records, "omnipick@512-368", "fifo@512-368") == (1, 1)
    text = render_markdown([full, pick, fifo], records, {"episodes": 1, "units": 24, "facts": 8, "model": "m"})
    assert "| OmniPick (ours) | 512/368 | 50.0 | 9-91 |" in text and "| No-slide | - | 100.0 | 34-100 |" in text
    assert "OmniPick (ours) 512/368 vs FIFO / basic 512/368: +1 / -1 (p = 1)" in text
    assert "| 4 units (~300 tok) | 7 units (~900 tok) |" in text


def test_study_command_skips_with_a_clear_message_without_gguf(tmp_path):
    code = ("import sys; sys.modules['gguf'] = None\n"
            "from omnitide_mlx.cli import main\n"
            f"sys.exit(main(['eval', 'study', '--out', {str(tmp_path / 'o')!r}]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "skipped" in r.stderr and "gguf" in r.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_a_small_study_on_smollm2(tmp_path):
    pytest.importorskip("mlx.core")
    pytest.importorskip("gguf")
    from omnitide_mlx.models.llama_gguf import GGUFError, smollm2_path

    try:
        smollm2_path()
    except GGUFError as e:
        pytest.skip(str(e))
    from omnitide_mlx.cli import main

    out = tmp_path / "study"
    args = ["eval", "study", "--out", str(out), "--episodes", "1", "--units", "10", "--facts", "3",
            "--policy", "full,omnipick,token", "--watermarks", "240/160"]
    assert main(args) == 0
    results = json.loads((out / "results.json").read_text())
    rows = {r["setting"]: r for r in results["summary"]}
    assert set(rows) == {"full", "omnipick@240-160", "token@240-160"}
    assert all(r["questions"] == rows["full"]["questions"] > 0 for r in rows.values())
    assert rows["full"]["retained"] == rows["full"]["questions"]  # full context never evicts
    assert rows["full"]["correct"] >= rows["full"]["questions"] - 1  # the real model reads the log
    assert rows["token@240-160"]["mean_cache_tokens"] < rows["full"]["mean_cache_tokens"]
    for r in rows.values():  # a fact the cache no longer holds is (nearly) never recalled
        hits, n = r["correct_when_evicted"]
        assert hits <= max(1, n // 3)
    before = (out / "omnipick@240-160" / "items.jsonl").read_text()
    assert main(args) == 0  # a rerun resumes: nothing is recomputed
    assert (out / "omnipick@240-160" / "items.jsonl").read_text() == before


def test_omni_style_units_are_laid_out_like_omni_units(tmp_path):
    """Tag (boundary), a fixed-length frame block (IMAGE), speech (TEXT), newline (boundary); the question-and-reply
    episodes put a real turn before every shortest-delay probe, and the study runs end to end on a tiny GGUF."""
    pytest.importorskip("mlx.core")
    pytest.importorskip("gguf")
    from omnitide_mlx.core.units import SpanKind
    from omnitide_mlx.eval.study import FRAME_TOKENS, StudyConfig, _OmniStyleModel
    from omnitide_mlx.models.llama_gguf import load_gguf
    from omnitide_mlx.models.llama_gguf.tiny import write_tiny_gguf
    from omnitide_mlx.session import OmniSession

    ep = make_episode(0, seed=1, style="omni", qa=True)
    f = ep.facts[0]
    assert ep.units[f.unit].endswith("</frame> " + f.sentence) and "<frame>" in ep.units[0]
    assert ep.qa_after == tuple(sorted({q.after_unit for q in ep.questions if q.delay == 2}))
    assert make_episode(0, seed=1).qa_after == ()
    path = write_tiny_gguf(tmp_path / "tiny.gguf", seed=2)
    model, tok = load_gguf(path)
    session = OmniSession((_OmniStyleModel(model), tok), policy="full")
    session.push(text=ep.units[0])
    session.push(text=ep.units[1])
    u0, u1 = session.history.stream_units
    kinds = [s.kind for s in u1.spans]
    assert kinds == [SpanKind.BOUNDARY, SpanKind.IMAGE, SpanKind.TEXT, SpanKind.BOUNDARY]
    assert u1.spans[1].length == FRAME_TOKENS and u0.spans[0].kind is SpanKind.BOUNDARY
    # under OmniPick an older unit keeps its tag, its first image_sink frame tokens and its newline
    pick = OmniSession((_OmniStyleModel(model), tok), policy=expand_settings(
        ["omnipick:text_budget=0,recent_units=2"], ["400/300"])[0].build())
    for text in ep.units[:12]:
        pick.push(text=text)
    older = [u for u in pick.history.stream_units if u.trimmed]
    assert older and pick.counters.evictions >= 1
    for u in older:
        assert [(s.kind, s.length) for s in u.spans][1] == (SpanKind.IMAGE, 4)
        assert u.spans[-1].kind is SpanKind.BOUNDARY and SpanKind.TEXT not in [s.kind for s in u.spans]
    assert StudyConfig(model="m").to_json() == {k: v for k, v in StudyConfig(model="m", style="omni").to_json().items()
                                               if k not in ("style", "qa")}
