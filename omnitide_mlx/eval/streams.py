"""What every benchmark run shares: finding a dataset's videos, cutting a clip into one-second chunks, and
streaming it through an OmniSession with questions asked when the stream reaches their times.

A run is a list of items (a video with its questions, a commentary event); each item gets a fresh session with the
setting's policy, is streamed at 1 fps with its audio, and is written to the setting's ``items.jsonl`` as soon as
it is done (store.py): a rerun skips what is there.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from ..errors import MediaError, OmniTideError

VIDEO_SUFFIXES = (".mp4", ".mkv", ".webm", ".avi", ".mov", ".m4v")


class DatasetError(OmniTideError, ValueError):
    """A dataset folder or annotation file that cannot be used: says which file and what is wrong."""


def read_json(path: Path, what: str):
    import json

    if not path.is_file():
        raise DatasetError(f"{what}: {path} does not exist")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DatasetError(f"{what}: {path} is not valid JSON ({e})") from None
    except UnicodeDecodeError:
        raise DatasetError(f"{what}: {path} is not UTF-8 text") from None


def require(obj: dict, key: str, kind: type | tuple, where: str):
    """``obj[key]``, which must exist and be of ``kind``; otherwise a DatasetError naming ``where``."""
    if not isinstance(obj, dict):
        raise DatasetError(f"{where}: expected an object, got {type(obj).__name__}")
    if key not in obj:
        raise DatasetError(f"{where}: field {key!r} is missing")
    value = obj[key]
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise DatasetError(f"{where}: field {key!r} should be {names}, got {type(value).__name__}")
    return value


def parse_hms(text: str, where: str) -> float:
    """``"00:01:52"`` / ``"1:52"`` / ``"112"`` -> seconds."""
    parts = str(text).strip().split(":")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise DatasetError(f"{where}: time stamp {text!r} is not HH:MM:SS") from None
    if not 1 <= len(values) <= 3 or any(v < 0 for v in values):
        raise DatasetError(f"{where}: time stamp {text!r} is not HH:MM:SS")
    if any(v >= 60 for v in values[1:]):  # "99:99:99": minutes and seconds run to 59
        raise DatasetError(f"{where}: time stamp {text!r} is not a time (minutes and seconds go up to 59)")
    return sum(v * 60 ** i for i, v in enumerate(reversed(values)))


class VideoFinder:
    """Resolves a dataset's video references: the path as written (relative to the annotation file or the data
    folder), else a unique file of the same name anywhere under the data folder (or ``videos``)."""

    def __init__(self, data: Path, videos: Path | None = None):
        self.roots = [p for p in (videos, data) if p is not None]
        self._by_name: dict[str, list[Path]] | None = None

    def _index(self) -> dict[str, list[Path]]:
        if self._by_name is None:
            self._by_name = {}
            for root in self.roots:
                for p in root.rglob("*"):
                    if p.suffix.lower() in VIDEO_SUFFIXES and p.is_file():
                        self._by_name.setdefault(p.name, []).append(p)
                        self._by_name.setdefault(p.stem, []).append(p)
        return self._by_name

    def find(self, ref: str, relative_to: Path | None = None) -> Path | None:
        ref = str(ref)
        bases = ([relative_to] if relative_to is not None else []) + self.roots
        for base in bases:
            p = (base / ref).resolve()
            if p.is_file():
                return p
        hits = sorted(set(self._index().get(Path(ref).name, []) or self._index().get(ref, [])))
        if len(hits) > 1:
            raise DatasetError(f"video {ref!r} is ambiguous: {', '.join(str(h) for h in hits[:4])}")
        return hits[0] if hits else None


def check_videos(items: list, skip_missing: bool, log: Callable[[str], None]) -> list:
    """Items whose video is found and decodes (``item.video`` set, ``item.video_ref`` for messages). A missing or
    broken video is an error naming the first few, unless ``skip_missing`` (then those items are left out)."""
    from ..media import probe_video

    good, bad = [], []
    for item in items:
        if item.video is None:
            bad.append(f"{item.video_ref}: not found")
            continue
        try:
            probe_video(item.video)
        except MediaError as e:
            bad.append(str(e))
            continue
        good.append(item)
    if bad:
        if not skip_missing:
            more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
            raise DatasetError(f"{len(bad)} of {len(items)} videos cannot be used: " + "; ".join(bad[:5]) + more
                               + ". Fix the paths (--videos DIR), or pass --skip-missing to leave them out")
        log(f"skipping {len(bad)} of {len(items)} items whose video is missing or broken (first: {bad[0]})")
    return good


@dataclass
class StreamItem:
    """One session's worth of a benchmark: a video (or a clip of one) and what to ask while it streams."""

    id: str
    video_ref: str  # as the dataset writes it
    video: Path | None  # resolved; None when not found


def clip_chunks(video: str | os.PathLike, start: float = 0.0, end: float | None = None) -> Iterator:
    """One chunk per second of ``video`` from ``start`` to ``end`` (or its end): the frame at t + 0.5 s and the
    second of audio [t, t + 1) when the file has an audio track; ``t`` counts from the start of the file."""
    from ..media import SAMPLE_RATE, Chunk, iter_video_frames, probe_video, read_audio

    duration = probe_video(video).duration
    end = duration if end is None else min(float(end), duration)
    try:
        samples = read_audio(video)
    except MediaError as e:
        if "no audio stream" not in str(e):
            raise
        samples = None
    n = int(math.ceil(end - start - 1e-6))
    frames = iter_video_frames(video, every=1.0, offset=start + 0.5)
    for k in range(max(0, n)):
        t = start + k
        nxt = next(frames, None)
        frame = nxt[1] if nxt is not None else None
        audio = None
        if samples is not None:
            a, b = int(round(t * SAMPLE_RATE)), int(round((t + 1) * SAMPLE_RATE))
            piece = samples[a:b]
            if piece.size:
                audio = np.pad(piece, (0, SAMPLE_RATE - piece.size)) if piece.size < SAMPLE_RATE else piece
        if frame is None and audio is None:
            return
        yield Chunk(t=t, frame=frame, audio=audio)


@dataclass
class Ask:
    """A question due when the stream reaches ``t`` seconds; ``run(session) -> record or None`` asks it."""

    t: float
    run: Callable
    stamp: float | None = None  # the dataset's time for the question, when the ask is not at it (proactive polls)


def stream_and_ask(session, chunks: Iterator, asks: list[Ask], on_chunk: Callable | None = None) -> tuple[list, dict]:
    """Push every chunk, asking each question once the stream has covered its time. A question stamped after the
    media's end is asked after the last chunk, its record marked ``past_end`` (the scores leave it out: it was
    never asked at its time). Returns the questions' records in order and stream figures."""
    pending = sorted(asks, key=lambda a: a.t)
    records: list = []
    stamps: list[float] = []
    pushed, rejected = 0, 0

    def due(now: float) -> None:
        while pending and pending[0].t <= now + 1e-9:
            ask = pending.pop(0)
            record = ask.run(session)
            if record is not None:
                records.append(record)
                stamps.append(ask.t if ask.stamp is None else ask.stamp)

    due(0.0)
    last = 0.0
    for chunk in chunks:
        try:
            session.push(frame=chunk.frame, audio=chunk.audio, t=chunk.t)
            pushed += 1
        except MediaError:
            rejected += 1
        last = chunk.t + 1.0
        if on_chunk is not None:
            on_chunk(chunk)
        due(last)
    due(math.inf)
    late = 0
    for record, stamp in zip(records, stamps):
        if stamp > last + 1e-9 and isinstance(record, dict):
            record["past_end"] = True
            late += 1
    st = session.stats()
    return records, {"seconds_streamed": pushed, "rejected_chunks": rejected, "stream_end": last,
                     "past_end_questions": late,
                     "evictions": st["evictions"], "evicted_tokens": st["evicted_tokens"],
                     "retained_cells": st["retained_cells"], "peak_physical_span": st["peak_physical_span"],
                     "prefill_ms": st["timings"]["prefill_ms"], "decode_ms": st["timings"]["decode_ms"],
                     "maintenance_ms": st["timings"]["maintenance_ms"]}
