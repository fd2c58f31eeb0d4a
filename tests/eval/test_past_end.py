"""Questions past the end of the media (issue 32 item 9): an eval question stamped after the video ends is still
asked at the end (so its record exists) but marked ``past_end`` and left out of the scores, an impossible stamp
("99:99:99") is refused with its place in the file, and ``omnitide stream --ask`` past the stream's end is a usage
error before the model loads."""

import pytest

from omnitide_mlx.eval.streams import DatasetError, parse_hms


def test_impossible_time_stamps_are_refused():
    assert parse_hms("00:05:00", "q") == 300 and parse_hms("1:52", "q") == 112 and parse_hms("75", "q") == 75
    for bad in ("99:99:99", "00:61:00", "1:60"):
        with pytest.raises(DatasetError, match="q: time stamp"):
            parse_hms(bad, "q")


def test_a_question_past_the_end_is_marked_and_not_scored(tiny_checkpoints, media_dir):
    from omnitide_mlx import OmniSession
    from omnitide_mlx.eval import streamingbench as sb

    video = media_dir / "video_10s_av.mp4"
    item = sb.SBItem(id="v", video=video, video_ref="v.mp4", task="real", questions=[
        sb.SBQuestion("real", "Object Recognition", "What colour?", 3.0, [0, 0], ["red", "blue"], "A"),
        sb.SBQuestion("real", "Object Recognition", "What colour?", 300.0, [0, 1], ["red", "blue"], "A")])
    rec = sb.run_item(OmniSession(tiny_checkpoints["qwen"]), item, max_tokens=2)
    qs = rec["questions"]
    assert [q.get("past_end", False) for q in qs] == [False, True]
    assert rec["stream"]["seconds_streamed"] == 10 and rec["stream"]["past_end_questions"] == 1
    for q in qs:
        q["correct"] = True
    scores = sb.score([rec])
    assert scores["questions"] == 1 and scores["past_end"] == 1
