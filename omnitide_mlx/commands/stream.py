"""``omnitide stream``: stream a video / audio file through a model a unit a second, answer questions at their
times, and report what the KV cache did."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

# the shared flags live in options.py; re-exported here for callers that import them from this module
from ..core.stream_units import MediaSetting
from .options import add_media_arguments, media_setting  # noqa: I001
from .options import (POLICIES, UsageError, add_model_arguments, add_policy_arguments,  # noqa: F401
                      add_progress_argument, add_sampling_arguments, check_output_dir, check_output_file,
                      check_session_dir, check_stop_strings,
                      parse_questions, positive_float, resolve_watermarks, sampling_kwargs)
from .options import add_kv_arguments, add_recall_arguments, kv_kwargs, recall_kwargs

HELP = "stream a video/audio file through a model, asking questions at given times"
DESCRIPTION = """Stream a file through an omni model one unit (a frame plus a second of audio) at a time, ask each
question when the stream reaches its time, print the answers as they stream and a KV summary.

Answers go to stdout; progress, --stats lines and the summary go to stderr (a question's stats print before its
answer). Every flag and output path is checked before the model loads.

examples:
  omnitide stream --model Qwen/Qwen2.5-Omni-3B --video clip.mp4 --ask "5:What colour is the background?"
  omnitide stream --model ./checkpoints/tiny-minicpmo --video clip.mp4 --policy fifo --kv-budget 64MiB \\
      --ask "0:03:What did you hear?" --stats --json out.json
  omnitide stream --backend torch --device cuda --model Qwen/Qwen2.5-Omni-3B --video clip.mp4 --ask "5:What is it?"
"""


from .speech_args import SpokenAnswers, add_speech_arguments, check_speech_args  # noqa: E402
from .voice import VoiceTurns, add_voice_arguments, check_voice_args  # noqa: E402


def add_backend_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=["mlx", "torch"], default="mlx",
                   help="mlx (default) or torch: transformers' Qwen2.5-Omni thinker on PyTorch (CUDA or CPU; needs "
                        "the torch extra)")
    p.add_argument("--device", default=None, help="torch backend: cuda, cuda:N or cpu (default: cuda if available)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_backend_arguments(p)
    add_media_arguments(p)
    p.add_argument("--video", default=None, help="video file (its audio track is used unless --audio is given)")
    p.add_argument("--audio", default=None, help="audio file (wav/flac/ogg/mp3/m4a/...)")
    p.add_argument("--ask", action="append", default=[], metavar="T:QUESTION",
                   help="a question asked when the stream reaches T (seconds, or m:ss / h:mm:ss), e.g. "
                        "'12:What colour is the square?' or '1:05:What did she say?' (repeatable)")
    p.add_argument("--seconds", type=positive_float, default=None, help="stream at most this many seconds")
    p.add_argument("--realtime", action="store_true", help="pace the stream at one unit per wall-clock second")
    add_policy_arguments(p)
    add_kv_arguments(p)
    add_recall_arguments(p)
    add_sampling_arguments(p)
    p.add_argument("--stats", action="store_true", help="print one line per streaming update (to stderr)")
    p.add_argument("--json", default=None, metavar="PATH", help="write answers and per-update KV figures as JSON")
    p.add_argument("--save-session", default=None, metavar="DIR", help="save the session state at the end")
    add_speech_arguments(p)
    add_voice_arguments(p)
    add_progress_argument(p, legacy_quiet=True)


def check_args(args) -> None:
    """Every check that needs no model and no decoding: flags, their combinations, output paths, the device
    flag. Raises UsageError."""
    args.high, args.low = resolve_watermarks(args)
    if getattr(args, "backend", "mlx") != "torch" and getattr(args, "device", None):
        raise UsageError("--device applies to --backend torch (MLX picks its own device)")
    check_output_file(getattr(args, "json", None), "--json")
    check_session_dir(getattr(args, "save_session", None), "--save-session")
    check_stop_strings(args)
    kv_kwargs(args)
    recall_kwargs(args)
    if hasattr(args, "speak"):
        check_speech_args(args)
    if hasattr(args, "voice"):
        check_voice_args(args)
    _check_outputs_apart(args)


def _check_outputs_apart(args) -> None:
    """``--save-session`` replaces its folder as a whole: ``--json`` or the spoken answers there would be lost
    (or make the save refuse the folder after the whole stream)."""
    sess = getattr(args, "save_session", None)
    if sess is None:
        return
    folder = Path(sess).expanduser().resolve()
    others = [("--json", getattr(args, "json", None))]
    if getattr(args, "speak", False):
        others.append(("--audio-out", args.audio_out))
    for flag, path in others:
        if path is None:
            continue
        p = Path(path).expanduser().resolve()
        if p == folder or folder in p.parents:
            raise UsageError(f"--save-session {sess}: {flag} {path} is in the session's folder, which a save "
                             "replaces as a whole: write it elsewhere")


def check_model(args) -> None:
    """The model path resolves (a folder with config.json, or a cached Hub id) before any media is decoded."""
    if getattr(args, "backend", "mlx") == "torch":
        return  # models.loading imports MLX; the torch loader checks its own path
    from ..models.loading import resolve_model_path

    resolve_model_path(args.model)


def check_question_times(questions, units: int) -> None:
    """A question is asked once the stream reaches its time; one past the last unit would be asked at the end as
    if on time, so it is refused before the model loads."""
    late = [(t, q) for t, q in questions if t > units]
    if late:
        t, q = late[0]
        raise UsageError(f"--ask {t:g}:{q!r} is past the end of the stream at {units} s"
                         + (f" ({len(late)} questions are)" if len(late) > 1 else "")
                         + ": ask at most at its end, or stream longer")


KV_GROUP_SIZES = (32, 64, 128)  # the group sizes MLX quantises in


def check_kv_group(args) -> None:
    """``--kv-bits``: the quantisation group must divide the checkpoint's K/V head (from config.json, before the
    model loads). Without ``--kv-group-size`` the group is 64, or 32 where 64 does not divide the head."""
    if getattr(args, "kv_bits", None) is None or getattr(args, "backend", "mlx") == "torch":
        return
    from ..models.budget import kv_need
    from ..models.loading import resolve_model_path

    need = kv_need(resolve_model_path(args.model), frame=False, audio=True)
    if need is None or not need.head_dim:
        return
    hd, given = need.head_dim, getattr(args, "kv_group_size", None)
    fits = [g for g in KV_GROUP_SIZES if hd % g == 0]
    if given is None and fits:
        args.kv_group_size = 64 if 64 in fits else fits[0]
        return
    if given in fits:
        return
    if not fits:
        raise UsageError(f"--kv-bits: this checkpoint's K/V heads are {hd} wide (head_dim {hd}) and MLX quantises in "
                         f"groups of {', '.join(map(str, KV_GROUP_SIZES))} along the head, so quantised KV needs a "
                         "head_dim that is a multiple of 32 (the released Qwen2.5-Omni and MiniCPM-o have 128; "
                         "scripts/make_tiny_checkpoints.py writes tiny ones with 32)")
    raise UsageError(f"--kv-group-size {given} does not divide this checkpoint's head_dim {hd}: give "
                     + " or ".join(f"--kv-group-size {g}" for g in fits))


def check_kv_budget(args, media, asks: bool = False) -> None:
    """``--kv-budget`` against what the stream needs, from the checkpoint's files alone (config.json, the
    safetensors headers, the model's unit layout at the video's frame size): a budget that cannot hold the system
    prompt next to one media unit (or, with questions, a reply of --max-tokens) is a UsageError before the model
    loads. (The torch backend, which must not import the MLX port's modules, checks after loading.)"""
    if getattr(args, "kv_budget", None) is None or getattr(args, "backend", "mlx") == "torch":
        return
    from ..engine import REPLY_CLOSING_RESERVE
    from ..models.budget import budget_problem, kv_need
    from ..models.loading import resolve_model_path

    info = media.video_info
    need = kv_need(resolve_model_path(args.model), media=media_setting(args) if hasattr(args, "preset") else None,
                   frame_size=(info.width, info.height) if info is not None else None, frame=info is not None,
                   audio=media.audio_path is not None, kv_bits=getattr(args, "kv_bits", None),
                   kv_group_size=getattr(args, "kv_group_size", None) or 64)
    if need is None:
        return
    reply = args.max_tokens + REPLY_CLOSING_RESERVE if asks else 0
    problem = budget_problem(args.kv_budget, need, reply_tokens=reply)
    if problem:
        raise UsageError(f"--kv-budget: {problem}")


@contextlib.contextmanager
def announce(what: str):
    """``what ...`` then `` done in X s`` on one stderr line; on failure the line is closed first, so the error
    message starts a line of its own."""
    t0 = time.perf_counter()
    print(f"{what} ...", file=sys.stderr, end="", flush=True)
    try:
        yield
    except BaseException:
        print(" failed", file=sys.stderr, flush=True)
        raise
    print(f" done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def session_from_args(args, on_update=None):
    """Load the model and build an OmniSession (``--backend mlx``) or a TorchSession (``--backend torch``) from the
    shared model / policy flags (already checked by ``check_args``)."""
    backend = getattr(args, "backend", "mlx")
    kv = kv_kwargs(args)
    media = media_setting(args) if hasattr(args, "preset") else None  # a bad knob fails before the model loads
    if media is not None and media == MediaSetting():
        media = None  # the adapter's own defaults (text-only adapters take no media setting)
    if backend == "torch":
        try:
            import torch

            from ..torch.qwen2_5_omni import load
            from ..torch.session import TorchSession as session_class
        except ImportError as e:
            raise ValueError(f"--backend torch needs PyTorch and transformers ({e}); install the torch extra: "
                             "pip install 'omnitide-mlx[torch]'") from None
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        load_kw = {"device": device}
    else:
        if getattr(args, "device", None):
            raise ValueError("--device applies to --backend torch (MLX picks its own device)")
        from ..models import load
        from ..session import OmniSession as session_class

        load_kw = {}
    with announce(f"loading {args.model}"):
        model, processor = load(args.model, **load_kw)
    session = session_class((model, processor), system_prompt=args.system_prompt, policy=args.policy,
                            high=args.high, low=args.low, kv_budget=args.kv_budget, on_update=on_update,
                            media=media, **kv, **recall_kwargs(args))
    session.model_path = _saved_model_path(args.model)
    return session


def _saved_model_path(model: str) -> str:
    """A local folder as an absolute path (a saved session is restored from anywhere), a Hub id as it is."""
    p = Path(model).expanduser()
    return str(p.resolve()) if p.is_dir() else str(model)


def update_columns(bytes_per_token: int) -> tuple[str, callable]:
    """The ``--stats`` header and a formatter: retained KV is what the kept tokens take, capacity what the cache
    has allocated (pages reserved for the next units included)."""
    header = (f"{'t':>8}  {'update':<6} {'+tokens':>7} {'retained':>8} {'retained MiB':>12} {'capacity MiB':>12} "
              f"{'span':>6} {'pages':>5} {'ms':>8}  events")

    def fmt(rec) -> str:
        t = f"{rec.t:7.1f}s" if rec.t is not None else "       -"
        extra = ""
        if rec.evicted_tokens:
            extra += f"evicted {rec.evicted_tokens} "
        if rec.migrated_cells:
            extra += f"moved {rec.migrated_cells}"
        return (f"{t}  {rec.kind:<6} {rec.tokens:>7d} {rec.retained_cells:>8d} "
                f"{rec.retained_cells * bytes_per_token / 2**20:>12.2f} {rec.kv_bytes / 2**20:>12.2f} "
                f"{rec.physical_span:>6d} {rec.active_pages:>5d} {rec.update_ms:>8.1f}  {extra}".rstrip())

    return header, fmt


def format_update(rec, bytes_per_token: int = 0) -> str:
    return update_columns(bytes_per_token)[1](rec)


def kv_summary(s: dict) -> str:
    retained = s["retained_cells"] * s["kv_bytes_per_token"]
    return (f"KV: {s['retained_cells']} tokens retained ({retained / 2**20:.2f} MiB) in a span of "
            f"{s['physical_span']} slots, {s['active_pages']} active pages; capacity {s['kv_bytes'] / 2**20:.2f} MiB "
            f"allocated; {s['units']} units, {s['evictions']} evictions ({s['evicted_tokens']} tokens), "
            f"{s['migrations']} migrations ({s['migrated_cells']} cells); policy {s['policy']} "
            + ("(no eviction)" if s["policy"] == "full" else f"(high {s['high']}, low {s['low']})")
            + recall_summary(s.get("recall")))


def recall_summary(r: dict | None) -> str:
    if not r:
        return ""
    brought = [a for a in r["answers"] if a["uids"]]
    return (f"; recall: {r['units']} units stored ({r['bytes'] / 2**20:.2f} of {r['budget'] / 2**20:.2f} MiB, "
            f"{r['forgotten']} forgotten), {len(brought)} of {len(r['answers'])} answers recalled some")


class ChunkTally:
    """What each chunk of a ``MediaStream`` held (a frame, seconds of the file's audio, seconds of padding), summed
    separately for the chunks the session took and the ones it rejected, so the summary says what became units and
    what was skipped (and why) instead of what was read from the files."""

    def __init__(self, has_audio: bool):
        self.has_audio = has_audio
        self.ok = {"video_seconds": 0, "audio_seconds": 0.0, "silence_seconds": 0.0}
        self.skip = {"video_seconds": 0, "audio_seconds": 0.0, "silence_seconds": 0.0}
        self.skipped_units = 0
        self.reasons: list[str] = []  # distinct, in the order they first came
        self._read = (0.0, 0.0)  # the stream's audio and padding seconds counted so far

    def add(self, chunk, media, skipped: str | None = None) -> None:
        """Count ``chunk``, just read from ``media``: its running totals say how many seconds of the file's audio
        and of padding the chunk holds."""
        side = self.skip if skipped is not None else self.ok
        side["video_seconds"] += chunk.frame is not None
        side["audio_seconds"] += media.audio_seconds - self._read[0]
        side["silence_seconds"] += media.silence_seconds - self._read[1]
        self._read = (media.audio_seconds, media.silence_seconds)
        if skipped is not None:
            self.skipped_units += 1
            if skipped not in self.reasons:
                self.reasons.append(skipped)

    def streamed(self, media_stats: dict) -> dict:
        """Seconds of each track that became units, from the session's ``stats()["media"]`` (frames, and seconds
        of audio it was pushed plus any silence it added); the part of that audio that was the file's padding comes
        from the chunks the session took."""
        total = media_stats["audio_seconds"] + media_stats["silence_seconds"]
        silence = min(total, self.ok["silence_seconds"] + media_stats["silence_seconds"])
        return {"video_seconds": int(media_stats["frames"]), "audio_seconds": round(total - silence, 3),
                "silence_seconds": round(silence, 3)}

    def skipped_json(self) -> dict:
        return {"units": self.skipped_units, "video_seconds": self.skip["video_seconds"],
                "audio_seconds": round(self.skip["audio_seconds"], 3),
                "silence_seconds": round(self.skip["silence_seconds"], 3), "reasons": list(self.reasons)}

    def _tracks(self, d: dict, video: bool) -> str:
        parts = [f"video {d['video_seconds']} s"] if video else []
        if self.has_audio:
            a = f"audio {d['audio_seconds']:.1f} s"
            if d["silence_seconds"] >= 0.05:
                a += f" (+ {d['silence_seconds']:.1f} s of silence)"
            parts.append(a)
        elif video:
            parts.append("no audio track")
        return ", ".join(parts)

    def summary(self, units: int, done: dict, video: bool) -> list[str]:
        """``streamed N s: ...`` (``streamed N of M s`` when chunks were skipped), then a ``skipped`` line naming the
        reasons."""
        if not self.skipped_units:
            return [f"streamed {units} s: {self._tracks(done, video)}"]
        n = self.skipped_units
        tracks = self._tracks(self.skip, video).replace(", no audio track", "")
        others = len(self.reasons) - 1
        why = self.reasons[0] + (f" (and {others} other reason{'s' if others > 1 else ''})" if others else "")
        return [f"streamed {units} of {units + n} s: {self._tracks(done, video)}",
                f"skipped {n} s ({tracks}): {why}"]


class StopRequest:
    """Ctrl-C while streaming asks for a clean stop: the unit or answer token under way finishes, the stream stops
    there and the command writes ``--json`` (marked interrupted) and ``--save-session`` as at the end, then exits
    130. A second Ctrl-C raises KeyboardInterrupt at once. Installed only in the main thread (signal handlers can
    be set nowhere else); elsewhere Ctrl-C keeps Python's default."""

    def __init__(self, prog: str):
        self.prog = prog
        self.requested = False
        self._previous = None

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print(f"\n{self.prog}: interrupted: stopping after this step and writing what was streamed (Ctrl-C again "
              "to abort)", file=sys.stderr, flush=True)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
        return False

    def sleep_until(self, deadline: float) -> None:
        """``time.sleep`` until ``deadline`` (perf_counter) in short steps, returning early on a stop request."""
        while not self.requested:
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            time.sleep(min(left, 0.1))


def write_json_atomic(path: Path, data) -> None:
    """Write then rename: a crash never leaves half a file where results were."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def run(args) -> int:
    from ..errors import MediaError, SessionError
    from ..media import MediaStream
    from ..models.loading import CheckpointError

    if args.video is None and args.audio is None:
        print("omnitide stream: give --video and/or --audio", file=sys.stderr)
        return 2
    try:
        questions = parse_questions(args.ask)
        check_args(args)
    except UsageError as e:
        print(f"omnitide stream: {e}", file=sys.stderr)
        return 2
    updates: list[dict] = []
    progress = None
    columns = None

    def on_update(rec):
        updates.append({"t": rec.t, "kind": rec.kind, "tokens": rec.tokens, "retained_cells": rec.retained_cells,
                        "retained_kv_bytes": rec.retained_cells * bytes_per_token,
                        "physical_span": rec.physical_span, "active_pages": rec.active_pages,
                        "kv_bytes": rec.kv_bytes, "update_ms": round(rec.update_ms, 3),
                        "evicted_tokens": rec.evicted_tokens, "migrated_cells": rec.migrated_cells})
        if args.stats:
            line = columns[1](rec)
            (progress.write(line, file=sys.stderr) if progress is not None else print(line, file=sys.stderr))

    bytes_per_token = 0
    try:
        check_model(args)  # a wrong model name fails before any media is decoded
        check_kv_group(args)  # from config.json: a group that cannot divide the head fails before loading
        media = MediaStream(args.video, args.audio, seconds=args.seconds)  # both files checked, nothing decoded
        check_question_times(questions, media.units)
        check_kv_budget(args, media, asks=bool(questions))  # from the checkpoint's files, before it loads
        session = session_from_args(args, on_update=on_update)
        speaker = SpokenAnswers(session, args, "omnitide stream")
        voice = (VoiceTurns(session, args, "omnitide stream", speaker.options if speaker.enabled else None,
                            args.audio_out) if getattr(args, "voice", False) else None)
    except UsageError as e:
        print(f"omnitide stream: {e}", file=sys.stderr)
        return 2
    except (MediaError, CheckpointError, ValueError) as e:
        print(f"omnitide stream: {e}", file=sys.stderr)
        return 1
    bytes_per_token = session.stats()["kv_bytes_per_token"]
    columns = update_columns(bytes_per_token)
    if args.stats:
        print(columns[0], file=sys.stderr)

    from tqdm import tqdm

    tqdm.monitor_interval = 0  # no background refresh: it would redraw the bar over an answer being printed
    progress = tqdm(total=media.units, unit="s", desc="streaming", file=sys.stderr, leave=False,
                    disable=args.no_progress or media.units < 2 or not sys.stderr.isatty())
    answers = []
    pending = list(questions)
    wall0 = time.perf_counter()
    stop = StopRequest("omnitide stream")

    def ask_due(now: float) -> None:
        while pending and pending[0][0] <= now and not stop.requested:
            t, q = pending.pop(0)
            progress.clear()
            if voice is not None:  # a typed question beside the spoken ones: a turn of the conversation
                voice.ask(t, q)
                continue
            print(f"\n[{t:g}s] Q: {q}", flush=True)
            pieces = iter(speaker.ask(q, label=f"{t:g}s", **sampling_kwargs(args)))
            first = next(pieces, "")  # the question's update (and its --stats line) happens here, before "A:"
            sys.stderr.flush()
            print(f"A: {first}", end="", flush=True)
            answer = [first]
            for piece in pieces:
                if stop.requested:  # the reply is cut here; closing it leaves the session ready to save
                    pieces.close()
                    break
                answer.append(piece)
                print(piece, end="", flush=True)
            print(flush=True)
            answers.append({"t": t, "question": q, "answer": "".join(answer)})
            if stop.requested:
                answers[-1]["interrupted"] = True
            recalled = session.last_recall() if getattr(session, "recall", None) is not None else None
            if recalled is not None:  # the stored units this answer was given back, by stream time
                answers[-1]["recalled"] = {"uids": recalled["uids"], "t": recalled["t"],
                                           "tokens": recalled["tokens"]}
                if recalled["uids"]:
                    print("   (recalled the units at " + ", ".join(f"{x:g}s" for x in recalled["t"] if x is not None)
                          + ")", file=sys.stderr, flush=True)

    streamed = 0
    tally = ChunkTally(has_audio=media.audio_path is not None)
    error = None
    with stop:  # Ctrl-C from here on: a clean stop, then the same --json and --save-session as at the end
        try:
            ask_due(0.0)
            for chunk in media:
                if args.realtime:
                    stop.sleep_until(wall0 + chunk.t)
                if stop.requested:
                    break
                try:
                    (voice.push if voice is not None else session.push)(frame=chunk.frame, audio=chunk.audio,
                                                                         t=chunk.t)
                    streamed += 1
                    tally.add(chunk, media)
                except MediaError as e:  # a bad chunk is skipped, the stream goes on
                    tally.add(chunk, media, skipped=str(e))
                    progress.write(f"skipped the chunk at {chunk.t:g}s: {e}", file=sys.stderr)
                progress.update(1)
                ask_due(chunk.t + 1.0)
                if stop.requested:
                    break
            ask_due(float("inf"))
            if voice is not None and not stop.requested:
                voice.finish()  # an utterance still open at the end of the file is answered
        except MediaError as e:  # the file broke mid-way: keep what was streamed and answered
            error = e
        finally:
            progress.close()

        s = session.stats()
        done = tally.streamed(s["media"])
        print("", file=sys.stderr)
        for line in tally.summary(streamed, done, video=args.video is not None):
            print(line, file=sys.stderr)
        print(kv_summary(s), file=sys.stderr)
        status = 0
        if stop.requested:
            print(f"omnitide stream: interrupted at {streamed} s", file=sys.stderr)
            status = 130
        elif error is not None:
            print(f"omnitide stream: stopped at {streamed} s: {error}", file=sys.stderr)
            status = 1
        elif streamed == 0 and tally.skipped_units:
            print(f"omnitide stream: nothing was streamed: the session rejected all {tally.skipped_units} chunks "
                  f"({tally.reasons[0]})", file=sys.stderr)
            status = 1
        if args.json:
            if speaker.enabled:
                for a, f in zip(answers, speaker.files):
                    a["speech"] = f
            out = {"model": args.model, "policy": args.policy, "answers": answers, "updates": updates, "stats": s,
                   **({"turns": voice.turns_json()} if voice is not None else {}),
                   "media": {"units": streamed, **done, "skipped": tally.skipped_json()}}
            if stop.requested:
                out["interrupted"] = True
                out["unasked"] = [{"t": t, "question": q} for t, q in pending]
            try:
                write_json_atomic(Path(args.json).expanduser(), out)
            except OSError as e:
                print(f"omnitide stream: could not write --json {args.json}: {e}", file=sys.stderr)
                status = 1
        if args.save_session:
            try:
                session.save(args.save_session)
            except (OSError, SessionError) as e:
                print(f"omnitide stream: could not save the session to {args.save_session}: {e}", file=sys.stderr)
                status = 1
        return status
