"""Flags shared by ``stream``, ``generate``, ``eval``, ``simulate``, ``bench`` and the live demo, and their checks.

Every flag is checked when argparse reads it (``type=`` functions: a bad value exits with status 2 and a message
naming the flag) or, for checks across flags and output paths, by ``validate_*`` before any model loads or any
file is decoded: a typo must not cost a model load, and an unusable ``--json`` path must not cost a whole stream.
This module imports no array framework, so ``--help`` stays instant and the torch path loads no MLX.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from pathlib import Path

from ..core.pick import DEFAULT_HIGH, DEFAULT_LOW, POLICY_NAMES
from ..errors import OmniTideError

POLICIES = list(POLICY_NAMES)  # core.pick's registry
# low / high when only one number is given (--high alone, --max-kv-size, --kv-budget): 0.72
LOW_RATIO = DEFAULT_LOW / DEFAULT_HIGH
LOW_PCT = f"{LOW_RATIO:.0%}%"  # for argparse help, where % must be doubled
MAX_KV_BUDGET = 1 << 50  # 1 PiB: anything larger is a typo, not a budget


class UsageError(OmniTideError, ValueError):
    """A flag value or a combination of flags that cannot work; raised before anything is loaded."""


# --- argparse types: each names the rule it checks ---------------------------------------------------------------
def _number(text: str, kind: type) -> float | int:
    try:
        value = kind(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def positive_int(text: str) -> int:
    v = _number(text, int)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {v})")
    return v


def non_negative_int(text: str) -> int:
    v = _number(text, int)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more (got {v})")
    return v


def positive_float(text: str) -> float:
    v = _number(text, float)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0 (got {v:g})")
    return v


def non_negative_float(text: str) -> float:
    v = _number(text, float)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more (got {v:g})")
    return v


def probability(text: str) -> float:
    v = _number(text, float)
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must lie in [0, 1] (got {v:g})")
    return v


def kv_budget(text: str) -> int:
    """``512MiB``, ``2GB``, ``1.5GiB``, ``100000`` -> bytes, positive and at most 1 PiB."""
    units = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
             "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}
    s = str(text).strip().lower().replace(" ", "").replace("_", "")
    m = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)(?:e([+-]?\d+))?([a-z]*)", s)
    if not m or m.group(3) not in units:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as a size (examples: 512MiB, 2GB, 1.5GiB)")
    value = float(m.group(1)) * 10.0 ** int(m.group(2) or 0) * units[m.group(3)]
    if not math.isfinite(value) or value > MAX_KV_BUDGET:
        raise argparse.ArgumentTypeError(f"{text!r} is more than 1 PiB: not a usable KV budget")
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size")
    return int(value)


# --- shared flag groups --------------------------------------------------------------------------------------------
def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local model folder or Hugging Face id (from the local cache)")
    p.add_argument("--system-prompt", default=None, help="system prompt (default: the model's own)")


def add_policy_arguments(p: argparse.ArgumentParser, *, policies: list[str] | None = None) -> None:
    """``--policy``, ``--high`` / ``--low``, ``--kv-budget`` and mlx-lm's ``--max-kv-size``; ``resolve_watermarks``
    turns them into (high, low)."""
    p.add_argument("--policy", choices=policies or POLICIES, default="omnitide",
                   help="KV retention: omnitide (OmniPick + OmniPage, default), omnipick (native layout), full "
                        "(no eviction), fifo (oldest units), token (oldest tokens), streamingllm, h2o, eager")
    p.add_argument("--high", type=positive_int, default=None,
                   help=f"high watermark in tokens: a trim starts above it (default {DEFAULT_HIGH})")
    p.add_argument("--low", type=positive_int, default=None,
                   help=f"low watermark in tokens: a trim's target (default {DEFAULT_LOW}; with --high alone, "
                        f"{LOW_PCT} of it)")
    p.add_argument("--kv-budget", type=kv_budget, default=None, metavar="SIZE",
                   help="KV memory budget, e.g. 512MiB: high = SIZE / the model's KV bytes per token, low = "
                        f"{LOW_PCT} of high")
    p.add_argument("--max-kv-size", type=positive_int, default=None, metavar="TOKENS",
                   help=f"as mlx_lm names it: the most tokens kept (same as --high TOKENS, low {LOW_PCT} "
                        "of it)")


def add_kv_arguments(p: argparse.ArgumentParser) -> None:
    """Quantised KV flags, named as mlx-lm names them (``--kv-bits``, ``--kv-group-size``)."""
    p.add_argument("--kv-bits", type=int, choices=[4, 8], default=None,
                   help="hold the KV cache quantised to 8 or 4 bits (default: the model's float dtype)")
    p.add_argument("--kv-group-size", type=int, choices=[32, 64, 128], default=64,
                   help="quantisation group size along the head dimension (default 64)")
    p.add_argument("--kv-keep-sinks-full", action="store_true",
                   help="with --kv-bits: keep the system prefix (the attention sinks) in full precision")


def kv_kwargs(args) -> dict:
    """``OmniSession`` keywords of the quantised KV flags (checked: --kv-keep-sinks-full needs --kv-bits; the torch
    backend holds float K/V only)."""
    kv = dict(kv_bits=getattr(args, "kv_bits", None), kv_group_size=getattr(args, "kv_group_size", 64),
              kv_keep_sinks_full=getattr(args, "kv_keep_sinks_full", False))
    if kv["kv_keep_sinks_full"] and kv["kv_bits"] is None:
        raise UsageError("--kv-keep-sinks-full goes with --kv-bits")
    if getattr(args, "backend", "mlx") == "torch":
        if kv["kv_bits"] is not None:
            raise UsageError("--kv-bits: the torch backend holds float K/V only (docs/torch.md)")
        return {}
    return kv


def add_media_arguments(p: argparse.ArgumentParser) -> None:
    """The resolution knobs, named as the official processors name them, and ``--preset`` (core/stream_units.py);
    ``media_setting(args)`` turns them into a MediaSetting."""
    p.add_argument("--preset", choices=["default", "paper"], default="default",
                   help="media setting: default (the official long-video processing: Qwen2.5-Omni frames capped at "
                        "128x28x28 pixels, MiniCPM-o frames unsliced) or paper (1344x1344 frames, Qwen at full "
                        "resolution: 2,333 tokens a unit; MiniCPM-o with 3x3 slices: 672)")
    p.add_argument("--frame-size", default=None, metavar="WxH",
                   help="resize frames to WxH before the processor (the simulator's frame; default: as they come, "
                        "640x480 in the simulator)")
    p.add_argument("--max-pixels", type=positive_int, default=None,
                   help="Qwen2.5-Omni: most pixels per frame (default 100352 = 128x28x28; paper 1806336)")
    p.add_argument("--max-slice-nums", type=positive_int, default=None,
                   help="MiniCPM-o: most slices per frame (default 1 = unsliced, as the official streaming calls; "
                        "paper 9)")


def media_setting(args):
    """The MediaSetting of ``--preset`` with ``--frame-size`` / ``--max-pixels`` / ``--max-slice-nums`` on top;
    UsageError names a bad value."""
    from ..core.stream_units import MediaSettingError, get_preset, parse_frame_size

    try:
        setting = get_preset(getattr(args, "preset", None) or "default")
        size = getattr(args, "frame_size", None)
        return setting.with_overrides(frame_size=parse_frame_size(size) if size else None,
                                      max_pixels=getattr(args, "max_pixels", None),
                                      max_slice_nums=getattr(args, "max_slice_nums", None))
    except MediaSettingError as e:
        raise UsageError(f"--frame-size / --max-pixels / --max-slice-nums: {e}") from None


def add_sampling_arguments(p: argparse.ArgumentParser, *, max_tokens: int | None = 128) -> None:
    """Sampling flags named as ``mlx_lm.generate`` names them."""
    default = f"default {max_tokens}" if max_tokens is not None else "default: per benchmark"
    p.add_argument("--max-tokens", "-m", type=positive_int, default=max_tokens,
                   help=f"most tokens per answer ({default})")
    p.add_argument("--temp", type=non_negative_float, default=0.0, help="sampling temperature; 0 is greedy (default)")
    p.add_argument("--top-p", type=probability, default=1.0, help="nucleus sampling threshold (1.0: off, default)")
    p.add_argument("--min-p", type=probability, default=0.0, help="min-p sampling threshold (0: off)")
    p.add_argument("--top-k", type=non_negative_int, default=0, help="top-k sampling (0: off)")
    p.add_argument("--repetition-penalty", type=positive_float, default=None,
                   help="penalise tokens already in the answer (1.0 or unset: off; mlx-lm's meaning)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop an answer where this text appears (repeatable); the text is not printed")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")


def add_progress_argument(p: argparse.ArgumentParser, *, legacy_quiet: bool = False) -> None:
    """One spelling across subcommands: ``--no-progress`` (``stream`` also keeps its older ``--quiet``)."""
    names = ["--no-progress", "--quiet"] if legacy_quiet else ["--no-progress"]
    p.add_argument(*names, dest="no_progress", action="store_true", help="no progress bar")


# --- checks across flags -------------------------------------------------------------------------------------------
def resolve_watermarks(args) -> tuple[int | None, int | None]:
    """(high, low) from ``--high`` / ``--low`` / ``--max-kv-size`` (``None`` leaves the policy's default), with
    one clear message for every combination that cannot work. ``--kv-budget`` is turned into watermarks by the
    session, which knows the model's KV bytes per token."""
    high, low = getattr(args, "high", None), getattr(args, "low", None)
    budget, max_kv = getattr(args, "kv_budget", None), getattr(args, "max_kv_size", None)
    given = [name for name, v in (("--high", high), ("--kv-budget", budget), ("--max-kv-size", max_kv))
             if v is not None]
    if len(given) > 1:
        raise UsageError(f"{' and '.join(given)} each set the high watermark: give one of them")
    if budget is not None:
        if low is not None:
            raise UsageError("--low cannot be combined with --kv-budget: the budget sets both watermarks (high = "
                             f"budget / KV bytes per token, low = {LOW_RATIO:.0%} of high)")
        return None, None
    if max_kv is not None:
        high = max_kv
    if high is not None and low is None:
        low = max(1, int(high * LOW_RATIO))
    elif high is None and low is not None:
        if low > DEFAULT_HIGH:
            raise UsageError(f"--low {low} is above the default high watermark {DEFAULT_HIGH}: give --high too")
        high = DEFAULT_HIGH
    if high is not None and low > high:
        raise UsageError(f"--low {low} is above --high {high}: the low watermark is a trim's target, below the high")
    return high, low


def check_output_file(path: str | None, flag: str) -> Path | None:
    """An output file we can create (its folder may not exist yet); checked before the work that fills it."""
    if path is None:
        return None
    p = Path(path).expanduser()
    if str(path).strip() == "":
        raise UsageError(f"{flag}: empty path")
    if p.is_dir():
        raise UsageError(f"{flag} {p} is a folder; give a file path")
    _check_creatable(p.parent, flag, p)
    if p.exists() and not os.access(p, os.W_OK):
        raise UsageError(f"{flag} {p} is not writable")
    return p


def check_output_dir(path: str | None, flag: str) -> Path | None:
    """An output folder we can create or write into."""
    if path is None:
        return None
    p = Path(path).expanduser()
    if str(path).strip() == "":
        raise UsageError(f"{flag}: empty path")
    if p.exists() and not p.is_dir():
        raise UsageError(f"{flag} {p} is a file; give a folder")
    _check_creatable(p, flag, p)
    return p


def _check_creatable(folder: Path, flag: str, target: Path) -> None:
    """The nearest existing ancestor of ``folder`` must be a writable folder."""
    q = folder if str(folder) else Path(".")
    while not q.exists():
        if q.parent == q:
            break
        q = q.parent
    if not q.is_dir():
        raise UsageError(f"{flag} {target}: {q} is not a folder")
    if not os.access(q, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {target}: {q} is not writable")


_CLOCK = re.compile(r"^\s*(?:(?:(\d+):)?(\d+):(?=[0-5]\d(?:\.\d*)?\s*:))?(\d+(?:\.\d*)?)\s*:(.*)$", re.S)


def parse_time(text: str) -> float:
    """Seconds from ``12``, ``12.5``, ``1:05`` (m:ss) or ``1:02:05`` (h:mm:ss)."""
    m = re.fullmatch(r"\s*(?:(?:(\d+):)?(\d+):(?=[0-5]\d))?(\d+(?:\.\d*)?)\s*", text)
    if not m:
        raise ValueError(text)
    h, mi, s = m.group(1), m.group(2), m.group(3)
    return int(h or 0) * 3600 + int(mi or 0) * 60 + float(s)


def parse_questions(items: list[str], flag: str = "--ask") -> list[tuple[float, str]]:
    """``T:QUESTION`` items, T in seconds (``12``, ``12.5``) or as a clock (``0:05``, ``1:02:05``); sorted by
    time."""
    out = []
    for item in items:
        m = _CLOCK.match(item)
        if not m or not m.group(4).strip():
            raise UsageError(f"{flag} {item!r} is not T:QUESTION (T in seconds or m:ss, e.g. '12:What is on the "
                             "screen?' or '1:05:What did they say?')")
        h, mi, s = m.group(1), m.group(2), m.group(3)
        out.append((int(h or 0) * 3600 + int(mi or 0) * 60 + float(s), m.group(4).strip()))
    return sorted(out, key=lambda q: q[0])


def sampling_kwargs(args) -> dict:
    """``OmniSession.ask`` keywords from the sampling flags; ``--top-p 1.0`` and ``--repetition-penalty 1.0`` are
    off, as in mlx-lm."""
    top_p = args.top_p if args.top_p < 1.0 else 0.0
    penalty = getattr(args, "repetition_penalty", None)
    kw = dict(max_tokens=args.max_tokens, temp=args.temp, top_p=top_p, min_p=args.min_p, top_k=args.top_k,
              seed=args.seed)
    if penalty is not None and penalty != 1.0:
        kw["repetition_penalty"] = penalty
    if getattr(args, "stop", None):
        kw["stop"] = list(args.stop)
    return kw
