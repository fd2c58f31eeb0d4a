"""``omnitide bench stream``: the streaming engine end to end on shape-true models (paper 7.1-7.4 metrics).

One process, one model (the port's LanguageModel at the real per-layer shape, random float32 weights, ``--layers``
of them: bench/shape_models.py), and ten variants of the engine driving it:

- the engine (``OmniSession``, OmniCache, tile-skip attention) under every retention policy / layout: ``full``
  (no-slide), ``fifo`` (unit FIFO), ``token`` (token sliding), ``streamingllm``, ``h2o``, ``omnipick`` (native
  layout), ``omnitide`` (OmniPick + OmniPage), ``eager`` (OmniPick + compaction after every eviction);
- mlx-lm's own ``KVCache`` (``mlx_kvcache``) and ``RotatingKVCache`` (``mlx_rotating``: ``max_size`` = the high
  watermark, ``keep=4`` as ``make_prompt_cache`` builds it) driving the same model through mlx-lm's cache protocol
  and ``mx.fast.scaled_dot_product_attention``, prefilling in steps of 2048 tokens as mlx-lm's ``generate_step``
  does.

With ``--kv-bits 8|4`` (and ``--kv-group-size``, mlx-lm's names) the same run adds quantised twins, side by side
with the float ones: the engine under each policy of ``--kv-policies`` (default ``full,omnitide``; rows
``full_kv4``, ``omnitide_kv4``, ...) over an OmniCache holding packed K/V with scales and biases (deferred
re-rotation, attention through ``quantized_matmul``: kernels/quantized.py), and mlx-lm's ``QuantizedKVCache``
(``mlx_quantized``: unbounded, quantised, mlx-lm's ``quantized_scaled_dot_product_attention``). A quantised twin
keeps exactly the cells its float policy keeps (same retention), so its rows differ in bytes and time only.

Three measurements:

1. **Updates at no-slide checkpoints** (paper figure 10). For each checkpoint (the no-slide history reaching 4K ..
   32K tokens) every variant is put in the state it would have then: the core simulator streams the same units
   through the same policy, and the cache gets that page table and history with *synthetic* K/V of the right shape
   (random values: an update's cost does not depend on them). Rows say ``"synthetic_kv": true``. Then one update is
   timed: ``session.push`` of the next second of input (input validation, unit assembly, prefill of the media unit
   with last-position logits, retention, eviction with re-rotation, migration). The state is restored before each
   repetition; variants take turns round by round so they see the same machine state. Attention is profiled
   apart (the paper profiles kernels separately): from the same state, each layer's ``attend`` (write the step's
   K/V, tile-skip attention; for H2O with its scores) or, for mlx-lm, ``update_and_fetch`` plus SDPA, timed after
   ``mx.eval`` of its inputs and outputs.
2. **Whole sessions** (paper table 3, figure 13): every variant streams the same session from its system prompt
   (excluded, as in the paper) - one unit a second, a question every ``question_every`` seconds answered by
   greedy decoding of the stream's reply length - taking turns event by event. ``session_s`` sums the events'
   wall time (input, prefill, answers, maintenance); no synthetic state.
3. **Attention under identical retention** (paper figure 15), from the same sessions: the engine's caches time
   every ``attend`` (between evaluated inputs and outputs) and every migration, so OmniPick over the native layout,
   OmniPage and eager can be compared. On the CPU this costs nothing measurable: MLX runs a graph's ops one after
   another on one stream, and evaluating it in three pieces instead of one changed a 3B-shape update by 0.6 %
   (6,963 against 6,921 ms, medians of 4 interleaved updates; within the run-to-run spread).

FLOP-count limit of a row: full-context update FLOPs over its own (shape, chunk, and the keys each query visits:
for the engine the 64-slot tiles that hold a key visible to it, holes included; for mlx-lm's SDPA every key,
since its CPU fallback computes the whole score matrix). Key-count limit: the same for attention keys alone.
``ratio_to_limit`` = measured speedup over ``full`` / limit. Memory per row: model weights + the variant's KV
buffers + what the update allocated above the memory in use before it (MLX's active-memory peak), i.e. the peak
of a process that held only this variant.
"""

# The code, by role: ``names`` (variant names, constants, the paper's figures; no array framework), ``profiling``
# (the profiled engine cache and the step counter), ``variants`` (the ``Variant`` protocol, the engine and mlx-lm
# variants), ``rows`` (the typed rows and their JSON form), ``checkpoints`` (state install at no-slide checkpoints,
# the timed updates), ``limits`` (speedups against the FLOP, key and cost limits), ``sessions`` (whole sessions),
# ``goal_checks`` (the goals), ``runner`` (one run, the result dict), ``report`` (log lines, Markdown), ``plots`` (the figures, from the result
# dict and ``names`` only) and ``cli`` (flags and entry point). This package re-exports the names callers use.

from .checkpoints import CheckpointState, _median, _timing, bench_checkpoints, checkpoint_states
from .cli import add_arguments, kv_variants, run
from .goal_checks import _fit, _ratio, float_twin, goals, kv_quant_comparison, kv_quant_info, memory_check
from .limits import add_limits
from .names import (ENGINE_POLICIES, KV_POLICIES, LAYOUT_TRIO, MAINTENANCE_GOAL, MLX_LM_KEEP, MLX_LM_PREFILL_STEP,
                    MLX_LM_QUANT, MLX_LM_VARIANTS, OMNIPAGE_GOAL, PAPER_ACCURACY, PAPER_SESSION, PAPER_UPDATE_32K,
                    RATIO_GOAL, UNBOUNDED, VARIANTS, quant_name, real_kv_bytes_per_token, split_variant)
from .profiling import ProfiledBackend, ProfiledLayerCache, ProfiledOmniCache, StepCounter, tile_keys_visited
from .report import _row_line, markdown
from .rows import (AttentionEvent, AttentionSessionRow, EventAttention, Row, SessionAttention, SessionEvent,
                   SessionLimits, SessionRow, UpdateLimits, UpdateRow, row_json)
from .runner import _cache_limit, _run_bench, _uncommitted, default_session, run_bench
from .sessions import _full_context_series, run_sessions, session_events
from .variants import (_FRAME, _SECOND, EngineVariant, MlxLmVariant, Probe, Variant, _now, _stored,
                       make_variant)

HELP = "stream-loop benchmark: update latency, attention, maintenance, sessions and memory for every policy"
DESCRIPTION = __doc__.split("\n\n", 1)[1] + """
example:
  omnitide bench stream --shape qwen2.5-omni-3b --checkpoints 4096,8192,16384,32768 --json out.json --plot out.png
"""

__all__ = [
    "HELP", "DESCRIPTION", "add_arguments", "run",
    "CheckpointState", "_median", "_timing", "bench_checkpoints", "checkpoint_states", "kv_variants",
    "_fit", "_ratio", "float_twin", "goals", "kv_quant_comparison", "kv_quant_info", "memory_check", "add_limits",
    "ENGINE_POLICIES", "KV_POLICIES", "LAYOUT_TRIO", "MAINTENANCE_GOAL", "MLX_LM_KEEP", "MLX_LM_PREFILL_STEP",
    "MLX_LM_QUANT", "MLX_LM_VARIANTS", "OMNIPAGE_GOAL", "PAPER_ACCURACY", "PAPER_SESSION", "PAPER_UPDATE_32K",
    "RATIO_GOAL", "UNBOUNDED", "VARIANTS", "quant_name", "real_kv_bytes_per_token", "split_variant",
    "ProfiledBackend", "ProfiledLayerCache", "ProfiledOmniCache", "StepCounter", "tile_keys_visited",
    "AttentionEvent", "AttentionSessionRow", "EventAttention", "Row", "SessionAttention", "SessionEvent",
    "SessionLimits", "SessionRow", "UpdateLimits", "UpdateRow", "row_json",
    "_row_line", "markdown", "_cache_limit", "_run_bench", "_uncommitted", "default_session", "run_bench",
    "_full_context_series", "run_sessions", "session_events",
    "_FRAME", "_SECOND", "EngineVariant", "MlxLmVariant", "Probe", "Variant", "_now", "_stored",
    "make_variant",
]
