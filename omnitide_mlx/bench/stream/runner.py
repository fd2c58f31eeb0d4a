"""One run: the model, the checkpoint updates, the sessions, and the result dict with its goals."""

from __future__ import annotations

import gc
import math
import resource
import time

import mlx.core as mx

from ...core.pick import make_policy
from ...core.profiles import StreamSpec
from ..common import load_average, versions
from ..shape_models import ShapeTrueModel
from .checkpoints import bench_checkpoints
from .goal_checks import goals, kv_quant_info
from .names import (ENGINE_POLICIES, MLX_LM_KEEP, MLX_LM_PREFILL_STEP, MLX_LM_QUANT, VARIANTS,
                    split_variant)
from .report import _row_line
from .rows import Row, row_json
from .sessions import run_sessions
from .variants import _now, make_variant


def default_session(profile, session_tokens: int) -> tuple[int, int]:
    """(seconds, question_every): enough seconds for the no-slide history to reach ``session_tokens``; two
    questions."""
    seconds = max(4, math.ceil((session_tokens - profile.system_tokens) / profile.media_unit_tokens))
    return seconds, max(1, seconds // 2)


def run_bench(shape: str, checkpoints: list[int], *, layers: int = 1, vocab: int = 4096, reps: int = 2,
              attention_reps: int = 1, session_seconds: int | None = None, question_every: int | None = None,
              session_tokens: int = 14000, policies: tuple[str, ...] = VARIANTS, sessions: bool = True,
              seed: int = 0, log=None, setting=None, kv_bits: int | None = None, kv_group_size: int = 64) -> dict:
    """``setting``: the media setting sizing the units (a MediaSetting or preset name; default: the default).
    ``policies`` may name quantised variants (``omnitide_kv4``, ``mlx_quantized``: see ``kv_variants``); they
    need ``kv_bits`` (the same bits) and use ``kv_group_size``."""
    for name in policies:
        base, bits = split_variant(name)
        if base not in VARIANTS and name != MLX_LM_QUANT:
            raise ValueError(f"unknown variant {name!r}")
        if (bits is not None or name == MLX_LM_QUANT) and (kv_bits is None or (bits and bits != kv_bits)):
            raise ValueError(f"variant {name} needs kv_bits={bits or '8|4'} (got {kv_bits})")
    gc_was_enabled = gc.isenabled()
    gc.disable()  # no collector pause inside a timed call: the runs collect between rounds and events
    try:
        return _run_bench(shape, checkpoints, layers=layers, vocab=vocab, reps=reps, attention_reps=attention_reps,
                          session_seconds=session_seconds, question_every=question_every,
                          session_tokens=session_tokens, policies=policies, sessions=sessions, seed=seed, log=log,
                          setting=setting, kv_bits=kv_bits, kv_group_size=kv_group_size)
    finally:
        if gc_was_enabled:
            gc.enable()


def _run_bench(shape, checkpoints, *, layers, vocab, reps, attention_reps, session_seconds, question_every,
               session_tokens, policies, sessions, seed, log, setting=None, kv_bits=None, kv_group_size=64) -> dict:
    t_start, c_start = _now()
    load_before = load_average()
    started = dict(versions(), uncommitted=_uncommitted())  # the code this run imports, taken at its start
    model = ShapeTrueModel(shape, layers=layers, vocab=vocab, seed=seed, setting=setting)
    prof = model.profile
    stream = StreamSpec(max(checkpoints, default=0) // prof.media_unit_tokens + 8, question_every=30, seed=seed)
    rows: list[Row] = []
    cost = {}
    if checkpoints:
        variants = {name: make_variant(name, model, kv_bits=kv_bits, kv_group_size=kv_group_size)
                    for name in policies}
        t0 = time.perf_counter()
        rows += bench_checkpoints(model, variants, checkpoints, stream, reps=reps,
                                  attention_reps=min(attention_reps, reps), seed=seed,
                                  log=(lambda r: log(_row_line(row_json(r)))) if log else None)
        cost["checkpoints_s"] = round(time.perf_counter() - t0, 1)
        del variants
        gc.collect()
    sec, qe = default_session(prof, session_tokens)
    session = StreamSpec(session_seconds or sec, question_every=question_every or qe, seed=seed)
    if sessions:
        t0 = time.perf_counter()
        variants = {name: make_variant(name, model, profiled=True, kv_bits=kv_bits, kv_group_size=kv_group_size)
                    for name in policies}
        rows += run_sessions(model, variants, session, log)
        cost["sessions_s"] = round(time.perf_counter() - t0, 1)
        del variants
        gc.collect()
    t_end, c_end = _now()
    import mlx_lm

    result = {
        "shape": shape,
        "layers": layers,
        "versions": dict(started, mlx_lm=mlx_lm.__version__),
        "model": {"bench": model.shape.to_json(), "real": model.real.to_json(), "dtype": "float32",
                  "weights_bytes": model.weights_bytes,
                  "vocab_note": "reduced vocabulary: logits of the last position only"},
        "profile": prof.to_json(),
        "policies": {name: make_policy(split_variant(name)[0], profile=prof).config() for name in policies
                     if split_variant(name)[0] in ENGINE_POLICIES},
        "mlx_lm": {"prefill_step": MLX_LM_PREFILL_STEP, "rotating_max_size": prof.high, "rotating_keep": MLX_LM_KEEP},
        "kv_quant": kv_quant_info(model, policies, kv_bits, kv_group_size),
        "checkpoints": sorted(checkpoints),
        "checkpoint_stream": stream.to_json(),
        "session_stream": session.to_json(),
        "reps": reps,
        "attention_reps": min(attention_reps, reps),
        "synthetic_kv_rows": "update rows (checkpoints): page table and history from the core simulator, random K/V; "
                             "session rows stream from the system prompt with real K/V",
        "load_average": {"before": load_before, "after": load_average()},
        "wall_s": round(t_end - t_start, 1),
        "cpu_s": round(c_end - c_start, 1),
        "cost": cost,
        "process_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "mlx_cache_limit_bytes": _cache_limit(),
        "rows": row_json(rows),  # the JSON boundary: typed rows become the result file's dicts
    }
    result["goals"] = goals(result)
    return result


def _uncommitted() -> list[str]:
    """Files of the package with uncommitted changes (other engineers share the working tree)."""
    import os
    import subprocess

    try:
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/, as before the split
        out = subprocess.run(["git", "status", "--porcelain", "--", ".."], cwd=here, capture_output=True, text=True,
                             timeout=10).stdout
        return [line[3:] for line in out.splitlines() if line.strip()]
    except (OSError, subprocess.SubprocessError):
        return []


def _cache_limit() -> int:
    """MLX's allocator cache limit (freed buffers kept for reuse), read without changing it."""
    limit = mx.set_cache_limit(0)
    mx.set_cache_limit(limit)
    return int(limit)
