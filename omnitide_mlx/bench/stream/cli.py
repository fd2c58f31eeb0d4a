"""``omnitide bench stream``'s flags and entry point."""

from __future__ import annotations

import argparse
import sys

from ..report import write_outputs
from ..shape_models import SHAPES
from .names import ENGINE_POLICIES, KV_POLICIES, MLX_LM_QUANT, MLX_LM_VARIANTS, VARIANTS, quant_name
from .report import markdown
from .runner import run_bench


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ...commands.options import add_media_arguments

    add_media_arguments(p)
    p.add_argument("--shape", default="qwen2.5-omni-3b", choices=sorted(SHAPES),
                   help="model shape and unit layout (default qwen2.5-omni-3b; 'tiny' is for smoke tests)")
    p.add_argument("--layers", type=int, default=1, help="decoder layers of the benchmark model (default 1)")
    p.add_argument("--vocab", type=int, default=4096, help="reduced vocabulary (default 4096)")
    p.add_argument("--checkpoints", default="4096,8192,16384,32768",
                   help="comma-separated no-slide checkpoints in tokens (default 4096,8192,16384,32768); "
                        "empty: sessions only")
    p.add_argument("--policies", default=",".join(VARIANTS), help=f"comma-separated variants (default all: "
                   f"{','.join(VARIANTS)})")
    p.add_argument("--reps", type=int, default=2, help="timed updates per variant and checkpoint (default 2)")
    p.add_argument("--attention-reps", type=int, default=1,
                   help="attention probes per variant and checkpoint, at most --reps (default 1)")
    p.add_argument("--session-tokens", type=int, default=14000,
                   help="session length: seconds enough for this many no-slide tokens (default 14000)")
    p.add_argument("--session-seconds", type=int, default=None, help="session length in seconds (overrides)")
    p.add_argument("--question-every", type=int, default=None,
                   help="a question every N seconds of the session (default: two per session)")
    p.add_argument("--no-sessions", action="store_true", help="skip the whole-session runs")
    p.add_argument("--kv-bits", type=int, choices=[4, 8], default=None,
                   help="also run quantised twins side by side: the engine over an OmniCache holding K/V in 8 or 4 "
                        "bits (one variant per --kv-policies policy, named omnitide_kv4, ...) and mlx-lm's "
                        f"QuantizedKVCache ({MLX_LM_QUANT}, when an mlx-lm variant runs)")
    p.add_argument("--kv-group-size", type=int, choices=[32, 64, 128], default=64,
                   help="quantisation group size along the head dimension (default 64)")
    p.add_argument("--kv-policies", default=",".join(KV_POLICIES),
                   help=f"with --kv-bits: the engine policies that get a quantised twin, each also in --policies "
                        f"(default {','.join(KV_POLICIES)})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", default=None, help="write the result JSON here")
    p.add_argument("--plot", default=None, help="write the figures (one PNG) here")
    p.add_argument("--markdown", action="store_true", help="print the tables as Markdown")


def kv_variants(policies: tuple[str, ...], bits: int, kv_policies) -> tuple[str, ...]:
    """``policies`` with the quantised twins of ``--kv-bits``: ``<policy>_kv<bits>`` right after each of
    ``kv_policies`` (each must run in float too), and mlx-lm's QuantizedKVCache after the mlx-lm variants when one
    runs."""
    want = [p.strip() for p in kv_policies if p.strip()]
    bad = [p for p in want if p not in ENGINE_POLICIES or p not in policies]
    if bad or not want:
        raise ValueError(f"--kv-policies {bad or want}: each must be an engine policy that also runs (--policies)")
    out = []
    for name in policies:
        out.append(name)
        if name in want:
            out.append(quant_name(name, bits))
    if any(n in MLX_LM_VARIANTS for n in policies):
        out.append(MLX_LM_QUANT)
    return tuple(out)


def run(args: argparse.Namespace) -> int:
    try:
        checkpoints = [int(x) for x in str(args.checkpoints).split(",") if x.strip()]
    except ValueError:
        print(f"bad --checkpoints {args.checkpoints!r}: want comma-separated integers", file=sys.stderr)
        return 2
    policies = tuple(x.strip() for x in str(args.policies).split(",") if x.strip())
    bad = [p for p in policies if p not in VARIANTS]
    if bad or not policies:
        print(f"unknown --policies {bad}; choose from {','.join(VARIANTS)}", file=sys.stderr)
        return 2
    if not checkpoints and args.no_sessions:
        print("nothing to run: --checkpoints is empty and --no-sessions skips the sessions", file=sys.stderr)
        return 2
    if checkpoints and (min(checkpoints) <= 0 or "full" not in policies):
        print("--checkpoints needs positive token counts and the 'full' policy (the baseline)", file=sys.stderr)
        return 2
    if args.layers < 1 or args.reps < 1 or args.attention_reps < 1:
        print("--layers, --reps and --attention-reps must be at least 1", file=sys.stderr)
        return 2
    if args.kv_bits is not None:
        try:
            policies = kv_variants(policies, args.kv_bits, str(args.kv_policies).split(","))
        except ValueError as e:
            print(e, file=sys.stderr)
            return 2
        head_dim = SHAPES[args.shape].head_dim
        if head_dim % args.kv_group_size:
            print(f"--kv-group-size {args.kv_group_size} does not divide the {args.shape} head_dim ({head_dim})",
                  file=sys.stderr)
            return 2

    def log(x):
        print(x, flush=True)

    from ...commands.options import UsageError, media_setting

    try:
        setting = media_setting(args)
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2
    result = run_bench(args.shape, checkpoints, setting=setting, layers=args.layers, vocab=args.vocab, reps=args.reps,
                       attention_reps=args.attention_reps, session_seconds=args.session_seconds,
                       question_every=args.question_every, session_tokens=args.session_tokens, policies=policies,
                       sessions=not args.no_sessions, seed=args.seed, log=log, kv_bits=args.kv_bits,
                       kv_group_size=args.kv_group_size)
    from .plots import plot

    write_outputs(result, args, markdown=markdown, plot=plot)
    print(f"wall {result['wall_s']} s, CPU {result['cpu_s']} s; cost {result['cost']}; load {result['load_average']}")
    return 0
