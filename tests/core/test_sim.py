"""Profiles, the stream generator, the simulator and ``omnitide simulate``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from omnitide_mlx.cli import main as cli_main
from omnitide_mlx.core.page import AllocClass
from omnitide_mlx.core.pick import H2O, OmniPick, StreamingLLM, make_policy
from omnitide_mlx.core.profiles import ProfileError, StreamSpec
from omnitide_mlx.models.family import get_profile, profiles
from omnitide_mlx.core.layout import LAYOUT_NAMES
from omnitide_mlx.core.sim import SimError, Simulator, page_table_at, simulate, snapshot_at
from omnitide_mlx.core.units import SpanKind
from omnitide_mlx.models.stream_units import resolve_profile


def paper(name):
    """The profile at the paper's media setting (table 1: a 1344x1344 frame and a second of audio a unit)."""
    return resolve_profile(name, "paper")


def test_profiles_match_table_1_and_the_real_shapes():
    q7, q3 = paper("qwen2.5-omni-7b"), paper("qwen2.5-omni-3b")
    m45, m26 = paper("minicpm-o-4.5"), paper("minicpm-o-2.6")
    assert q7.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2
    assert q3.kv_bytes_per_token == 2 * 36 * 2 * 128 * 2
    assert m45.kv_bytes_per_token == 2 * 36 * 8 * 128 * 2
    assert m26.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2
    # table 1: ~2,300 tokens a unit for Qwen, ~700 for MiniCPM (image 640 = source + 3x3 slices of 64; the duplex
    # unit: <unit> ... </unit> around it, 2 markers per image or slice, no "\n" between slice rows)
    assert q7.media_unit_tokens == q3.media_unit_tokens == 2 + 2304 + 25 + 2
    assert m45.media_unit_tokens == 672 and m26.media_unit_tokens == 687
    assert (q7.q_heads, q3.q_heads, m45.q_heads) == (28, 16, 32)
    u = m45.media_unit(3, 100)
    kinds = [s.kind for s in u.spans]
    assert kinds.count(SpanKind.IMAGE_SLICE) == 9 and kinds.count(SpanKind.IMAGE_SOURCE) == 1
    assert sum(s.length for s in u.spans_of(SpanKind.AUDIO)) == 10
    assert sum(s.length for s in u.spans_of(SpanKind.BOUNDARY)) == 672 - 640 - 10
    assert np.array_equal(u.positions[0], np.arange(100, 772))


def test_a_profile_without_its_unit_layout_says_how_to_get_one():
    with pytest.raises(ProfileError, match="resolve_profile"):
        Simulator("qwen2.5-omni-7b", "omnitide", StreamSpec(2))
    with pytest.raises(ProfileError, match="does not fit"):
        get_profile("qwen2.5-omni-7b").with_units(paper("minicpm-o-4.5").units)


def test_qwen_unit_uses_tmrope_positions():
    u = paper("qwen2.5-omni-7b").media_unit(1, 50)
    pos = u.positions
    assert pos.shape == (3, 2333)
    assert (pos[:, :2] == 50).all()  # <|vision_bos|><|audio_bos|> share a position
    video = pos[:, 2:2306]
    assert (video[0] == 51).all() and video[1].max() == 51 + 47 and video[2].max() == 51 + 47
    assert np.array_equal(pos[:, 2306:2331], np.broadcast_to(np.arange(51, 76), (3, 25)))
    assert (pos[:, -2:] == 76).all()  # both eos one past the last run's largest position (transformers)


def test_policy_defaults_come_from_the_profile_and_keywords_win():
    p = make_policy("omnitide", profile=get_profile("minicpm-o-4.5"))
    assert (p.high, p.low) == (2500, 1800) and p.recent_units == 2
    p = make_policy("omnitide", profile=get_profile("minicpm-o-4.5"), slice_sink=5, low=1000)
    assert p.slice_sink == 5 and p.low == 1000
    assert make_policy("streamingllm", profile=get_profile("qwen2.5-omni-7b")).sink == 2  # OmniPick knobs are filtered out
    with pytest.raises(ProfileError, match="unknown profile"):
        get_profile("llava")


def test_stream_is_deterministic_by_seed():
    a = list(StreamSpec(120, question_every=30, seed=4).events())
    b = list(StreamSpec(120, question_every=30, seed=4).events())
    c = list(StreamSpec(120, question_every=30, seed=5).events())
    assert a == b and a != c
    assert sum(e.kind == "media" for e in a) == 120 and sum(e.kind == "question" for e in a) == 4
    with pytest.raises(ProfileError):
        StreamSpec(10, reply_tokens=(5, 2))


@pytest.mark.parametrize("profile", sorted(profiles()))
@pytest.mark.parametrize("policy", ["omnitide", "fifo", "token", "streamingllm", "h2o", "full"])
def test_simulator_keeps_tables_and_history_in_step(profile, policy):
    """check=True validates every layout's table against the history after each update (invariant 6)."""
    prof = paper(profile)
    pol = make_policy(policy, profile=prof)
    sim = Simulator(prof, pol, StreamSpec(12, question_every=4, seed=1), check=True)
    for event in sim.stream.events():
        recs = sim.step(event)
        retained = {r["retained_cells"] for r in recs.values()}
        assert retained == {sim.history.total_tokens}  # every layout holds exactly the retained history
        assert sim.history[0].length == prof.system_tokens  # invariant 1: the system prefix survives
        if isinstance(pol, OmniPick) and recs["native"]["trimmed"]:
            assert sim.history.total_tokens <= pol.low or len(sim.history.stream_units) == 1  # invariant 2
        eager = sim.layouts["eager"].table
        if recs["eager"]["trimmed"]:
            assert recs["eager"]["holes"] < eager.page_size  # packed after every eviction
        paged = sim.layouts["omnipage"].table
        assert (paged.alloc_class[paged.slots_of_unit(0)] == AllocClass.MUST_KEEP).all()
    if policy == "full":
        assert sim.trims == 0


def test_same_seed_same_numbers():
    a = simulate(paper("minicpm-o-4.5"), "omnitide", 90, seed=3)
    b = simulate(paper("minicpm-o-4.5"), "omnitide", 90, seed=3)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    h1 = simulate(paper("qwen2.5-omni-3b"), "h2o", 20, seed=3)
    h2 = simulate(paper("qwen2.5-omni-3b"), "h2o", 20, seed=3)
    assert json.dumps(h1, sort_keys=True) == json.dumps(h2, sort_keys=True)


@pytest.mark.parametrize("profile", ["qwen2.5-omni-7b", "minicpm-o-4.5"])
def test_long_stream_memory_is_flat_after_the_first_trims(profile):
    prof = paper(profile)  # at the paper's default watermarks (the per-model ones fill up later)
    sim = Simulator(prof, make_policy("omnitide", profile=prof, high=2500, low=1800), StreamSpec(900, question_every=30, seed=0))
    cap_after_warmup = None
    spans = []
    for event in sim.stream.events():
        recs = sim.step(event)
        if event.t >= 60 and cap_after_warmup is None:
            cap_after_warmup = {n: r["capacity"] for n, r in recs.items()}
        if event.t >= 60:
            spans.append(max(r["physical_span"] for r in recs.values()))
    # flat: a longer question + reply than any before may need one more page, never more
    for n, lt in sim.layouts.items():
        assert cap_after_warmup[n] <= lt.table.capacity <= cap_after_warmup[n] + lt.table.page_size
    assert max(spans) <= max(lt.table.capacity for lt in sim.layouts.values())
    assert sim.history.total_tokens <= sim.policy.high


def test_page_table_at_a_no_slide_checkpoint():
    for layout in LAYOUT_NAMES:
        snap = snapshot_at(paper("qwen2.5-omni-7b"), "omnitide", layout, 8192)
        assert snap.full_context_tokens >= 8192
        snap.table.check_history(snap.history)
        assert snap.table.stats().retained_cells == snap.history.total_tokens
    full = page_table_at(paper("minicpm-o-4.5"), "full", "native", 4096)
    assert full.stats().retained_cells >= 4096 and full.stats().holes < full.page_size
    with pytest.raises(SimError, match="system"):
        page_table_at(paper("minicpm-o-4.5"), "full", "native", 3)


def test_the_simulator_refuses_an_unknown_layout_or_migration():
    with pytest.raises(SimError, match="unknown layout"):
        Simulator(paper("minicpm-o-4.5"), "omnitide", StreamSpec(10), ("native", "vattention"))
    with pytest.raises(SimError, match="migration"):
        Simulator(paper("minicpm-o-4.5"), "omnitide", StreamSpec(10), migration="eager")


def test_h2o_and_streamingllm_run_in_the_simulator():
    for pol in (H2O(high=3000, low=2000), StreamingLLM(high=3000, low=2000)):
        r = simulate(paper("minicpm-o-4.5"), pol, 30)
        assert r["trims"] > 0
        assert r["layouts"]["native"]["final"]["retained_cells"] <= 3000


def test_cli_writes_the_issue_json_and_a_plot(tmp_path, capsys):
    out, png = tmp_path / "r" / "sim.json", tmp_path / "r" / "sim.png"
    rc = cli_main(["simulate", "--profile", "qwen2.5-omni-7b", "--seconds", "80", "--policy", "omnitide",
                   "--json", str(out), "--plot", str(png)])
    assert rc == 0
    d = json.loads(out.read_text())
    assert d["profile"] == "qwen2.5-omni-7b" and d["policy"] == "omnitide" and d["seconds"] == 80
    assert set(d["layouts"]) == {"native", "omnipage", "eager"}
    for lay in d["layouts"].values():
        for block in (lay["final"], lay["peak"], lay["series"][0], lay["series"][-1]):
            for k in ("retained_cells", "physical_span", "active_pages", "active_subblocks", "kv_bytes"):
                assert k in block
        assert isinstance(lay["moved_cells_total"], int)
        assert len(lay["series"]) == d["updates"]
        steady = lay["after_first_trim"]
        assert 0 < steady["updates"] <= d["updates"]
        for k in ("physical_span", "active_pages", "active_subblocks"):
            assert steady["mean"][k] <= steady["p95"][k] + 1e-9 or steady["updates"] < 20
    assert d["tokens_per_unit"] == 146 and d["tokens_per_unit_by_kind"] == {"boundary": 4, "image": 117, "audio": 25}
    assert d["setting"]["name"] == "default" and d["policy_config"]["high"] == 8000  # figure 14's 7B watermarks
    assert png.stat().st_size > 10_000
    assert "OmniPage" in capsys.readouterr().out


def test_cli_rejects_bad_requests(capsys):
    assert cli_main(["simulate", "--policy", "fifo", "--image-sink", "3", "--seconds", "2"]) == 2
    assert "apply to omnipick" in capsys.readouterr().err
    assert cli_main(["simulate", "--high", "100", "--low", "200", "--seconds", "2"]) == 2
    assert "low <= high" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["simulate", "--profile", "nope"])
    assert cli_main(["simulate", "--frame-size", "12x", "--seconds", "2"]) == 2
    assert "--frame-size" in capsys.readouterr().err


def test_the_guard_warns_when_low_cannot_hold_the_recent_units(capsys):
    """At the paper's units (2,333 tokens) the paper's default 2500/1800 keeps one unit; figure 14's 8000/6000
    for the 7B model hold two, and the default setting's 146-token units never trigger the guard."""
    args = ["simulate", "--profile", "qwen2.5-omni-7b", "--seconds", "3", "--no-progress"]
    assert cli_main(args + ["--preset", "paper", "--high", "2500", "--low", "1800"]) == 0
    assert "warning: the low watermark (1800 tokens) cannot hold" in capsys.readouterr().err
    assert cli_main(args + ["--preset", "paper", "--high", "2000", "--low", "1800"]) == 0
    assert "warning: the high watermark (2000 tokens) cannot hold the system prefix" in capsys.readouterr().err
    for extra in (["--preset", "paper"], []):
        assert cli_main(args + extra) == 0
        assert "warning" not in capsys.readouterr().err
    out = cli_main(["simulate", "--profile", "minicpm-o-4.5", "--preset", "paper", "--max-slice-nums", "4",
                    "--seconds", "3", "--no-progress"])
    assert out == 0 and "image_slice 256" in capsys.readouterr().out  # a 2x2 grid
