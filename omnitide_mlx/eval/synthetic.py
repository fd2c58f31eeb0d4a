"""Small synthetic datasets in the exact official layouts, built from generated media (no downloads, no ffmpeg).

Each video shows one solid colour per second and plays one tone per second (PyAV writes MPEG-4 video with AAC
audio in an .mp4). The questions are about those colours and tones, so a real omni model can answer them and a
random one exercises the whole pipeline. ``python -m omnitide_mlx.eval.synthetic OUT`` writes all three datasets
under OUT (``streamingbench/``, ``svbench/``, ``livesports/``) to try the harness with.
"""

from __future__ import annotations

import csv
import json
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220), "yellow": (230, 210, 40),
           "white": (240, 240, 240), "black": (15, 15, 15)}
SAMPLE_RATE = 16000


def write_video(path: Path, colours: list[str], size: int = 64, fps: int = 4, tones: list[float] | None = None,
                audio: bool = True) -> Path:
    """An .mp4 of ``len(colours)`` seconds: second k is a solid ``colours[k]`` frame with a white square that moves,
    over a sine tone of ``tones[k]`` Hz (default 300 + 100 k)."""
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    seconds = len(colours)
    tones = tones or [300.0 + 100.0 * k for k in range(seconds)]
    with av.open(str(path), "w") as out:
        v = out.add_stream("mpeg4", rate=fps)
        v.width = v.height = size
        v.pix_fmt = "yuv420p"
        a = None
        if audio:
            a = out.add_stream("aac", rate=SAMPLE_RATE)
            a.layout = "mono"
        for k, name in enumerate(colours):
            for i in range(fps):
                img = np.empty((size, size, 3), dtype=np.uint8)
                img[:] = COLOURS[name]
                x = (i * size // fps) % (size - size // 4)
                img[size // 3:size // 3 + size // 4, x:x + size // 4] = 255
                frame = av.VideoFrame.from_ndarray(img, format="rgb24")
                frame.pts = k * fps + i
                frame.time_base = Fraction(1, fps)
                for packet in v.encode(frame):
                    out.mux(packet)
        for packet in v.encode():
            out.mux(packet)
        if a is not None:
            freq = np.repeat(np.asarray(tones, dtype=np.float64), SAMPLE_RATE)
            wave = (0.3 * np.sin(2 * np.pi * np.cumsum(freq) / SAMPLE_RATE)).astype(np.float32)[None, :]
            chunk = 1024
            for start in range(0, wave.shape[1], chunk):
                frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(wave[:, start:start + chunk]), format="fltp",
                                                   layout="mono")
                frame.sample_rate = SAMPLE_RATE
                frame.pts = start
                frame.time_base = Fraction(1, SAMPLE_RATE)
                for packet in a.encode(frame):
                    out.mux(packet)
            for packet in a.encode():
                out.mux(packet)
    return path


def _options(rng, answer: str, k: int = 4) -> tuple[list[str], str]:
    others = [c for c in COLOURS if c != answer]
    picks = list(rng.choice(others, size=k - 1, replace=False)) + [answer]
    rng.shuffle(picks)
    letter = "ABCD"[picks.index(answer)]
    return [f"{'ABCD'[i]}. The screen is {c}." for i, c in enumerate(picks)], letter


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"


def make_streamingbench(root: Path, seconds: int = 6, seed: int = 0) -> Path:
    """``questions_{real,omni,sqa,proactive}.json`` and ``videos/*.mp4`` in StreamingBench's layout."""
    rng = np.random.default_rng(seed)
    root = Path(root)
    names = list(COLOURS)

    def video(name: str) -> tuple[str, list[str]]:
        colours = [names[int(i)] for i in rng.integers(0, len(names), seconds)]
        write_video(root / "videos" / f"{name}.mp4", colours)
        return f"./videos/{name}.mp4", colours

    def mcq(task_type: str, colours: list[str], t: int, letters: bool = True) -> dict:
        options, answer = _options(rng, colours[t - 1])
        if not letters:
            options = [o[3:] for o in options]
        return {"task_type": task_type, "question": "What colour is the screen now?", "time_stamp": _hms(t),
                "answer": answer, "options": options, "required_ability": "working memory"}

    real_path, real_c = video("sample_1_real")
    real = [{"time": "[0:00:00 - 0:01:00]", "questions": [mcq("Attribute Recognition", real_c, t)],
             "video_categories": "synthetic", "video_path": real_path} for t in (2, seconds)]
    omni_path, omni_c = video("sample_2_Emotion_Recognition")
    omni = [{"time": "[0:00:00 - 0:01:00]", "questions": [mcq("Scene Understanding", omni_c, t)],
             "video_categories": "synthetic", "video_path": omni_path} for t in (3, seconds - 1)]
    sqa_path, sqa_c = video("sample_3_sqa")
    sqa = [[{"time": "[0:00:00 - 0:01:00]", "questions": [mcq("Sequential Question Answering", sqa_c, t,
                                                               letters=False)],
             "video_categories": "synthetic", "video_path": sqa_path} for t in (2, 4)]]
    pro_path, pro_c = video("sample_4_proactive")
    target = pro_c[-2]
    pro = [{"time": "[0:00:00 - 0:00:30]", "questions": [{
        "task_type": "Proactive Output", "question": f"When the screen turns {target}, output \"{target}\".",
        "time_stamp": _hms(1), "ground_truth_time_stamp": _hms(seconds - 1), "ground_truth_output": target,
        "required_ability": "working memory"}], "video_categories": "synthetic", "video_path": pro_path}]
    for name, data in (("questions_real.json", real), ("questions_omni.json", omni), ("questions_sqa.json", sqa),
                       ("questions_proactive.json", pro)):
        (root / name).write_text(json.dumps(data, indent=1), encoding="utf-8")
    return root


def make_svbench(root: Path, seconds: int = 6, seed: int = 1) -> Path:
    """``Dialogue/Dialogue_EN/<video>.json`` chains and ``Video/<video>.mp4`` in SVBench's released layout."""
    rng = np.random.default_rng(seed)
    root = Path(root)
    names = list(COLOURS)
    for v in ("svb_video_a", "svb_video_b"):
        colours = [names[int(i)] for i in rng.integers(0, len(names), seconds)]
        write_video(root / "Video" / f"{v}.mp4", colours)
        half = seconds // 2
        segments = [
            {"images": [], "qac_timestamps_start": 0.0, "qac_timestamps_end": float(half), "chain": {
                "questions": ["What colour is the screen?", "Did it change colour?"],
                "answers": [f"The screen is {colours[half - 1]}.",
                            "Yes, it changed." if len(set(colours[:half])) > 1 else "No, it stayed the same."]}},
            {},  # a segment without a chain, as the release has
            {"images": [], "qac_timestamps_start": float(half), "qac_timestamps_end": float(seconds), "chain": {
                "questions": ["What colour is it now?", "What colour was it before that?"],
                "answers": [f"It is {colours[-1]}.", f"It was {colours[-2]}."]}},
        ]
        d = root / "Dialogue" / "Dialogue_EN"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{v}.json").write_text(json.dumps(segments, indent=1), encoding="utf-8")
    return root


def make_livesports(root: Path, seconds: int = 8, seed: int = 2) -> Path:
    """``LiveSports-3K-CC-val.csv`` and ``videos/<video_id>.mp4`` (two events of one video)."""
    rng = np.random.default_rng(seed)
    root = Path(root)
    names = list(COLOURS)
    colours = [names[int(i)] for i in rng.integers(0, len(names), seconds)]
    write_video(root / "videos" / "synthVideo01.mp4", colours)
    fields = ["video_id", "url", "event_id", "begin", "end", "event_title", "event_type", "video", "class",
              "event_asr"]
    rows = [
        {"video_id": "synthVideo01", "url": "https://example.invalid/synthVideo01", "event_id": 1, "begin": 0.0,
         "end": 3.5, "event_title": "Colour relay", "event_type": 1, "video": "videos/synthVideo01.mp4",
         "class": "synthetic", "event_asr": "And here we go, the colours are on the move."},
        {"video_id": "synthVideo01", "url": "https://example.invalid/synthVideo01", "event_id": 2, "begin": 3.5,
         "end": float(seconds), "event_title": "Colour relay", "event_type": 1, "video": "videos/synthVideo01.mp4",
         "class": "synthetic", "event_asr": ""},
    ]
    with open(root / "LiveSports-3K-CC-val.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    return root


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m omnitide_mlx.eval.synthetic OUT_DIR", file=sys.stderr)
        sys.exit(2)
    out = Path(sys.argv[1])
    for name, make in (("streamingbench", make_streamingbench), ("svbench", make_svbench),
                       ("livesports", make_livesports)):
        print(make(out / name))
