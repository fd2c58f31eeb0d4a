"""Short versions of the soak runs (omnitide_mlx/eval/soak.py; the full runs' figures are in results/ and
docs/benchmarks.md, "Soak"): an hour of simulated MiniCPM-o stream through the planner and page table with every
invariant checked at every update, and the engine with a producer thread pushing while a consumer asks and abandons
replies. Both fail on a broken invariant, a lost or duplicated unit, a deadlock, or growth."""

import pytest

from omnitide_mlx.eval.soak import engine_soak, fitted_slope, flatness, sim_soak


def test_fitted_slope_and_flatness():
    assert fitted_slope([0, 1, 2], [5, 7, 9]) == pytest.approx(2.0)
    windows = [{"h": h, "a": 100 + 50 * (h == 0), "b": 10 * h} for h in range(5)]  # warm-up window ignored
    f = flatness(windows, "h", {"a": 1, "b": 1})
    assert f["a"]["flat"] and not f["b"]["flat"] and f["b"]["change_over_run"] == pytest.approx(30)


@pytest.mark.slow
def test_an_hour_of_simulated_minicpmo_stream_stays_bounded():
    res = sim_soak(3600, window=600)
    assert res["updates"] == 3600 + 2 * 120 and res["invariant_checks"] == res["updates"]
    assert res["trims"] > 100
    for key in ("max_physical_span", "max_units", "max_next_position", "rss_bytes"):
        assert res["flat"][key]["flat"], (key, res["flat"][key])
    # capacity only grows, a page at a time, while the layout settles (the 24-hour run: flat after the first hour)
    assert res["peak"]["max_capacity"] <= res["policy"]["high"] + 4 * 64
    assert res["peak"]["max_retained"] <= res["policy"]["high"]
    assert res["peak"]["max_next_position"] <= res["policy"]["high"]  # positions are closed up by every trim


@pytest.mark.slow
def test_engine_soak_with_producer_and_abandoning_consumer():
    res = engine_soak(60, question_every=10, window=30, high=300, low=200)
    assert not res["lost_units"] and res["duplicated_units"] == 0 and not res["deadlock"]
    assert res["consumer"]["asked"] >= 4  # one every 10 units: 5 (before the settle fix: about one per window)
    assert res["flat"]["kv_bytes"]["flat"]  # (retained cells saw-tooth; too few windows here to fit a slope)
    assert res["peak"]["retained_cells"] <= 300 + 200  # high plus the largest unit (150 tokens) and a question
    assert res["peak"]["kv_bytes"] <= res["capacity_bound"] * res["kv_bytes_per_token"]


@pytest.mark.slow
def test_a_spoken_session_at_stream_speed_stays_flat():
    """The spoken soak (issue 32), cut to fit CI: 600 one-second audio units (ten minutes of stream) and a question
    answered in speech every 60 s; `python -m omnitide_mlx.eval.soak spoken` runs the hour (docs/benchmarks.md)."""
    from omnitide_mlx.eval.soak import spoken_soak

    res = spoken_soak(600, question_every=60, window=60)
    assert len(res["replies"]) == 10 and all(r["text_chars"] for r in res["replies"])
    assert len(res["replies_without_audio"]) <= 2, res["replies"]  # seeded: the same replies speak in every run
    assert res["flat"]["kv_bytes"]["flat"] and res["flat"]["rss_bytes"]["flat"], res["flat"]
    assert res["peak"]["kv_bytes"] <= res["capacity_bound"] * res["kv_bytes_per_token"]
    assert res["peak"]["retained_cells"] <= 400 + 200
