"""Names and constants of ``omnitide bench stream``: the variants, their groupings, the goals and the paper's
figures, and the pure helpers on variant names. Imports no array framework (the policy names are core.pick's): the
plots, the goals and the variants all read these, so no two of them have to import each other."""

from __future__ import annotations

from ...core.pick import POLICY_NAMES

ENGINE_POLICIES = POLICY_NAMES  # core.pick's registry, in its order (the order of the JSON's rows)
MLX_LM_VARIANTS = ("mlx_kvcache", "mlx_rotating")
VARIANTS = ENGINE_POLICIES + MLX_LM_VARIANTS
MLX_LM_QUANT = "mlx_quantized"  # mlx-lm's QuantizedKVCache (unbounded, quantised): with --kv-bits
KV_POLICIES = ("full", "omnitide")  # the engine policies that get a quantised twin under --kv-bits by default
UNBOUNDED = ("full", "mlx_kvcache", MLX_LM_QUANT)  # variants whose cache holds the whole stream
LAYOUT_TRIO = ("omnipick", "omnitide", "eager")  # identical retention, native / OmniPage / eager layouts
MLX_LM_PREFILL_STEP = 2048  # mlx_lm.generate.generate_step's prefill_step_size
MLX_LM_KEEP = 4  # mlx_lm.models.cache.make_prompt_cache: RotatingKVCache(max_size, keep=4)

RATIO_GOAL = 0.9
OMNIPAGE_GOAL = 0.885  # paper 7.4.2: OmniPage captures 88.5 % of eager's prefill-attention reduction
MAINTENANCE_GOAL = 0.02  # maintenance under 2 % of stream-loop time
# paper figure 10 (CUDA, 32K checkpoint): full-context and OmniTide update latency, ms
PAPER_UPDATE_32K = {"qwen2.5-omni-3b": (429.0, 192.0), "qwen2.5-omni-7b": (535.0, 234.0),
                    "minicpm-o-4.5": (268.0, 203.0)}
# paper table 3 (CUDA): mean session latency no-slide / OmniTide, s
PAPER_SESSION = {"qwen2.5-omni-3b": (40.33, 17.61), "qwen2.5-omni-7b": (51.71, 21.52)}
# paper table 2: StreamingBench accuracy (%) per policy (real weights; not measured here, figure 13's y axis)
PAPER_ACCURACY = {
    "qwen2.5-omni-3b": {"full": 62.3, "fifo": 58.1, "token": 56.2, "streamingllm": 59.6, "h2o": 55.8,
                        "omnitide": 62.8},
    "qwen2.5-omni-7b": {"full": 52.0, "fifo": 49.8, "token": 47.8, "streamingllm": 50.5, "h2o": 47.0,
                        "omnitide": 52.4},
    "minicpm-o-4.5": {"full": 74.1, "fifo": 69.0, "token": 57.0, "streamingllm": 70.1, "h2o": 52.7,
                      "omnitide": 75.0},
}


def quant_name(policy: str, bits: int) -> str:
    """The row name of an engine policy over a ``bits``-bit OmniCache: ``omnitide_kv4``."""
    return f"{policy}_kv{bits}"


def split_variant(name: str) -> tuple[str, int | None]:
    """(retention, kv bits) of a variant name: ``omnitide_kv4`` -> ("omnitide", 4), ``omnitide`` -> (.., None);
    ``mlx_quantized`` is its own retention (its bits are the run's)."""
    base, sep, bits = name.rpartition("_kv")
    if sep and base in ENGINE_POLICIES and bits in ("4", "8"):
        return base, int(bits)
    return name, None


def real_kv_bytes_per_token(prof, bits: int | None, group_size: int) -> int:
    """K and V bytes of one token of the real model (all layers, the paper's fp16 KV); quantised: packed values
    plus fp16 scales and biases per group of ``group_size``."""
    return prof.shape.kv_bytes_per_token(prof.kv_dtype_bytes, bits, group_size)
