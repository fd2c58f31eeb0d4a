"""``omnitide stream``: stream a video / audio file through a model a unit a second, answer questions at their
times, and report what the KV cache did."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

HELP = "stream a video/audio file through a model, asking questions at given times"
DESCRIPTION = """Stream a file through an omni model one unit (a frame plus a second of audio) at a time, ask each
question when the stream reaches its time, print the answers as they stream and a KV summary.

examples:
  omnitide stream --model Qwen/Qwen2.5-Omni-3B --video clip.mp4 --ask "5:What colour is the background?"
  omnitide stream --model ./checkpoints/tiny-minicpmo --video clip.mp4 --policy fifo --kv-budget 64MiB \\
      --ask "3:What did you hear?" --stats --json out.json
  omnitide stream --backend torch --device cuda --model Qwen/Qwen2.5-Omni-3B --video clip.mp4 --ask "5:What is it?"
"""

POLICIES = ["omnitide", "omnipick", "full", "fifo", "token", "streamingllm", "h2o", "eager"]


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    """Sampling flags named as ``mlx_lm.generate`` names them."""
    p.add_argument("--max-tokens", "-m", type=int, default=128, help="most tokens per answer (default 128)")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=0.0, help="nucleus sampling threshold (0: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p sampling threshold (0: off)")
    p.add_argument("--top-k", type=int, default=0, help="top-k sampling (0: off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local model folder or Hugging Face id (from the local cache)")
    p.add_argument("--system-prompt", default=None, help="system prompt (default: the model's own)")


def add_policy_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", choices=POLICIES, default="omnitide",
                   help="KV retention: omnitide (OmniPick + OmniPage, default), omnipick (native layout), full "
                        "(no eviction), fifo (oldest units), token (oldest tokens), streamingllm, h2o, eager")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--high", type=int, default=None, help="high watermark in tokens (default 2500)")
    g.add_argument("--kv-budget", default=None, help="KV memory budget, e.g. 512MiB; sets the watermarks from "
                                                      "the model's KV bytes per token")
    p.add_argument("--low", type=int, default=None, help="low watermark in tokens (default 1800)")


def add_kv_arguments(p: argparse.ArgumentParser) -> None:
    """Quantised KV flags, named as mlx-lm names them (``--kv-bits``, ``--kv-group-size``)."""
    p.add_argument("--kv-bits", type=int, choices=[4, 8], default=None,
                   help="hold the KV cache quantised to 8 or 4 bits (default: the model's float dtype)")
    p.add_argument("--kv-group-size", type=int, choices=[32, 64, 128], default=64,
                   help="quantisation group size along the head dimension (default 64)")
    p.add_argument("--kv-keep-sinks-full", action="store_true",
                   help="with --kv-bits: keep the system prefix (the attention sinks) in full precision")


def kv_kwargs(args) -> dict:
    return dict(kv_bits=getattr(args, "kv_bits", None), kv_group_size=getattr(args, "kv_group_size", 64),
                kv_keep_sinks_full=getattr(args, "kv_keep_sinks_full", False))


def add_backend_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=["mlx", "torch"], default="mlx",
                   help="mlx (default) or torch: transformers' Qwen2.5-Omni thinker on PyTorch (CUDA or CPU; needs "
                        "the torch extra)")
    p.add_argument("--device", default=None, help="torch backend: cuda, cuda:N or cpu (default: cuda if available)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_backend_arguments(p)
    p.add_argument("--video", default=None, help="video file (its audio track is used unless --audio is given)")
    p.add_argument("--audio", default=None, help="audio file (wav/flac/ogg/mp3/m4a/...)")
    p.add_argument("--ask", action="append", default=[], metavar="T:QUESTION",
                   help="a question asked when the stream reaches T seconds, e.g. '12:What colour is the square?' "
                        "(repeatable)")
    p.add_argument("--seconds", type=float, default=None, help="stream at most this many seconds")
    p.add_argument("--realtime", action="store_true", help="pace the stream at one unit per wall-clock second")
    add_policy_arguments(p)
    add_kv_arguments(p)
    add_sampling_arguments(p)
    p.add_argument("--stats", action="store_true", help="print one line per streaming update")
    p.add_argument("--json", default=None, metavar="PATH", help="write answers and per-update KV figures as JSON")
    p.add_argument("--save-session", default=None, metavar="DIR", help="save the session state at the end")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def parse_questions(items: list[str]) -> list[tuple[float, str]]:
    out = []
    for item in items:
        m = re.match(r"^\s*(\d+(?:\.\d+)?)\s*:(.+)$", item, re.S)
        if not m or not m.group(2).strip():
            raise SystemExit(f"omnitide stream: --ask {item!r} is not T:QUESTION (T in seconds, e.g. '12:What is "
                             "on the screen?')")
        out.append((float(m.group(1)), m.group(2).strip()))
    return sorted(out, key=lambda q: q[0])


def session_from_args(args, on_update=None):
    """Load the model and build an OmniSession (``--backend mlx``) or a TorchSession (``--backend torch``) from the
    shared model / policy flags."""
    backend = getattr(args, "backend", "mlx")
    kv = kv_kwargs(args)
    if kv["kv_keep_sinks_full"] and kv["kv_bits"] is None:
        raise ValueError("--kv-keep-sinks-full goes with --kv-bits")
    if backend == "torch":
        if kv["kv_bits"] is not None:
            raise ValueError("--kv-bits: the torch backend holds float K/V only (docs/torch.md)")
        kv = {}
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
    t0 = time.perf_counter()
    print(f"loading {args.model} ...", file=sys.stderr, end="", flush=True)
    model, processor = load(args.model, **load_kw)
    print(f" done in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    session = session_class((model, processor), system_prompt=args.system_prompt, policy=args.policy,
                            high=args.high, low=args.low, kv_budget=args.kv_budget, on_update=on_update, **kv)
    session.model_path = args.model
    return session


def sampling_kwargs(args) -> dict:
    return dict(max_tokens=args.max_tokens, temp=args.temp, top_p=args.top_p, min_p=args.min_p, top_k=args.top_k,
                seed=args.seed)


def format_update(rec) -> str:
    t = f"{rec.t:7.1f}s" if rec.t is not None else "      -"
    extra = ""
    if rec.evicted_tokens:
        extra += f"  evicted {rec.evicted_tokens}"
    if rec.migrated_cells:
        extra += f"  moved {rec.migrated_cells}"
    return (f"[{t}] {rec.kind:<6} +{rec.tokens:<5d} retained {rec.retained_cells:<6d} span {rec.physical_span:<6d} "
            f"pages {rec.active_pages:<4d} kv {rec.kv_bytes / 2**20:8.2f} MiB  update {rec.update_ms:8.1f} ms{extra}")


def run(args) -> int:
    from ..errors import MediaError
    from ..media import iter_chunks, probe_video, read_audio
    from ..models.loading import CheckpointError

    if args.video is None and args.audio is None:
        print("omnitide stream: give --video and/or --audio", file=sys.stderr)
        return 2
    questions = parse_questions(args.ask)
    try:
        # check the inputs before loading a model: a bad file fails fast
        if args.video is not None:
            probe_video(args.video)
        if args.audio is not None:
            read_audio(args.audio)
        updates: list[dict] = []
        progress = None

        def on_update(rec):
            updates.append({"t": rec.t, "kind": rec.kind, "tokens": rec.tokens, "retained_cells": rec.retained_cells,
                            "physical_span": rec.physical_span, "active_pages": rec.active_pages,
                            "kv_bytes": rec.kv_bytes, "update_ms": round(rec.update_ms, 3),
                            "evicted_tokens": rec.evicted_tokens, "migrated_cells": rec.migrated_cells})
            if args.stats:
                line = format_update(rec)
                (progress.write(line) if progress is not None else print(line))

        session = session_from_args(args, on_update=on_update)
        chunks = list(iter_chunks(args.video, args.audio, seconds=args.seconds))
    except (MediaError, CheckpointError, ValueError) as e:
        print(f"omnitide stream: {e}", file=sys.stderr)
        return 1

    from tqdm import tqdm

    progress = tqdm(total=len(chunks), unit="s", desc="streaming", file=sys.stderr,
                    disable=args.quiet or len(chunks) < 2 or not sys.stderr.isatty())
    answers = []
    pending = list(questions)
    wall0 = time.perf_counter()

    def ask_due(now: float) -> None:
        while pending and pending[0][0] <= now:
            t, q = pending.pop(0)
            progress.clear()
            print(f"\n[{t:g}s] Q: {q}\nA: ", end="", flush=True)
            pieces = []
            for piece in session.ask(q, **sampling_kwargs(args)):
                pieces.append(piece)
                print(piece, end="", flush=True)
            print(flush=True)
            answers.append({"t": t, "question": q, "answer": "".join(pieces)})

    try:
        ask_due(0.0)
        for chunk in chunks:
            if args.realtime:
                time.sleep(max(0.0, wall0 + chunk.t - time.perf_counter()))
            try:
                session.push(frame=chunk.frame, audio=chunk.audio, t=chunk.t)
            except MediaError as e:  # a bad chunk is skipped, the stream goes on
                progress.write(f"skipped the chunk at {chunk.t:g}s: {e}")
            progress.update(1)
            ask_due(chunk.t + 1.0)
        ask_due(float("inf"))
    finally:
        progress.close()

    s = session.stats()
    print(f"\nKV: {s['retained_cells']} retained cells in a span of {s['physical_span']} slots "
          f"({s['active_pages']} active pages), {s['kv_bytes'] / 2**20:.2f} MiB; {s['units']} units, "
          f"{s['evictions']} evictions ({s['evicted_tokens']} tokens), {s['migrations']} migrations "
          f"({s['migrated_cells']} cells); policy {s['policy']} (high {s['high']}, low {s['low']})",
          file=sys.stderr)
    if args.save_session:
        session.save(args.save_session)
    if args.json:
        out = {"model": args.model, "policy": args.policy, "answers": answers, "updates": updates, "stats": s}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    return 0
