"""Soak runs: does a session stay bounded and correct for hours, not minutes?

Two runs, each writing a JSON of per-window figures and fitted slopes (docs/benchmarks.md, "Soak"):

- ``sim``: a simulated stream through the core planner and page table only (no model, no MLX): one MiniCPM-o 4.5
  unit a second for 24 hours (86,400 units) plus a question and a reply every 30 s, OmniTide retention and the
  OmniPage layout. Every update checks the page table's invariants (``validate``: slot accounting, counters,
  serials; ``check_history``: one entry per history token) and that retained tokens, units and positions stay
  bounded; per window of stream time it records the largest physical span, capacity, retained cells, units and
  next position, and the process RSS.
- ``engine``: OmniSession on a tiny checkpoint with a producer thread pushing one unit a second of media (as fast
  as it goes) while a consumer thread asks questions and abandons some replies (reads a piece and closes the
  iterator, or leaves it open and asks again). Checks: no deadlock (both threads finish within a deadline), no
  unit lost or duplicated (every pushed second is exactly one media unit, in order), and RSS and KV bytes flat.

Flat means the least-squares slope over the windows after the first (warm-up) changes the quantity by less than
its tolerance over the whole run. ``python -m omnitide_mlx.eval.soak sim|engine --help``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np


def rss_bytes() -> int:
    """Resident memory of this process now (Linux /proc; elsewhere the peak from getrusage, which can only
    grow, so a flat peak still shows no growth)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def fitted_slope(x: list[float], y: list[float]) -> float:
    """Least-squares slope of ``y`` against ``x`` (0 for fewer than two points)."""
    if len(x) < 2:
        return 0.0
    return float(np.polyfit(np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64), 1)[0])


def flatness(windows: list[dict], x_key: str, keys: dict[str, float]) -> dict:
    """For each key: the slope over the windows after the first, the change it predicts over the run, and whether
    that change is within the key's tolerance."""
    body = windows[1:] if len(windows) > 2 else windows
    xs = [w[x_key] for w in body]
    span = (xs[-1] - xs[0]) if xs else 0.0
    out = {}
    for key, tol in keys.items():
        slope = fitted_slope(xs, [w[key] for w in body])
        out[key] = {"slope_per_" + x_key: slope, "change_over_run": slope * span, "tolerance": tol,
                    "flat": abs(slope * span) <= tol}
    return out


def machine() -> dict:
    import importlib.metadata as md

    versions = {}
    for pkg in ("omnitide-mlx", "mlx", "numpy"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
            "versions": versions}


# --- the simulated stream ---------------------------------------------------------------------------------------
def sim_soak(seconds: int = 86_400, *, profile: str = "minicpm-o-4.5", policy: str = "omnitide",
             layout: str = "omnipage", question_every: int = 30, window: int = 3600, seed: int = 0,
             check_every: int = 1, progress: bool = False, on_window: Callable[[list], None] | None = None) -> dict:
    """Stream ``seconds`` simulated units through the planner and page table, checking invariants every
    ``check_every`` updates; per ``window`` seconds of stream time, the largest span, capacity, retained cells,
    units and next position, and RSS. Raises AssertionError at the first broken invariant."""
    from ..core.profiles import StreamSpec
    from ..core.sim import Simulator
    from ..models.stream_units import resolve_profile

    prof = resolve_profile(profile)
    sim = Simulator(prof, policy, StreamSpec(seconds, question_every=question_every, seed=seed),
                    layouts=(layout,), check=False)
    lt = sim.layouts[layout]
    table = lt.table
    high = sim.policy.high
    largest_unit = 0
    windows: list[dict] = []
    cur: dict | None = None
    last_seq = table.next_seq
    t0 = time.perf_counter()
    checks = 0

    def close(w: dict) -> None:
        w["rss_bytes"] = rss_bytes()
        w["wall_s"] = round(time.perf_counter() - t0, 2)
        windows.append(w)
        if on_window is not None:
            on_window(windows)
        if progress:
            print(f"  {w['hour']:6.2f} h  span {w['max_physical_span']:6d}  cap {w['max_capacity']:6d}  "
                  f"retained {w['max_retained']:5d}  units {w['max_units']:4d}  pos {w['max_next_position']:6d}  "
                  f"rss {w['rss_bytes'] / 2**20:7.1f} MiB  {w['wall_s']:7.1f} s", file=sys.stderr, flush=True)

    for event in sim.stream.events():
        k = int(event.t) // window
        if cur is None or cur["window"] != k:
            if cur is not None:
                close(cur)
            cur = {"window": k, "hour": (k + 1) * window / 3600, "updates": 0, "max_physical_span": 0,
                   "max_capacity": 0, "max_retained": 0, "max_units": 0, "max_next_position": 0}
        rec = sim.step(event)[layout]
        largest_unit = max(largest_unit, sim.history[-1].length if sim.history[-1].uid == rec["uid"] else 0)
        if sim.updates % check_every == 0:
            table.validate()
            table.check_history(sim.history)
            assert table.retained == sim.history.total_tokens, "table and history hold different token counts"
            assert table.next_seq > last_seq, "serials must increase with every update"
            checks += 1
        last_seq = table.next_seq
        # retention keeps the history under high plus the newest units (the policy never drops the newest)
        assert rec["retained_cells"] <= high + 3 * largest_unit, f"retained {rec['retained_cells']} unbounded"
        cur["updates"] += 1
        cur["max_physical_span"] = max(cur["max_physical_span"], rec["physical_span"], rec["prefill_span"])
        cur["max_capacity"] = max(cur["max_capacity"], rec["capacity"])
        cur["max_retained"] = max(cur["max_retained"], rec["retained_cells"])
        cur["max_units"] = max(cur["max_units"], len(sim.history))
        # 1-D RoPE: the newest unit holds the largest position (History.next_position scans every unit)
        cur["max_next_position"] = max(cur["max_next_position"], sim.history[-1].max_position() + 1)
    if cur is not None:
        close(cur)
    page = table.page_size
    flat = flatness(windows, "hour", {"max_physical_span": page, "max_capacity": page, "max_units": 8,
                                      "max_next_position": 2 * high, "rss_bytes": 16 << 20})
    return {
        "run": "sim", "profile": prof.name, "policy": sim.policy.config(), "layout": layout,
        "migration": lt.planner.mode, "seconds": seconds, "question_every": question_every, "seed": seed,
        "updates": sim.updates, "trims": sim.trims, "migrations": lt.migrations,
        "moved_cells_total": lt.moved_entries_total, "invariant_checks": checks, "largest_unit": largest_unit,
        "full_context_tokens": sim.full_context_tokens, "window_s": window,
        "peak": {k: max(w[k] for w in windows) for k in ("max_physical_span", "max_capacity", "max_retained",
                                                          "max_units", "max_next_position")},
        "flat": flat, "all_flat": all(v["flat"] for v in flat.values()),
        "wall_s": round(time.perf_counter() - t0, 1), "machine": machine(), "windows": windows,
    }


# --- the engine ---------------------------------------------------------------------------------------------------
def engine_soak(units: int = 2000, *, model: str | None = None, question_every: int = 20, max_tokens: int = 8,
                window: int = 200, high: int = 400, low: int = 280, deadline_s: float = 3600.0,
                progress: bool = False, seed: int = 0, on_window: Callable[[list], None] | None = None) -> dict:
    """Push ``units`` seconds of media from a producer thread while a consumer asks a question about every
    ``question_every`` units and abandons some replies; returns per-window RSS and KV figures and the checks.
    ``model``: a checkpoint folder (default: a tiny random Qwen2.5-Omni checkpoint with the real tokenizer, built
    in a temporary folder). Raises AssertionError when a check fails."""
    import tempfile

    from ..media import iter_chunks
    from ..models import load
    from ..session import OmniSession

    repo = Path(__file__).resolve().parents[2]
    tmp = None
    if model is None:
        from ..models.qwen2_5_omni.tiny import make_tiny_checkpoint

        tmp = tempfile.TemporaryDirectory(prefix="omnitide-soak-")
        model = make_tiny_checkpoint(Path(tmp.name) / "tiny-qwen2.5-omni",
                                     tokenizer_dir=repo / "tests/data/tokenizers/qwen2", vocab="real")
    chunks = [(c.frame[::4, ::4].copy(), c.audio) for c in iter_chunks(repo / "assets/media/video_10s_av.mp4")]
    rng = np.random.default_rng(seed)
    session = OmniSession(load(model), policy="omnitide", high=high, low=low)
    pushed = threading.Event()
    errors: list[BaseException] = []
    progress_at = {"pushed": 0, "asked": 0, "abandoned": 0, "answered": 0, "superseded": 0}
    windows: list[dict] = []
    t0 = time.perf_counter()

    def sample(k: int) -> None:
        st = session.stats()
        windows.append({"units": k, "rss_bytes": rss_bytes(), "kv_bytes": st["kv_bytes"],
                        "kv_bytes_retained": st["kv_bytes_retained"], "retained_cells": st["retained_cells"],
                        "physical_span": st["physical_span"], "history_units": st["units"],
                        "wall_s": round(time.perf_counter() - t0, 2), "consumer": dict(progress_at)})
        if on_window is not None:
            on_window(windows)
        if progress:
            w = windows[-1]
            print(f"  {k:6d} units  rss {w['rss_bytes'] / 2**20:7.1f} MiB  kv {w['kv_bytes'] / 1024:7.1f} KiB  "
                  f"retained {w['retained_cells']:5d}  {w['wall_s']:7.1f} s  {progress_at}", file=sys.stderr,
                  flush=True)

    def produce() -> None:
        try:
            for k in range(units):
                while session.queued > 2 and not pushed.is_set():  # as fast as the model goes, not faster
                    time.sleep(0.002)
                frame, audio = chunks[k % len(chunks)]
                session.push(frame=frame, audio=audio, t=float(k))
                progress_at["pushed"] = k + 1
                if (k + 1) % window == 0:
                    sample(k + 1)
        except BaseException as e:  # reported by the caller
            errors.append(e)
        finally:
            pushed.set()

    def consume() -> None:
        try:
            open_reply = None
            i = 0
            while not pushed.is_set():
                # a reply left open is superseded by the next question at once ("stop and ask again"); while it
                # is open the session queues pushes, so waiting for more pushes here would wait forever
                if open_reply is None and progress_at["pushed"] < (i + 1) * question_every:
                    time.sleep(0.005)
                    continue
                i += 1
                it = session.ask(f"Question {i}: what changed?", max_tokens=max_tokens)
                progress_at["asked"] += 1
                if open_reply is not None:
                    progress_at["superseded"] += 1  # asking again ends the reply left open
                open_reply = None
                mode = rng.integers(3)
                if mode == 0:  # read to the end
                    "".join(it)
                    progress_at["answered"] += 1
                elif mode == 1:  # a piece, then stop
                    next(it, None)
                    it.close()
                    progress_at["abandoned"] += 1
                else:  # a piece, then leave it open: the next question (or the end) ends it
                    next(it, None)
                    open_reply = it
            if open_reply is not None:
                open_reply.close()
        except BaseException as e:
            errors.append(e)

    producer = threading.Thread(target=produce, name="soak-producer", daemon=True)
    consumer = threading.Thread(target=consume, name="soak-consumer", daemon=True)
    sample(0)
    producer.start()
    consumer.start()
    producer.join(deadline_s)
    consumer.join(max(1.0, deadline_s - (time.perf_counter() - t0)))
    deadlock = producer.is_alive() or consumer.is_alive()
    if errors:
        raise errors[0]
    assert not deadlock, f"a thread did not finish within {deadline_s} s (deadlock?): {progress_at}"
    session.flush()
    media_t = [r.t for r in session.records if r.kind == "media"]
    lost = sorted(set(range(units)) - {int(t) for t in media_t})
    duplicated = len(media_t) - len(set(media_t))
    assert media_t == [float(k) for k in range(units)], f"media units lost {lost[:5]} or duplicated {duplicated}"
    session.cache.page_table.validate()
    session.cache.page_table.check_history(session.history)
    expected_units = 1 + units + progress_at["asked"] * 2
    replies = sum(1 for r in session.history if r.kind.value == "reply")
    # retained cells saw-tooth between low and high with every trim: only a drift beyond that amplitude is growth
    flat = flatness(windows, "units", {"rss_bytes": 32 << 20, "kv_bytes": 64 * session.cache.bytes_per_token,
                                       "retained_cells": high - low})
    out = {
        "run": "engine", "model": str(model) if tmp is None else "tiny random Qwen2.5-Omni (real tokenizer)",
        "policy": session.policy.config(), "units": units, "question_every": question_every,
        "max_tokens": max_tokens, "consumer": progress_at, "lost_units": lost, "duplicated_units": duplicated,
        "session_units_total": session.counters.units, "expected_units_total_at_most": expected_units,
        "replies_retained_now": replies, "deadlock": deadlock, "kv_bytes_per_token": session.cache.bytes_per_token,
        "capacity_bound": session.capacity_bound(),
        "peak": {k: max(w[k] for w in windows) for k in ("rss_bytes", "kv_bytes", "retained_cells")},
        "flat": flat, "all_flat": all(v["flat"] for v in flat.values()),
        "wall_s": round(time.perf_counter() - t0, 1), "machine": machine(), "windows": windows,
    }
    if tmp is not None:
        tmp.cleanup()
    return out


def spoken_soak(seconds: int = 3600, *, model: str | None = None, question_every: int = 300, max_tokens: int = 8,
                window: int = 300, high: int = 400, low: int = 280, progress: bool = False,
                on_window: Callable[[list], None] | None = None) -> dict:
    """An hour of a spoken session at stream speed, not wall time: ``seconds`` one-second audio units (the bundled
    speech clip, cycled) pushed as fast as the model takes them, and every ``question_every`` seconds a question
    answered in speech (``speak=True``, seeded), its text and audio read to the end. Checks: every second is one
    media unit, every reply has text and the spoken path gave audio, RSS / KV bytes / retained cells flat per
    ``window`` seconds (replies a random talker ended before any audio are listed). ``model``:
    a checkpoint with a talker (default: a tiny random Qwen2.5-Omni with talker and token2wav, real tokenizer).
    Raises AssertionError when a check fails."""
    import tempfile

    from ..media import SAMPLE_RATE, read_audio
    from ..session import OmniSession
    from ..speech import AudioChunk

    repo = Path(__file__).resolve().parents[2]
    tmp = None
    if model is None:
        from ..models.qwen2_5_omni.tiny import make_tiny_checkpoint

        tmp = tempfile.TemporaryDirectory(prefix="omnitide-spoken-soak-")
        model = make_tiny_checkpoint(Path(tmp.name) / "tiny-qwen2.5-omni-speech", speech=True, seed=1,
                                     tokenizer_dir=repo / "tests/data/tokenizers/qwen2", vocab="real")
    speech = read_audio(repo / "assets/media/speech_16k.wav")
    clips = [speech[k * SAMPLE_RATE:(k + 1) * SAMPLE_RATE] for k in range(len(speech) // SAMPLE_RATE)]
    session = OmniSession(model, policy="omnitide", high=high, low=low)
    windows: list[dict] = []
    replies: list[dict] = []
    t0 = time.perf_counter()

    def sample(k: int) -> None:
        st = session.stats()
        windows.append({"seconds": k, "rss_bytes": rss_bytes(), "kv_bytes": st["kv_bytes"],
                        "retained_cells": st["retained_cells"], "history_units": st["units"],
                        "replies": len(replies), "wall_s": round(time.perf_counter() - t0, 2)})
        if on_window is not None:
            on_window(windows)
        if progress:
            w = windows[-1]
            print(f"  {k:6d} s  rss {w['rss_bytes'] / 2**20:7.1f} MiB  kv {w['kv_bytes'] / 1024:7.1f} KiB  "
                  f"retained {w['retained_cells']:5d}  replies {len(replies)}  {w['wall_s']:7.1f} s",
                  file=sys.stderr, flush=True)

    sample(0)
    for k in range(seconds):
        session.push(audio=clips[k % len(clips)], t=float(k))
        if (k + 1) % question_every == 0:
            text, samples = [], 0
            # seeded: the spoken reply (the talker samples) is the same in every run
            for item in session.ask(f"At {k + 1} seconds: what did you hear?", speak=True, max_tokens=max_tokens,
                                    seed=k + 1):
                if isinstance(item, AudioChunk):
                    samples += item.pcm.size
                else:
                    text.append(item)
            replies.append({"t": k + 1, "text_chars": len("".join(text)), "audio_samples": samples})
        if (k + 1) % window == 0:
            sample(k + 1)
    session.flush()
    media_t = [r.t for r in session.records if r.kind == "media"]
    assert media_t == [float(k) for k in range(seconds)], "media units lost or duplicated"
    session.cache.page_table.validate()
    session.cache.page_table.check_history(session.history)
    # a random talker may end a reply before its first audio frame (its first codec token the end token): the
    # soak asks that the spoken path ran and kept running, not that random weights always speak
    silent = [r["t"] for r in replies if r["audio_samples"] == 0]
    assert len(replies) == seconds // question_every and all(r["text_chars"] for r in replies), replies
    assert len(silent) < len(replies), f"no reply had audio: {replies}"
    flat = flatness(windows, "seconds", {"rss_bytes": 32 << 20, "kv_bytes": 64 * session.cache.bytes_per_token,
                                         "retained_cells": high - low})
    out = {"run": "spoken", "model": str(model) if tmp is None else
           "tiny random Qwen2.5-Omni with talker and token2wav (real tokenizer)",
           "policy": session.policy.config(), "seconds": seconds, "question_every": question_every,
           "max_tokens": max_tokens, "replies": replies, "replies_without_audio": silent,
           "kv_bytes_per_token": session.cache.bytes_per_token,
           "capacity_bound": session.capacity_bound(),
           "peak": {k: max(w[k] for w in windows) for k in ("rss_bytes", "kv_bytes", "retained_cells")},
           "flat": flat, "all_flat": all(v["flat"] for v in flat.values()),
           "wall_s": round(time.perf_counter() - t0, 1), "machine": machine(), "windows": windows}
    if tmp is not None:
        tmp.cleanup()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m omnitide_mlx.eval.soak", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="run", required=True)
    s = sub.add_parser("sim", help="24 hours of simulated MiniCPM-o units through the planner and page table")
    s.add_argument("--seconds", type=int, default=86_400)
    s.add_argument("--profile", default="minicpm-o-4.5")
    s.add_argument("--policy", default="omnitide")
    s.add_argument("--window", type=int, default=3600, help="seconds of stream time per window")
    s.add_argument("--check-every", type=int, default=1)
    e = sub.add_parser("engine", help="OmniSession on a tiny checkpoint: producer and consumer threads")
    e.add_argument("--units", type=int, default=2000)
    e.add_argument("--model", default=None, help="checkpoint folder (default: a tiny random Qwen2.5-Omni)")
    e.add_argument("--question-every", type=int, default=20)
    e.add_argument("--window", type=int, default=200, help="units per sample")
    sp = sub.add_parser("spoken", help="an hour of spoken session at stream speed: audio units, spoken answers")
    sp.add_argument("--seconds", type=int, default=3600)
    sp.add_argument("--model", default=None, help="checkpoint folder with a talker (default: a tiny random one)")
    sp.add_argument("--question-every", type=int, default=300)
    sp.add_argument("--window", type=int, default=300, help="seconds per sample")
    for q in (s, e, sp):
        q.add_argument("--json", default=None, help="write the result here")
        q.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.run == "sim":
        for name, v in (("--seconds", args.seconds), ("--window", args.window), ("--check-every", args.check_every)):
            if v < 1:
                p.error(f"{name} must be at least 1")
        def partial(windows):  # a long run leaves its figures so far, marked incomplete
            if args.json:
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps({"run": "sim", "complete": False, "windows": windows}) + "\n")

        res = sim_soak(args.seconds, profile=args.profile, policy=args.policy, window=args.window,
                       check_every=args.check_every, progress=not args.no_progress, on_window=partial)
        res["complete"] = True
    elif args.run == "spoken":
        for name, v in (("--seconds", args.seconds), ("--question-every", args.question_every),
                        ("--window", args.window)):
            if v < 1:
                p.error(f"{name} must be at least 1")

        def partial(windows):
            if args.json:
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps({"run": "spoken", "complete": False, "windows": windows}) + "\n")

        res = spoken_soak(args.seconds, model=args.model, question_every=args.question_every, window=args.window,
                          progress=not args.no_progress, on_window=partial)
        res["complete"] = True
    else:
        for name, v in (("--units", args.units), ("--question-every", args.question_every), ("--window", args.window)):
            if v < 1:
                p.error(f"{name} must be at least 1")
        def partial(windows):
            if args.json:
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps({"run": "engine", "complete": False, "windows": windows}) + "\n")

        res = engine_soak(args.units, model=args.model, question_every=args.question_every, window=args.window,
                          progress=not args.no_progress, on_window=partial)
        res["complete"] = True
    res["command"] = "python -m omnitide_mlx.eval.soak " + " ".join(sys.argv[1:] if argv is None else argv)
    text = json.dumps(res, indent=1)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    print(f"{res['run']}: {'flat' if res['all_flat'] else 'NOT FLAT'} in {res['wall_s']} s; peak {res['peak']}")
    for k, v in res["flat"].items():
        print(f"  {k}: change over the run {v['change_over_run']:.4g} (tolerance {v['tolerance']}): "
              f"{'flat' if v['flat'] else 'GROWS'}")
    return 0 if res["all_flat"] else 1


if __name__ == "__main__":
    sys.exit(main())
