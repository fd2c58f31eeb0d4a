"""``omnitide eval`` end to end on synthetic datasets in the official layouts (generated media, tiny random
checkpoints): every paper policy, official-format outputs, scores recomputed independently, resuming after an
interruption, and clear errors for bad datasets and videos."""

from __future__ import annotations

import csv
import json
import shutil

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("av")

from omnitide_mlx.cli import main  # noqa: E402
from omnitide_mlx.eval import livesports, streamingbench, svbench  # noqa: E402
from omnitide_mlx.eval.policies import expand_settings  # noqa: E402
from omnitide_mlx.eval.runner import RunOptions, paper_table, run_benchmark  # noqa: E402
from omnitide_mlx.eval.store import RunFolderError  # noqa: E402
from omnitide_mlx.eval.streams import DatasetError  # noqa: E402
from omnitide_mlx.eval.synthetic import make_livesports, make_streamingbench, make_svbench  # noqa: E402

PAPER = ["full", "fifo", "token", "streamingllm", "h2o", "omnipick"]


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("datasets")
    return {"streamingbench": make_streamingbench(root / "sb"), "svbench": make_svbench(root / "svb"),
            "livesports": make_livesports(root / "ls")}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, data_dir):
    from omnitide_mlx.models.minicpmo.tiny import make_tiny_checkpoint as make_minicpmo
    from omnitide_mlx.models.qwen2_5_omni.tiny import make_tiny_checkpoint as make_qwen

    root = tmp_path_factory.mktemp("ckpt")
    return {"qwen": make_qwen(root / "qwen", tokenizer_dir=data_dir / "tokenizers/qwen2", vocab="real"),
            "minicpmo": make_minicpmo(root / "minicpmo", tokenizer_dir=data_dir / "tokenizers/minicpm-o-4_5")}


def count_py(question_file, task: str, model: str) -> dict:
    """StreamingBench's count.py rules, restated: first character == answer (real / omni / sqa); proactive: last
    dialog turn within 2 s of the ground truth, and the ground-truth output in its content."""
    data = json.loads(question_file.read_text())
    entries = [e for group in data for e in group] if task == "sqa" else data
    n = correct = time_ok = answer_ok = 0
    for e in entries:
        for q in e["questions"]:
            if model not in q:
                continue
            n += 1
            if task == "proactive":
                last = q[model]["dialog_history"][-1]
                gt = sum(int(x) * 60 ** i for i, x in enumerate(reversed(q["ground_truth_time_stamp"].split(":"))))
                if abs(last["time"] - gt) <= 2:
                    time_ok += 1
                    answer_ok += q["ground_truth_output"] in last["content"]
            else:
                correct += q[model][:1] == q["answer"]
    return {"n": n, "correct": correct, "time_ok": time_ok, "answer_ok": answer_ok}


def test_streamingbench_cli_runs_every_paper_policy_and_writes_scores(datasets, checkpoints, tmp_path, capsys):
    out = tmp_path / "sb"
    rc = main(["eval", "streamingbench", "--data", str(datasets["streamingbench"]), "--model",
               str(checkpoints["qwen"]), "--policy", "paper", "--watermarks", "300/200", "--out", str(out)])
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert [r["setting"]["name"] for r in results["rows"]] == PAPER
    table = (out / "table.md").read_text()
    assert "| OmniPick (ours) | 300/200 |" in table and "| No-slide | - |" in table
    assert table in capsys.readouterr().out
    for row in results["rows"]:
        key = row["setting"]["key"]
        assert row["items"] == row["items_total"] == 4
        if key != "full":
            assert row["evictions"] > 0  # the 300-token budget really bounded the streams
        # the official-format files, scored with count.py's rules, give the same numbers
        got = {t: count_py(out / key / "streamingbench" / f"questions_{t}.json", t, "omnitide")
               for t in ("real", "omni", "sqa", "proactive")}
        m = row["metrics"]
        mcq = [got[t] for t in ("real", "omni", "sqa")]
        assert m["questions"] == sum(g["n"] for g in mcq) == 6
        assert m["accuracy"] == pytest.approx(100.0 * sum(g["correct"] for g in mcq) / 6)
        assert m["by_task"]["sqa"]["questions"] == 2
        assert m["proactive"]["questions"] == got["proactive"]["n"] == 1
        assert m["proactive"]["time_accuracy"] == 100.0 * got["proactive"]["time_ok"]
        # every question was asked once the stream had covered its time stamp
        items = [json.loads(line)["record"] for line in (out / key / "items.jsonl").read_text().splitlines()]
        for it in items:
            assert it["stream"]["seconds_streamed"] >= 1
            for q in it["questions"]:
                if it["task"] != "proactive":
                    assert q["pred"] == q["response"].strip()[:1]
                    assert it["stream"]["stream_end"] >= q["time"]


def test_streamingbench_scoring_follows_count_py():
    records = [
        {"task": "real", "questions": [{"task_type": "A", "correct": True}, {"task_type": "B", "correct": False}]},
        {"task": "sqa", "questions": [{"task_type": "S", "correct": True}]},
        {"task": "proactive", "questions": [{"task_type": "P", "time_correct": True, "answer_correct": False},
                                           {"task_type": "P", "time_correct": False, "answer_correct": False}]},
    ]
    m = streamingbench.score(records)
    assert m["accuracy"] == pytest.approx(200 / 3) and m["questions"] == 3
    assert m["by_task"]["real"] == {"accuracy": 50.0, "questions": 2}
    assert m["proactive"] == {"questions": 2, "time_accuracy": 50.0, "answer_accuracy": 0.0}
    assert streamingbench.first_letter("  B. The screen is blue") == "B"
    q = streamingbench.SBQuestion("sqa", "S", "Who?", 3.0, [0, 0, 0], options=["Ann.", "Bo.", "Cy.", "Di."],
                                  answer="C")
    prompt = streamingbench.mcq_prompt(q)
    assert "A. Ann.\nB. Bo.\nC. Cy.\nD. Di." in prompt and prompt.endswith("The best option is:")


def test_svbench_writes_the_answer_files_its_judge_reads(datasets, checkpoints, tmp_path):
    out = tmp_path / "svb"
    rc = main(["eval", "svbench", "--data", str(datasets["svbench"]), "--model", str(checkpoints["minicpmo"]),
               "--policy", "omnipick,token", "--watermarks", "200/150", "--max-tokens", "6", "--out", str(out)])
    assert rc == 0
    chains = sorted((datasets["svbench"] / "Dialogue" / "Dialogue_EN").glob("*.json"))
    for key in ("omnipick@200-150", "token@200-150"):
        for chain in chains:
            gt = json.loads(chain.read_text())
            answers = json.loads((out / key / "svbench_answers" / chain.name).read_text())
            assert len(answers) == len(gt)  # one entry per segment, {} where the chain is empty
            for seg, ans in zip(gt, answers):
                if not seg:
                    assert ans == {}
                    continue
                assert ans["questions"] == seg["chain"]["questions"]
                assert ans["gt_answers"] == seg["chain"]["answers"]
                assert len(ans["answers"]) == len(ans["questions"]) and all(isinstance(a, str) for a in ans["answers"])
    # a judge result saved next to the answers becomes the table's score (0-100)
    judge = [{"video_name": "svb_video_a", "scores": {"Overall Evaluation": 6}},
             {"video_name": "svb_video_b", "scores": {"Overall Evaluation": 8}}]
    (out / "omnipick@200-150" / "judge.json").write_text(json.dumps(judge))
    assert main(["eval", "table", str(out)]) == 0
    assert svbench.read_judge(out / "omnipick@200-150" / "judge.json") == pytest.approx(70.0)
    assert svbench.token_f1("The screen is red.", "It is red") == pytest.approx(2 * 0.5 * 2 / 3 / (0.5 + 2 / 3))


def test_livesports_writes_prediction_jsonl_and_reads_the_judge(datasets, checkpoints, tmp_path, capsys):
    out = tmp_path / "ls"
    rc = main(["eval", "livesports", "--data", str(datasets["livesports"]), "--model", str(checkpoints["qwen"]),
               "--policy", "omnitide", "--watermarks", "300/200", "--interval", "2", "--max-tokens", "6",
               "--out", str(out)])
    assert rc == 0
    lines = [json.loads(x) for x in (out / "omnitide@300-200" / "livesports3kcc.jsonl").read_text().splitlines()]
    with open(datasets["livesports"] / "LiveSports-3K-CC-val.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(x["video_id"], x["event_id"], x["begin"], x["end"]) for x in lines] == \
        [(r["video_id"], int(r["event_id"]), float(r["begin"]), float(r["end"])) for r in rows]
    assert all(set(x) == {"video_id", "event_id", "begin", "end", "pred"} for x in lines)
    record = json.loads((out / "omnitide@300-200" / "items.jsonl").read_text().splitlines()[1])["record"]
    assert [s["t"] for s in record["steps"]] == [5.5, 7.5]  # every 2 s of the 3.5-8 s clip
    assert record["stream"]["seconds_streamed"] == 5
    judge = out / "omnitide@300-200" / "judge.jsonl"
    judge.write_text("\n".join(json.dumps(r) for r in [
        {"video_event_id": "synthVideo01_1", "ab_winner": "omnitide", "ba_winner": "GPT-4o"},
        {"video_event_id": "synthVideo01_2", "ab_winner": "omnitide", "ba_winner": "tie"}]))
    assert livesports.read_judge(judge) == 50.0
    capsys.readouterr()
    assert main(["eval", "table", str(out)]) == 0
    assert "| - / - / 50.0 |" in capsys.readouterr().out


def test_an_interrupted_run_resumes_without_redoing_finished_items(datasets, checkpoints, tmp_path):
    from omnitide_mlx.models import load

    model = load(checkpoints["qwen"])
    opts = RunOptions(benchmark="streamingbench", model=str(checkpoints["qwen"]), data=datasets["streamingbench"],
                      out=tmp_path / "run", settings=expand_settings(["omnipick"], ["300/200"]))
    done_messages: list[str] = []

    def stop_after_two(msg: str) -> None:
        done_messages.append(msg)
        if sum("done in" in m for m in done_messages) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_benchmark(opts, model=model, log=stop_after_two)
    log_file = tmp_path / "run" / "omnipick@300-200" / "items.jsonl"
    first = log_file.read_text().splitlines()
    assert len(first) == 2
    with open(log_file, "a") as f:  # a crash in the middle of writing the third line
        f.write('{"id": "omni:./videos/sample_2_Emo')
    messages: list[str] = []
    results = run_benchmark(opts, model=model, log=messages.append)
    assert sum("done in" in m for m in messages) == 2 and "2 of 4 items already done" in messages[0]
    lines = log_file.read_text().splitlines()
    assert lines[:2] == first and len([x for x in lines if x.endswith("}}")]) == 4
    assert results["rows"][0]["items"] == 4
    # the same folder for a different run is refused
    other = RunOptions(**{**opts.__dict__, "model": "another-model"})
    with pytest.raises(RunFolderError, match="different run"):
        run_benchmark(other, model=model, log=messages.append)


def test_bad_datasets_and_videos_fail_with_the_reason(datasets, tmp_path, capsys):
    def run(data, *extra) -> tuple[int, str]:
        rc = main(["eval", "streamingbench", "--data", str(data), "--model", "unused", "--policy", "full",
                   "--out", str(tmp_path / "o"), *extra])
        return rc, capsys.readouterr().err

    rc, err = run(tmp_path / "nowhere")
    assert rc == 1 and "does not exist" in err
    (tmp_path / "empty").mkdir()
    rc, err = run(tmp_path / "empty")
    assert rc == 1 and "no StreamingBench question file" in err

    bad = tmp_path / "bad"
    shutil.copytree(datasets["streamingbench"], bad)
    (bad / "questions_real.json").write_text('[{"questions": [')
    rc, err = run(bad)
    assert rc == 1 and "questions_real.json is not valid JSON" in err
    real = json.loads((datasets["streamingbench"] / "questions_real.json").read_text())
    del real[1]["questions"][0]["time_stamp"]
    (bad / "questions_real.json").write_text(json.dumps(real))
    rc, err = run(bad)
    assert rc == 1 and "questions_real.json entry [1] question 0: field 'time_stamp' is missing" in err
    real[1]["questions"][0]["time_stamp"] = "00:00:06"
    real[1]["questions"][0]["answer"] = "E"
    (bad / "questions_real.json").write_text(json.dumps(real))
    rc, err = run(bad)
    assert rc == 1 and "answer 'E' is not one of the option letters" in err

    shutil.rmtree(bad)
    shutil.copytree(datasets["streamingbench"], bad)
    (bad / "videos" / "sample_2_Emotion_Recognition.mp4").unlink()
    (bad / "videos" / "sample_3_sqa.mp4").write_bytes(b"\x00" * 2048)
    rc, err = run(bad, "--tasks", "real,omni,sqa")
    assert rc == 1 and "2 of 3 videos cannot be used" in err
    assert "./videos/sample_2_Emotion_Recognition.mp4: not found" in err and "sample_3_sqa.mp4" in err
    assert "--skip-missing" in err
    rc, err = run(bad, "--tasks", "real,proactive,omni", "--skip-missing", "--limit", "0")  # check only
    assert rc == 0 and "skipping 1 of 3 items" in err
    with pytest.raises(DatasetError, match="unknown StreamingBench task"):
        streamingbench.find_files(bad, ["live"])

    rc = main(["eval", "svbench", "--data", str(tmp_path / "empty"), "--model", "m", "--out", str(tmp_path / "o2")])
    assert rc == 1 and "holds no SVBench chain files" in capsys.readouterr().err
    rc = main(["eval", "svbench", "--data", str(datasets["streamingbench"]), "--model", "m", "--out",
               str(tmp_path / "o2")])
    assert rc == 1 and "questions_omni.json segment 0: field 'chain' is missing" in capsys.readouterr().err
    ls = tmp_path / "ls"
    ls.mkdir()
    (ls / "LiveSports-3K-CC-val.csv").write_text("video_id,event_id,begin\nabc,1,2.0\n")
    rc = main(["eval", "livesports", "--data", str(ls), "--model", "m", "--out", str(tmp_path / "o3")])
    assert rc == 1 and "row 1: missing end" in capsys.readouterr().err
    rc = main(["eval", "streamingbench", "--data", str(datasets["streamingbench"]), "--model", "m", "--policy",
               "omnipick:text_budget=x", "--out", str(tmp_path / "o4")])
    assert rc == 1 and "is not NAME=INTEGER" in capsys.readouterr().err


def test_paper_table_lays_runs_out_as_table_2():
    def run(bench, model, headline):
        return {"benchmark": bench, "model": model, "rows": [
            {"setting": {"key": "full"}, "label": "No-slide", "watermarks": "-", "headline": headline},
            {"setting": {"key": "omnipick@2500-1800"}, "label": "OmniPick (ours)", "watermarks": "2500/1800",
             "headline": "1.0"}]}

    text = paper_table([run("streamingbench", "m/3B", "62.3"), run("svbench", "m/3B", "43.4"),
                        run("streamingbench", "m/7B", "52.0")])
    assert "| Method | 3B | 7B |" in text
    assert "| No-slide | 62.3 / 43.4 / - | 52.0 / - / - |" in text
    assert "| OmniPick (ours) 2500/1800 | 1.0 / 1.0 / - | 1.0 / - / - |" in text


def test_eval_takes_the_media_setting_and_records_tokens_per_unit(datasets, checkpoints, tmp_path, capsys):
    """``--preset`` / ``--max-pixels`` reach the sessions (issue 12: the knobs wherever frames enter): the run's
    folder records the setting, each item the tokens per unit by span kind, and a larger frame makes more tokens."""
    per_unit = {}
    for name, extra in (("default", []), ("paper", ["--preset", "paper"])):
        out = tmp_path / name
        rc = main(["eval", "streamingbench", "--data", str(datasets["streamingbench"]), "--model",
                   str(checkpoints["qwen"]), "--policy", "omnitide", "--watermarks", "3000/2000", "--limit", "1",
                   "--out", str(out), *extra])
        assert rc == 0, capsys.readouterr().err
        run = json.loads((out / "run.json").read_text())
        assert ("media" in run) == (name == "paper")
        item = json.loads((out / "omnitide@3000-2000" / "items.jsonl").read_text().splitlines()[0])["record"]
        per_unit[name] = item["tokens_per_unit"]
    assert per_unit["paper"]["setting"]["name"] == "paper"
    assert per_unit["paper"]["by_kind"]["image"] > per_unit["default"]["by_kind"]["image"]
    rc = main(["eval", "streamingbench", "--data", str(datasets["streamingbench"]), "--model", "m", "--out",
               str(tmp_path / "x"), "--frame-size", "640"])
    assert rc == 2 and "--frame-size" in capsys.readouterr().err and not (tmp_path / "x").exists()
