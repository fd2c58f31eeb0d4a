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

from __future__ import annotations

import argparse
import gc
import math
import resource
import statistics
import sys
import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..cache import DECODE_MAX_TOKENS, OmniCache, OmniLayerCache
from ..core.page import PageTable
from ..core.pick import make_policy
from ..core.profiles import StreamSpec
from ..core.sim import Simulator
from ..core.units import History
from ..engine import SessionCounters
from ..kernels.quantized import quantize_rows
from ..models.attention import cached_attention
from ..session import MlxBackend, OmniSession, keep_cpu_buffers
from .common import Timing, load_average, versions
from .report import write_outputs
from .shape_models import SHAPES, ModelShape, ShapeTrueModel, question_tokens, reply_closing_tokens, update_flops

HELP = "stream-loop benchmark: update latency, attention, maintenance, sessions and memory for every policy"
DESCRIPTION = __doc__.split("\n\n", 1)[1] + """
example:
  omnitide bench stream --shape qwen2.5-omni-3b --checkpoints 4096,8192,16384,32768 --json out.json --plot out.png
"""

ENGINE_POLICIES = ("full", "fifo", "token", "streamingllm", "h2o", "omnipick", "omnitide", "eager")
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

_FRAME = np.zeros((28, 28, 3), dtype=np.uint8)  # validated by the engine, then ignored by the random-unit adapter
_SECOND = np.zeros(16000, dtype=np.float32)


def _now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


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
    if not bits:
        return prof.kv_bytes_per_token
    row = prof.head_dim * bits // 8 + 2 * (prof.head_dim // group_size) * prof.kv_dtype_bytes
    return 2 * prof.layers * prof.kv_heads * row


# --- the engine, with optional attention profiling ------------------------------------------------------------

class ProfiledLayerCache(OmniLayerCache):
    """``attend`` timed between evaluated inputs and evaluated output (profiled runs only)."""

    def attend(self, q, k, v, scale):
        mx.eval(q, k, v)
        t0 = time.perf_counter()
        out = super().attend(q, k, v, scale)
        mx.eval(out)
        self._parent.record_attention(q.shape[2], time.perf_counter() - t0)
        return out


class ProfiledOmniCache(OmniCache):
    """OmniCache that adds up attention time (prefill / decode steps apart) and migration time."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.layers = [ProfiledLayerCache(self, i) for i in range(self.num_layers)]
        self.attention_s = {"prefill": 0.0, "decode": 0.0}
        self.migration_s = 0.0

    def record_attention(self, tokens: int, seconds: float) -> None:
        self.attention_s["decode" if tokens <= DECODE_MAX_TOKENS else "prefill"] += seconds

    def migrate(self, plan) -> int:
        t0 = time.perf_counter()
        moved = super().migrate(plan)
        mx.synchronize()
        self.migration_s += time.perf_counter() - t0
        return moved


class ProfiledBackend(MlxBackend):
    """The MLX backend over a ProfiledOmniCache."""

    def make_cache(self, model, spec, *, dtype, placement, page_size, subblock_size, collect_scores, kv_quant):
        keep_cpu_buffers()  # as MlxBackend.make_cache does
        return ProfiledOmniCache.for_spec(spec, dtype=dtype, page_size=page_size, subblock_size=subblock_size,
                                          placement=placement, collect_scores=collect_scores, **kv_quant)


class StepCounter:
    """A backend (``MlxBackend`` or ``ProfiledBackend``) wrapped to note, per forward step, its tokens and the keys
    its queries visit (for the session's FLOP count), and the physical span right after each unit's prefill (the
    span attention walked before maintenance: the peak span counts it). The engine variant says which forwards
    are prefills (``prefills``: how many of the next forwards are); every other call goes to the backend."""

    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name
        self.quantised_kv = inner.quantised_kv
        self.steps: list[tuple[int, int]] = []  # (tokens, keys visited) per forward step
        self.prefills = 1  # the system prompt's, in the session's constructor
        self.prefill_span = 0
        self.peak_span = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, model, cache, embeds, positions, *, hidden=False):
        out = self.inner.forward(model, cache, embeds, positions, hidden=hidden)  # evaluation already started
        t = int(embeds.shape[0])  # (async): the count overlaps it
        table = cache.page_table
        slots = np.flatnonzero(table.seq >= table.next_seq - t)
        tile = table.subblock_size if t <= DECODE_MAX_TOKENS else table.page_size
        self.steps.append((t, tile_keys_visited(table, slots, tile)[1]))
        if self.prefills:
            self.prefills -= 1
            self.prefill_span = table.stats().physical_span
            self.peak_span = max(self.peak_span, self.prefill_span)
        return out


def tile_keys_visited(table: PageTable, slots: np.ndarray, tile: int) -> tuple[int, int]:
    """(active slots, keys visited summed over the step's queries): a query reads every slot of each active tile
    that holds a key visible to it (holes included), as a tile-skipping kernel does."""
    seq = table.seq
    tiles = table.active_pages() if tile == table.page_size else table.active_subblocks()
    key = np.where(seq < 0, np.iinfo(np.int64).max, seq).reshape(-1, tile)[tiles]
    tile_min = np.sort(key.min(axis=1))
    visible = np.searchsorted(tile_min, seq[slots], side="right")
    return int(tiles.size * tile), int(visible.sum() * tile)


@dataclass
class Probe:
    """One attention profile of an update (all layers)."""

    wall_ms: float
    cpu_ms: float
    active_slots: int
    keys_visited: int


class EngineVariant:
    """The engine under one retention policy / layout; ``kv_bits``: over a quantised OmniCache (``omnitide_kv4``)."""

    kind = "engine"

    def __init__(self, name: str, model: ShapeTrueModel, profiled: bool = False, kv_bits: int | None = None,
                 kv_group_size: int = 64):
        self.name = name
        self.model = model
        self.retention, bits = split_variant(name)
        if bits is not None and kv_bits is not None and bits != kv_bits:
            raise ValueError(f"variant {name} is {bits}-bit, kv_bits={kv_bits}")
        self.kv_bits = bits if bits is not None else kv_bits
        self.kv_group_size = kv_group_size if self.kv_bits else None
        self.policy = make_policy(self.retention, profile=model.profile)
        quant = {"kv_bits": self.kv_bits, "kv_group_size": kv_group_size} if self.kv_bits else {}
        self.backend = StepCounter(ProfiledBackend() if profiled else MlxBackend())
        self.session = OmniSession(model, policy=self.policy, backend=self.backend, **quant)  # system prompt prefilled
        self.spec = self.session.adapter.kv_spec
        self._state = None

    # streaming
    def media(self, t: float) -> None:
        self.backend.prefills = 1  # one unit: a second of audio with its frame
        self.session.push(frame=_FRAME, audio=_SECOND, t=t)
        self.backend.prefills = 0

    def ask(self, n_question: int, n_reply: int) -> None:
        self.backend.prefills = 1  # the question; then the reply's decode steps and closing tokens
        "".join(self.session.ask(" ".join(["w"] * n_question), max_tokens=n_reply))

    def counters(self) -> dict:
        c = self.session.counters
        return {"prefill_ms": c.prefill_ms, "decode_ms": c.decode_ms, "maintenance_ms": c.maintenance_ms,
                "decoded_tokens": c.decoded_tokens, "evictions": c.evictions, "migrations": c.migrations,
                "migrated_cells": c.migrated_cells}

    def layout(self) -> dict:
        s = self.session.cache.page_table.stats()
        return {"retained_cells": s.retained_cells, "physical_span": s.physical_span,
                "active_pages": s.active_pages, "active_subblocks": s.active_subblocks,
                "kv_bytes": self.session.cache.nbytes, "peak_span": max(self.backend.peak_span, s.physical_span),
                "prefill_span": self.backend.prefill_span}

    @property
    def kv_bytes(self) -> int:
        return self.session.cache.nbytes

    def step_log(self) -> list:
        return self.backend.steps

    # checkpoint state
    def install(self, table: PageTable, history: History, peak_span: int, rng: np.random.Generator) -> None:
        """Put the session in the state the simulator reached: this page table and history, synthetic K/V."""
        cache = self.session.cache
        cap = table.capacity
        shape = (1, self.spec.kv_heads, cap, self.spec.head_dim)
        arrays = {}
        for i in range(self.spec.num_layers):
            for part in ("keys", "values"):
                x = mx.array(rng.standard_normal(shape, dtype=np.float32)).astype(cache.dtype)
                if cache.kv_bits:  # packed rows, scales and biases, as the cache saves them
                    packed = quantize_rows(x, cache.kv_group_size, cache.kv_bits)
                    for suffix, a in zip(cache.QUANT_PARTS, packed):
                        arrays[f"layers.{i}.{part}{suffix}"] = a
                else:
                    arrays[f"layers.{i}.{part}"] = x
        if cache.kv_bits and cache.kv_rerotate == "deferred":
            arrays["key_shifts"] = mx.zeros((cap,), mx.int32)  # no eviction pending in the installed state
        scores = None
        if cache.collect_scores:  # H2O: accumulated attention per slot (any values; retained slots only)
            scores = np.where(table.seq >= 0, rng.gamma(0.3, size=cap), 0.0).astype(np.float32)
        mx.eval(list(arrays.values()))
        self._state = (PageTable.from_state(table.state()), arrays, scores, list(history.units), peak_span)
        self.restore()

    def restore(self) -> None:
        table, arrays, scores, units, peak_span = self._state
        s = self.session
        s.cache = s.cache.from_table(table, arrays, scores)
        s.history = History(list(units))
        s.counters = SessionCounters()
        s.records = []
        s._last_logits = None
        self.backend.peak_span = peak_span
        self.backend.steps = []

    def release(self) -> None:
        self._state = None

    def probe_attention(self, chunk: int, qkv: tuple) -> Probe:
        """Time every layer's ``attend`` for the next media unit's prefill from the current state (then
        ``end_step``, which for H2O evaluates the step's scores). Leaves the step committed: restore() after."""
        s = self.session
        cache = s.cache
        cache.set_owner(s.history.next_uid())
        slots = cache.begin_step(chunk)
        mx.eval([layer.keys for layer in cache.layers], [layer.values for layer in cache.layers])
        active, visited = tile_keys_visited(cache.page_table, slots, cache.page_table.page_size)
        q, k, v = qkv
        scale = self.spec.head_dim ** -0.5
        t0, c0 = _now()
        for layer in cache.layers:
            mx.eval(layer.attend(q, k, v, scale))
        cache.end_step()
        t1, c1 = _now()
        return Probe((t1 - t0) * 1000, (c1 - c0) * 1000, active, visited)


def _stored(c) -> int:
    """Slots an mlx-lm cache's buffers hold (QuantizedKVCache keeps (packed, scales, biases) tuples)."""
    if c.keys is None:
        return 0
    k = c.keys[0] if isinstance(c.keys, (tuple, list)) else c.keys
    return int(k.shape[2])


class MlxLmVariant:
    """The same model and units through mlx-lm's ``KVCache``, ``RotatingKVCache`` or ``QuantizedKVCache`` (no
    retention of ours)."""

    kind = "mlx_lm"

    def __init__(self, name: str, model: ShapeTrueModel, max_size: int, kv_bits: int | None = None,
                 kv_group_size: int = 64):
        from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

        self.name = name
        self.retention = name
        self.model = model
        self.lm = model.language_model
        self.adapter = model.stream_adapter()
        self.spec = self.adapter.kv_spec
        self.max_size = max_size
        self.kv_bits = self.kv_group_size = None
        if name == "mlx_kvcache":
            self.make = KVCache
        elif name == "mlx_rotating":
            self.make = lambda: RotatingKVCache(max_size=max_size, keep=MLX_LM_KEEP)
        elif name == MLX_LM_QUANT:
            if kv_bits is None:
                raise ValueError(f"{name} needs kv_bits")
            self.kv_bits, self.kv_group_size = int(kv_bits), int(kv_group_size)
            self.make = lambda: QuantizedKVCache(group_size=self.kv_group_size, bits=self.kv_bits)
        else:
            raise ValueError(name)
        self.caches = [self.make() for _ in range(self.spec.num_layers)]
        self.next_position = 0
        self.next_uid = 0
        self.tokens = 0  # every token ever fed
        self._counters = SessionCounters()
        self.peak_span = 0
        self.prefill_span = 0
        self.steps: list[tuple[int, int]] = []  # (tokens, keys each query scores, summed) per forward step
        self._state = None
        self._prefill(self.adapter.system_unit(None, 0))
        self._counters = SessionCounters()  # the system prompt does not count

    def _positions(self, positions: np.ndarray, a: int, b: int) -> mx.array:
        p = positions[:, a:b]
        return mx.array(p if p.shape[0] > 1 else p[0])

    def _forward(self, embeds: mx.array, positions: np.ndarray) -> mx.array:
        """Prefill in mlx-lm's steps, evaluating the caches after each as generate_step does, and each step's
        output too: generate_step discards it, so MLX never computes the last layer's attention and MLP for any
        step but the last - 1/36 of a step's work in the real 3B model, all of it in a 1-layer benchmark model,
        which would make per-layer cost ratios meaningless. Returns the last position's logits."""
        n = embeds.shape[0]
        logits = None
        for a in range(0, n, MLX_LM_PREFILL_STEP):
            b = min(n, a + MLX_LM_PREFILL_STEP)
            logits = self.lm(embeds[a:b][None], self.caches, self._positions(positions, a, b), last_only=True)
            mx.eval(logits, [c.state for c in self.caches])
            self.steps.append((b - a, (b - a) * self._keys_seen()))
        return logits[0, -1]

    def _keys_seen(self) -> int:
        """Keys the last step's SDPA scored for each query (mlx-lm's CPU fallback scores all of them)."""
        c = self.caches[0]
        return int(min(c.offset, _stored(c)))

    def _prefill(self, prepared) -> mx.array:
        t0 = time.perf_counter()
        out = self._forward(prepared.inputs_embeds, prepared.positions)
        self._counters.prefill_ms += (time.perf_counter() - t0) * 1000
        self._advance(prepared.positions)
        self._counters.units += 1
        self.prefill_span = _stored(self.caches[0])
        self.peak_span = max(self.peak_span, self.prefill_span)
        return out

    def _advance(self, positions: np.ndarray) -> None:
        self.next_position = max(self.next_position, int(positions.max()) + 1)
        self.next_uid += 1
        self.tokens += int(positions.shape[1])

    def media(self, t: float) -> None:
        self._prefill(self.adapter.media_unit(_FRAME, _SECOND, t, self.next_position))

    def ask(self, n_question: int, n_reply: int) -> None:
        logits = self._prefill(self.adapter.user_unit(" ".join(["w"] * n_question), self.next_position))
        start = self.next_position
        t0 = time.perf_counter()
        generated = []
        for i in range(n_reply):
            token = int(mx.argmax(logits).item())
            generated.append(token)
            pos = np.full((self.spec.position_axes, 1), start + i, dtype=np.int64)
            logits = self.lm(self.adapter.embed_tokens([token])[None], self.caches, self._positions(pos, 0, 1),
                             last_only=True)[0, -1]
            mx.async_eval(logits)
            self.steps.append((1, self._keys_seen()))
            self.adapter.decode(generated)
        mx.eval(logits)
        self._counters.decode_ms += (time.perf_counter() - t0) * 1000
        self._counters.decoded_tokens += n_reply
        closing = self.adapter.finish_reply(generated, False)
        pos = np.broadcast_to(np.arange(start + n_reply, start + n_reply + len(closing)),
                              (self.spec.position_axes, len(closing)))
        t0 = time.perf_counter()
        self._forward(self.adapter.embed_tokens(closing), np.ascontiguousarray(pos))
        self._counters.prefill_ms += (time.perf_counter() - t0) * 1000
        self._advance(np.arange(start, start + n_reply + len(closing))[None])

    def counters(self) -> dict:
        c = self._counters
        return {"prefill_ms": c.prefill_ms, "decode_ms": c.decode_ms, "maintenance_ms": 0.0,
                "decoded_tokens": c.decoded_tokens, "evictions": 0, "migrations": 0, "migrated_cells": 0}

    def layout(self) -> dict:
        c = self.caches[0]
        held = min(_stored(c), c.offset)  # RotatingKVCache holds up to max_size - 1 + the last chunk's tokens
        return {"retained_cells": held, "physical_span": held, "active_pages": None,
                "active_subblocks": None, "kv_bytes": self.kv_bytes, "peak_span": self.peak_span,
                "prefill_span": self.prefill_span}

    @property
    def kv_bytes(self) -> int:
        return sum(c.nbytes for c in self.caches if c.keys is not None)  # packed + scales + biases if quantised

    def step_log(self) -> list:
        return self.steps

    # checkpoint state
    def install(self, full_tokens: int, last_unit: int, next_position: int, rng: np.random.Generator) -> None:
        """The cache after streaming ``full_tokens`` tokens, the last update ``last_unit`` long (synthetic K/V)."""
        self.caches = [self.make() for _ in range(self.spec.num_layers)]
        shape = (1, self.spec.kv_heads)
        for c in self.caches:
            for n in (full_tokens - last_unit, last_unit):
                k = mx.array(rng.standard_normal(shape + (n, self.spec.head_dim), dtype=np.float32))
                v = mx.array(rng.standard_normal(shape + (n, self.spec.head_dim), dtype=np.float32))
                c.update_and_fetch(k, v)
            mx.eval(c.keys, c.values)
        self.next_position = next_position
        self._state = ([c.state for c in self.caches], next_position, full_tokens)
        self.peak_span = _stored(self.caches[0])
        self.restore()

    def restore(self) -> None:
        states, self.next_position, self.tokens = self._state
        for c, st in zip(self.caches, states):
            c.state = st
        self._counters = SessionCounters()
        self.peak_span = _stored(self.caches[0])

    def release(self) -> None:
        self._state = None
        self.caches = [self.make() for _ in range(self.spec.num_layers)]

    def probe_attention(self, chunk: int, qkv: tuple) -> Probe:
        """Time each layer's ``update_and_fetch`` + SDPA (quantised: mlx-lm's quantised SDPA) for the next media
        unit's prefill steps."""
        q_all, k_all, v_all = qkv
        scale = self.spec.head_dim ** -0.5
        wall = cpu = 0.0
        keys = 0
        active = 0
        for a in range(0, chunk, MLX_LM_PREFILL_STEP):
            b = min(chunk, a + MLX_LM_PREFILL_STEP)
            q, k, v = q_all[:, :, a:b], k_all[:, :, a:b], v_all[:, :, a:b]
            mx.eval(q, k, v)
            for c in self.caches:
                t0, c0 = _now()
                mx.eval(cached_attention(q, k, v, c, scale, mask="causal"))  # update_and_fetch + (quantised) SDPA
                t1, c1 = _now()
                wall += t1 - t0
                cpu += c1 - c0
            active = min(_stored(self.caches[-1]), self.caches[-1].offset)
            keys += (b - a) * active  # the CPU fallback scores every key for every query (masked, not skipped)
        return Probe(wall * 1000, cpu * 1000, active, keys)


def make_variant(name: str, model: ShapeTrueModel, profiled: bool = False, kv_bits: int | None = None,
                 kv_group_size: int = 64):
    """A variant by name; ``profiled`` engine variants time their attention and migrations (sessions). Quantised
    variants (``omnitide_kv4``, ``mlx_quantized``) take ``kv_group_size`` (and ``mlx_quantized`` ``kv_bits``)."""
    if name in MLX_LM_VARIANTS or name == MLX_LM_QUANT:
        return MlxLmVariant(name, model, model.profile.high, kv_bits=kv_bits if name == MLX_LM_QUANT else None,
                            kv_group_size=kv_group_size)
    base, bits = split_variant(name)
    if base not in ENGINE_POLICIES:
        raise ValueError(f"unknown variant {name!r}")
    return EngineVariant(name, model, profiled=profiled, kv_bits=bits, kv_group_size=kv_group_size)


# --- checkpoints ----------------------------------------------------------------------------------------------

@dataclass
class CheckpointState:
    """Where one policy's simulator stood when the no-slide history first reached a checkpoint."""

    checkpoint: int
    full_context_tokens: int
    table: PageTable
    history: History
    peak_span: int
    updates: int
    trims: int
    last_unit: int


def checkpoint_states(profile, policy: str, checkpoints: list[int], stream: StreamSpec) -> list[CheckpointState]:
    """Stream through the checkpoints (ascending) with the core simulator; the layout of the policy's own kind."""
    pol = make_policy(policy, profile=profile)
    sim = Simulator(profile, pol, stream, (pol.layout,))
    lt = next(iter(sim.layouts.values()))
    todo, out = sorted(checkpoints), []
    for event in stream.events():
        sim.step(event)
        while todo and sim.full_context_tokens >= todo[0]:
            out.append(CheckpointState(todo.pop(0), sim.full_context_tokens, lt.table.copy(),
                                       History(list(sim.history.units)), lt.peak_span, sim.updates, sim.trims,
                                       sim.history[-1].length))
        if not todo:
            return out
    raise RuntimeError(f"the stream ended before checkpoints {todo}")


def _timing(samples: list[float], cpu: list[float]) -> Timing:
    return Timing(statistics.median(samples), min(samples), max(samples), len(samples), statistics.median(cpu))


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def bench_checkpoints(model: ShapeTrueModel, variants: dict, checkpoints: list[int], stream: StreamSpec, *,
                      reps: int, attention_reps: int, seed: int, log) -> list[dict]:
    """Rows for every checkpoint and variant: ``reps`` updates and ``attention_reps`` attention probes each,
    interleaved round by round (the round's first variant rotates)."""
    prof = model.profile
    chunk = prof.media_unit_tokens
    rng = np.random.default_rng(seed)
    by_retention = {}  # a quantised twin keeps what its float policy keeps: one simulation per retention
    for var in variants.values():
        if var.kind == "engine" and var.retention not in by_retention:
            by_retention[var.retention] = checkpoint_states(prof, var.retention, checkpoints, stream)
    states = {name: by_retention[var.retention] for name, var in variants.items() if var.kind == "engine"}
    full_states = by_retention.get("full") or checkpoint_states(prof, "full", checkpoints, stream)
    s = model.shape
    qkv = tuple(mx.array(rng.standard_normal((1, h, chunk, s.head_dim), dtype=np.float32))
                for h in (s.q_heads, s.kv_heads, s.kv_heads))
    mx.eval(qkv)
    rows = []
    warmed = False
    for ci, cp in enumerate(sorted(checkpoints)):
        fs = full_states[ci]
        for name, var in variants.items():
            if var.kind == "engine":
                st = states[name][ci]
                var.install(st.table, st.history, st.peak_span, rng)
            else:
                var.install(fs.full_context_tokens, fs.last_unit, fs.history.next_position(), rng)
        order = list(variants)
        if not warmed:  # unrecorded updates of one engine and one mlx-lm variant: the process's first allocations
            for kind in ("engine", "mlx_lm"):
                first = next((v for v in variants.values() if v.kind == kind), None)
                if first is not None:
                    first.media(float(fs.updates))
                    first.restore()
            warmed = True
        samples = {name: [] for name in order}
        probes = {name: [] for name in order}
        for r in range(reps):
            gc.collect()
            for name in order[r % len(order):] + order[:r % len(order)]:
                var = variants[name]
                var.restore()
                kv_before = var.kv_bytes
                active0 = mx.get_active_memory()
                mx.reset_peak_memory()
                t0, c0 = _now()
                var.media(float(fs.updates))
                t1, c1 = _now()
                peak = model.weights_bytes + kv_before + max(0, mx.get_peak_memory() - active0)
                cnt = var.counters()
                samples[name].append({"wall": (t1 - t0) * 1000, "cpu": (c1 - c0) * 1000,
                                      "prefill": cnt["prefill_ms"], "maintenance": cnt["maintenance_ms"],
                                      "peak": peak, "layout": var.layout(), "kv_before": kv_before,
                                      "migrated": cnt["migrated_cells"]})
                var.restore()
                if r < attention_reps:
                    probes[name].append(var.probe_attention(chunk, qkv))
                    var.restore()
        for name in order:
            sm, pr = samples[name], probes[name]
            lay = sm[-1]["layout"]
            fstate = states[name][ci] if name in states else fs
            var = variants[name]
            row = {
                "kind": "update", "policy": name, "checkpoint": cp, "full_context_tokens": fs.full_context_tokens,
                "chunk_tokens": chunk, "synthetic_kv": True, **_quant_keys(var),
                "retained_before": (fstate.history.total_tokens if name in states
                                    else variants[name].layout()["retained_cells"]),
                "active_slots": pr[0].active_slots, "keys_visited": pr[0].keys_visited,
                "flops": update_flops(s, s.layers, s.vocab, chunk, pr[0].keys_visited),
                "flops_all_active": update_flops(s, s.layers, s.vocab, chunk, pr[0].active_slots * chunk),
                "update_ms": round(statistics.median(x["wall"] for x in sm), 3),
                "update_cpu_ms": round(statistics.median(x["cpu"] for x in sm), 3),
                "prefill_ms": round(statistics.median(x["prefill"] for x in sm), 3),
                "attention_ms": round(statistics.median(p.wall_ms for p in pr), 3),
                "attention_cpu_ms": round(statistics.median(p.cpu_ms for p in pr), 3),
                "maintenance_ms": round(statistics.median(x["maintenance"] for x in sm), 3),
                "migrated_cells": sm[-1]["migrated"],
                "timing": _timing([x["wall"] for x in sm], [x["cpu"] for x in sm]).to_json(),
                "attention_timing": _timing([p.wall_ms for p in pr], [p.cpu_ms for p in pr]).to_json(),
                **{k: lay[k] for k in ("retained_cells", "physical_span", "active_pages", "active_subblocks")},
                "prefill_span": lay["prefill_span"],
                "peak_span": max(fstate.peak_span if name in states else 0, lay["peak_span"]),
                "kv_bytes": lay["kv_bytes"],
                "kv_bytes_real_model": lay["retained_cells"] * real_kv_bytes_per_token(prof, var.kv_bits,
                                                                                       var.kv_group_size or 64),
                "peak_memory_bytes": int(statistics.median(x["peak"] for x in sm)),
            }
            rows.append(row)
            if log:
                log(row)
        for var in variants.values():
            var.release()
        gc.collect()
    add_limits(rows, model.shape, model.real)
    return rows


def _quant_keys(var) -> dict:
    """A row's retention and KV quantisation (None, None for float K/V)."""
    return {"retention": var.retention, "kv_bits": var.kv_bits, "kv_group_size": var.kv_group_size}


def add_limits(rows: list[dict], bench: ModelShape, real: ModelShape) -> None:
    """Per row: speedup over ``full`` at its checkpoint (wall and CPU time), the FLOP-count and key-count limits,
    and the ratios; also the limits the real model (all layers, real vocabulary) would have, and the *cost-weighted*
    limit: the speedup if each of the row's FLOPs cost what the same kind of FLOP (projections and MLP, or
    attention) cost in the full-context row, in CPU time - on a CPU attention FLOPs cost several times more than
    GEMM FLOPs, so time speedups exceed the FLOP-count limit."""
    by = {(r["checkpoint"], r["policy"]): r for r in rows if r["kind"] == "update"}
    for r in rows:
        full = by.get((r["checkpoint"], "full")) if r["kind"] == "update" else None
        if full is None:
            continue
        lim = full["flops"] / r["flops"]
        key_lim = full["keys_visited"] / r["keys_visited"]
        # looser: this row's queries read every active slot (no causal skipping inside the chunk), full context's
        # only the keys visible to them (the convention of the "about 2.35x" at 32K for the 3B shape)
        loose = full["flops"] / r["flops_all_active"]
        real_lim = (update_flops(real, real.layers, real.vocab, r["chunk_tokens"], full["keys_visited"])
                    / update_flops(real, real.layers, real.vocab, r["chunk_tokens"], r["keys_visited"]))
        dense = update_flops(bench, bench.layers, bench.vocab, r["chunk_tokens"], 0)  # all but attention
        full_att_flops = full["flops"] - dense
        full_dense_ms = full["update_cpu_ms"] - full["attention_cpu_ms"] - full["maintenance_ms"]
        # the same chunk's non-attention work as full context, plus this row's attention FLOPs at full's rate
        predicted = full_dense_ms + (r["flops"] - dense) * full["attention_cpu_ms"] / full_att_flops + r[
            "maintenance_ms"]
        # an estimate from separately probed times: on a loaded machine the probed attention can exceed the
        # update's own time, and then there is no estimate (None) rather than a negative one
        cost_limit = round(full["update_cpu_ms"] / predicted, 4) if full_dense_ms > 0 and predicted > 0 else None
        r.update({
            "cpu_cost_limit": cost_limit,
            "flop_limit": round(lim, 4), "flop_limit_real_model": round(real_lim, 4),
            "flop_limit_no_chunk_skip": round(loose, 4),
            "speedup": round(full["update_ms"] / r["update_ms"], 4),
            "cpu_speedup": round(full["update_cpu_ms"] / r["update_cpu_ms"], 4),
            "key_limit": round(key_lim, 4),
            "attention_speedup": round(full["attention_ms"] / r["attention_ms"], 4),
            "attention_cpu_speedup": round(full["attention_cpu_ms"] / r["attention_cpu_ms"], 4),
        })
        for k, l in (("speedup", lim), ("cpu_speedup", lim), ("attention_speedup", key_lim),
                     ("attention_cpu_speedup", key_lim)):
            r[k.replace("speedup", "ratio_to_limit")] = round(r[k] / l, 4)
        r["cpu_ratio_to_cost_limit"] = round(r["cpu_speedup"] / cost_limit, 4) if cost_limit else None


# --- sessions -------------------------------------------------------------------------------------------------

def session_events(stream: StreamSpec) -> list[tuple]:
    """("media", t) per second; ("ask", question tokens, reply tokens) for each question / reply pair."""
    out, pending = [], None
    for e in stream.events():
        if e.kind == "media":
            out.append(("media", e.t))
        elif e.kind == "question":
            pending = e.n_text
        else:
            out.append(("ask", pending, e.n_text))
    return out


def run_sessions(model: ShapeTrueModel, variants: dict, stream: StreamSpec, log) -> list[dict]:
    """Every variant streams the same session, taking turns event by event; one row per variant, and for the
    OmniPick layouts (native, OmniPage, eager) one ``attention_session`` row (figure 15). Engine variants should be
    profiled (``make_variant(..., profiled=True)``) for the attention series."""
    for var in variants.values():  # the system prompt's prefill is not part of the session
        var.step_log().clear()
        if isinstance(getattr(getattr(var, "session", None), "cache", None), ProfiledOmniCache):
            var.session.cache.attention_s = {"prefill": 0.0, "decode": 0.0}
    events = session_events(stream)
    series = {name: [] for name in variants}
    wall = {name: 0.0 for name in variants}
    cpu = {name: 0.0 for name in variants}
    order = list(variants)
    t_start = time.perf_counter()
    for i, ev in enumerate(events):
        gc.collect()
        for name in order[i % len(order):] + order[:i % len(order)]:
            var = variants[name]
            kv_before = var.kv_bytes
            active0 = mx.get_active_memory()
            mx.reset_peak_memory()
            t0, c0 = _now()
            if ev[0] == "media":
                var.media(ev[1])
            else:
                var.ask(ev[1], ev[2])
            t1, c1 = _now()
            peak = model.weights_bytes + max(kv_before, var.kv_bytes) + max(0, mx.get_peak_memory() - active0)
            wall[name] += t1 - t0
            cpu[name] += c1 - c0
            lay = var.layout()
            rec = {"event": i, "kind": ev[0], "ms": round((t1 - t0) * 1000, 2), "cpu_ms": round((c1 - c0) * 1000, 2),
                   "retained_cells": lay["retained_cells"], "physical_span": lay["physical_span"],
                   "active_pages": lay["active_pages"], "kv_bytes": lay["kv_bytes"], "peak_memory_bytes": int(peak),
                   "evictions": var.counters()["evictions"]}
            cache = getattr(getattr(var, "session", None), "cache", None)
            if isinstance(cache, ProfiledOmniCache):
                rec.update(prefill_attention_ms=round(cache.attention_s["prefill"] * 1000, 3),
                           decode_attention_ms=round(cache.attention_s["decode"] * 1000, 3),
                           migration_ms=round(cache.migration_s * 1000, 3))
            series[name].append(rec)
        if log:
            log(f"  session event {i + 1}/{len(events)} ({ev[0]}) done, {time.perf_counter() - t_start:.0f} s")
    rows = []
    for name, var in variants.items():
        c = var.counters()
        lay = var.layout()
        ser = series[name]
        for rec, tok in zip(ser, _full_context_series(model, events)):
            rec["full_context_tokens"] = tok
        session_s = wall[name]
        maint = c["maintenance_ms"] / 1000
        s = model.shape
        steps = var.step_log()
        keys = {"prefill": sum(k for t, k in steps if t > DECODE_MAX_TOKENS),
                "decode": sum(k for t, k in steps if t <= DECODE_MAX_TOKENS)}
        rows.append({
            "kind": "session", "policy": name, "synthetic_kv": False, **_quant_keys(var),
            "session_s": round(session_s, 3), "session_cpu_s": round(cpu[name], 3),
            "prefill_s": round(c["prefill_ms"] / 1000, 3), "decode_s": round(c["decode_ms"] / 1000, 3),
            "maintenance_s": round(maint, 4), "maintenance_share": round(maint / session_s, 5),
            "flops": sum(update_flops(s, s.layers, s.vocab, t, k) for t, k in steps),
            "prefill_keys_visited": keys["prefill"], "decode_keys_visited": keys["decode"],
            "other_s": round(session_s - (c["prefill_ms"] + c["decode_ms"] + c["maintenance_ms"]) / 1000, 3),
            "units": sum(1 for e in events if e[0] == "media"), "questions": sum(1 for e in events if e[0] == "ask"),
            "decoded_tokens": c["decoded_tokens"], "evictions": c["evictions"], "migrations": c["migrations"],
            "migrated_cells": c["migrated_cells"], "full_context_tokens": ser[-1]["full_context_tokens"],
            **{k: lay[k] for k in ("retained_cells", "physical_span", "active_pages", "active_subblocks",
                                   "peak_span", "kv_bytes")},
            "kv_bytes_real_model": lay["retained_cells"] * real_kv_bytes_per_token(model.profile, var.kv_bits,
                                                                                   var.kv_group_size or 64),
            "peak_memory_bytes": max(r["peak_memory_bytes"] for r in ser),
            "series": ser,
        })
        cache = getattr(getattr(var, "session", None), "cache", None)
        if isinstance(cache, ProfiledOmniCache):
            rows[-1].update(prefill_attention_s=round(cache.attention_s["prefill"], 4),
                            decode_attention_s=round(cache.attention_s["decode"], 4),
                            migration_s=round(cache.migration_s, 4))
            if name in LAYOUT_TRIO:
                rows.append({"kind": "attention_session", "policy": name, "layout": var.policy.layout,
                             **{k: rows[-1][k] for k in ("prefill_attention_s", "decode_attention_s", "migration_s",
                                                         "migrations", "migrated_cells", "maintenance_s",
                                                         "prefill_keys_visited", "decode_keys_visited")},
                             "series": [{k: e[k] for k in ("event", "kind", "prefill_attention_ms",
                                                           "decode_attention_ms", "migration_ms", "active_pages")}
                                        for e in ser]})
    full = next((r for r in rows if r["kind"] == "session" and r["policy"] == "full"), None)
    for r in rows:
        if r["kind"] == "session" and full is not None:
            r.update(flop_limit=round(full["flops"] / r["flops"], 4),
                     speedup=round(full["session_s"] / r["session_s"], 4),
                     cpu_speedup=round(full["session_cpu_s"] / r["session_cpu_s"], 4))
            r["ratio_to_limit"] = round(r["speedup"] / r["flop_limit"], 4)
    return rows


def _full_context_series(model: ShapeTrueModel, events: list[tuple]) -> list[int]:
    """The no-slide history length after each session event (system prompt included)."""
    prof = model.profile
    tokens = prof.system_tokens
    out = []
    for ev in events:
        if ev[0] == "media":
            tokens += prof.media_unit_tokens
        else:
            tokens += question_tokens(prof.family, ev[1]) + ev[2] + reply_closing_tokens(prof.family)
        out.append(tokens)
    return out


# --- goals ----------------------------------------------------------------------------------------------------

def goals(result: dict) -> dict:
    """The issue's goals on the measured rows (wall time; CPU time alongside)."""
    rows = result["rows"]
    shape = result["shape"]
    upd = [r for r in rows if r["kind"] == "update" and r["policy"] == "omnitide" and "flop_limit" in r]
    update_goal = [{"checkpoint": r["checkpoint"], "speedup": r["speedup"], "cpu_speedup": r["cpu_speedup"],
                    "flop_limit": r["flop_limit"], "ratio_to_limit": r["ratio_to_limit"],
                    "cpu_ratio_to_limit": r["cpu_ratio_to_limit"], "met": r["ratio_to_limit"] >= RATIO_GOAL,
                    "cpu_met": r["cpu_ratio_to_limit"] >= RATIO_GOAL, "cpu_cost_limit": r["cpu_cost_limit"],
                    "cpu_ratio_to_cost_limit": r["cpu_ratio_to_cost_limit"],
                    "attention_speedup": r["attention_speedup"], "key_limit": r["key_limit"],
                    "attention_ratio_to_limit": r["attention_ratio_to_limit"],
                    "attention_cpu_ratio_to_limit": r["attention_cpu_ratio_to_limit"],
                    "attention_met": r["attention_ratio_to_limit"] >= RATIO_GOAL,
                    "attention_cpu_met": r["attention_cpu_ratio_to_limit"] >= RATIO_GOAL} for r in upd]
    out = {"ratio_goal": RATIO_GOAL, "omnitide_updates": update_goal}
    last = max(upd, key=lambda r: r["checkpoint"]) if upd else None
    if last is not None and shape in PAPER_UPDATE_32K:
        full_ms, tide_ms = PAPER_UPDATE_32K[shape]
        paper = full_ms / tide_ms
        out["paper_update"] = {"checkpoint": last["checkpoint"], "paper_speedup_32k": round(paper, 3),
                               "speedup": last["speedup"], "flop_limit": last["flop_limit"],
                               "limit_allows": last["flop_limit"] >= paper, "beats_paper": last["speedup"] > paper}
    sess = {r["policy"]: r for r in rows if r["kind"] == "session"}
    if "full" in sess and "omnitide" in sess:
        sp = sess["full"]["session_s"] / sess["omnitide"]["session_s"]
        entry = {"speedup": round(sp, 3),
                 "cpu_speedup": round(sess["full"]["session_cpu_s"] / sess["omnitide"]["session_cpu_s"], 3),
                 "flop_limit": sess["omnitide"].get("flop_limit"),
                 "ratio_to_limit": sess["omnitide"].get("ratio_to_limit"),
                 "full_context_tokens": sess["omnitide"]["full_context_tokens"]}
        if shape in PAPER_SESSION:
            a, b = PAPER_SESSION[shape]
            entry.update(paper_speedup=round(a / b, 3), beats_paper=sp > a / b)
        out["session"] = entry
    out["maintenance"] = {name: {"share": r["maintenance_share"], "met": r["maintenance_share"] < MAINTENANCE_GOAL}
                          for name, r in sess.items() if split_variant(name)[0] in ENGINE_POLICIES}
    if any(r.get("kv_bits") for r in rows):
        out["kv_quant"] = kv_quant_comparison(rows)
    prof = {r["policy"]: r for r in rows if r["kind"] == "attention_session"}
    if set(LAYOUT_TRIO) <= set(prof):
        nat, omp, eag = (prof[n] for n in LAYOUT_TRIO)
        share = {}
        for phase in ("prefill", "decode", "total"):
            def att(r):
                return (r["prefill_attention_s"] + r["decode_attention_s"] if phase == "total"
                        else r[f"{phase}_attention_s"])
            def keys(r):
                return (r["prefill_keys_visited"] + r["decode_keys_visited"] if phase == "total"
                        else r[f"{phase}_keys_visited"])
            mig = omp["migration_s"] if phase != "decode" else 0.0
            gain = att(nat) - att(eag)
            key_gain = keys(nat) - keys(eag)
            share[phase] = {"native_s": round(att(nat), 4), "omnipage_s_with_migration": round(att(omp) + mig, 4),
                            "eager_s": round(att(eag), 4), "eager_gain_s": round(gain, 4),
                            "omnipage_gain_s": round(att(nat) - att(omp) - mig, 4),
                            "share": round((att(nat) - att(omp) - mig) / gain, 4) if gain > 0 else None,
                            "keys_visited": {n: keys(r) for n, r in zip(LAYOUT_TRIO, (nat, omp, eag))},
                            # what the layouts allow: eager's reduction of visited keys, OmniPage's share of it
                            "eager_key_reduction": round(key_gain / keys(nat), 4) if keys(nat) else None,
                            "key_share": round((keys(nat) - keys(omp)) / key_gain, 4) if key_gain > 0 else None}
        share["goal"] = OMNIPAGE_GOAL
        pre = share["prefill"]
        # without a reduction of visited keys for eager to make, a time difference is noise, not a gain to capture
        share["applicable"] = bool(pre["eager_key_reduction"] and pre["eager_key_reduction"] > 0.01)
        share["met"] = (share["applicable"] and pre["share"] is not None and pre["share"] >= OMNIPAGE_GOAL)
        out["omnipage_share_session"] = share
    cps = {}
    for r in rows:
        if r["kind"] == "update" and r["policy"] in LAYOUT_TRIO:
            cps.setdefault(r["checkpoint"], {})[r["policy"]] = r
    cp_share = []
    for cp, by in sorted(cps.items()):
        if set(LAYOUT_TRIO) <= set(by):
            mig = by["omnitide"]["maintenance_ms"]
            gain = by["omnipick"]["attention_ms"] - by["eager"]["attention_ms"]
            own = by["omnipick"]["attention_ms"] - by["omnitide"]["attention_ms"] - mig
            cp_share.append({"checkpoint": cp, "native_ms": by["omnipick"]["attention_ms"],
                             "omnipage_ms": by["omnitide"]["attention_ms"], "omnipage_maintenance_ms": mig,
                             "eager_ms": by["eager"]["attention_ms"],
                             "share": round(own / gain, 4) if gain > 0 else None})
    out["omnipage_share_checkpoints"] = cp_share
    out["memory"] = memory_check(rows)
    return out


def float_twin(name: str) -> str:
    """The float variant a quantised one is measured against: ``omnitide_kv4`` -> ``omnitide``, mlx-lm's
    ``QuantizedKVCache`` -> its ``KVCache`` (both unbounded)."""
    return "mlx_kvcache" if name == MLX_LM_QUANT else split_variant(name)[0]


def _ratio(a, b):
    return round(a / b, 4) if a is not None and b else None


def kv_quant_comparison(rows: list[dict]) -> dict:
    """Each quantised variant against its float twin, measured side by side in the same run: per checkpoint the
    update and attention medians, KV bytes (buffers as allocated, and the retained cells at the real model's
    bytes per token) and their ratios (quantised / float); per session the session, prefill-attention and
    decode-attention times and the KV bytes at the end."""
    upd = {(r["checkpoint"], r["policy"]): r for r in rows if r["kind"] == "update"}
    sess = {r["policy"]: r for r in rows if r["kind"] == "session"}
    out = {"checkpoints": [], "sessions": []}
    for (cp, name), q in sorted(upd.items()):
        f = upd.get((cp, float_twin(name)))
        if not q.get("kv_bits") or f is None:
            continue
        e = {"checkpoint": cp, "variant": name, "float": f["policy"], "same_retained_cells":
             q["retained_cells"] == f["retained_cells"]}
        for k in ("update_ms", "update_cpu_ms", "attention_ms", "attention_cpu_ms", "kv_bytes",
                  "kv_bytes_real_model", "peak_memory_bytes"):
            e[k] = [q[k], f[k]]
            e[k + "_ratio"] = _ratio(q[k], f[k])
        out["checkpoints"].append(e)
    for name, q in sess.items():
        f = sess.get(float_twin(name))
        if not q.get("kv_bits") or f is None:
            continue
        e = {"variant": name, "float": f["policy"], "same_retained_cells": q["retained_cells"] == f["retained_cells"]}
        for k in ("session_s", "session_cpu_s", "prefill_s", "decode_s", "prefill_attention_s", "decode_attention_s",
                  "kv_bytes", "kv_bytes_real_model", "peak_memory_bytes"):
            if k in q and k in f:
                e[k] = [q[k], f[k]]
                e[k + "_ratio"] = _ratio(q[k], f[k])
        out["sessions"].append(e)
    return out


def kv_quant_info(model: ShapeTrueModel, policies, kv_bits: int | None, kv_group_size: int) -> dict | None:
    """The run's KV quantisation: bits, group size, the quantised variants, and KV bytes per token (packed values
    plus scales and biases) of the benchmark model (float32 scales, all its layers) and of the real model (fp16
    scales, as the paper's fp16 KV), next to the float figures."""
    if kv_bits is None:
        return None
    prof = model.profile
    s = model.shape
    row = s.head_dim * kv_bits // 8 + 2 * (s.head_dim // kv_group_size) * 4
    return {"bits": kv_bits, "group_size": kv_group_size, "engine_rerotate": "deferred",
            "variants": [n for n in policies if split_variant(n)[1] or n == MLX_LM_QUANT],
            "mlx_lm_cache": f"QuantizedKVCache(group_size={kv_group_size}, bits={kv_bits})",
            "bench_kv_bytes_per_token": 2 * s.layers * s.kv_heads * row,
            "bench_kv_bytes_per_token_float": 2 * s.layers * s.kv_heads * s.head_dim * 4,
            "real_kv_bytes_per_token": real_kv_bytes_per_token(prof, kv_bits, kv_group_size),
            "real_kv_bytes_per_token_fp16": prof.kv_bytes_per_token}


def _fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least-squares slope and R^2 of y against x."""
    slope, icpt = np.polyfit(x, y, 1)
    r2 = 1 - ((y - (slope * x + icpt)) ** 2).sum() / max(((y - y.mean()) ** 2).sum(), 1e-9)
    return float(slope), float(r2)


def memory_check(rows: list[dict]) -> dict:
    """Session memory per media update against the no-slide history. Full context (and mlx-lm's KVCache) should grow
    linearly: slope in bytes per token and R^2. A bounded policy should stay flat once it has trimmed: the fitted
    growth over the updates from its first trim on, as a fraction of their mean peak ("flat": less than 5 % growth;
    the peaks alternate between trimming and non-trimming updates, so a band is expected, an upward trend is not)."""
    out = {}
    for r in rows:
        if r["kind"] != "session":
            continue
        media = [e for e in r["series"] if e["kind"] == "media"]
        x = np.array([e["full_context_tokens"] for e in media], dtype=np.float64)
        y = np.array([e["peak_memory_bytes"] for e in media], dtype=np.float64)
        # the first update after which the cache holds less than the whole stream (mlx-lm's RotatingKVCache trims
        # inside its update, so no eviction counter says so)
        first_trim = next((i for i, e in enumerate(media) if e["retained_cells"] < e["full_context_tokens"]), None)
        if split_variant(r["policy"])[0] in UNBOUNDED or first_trim is None:
            if len(x) >= 3:
                slope, r2 = _fit(x, y)
                out[r["policy"]] = {"growth": "linear", "bytes_per_token": round(slope, 1), "r2": round(r2, 4)}
            continue
        xa, ya = x[first_trim:], y[first_trim:]
        entry = {"growth": "bounded", "first_trim_update": first_trim, "peak_at_first_trim": int(ya[0]),
                 "max_after": int(ya.max()), "min_after": int(ya.min()),
                 "spread": round(float((ya.max() - ya.min()) / ya.mean()), 4)}
        if len(xa) >= 3:
            slope, _ = _fit(xa, ya)
            growth = slope * (xa[-1] - xa[0]) / ya.mean()
            entry.update(bytes_per_token=round(slope, 1), fitted_growth=round(float(growth), 4),
                         flat=bool(growth < 0.05))
        out[r["policy"]] = entry
    return out


# --- the run --------------------------------------------------------------------------------------------------

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
    rows: list[dict] = []
    cost = {}
    if checkpoints:
        variants = {name: make_variant(name, model, kv_bits=kv_bits, kv_group_size=kv_group_size)
                    for name in policies}
        t0 = time.perf_counter()
        rows += bench_checkpoints(model, variants, checkpoints, stream, reps=reps,
                                  attention_reps=min(attention_reps, reps), seed=seed,
                                  log=(lambda r: log(_row_line(r))) if log else None)
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
        "rows": rows,
    }
    result["goals"] = goals(result)
    return result


def _uncommitted() -> list[str]:
    """Files of the package with uncommitted changes (other engineers share the working tree)."""
    import os
    import subprocess

    try:
        here = os.path.dirname(os.path.abspath(__file__))
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


def _row_line(r: dict) -> str:
    return (f"  {r['checkpoint']:>6} {r['policy']:<13} update {r['update_ms']:>9.1f} ms "
            f"(cpu {r['update_cpu_ms']:>9.1f})"
            f"  attention {r['attention_ms']:>9.1f} ms  maintenance {r['maintenance_ms']:>7.1f} ms  "
            f"retained {r['retained_cells']:>6} span {r['physical_span']:>6}")


def markdown(result: dict) -> str:
    """The tables of docs/benchmarks.md: checkpoints, then sessions."""
    lines = ["| checkpoint (no-slide) | policy | update ms (CPU ms) | speedup (CPU) | FLOP limit | ratio (CPU) "
             "| attention ms | attn speedup | key limit | ratio | maintenance ms | retained / span / active slots "
             "| peak span | peak memory MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r["kind"] != "update":
            continue
        lim = r.get("flop_limit")
        lines.append(
            f"| {r['checkpoint']} ({r['full_context_tokens']}) | {r['policy']} | {r['update_ms']:.0f} "
            f"({r['update_cpu_ms']:.0f}) | {r.get('speedup', 0):.2f}x ({r.get('cpu_speedup', 0):.2f}x) | "
            f"{lim:.2f}x | {r.get('ratio_to_limit', 0):.2f} ({r.get('cpu_ratio_to_limit', 0):.2f}) | "
            f"{r['attention_ms']:.0f} | {r.get('attention_speedup', 0):.2f}x | {r.get('key_limit', 0):.2f}x | "
            f"{r.get('attention_ratio_to_limit', 0):.2f} | {r['maintenance_ms']:.1f} | "
            f"{r['retained_cells']} / {r['physical_span']} / {r['active_slots']} | {r['peak_span']} | "
            f"{r['peak_memory_bytes'] / 1e6:.0f} |")
    lines += ["", "| policy | session s (CPU s) | speedup (CPU) | FLOP limit | ratio | prefill s | decode s "
              "| maintenance s (share) | retained / span / peak span | KV MB (real model, fp16) | peak memory MB |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r["kind"] != "session":
            continue
        lines.append(f"| {r['policy']} | {r['session_s']:.1f} ({r['session_cpu_s']:.1f}) | "
                     f"{r.get('speedup', 0):.2f}x ({r.get('cpu_speedup', 0):.2f}x) | {r.get('flop_limit', 0):.2f}x | "
                     f"{r.get('ratio_to_limit', 0):.2f} | {r['prefill_s']:.1f} | "
                     f"{r['decode_s']:.1f} | {r['maintenance_s']:.3f} ({100 * r['maintenance_share']:.2f} %) | "
                     f"{r['retained_cells']} / {r['physical_span']} / {r['peak_span']} | "
                     f"{r['kv_bytes_real_model'] / 1e6:.0f} | {r['peak_memory_bytes'] / 1e6:.0f} |")
    kq = result.get("goals", {}).get("kv_quant")
    if kq:
        lines += ["", "| checkpoint | quantised | float | update ms (ratio) | attention ms (ratio) "
                  "| KV MB allocated (ratio) | KV MB real model, retained (ratio) |", "|---|---|---|---|---|---|---|"]
        for e in kq["checkpoints"]:
            lines.append(f"| {e['checkpoint']} | {e['variant']} | {e['float']} | {e['update_ms'][0]:.0f} / "
                         f"{e['update_ms'][1]:.0f} ({e['update_ms_ratio']:.2f}) | {e['attention_ms'][0]:.0f} / "
                         f"{e['attention_ms'][1]:.0f} ({e['attention_ms_ratio']:.2f}) | "
                         f"{e['kv_bytes'][0] / 1e6:.1f} / {e['kv_bytes'][1] / 1e6:.1f} ({e['kv_bytes_ratio']:.3f}) | "
                         f"{e['kv_bytes_real_model'][0] / 1e6:.1f} / {e['kv_bytes_real_model'][1] / 1e6:.1f} "
                         f"({e['kv_bytes_real_model_ratio']:.3f}) |")
        lines += ["", "| quantised | float | session s (ratio) | prefill attention s (ratio) | decode attention s "
                  "(ratio) | KV MB allocated at the end (ratio) |", "|---|---|---|---|---|---|"]
        for e in kq["sessions"]:
            def pair(k, scale=1.0, fmt=".2f"):
                if k not in e:
                    return "-"
                return (f"{e[k][0] / scale:{fmt}} / {e[k][1] / scale:{fmt}} "
                        f"({e[k + '_ratio'] if e[k + '_ratio'] is not None else float('nan'):.2f})")
            lines.append(f"| {e['variant']} | {e['float']} | {pair('session_s')} | {pair('prefill_attention_s')} | "
                         f"{pair('decode_attention_s')} | {pair('kv_bytes', 1e6, '.1f')} |")
    return "\n".join(lines)


# --- command line (omnitide bench stream) ----------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..commands.options import add_media_arguments

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

    from ..commands.options import UsageError, media_setting

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
    from .stream_plots import plot

    write_outputs(result, args, markdown=markdown, plot=plot)
    print(f"wall {result['wall_s']} s, CPU {result['cpu_s']} s; cost {result['cost']}; load {result['load_average']}")
    return 0
