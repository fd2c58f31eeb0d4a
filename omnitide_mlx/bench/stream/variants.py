"""The variants a run compares, behind one small protocol (``Variant``): the engine under a retention policy /
layout (``EngineVariant``, optionally over a quantised OmniCache) and mlx-lm's own caches driving the same model
(``MlxLmVariant``); ``make_variant`` builds one by name."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import numpy as np

from ...core.page import PageTable
from ...core.pick import make_policy
from ...core.units import History
from ...engine import SessionCounters
from ...kernels.quantized import quantize_rows
from ...models.attention import cached_attention
from ...session import MlxBackend, OmniSession
from ..shape_models import ShapeTrueModel
from .names import ENGINE_POLICIES, MLX_LM_KEEP, MLX_LM_PREFILL_STEP, MLX_LM_QUANT, MLX_LM_VARIANTS, split_variant
from .profiling import ProfiledBackend, StepCounter, tile_keys_visited

_FRAME = np.zeros((28, 28, 3), dtype=np.uint8)  # validated by the engine, then ignored by the random-unit adapter
_SECOND = np.zeros(16000, dtype=np.float32)


def _now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()



@dataclass
class Probe:
    """One attention profile of an update (all layers)."""

    wall_ms: float
    cpu_ms: float
    active_slots: int
    keys_visited: int



class Variant(Protocol):
    """What the checkpoint and session runs use of a variant. ``install`` (the state at a no-slide checkpoint) is
    per kind: the engine takes the simulator's page table and history, mlx-lm's caches a token count."""

    name: str
    kind: str  # "engine" or "mlx_lm"
    retention: str
    kv_bits: int | None
    kv_group_size: int | None

    def media(self, t: float) -> None: ...

    def ask(self, n_question: int, n_reply: int) -> None: ...

    def counters(self) -> dict: ...

    def layout(self) -> dict: ...

    @property
    def kv_bytes(self) -> int: ...

    def step_log(self) -> list: ...

    def restore(self) -> None: ...

    def release(self) -> None: ...

    def probe_attention(self, chunk: int, qkv: tuple) -> Probe: ...


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
