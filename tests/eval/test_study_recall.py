"""``omnitide eval ... --recall SIZE``: every evicting setting also runs with a recall store, keyed apart and paired
with its twin in the study's sign tests; the study records which probes were answered with the fact's unit
recalled. End to end on a tiny random GGUF (plumbing only: random weights answer at chance)."""

import json

import pytest

from omnitide_mlx.eval.policies import expand_settings
from omnitide_mlx.eval.study import _with_and_without_recall


def test_recall_settings_run_next_to_their_twins():
    settings = expand_settings(["full", "omnipick", "fifo"], ["512/368"], recall=2**20)
    assert [s.key for s in settings] == ["full", "omnipick@512-368", "omnipick+recall=1048576@512-368",
                                         "fifo@512-368", "fifo+recall=1048576@512-368"]
    assert settings[2].session_kwargs() == {"recall": 2**20} and settings[1].session_kwargs() == {}
    assert "recall" not in settings[1].to_json() and settings[2].to_json()["recall"] == 2**20
    assert settings[2].label == "OmniPick (ours) + recall"
    assert _with_and_without_recall(settings[2].key, settings[1].key)
    assert not _with_and_without_recall(settings[4].key, settings[1].key)


@pytest.mark.slow
def test_a_small_study_with_recall_on_smollm2(tmp_path):
    """``omnitide eval study --recall``: both twins run, the recall twin's records say which probes got their
    fact's unit back (never one the policy had kept), and the table pairs the twins."""
    pytest.importorskip("mlx.core")
    pytest.importorskip("gguf")
    from omnitide_mlx.models.llama_gguf import GGUFError, smollm2_path

    try:
        smollm2_path()
    except GGUFError as e:
        pytest.skip(str(e))
    from omnitide_mlx.cli import main

    out = tmp_path / "study"
    assert main(["eval", "study", "--style", "omni", "--out", str(out), "--episodes", "1", "--units", "20",
                 "--facts", "3", "--policy", "omnipick", "--watermarks", "240/160", "--recall", "10MB"]) == 0
    rows = {r["setting"]: r for r in json.loads((out / "results.json").read_text())["summary"]}
    assert set(rows) == {"omnipick@240-160", "omnipick+recall=10000000@240-160"}
    (item,) = [json.loads(line) for line in (out / "omnipick+recall=10000000@240-160" / "items.jsonl")
               .read_text().splitlines()]
    records = item["record"]["probes"]
    assert any(r["recalled"] for r in records)  # some probes got their fact's unit back
    assert not any(r["recalled"] and r["retained"] for r in records)  # only evicted units are recalled
    assert "OmniPick (ours) + recall 240/160 vs OmniPick (ours) 240/160" in (out / "table.md").read_text()
    assert main(["eval", "study", "--experiment", "drift", "--out", str(tmp_path / "d"), "--recall", "1MB"]) == 2
