"""The backend-neutral half of the synthetic omni stream that drives a cache (MLX: tests/cache/cache_stream.py,
PyTorch: tests/torch/torch_stream.py) the way a model and a session do, with a float64 oracle.

Every token ever written gets raw (pre-RoPE) keys and values per layer; queries are random per step. The "model"
rotates q and k at the tokens' positions (plain NeoX RoPE, or M-RoPE with t/h/w sections) and hands them to the
cache; how is the backend's ``forward``. The oracle keeps every token ever written, masks the deleted ones, rotates
each kept key at its *current* (shifted) position in float64 and attends with a causal mask inside the new chunk.
Numpy and the core only: both backends' tests use it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omnitide_mlx.core.page import AllocClass, MigrationPlanner
from omnitide_mlx.core.pick import apply_plan
from omnitide_mlx.core.units import History, Span, SpanKind, Unit, UnitKind

BASE = 10000.0


def inv_freq(d: int) -> np.ndarray:
    return BASE ** (-np.arange(0, d, 2, dtype=np.float64) / d)


def rope64(x: np.ndarray, pos: np.ndarray, sections=None) -> np.ndarray:
    """NeoX RoPE in float64. ``x`` [..., n, D]; ``pos`` [axes, n]. With ``sections`` (M-RoPE), frequency band f
    reads the axis its section assigns (t, h, w); with one axis every band reads it."""
    d = x.shape[-1]
    f = inv_freq(d)
    pos = np.asarray(pos, dtype=np.float64).reshape(-1, x.shape[-2])
    if sections is None:
        axis_of = np.zeros(d // 2, dtype=int)
    else:
        axis_of = np.repeat(np.arange(len(sections)), sections)
    ang = pos[axis_of, :].T * f[None, :]  # [n, D/2]
    c, s = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1)


@dataclass
class OracleStream(ABC):
    """Drives one cache through units, decode steps and evictions; remembers what the oracle needs. A backend
    subclass provides ``forward`` (one step through every layer of the cache)."""

    cache: Any
    q_heads: int
    seed: int = 0
    sections: tuple[int, ...] | None = None  # M-RoPE sections (sum = head_dim / 2), None for plain RoPE
    planner: MigrationPlanner | None = None
    history: History = field(default_factory=History)
    raw_k: dict = field(default_factory=dict)  # token id -> [layers, Hkv, D]
    raw_v: dict = field(default_factory=dict)
    alive: list = field(default_factory=list)  # token ids in logical order
    pos: dict = field(default_factory=dict)  # token id -> current positions [axes]
    next_id: int = 0
    outputs: list = field(default_factory=list)  # per step: [layers] float32 outputs
    oracle: list = field(default_factory=list)  # per step: [layers] float64 oracle outputs
    scores: dict = field(default_factory=dict)  # token id -> oracle attention received (H2O), all layers/heads
    migrations: int = 0
    evictions: int = 0

    @property
    def axes(self) -> int:
        return 1 if self.sections is None else 3

    def _raw(self, tid: int):
        if tid not in self.raw_k:
            r = np.random.default_rng([self.seed, 1, tid])
            c = self.cache
            self.raw_k[tid] = r.standard_normal((c.num_layers, c.kv_heads, c.head_dim))
            self.raw_v[tid] = r.standard_normal((c.num_layers, c.kv_heads, c.head_dim))
        return self.raw_k[tid], self.raw_v[tid]

    def layer_inputs(self, layer: int, ids: list, positions: np.ndarray, rq: np.ndarray):
        """Float64 q [Hq, T, D], k, v [Hkv, T, D] of one layer for the tokens ``ids`` (q and k rotated)."""
        k = np.stack([self._raw(i)[0][layer] for i in ids], axis=1)  # [Hkv, T, D]
        v = np.stack([self._raw(i)[1][layer] for i in ids], axis=1)
        return rope64(rq[layer], positions, self.sections), rope64(k, positions, self.sections), v

    @abstractmethod
    def forward(self, ids: list, positions: np.ndarray, rq: np.ndarray, scale: float) -> list[np.ndarray]:
        """Write the tokens ``ids`` through every layer of the cache (owner already set); per layer the attention
        output [1, Hq, T, D] as float32 numpy."""

    def step(self, uid: int, positions: np.ndarray, cls=AllocClass.RECENT_CONTEXT, check_oracle=True):
        """Write len(positions[0]) tokens of unit ``uid`` at ``positions`` [axes, T] through every layer."""
        c = self.cache
        t = positions.shape[1]
        ids = list(range(self.next_id, self.next_id + t))
        self.next_id += t
        c.set_owner(uid, cls)
        rq = np.random.default_rng([self.seed, 2, ids[0]]).standard_normal((c.num_layers, self.q_heads, t, c.head_dim))
        scale = c.head_dim ** -0.5
        outs = self.forward(ids, positions, rq, scale)
        self.outputs.append(outs)
        for j, tid in enumerate(ids):
            self.pos[tid] = positions[:, j].copy()
        self.alive.extend(ids)
        if check_oracle:
            self.oracle.append(self._oracle(rq, ids, positions, scale))
        return outs

    def _oracle(self, rq, new_ids, positions, scale):
        """Float64 attention of the new tokens over every retained token at its current position."""
        c = self.cache
        ids = self.alive  # retained history + the new tokens, logical order
        n_new, n = len(new_ids), len(ids)
        pos = np.stack([self.pos[i] for i in ids], axis=1)  # [axes, N]
        g = self.q_heads // c.kv_heads
        mask = np.ones((n_new, n), bool)
        mask[:, n - n_new:] = np.tril(np.ones((n_new, n_new), bool))
        out = []
        for layer in range(c.num_layers):
            k = rope64(np.stack([self.raw_k[i][layer] for i in ids], axis=1), pos, self.sections)  # [Hkv, N, D]
            v = np.stack([self.raw_v[i][layer] for i in ids], axis=1)
            q = rope64(rq[layer], positions, self.sections)  # [Hq, T, D]
            o = np.zeros_like(q)
            for h in range(self.q_heads):
                s = np.where(mask, q[h] @ k[h // g].T * scale, -np.inf)  # [T, N]
                p = np.exp(s - s.max(axis=1, keepdims=True))
                p /= p.sum(axis=1, keepdims=True)
                o[h] = p @ v[h // g]
                for tid, w in zip(ids, p.sum(axis=0)):
                    self.scores[tid] = self.scores.get(tid, 0.0) + w
            out.append(o[None])
        return out

    # --- units ----------------------------------------------------------------------------------------------
    def unit_positions(self, n: int, image: int = 0) -> np.ndarray:
        """Positions for a unit of ``n`` tokens continuing the history: sequential, except that with M-RoPE the
        first ``image`` tokens form a 2-D grid at one time step (as Qwen2.5-Omni places vision tokens)."""
        p0 = self.history.next_position() if self.history.units else 0
        if self.axes == 1:
            return (p0 + np.arange(n))[None, :]
        pos = np.zeros((3, n), dtype=np.int64)
        side = max(1, int(np.sqrt(image))) if image else 1
        for j in range(n):
            if j < image:
                pos[:, j] = (p0, p0 + j // side, p0 + j % side)
            else:
                pos[:, j] = p0 + (side if image else 0) + (j - image)
        return pos

    def add_unit(self, kind: UnitKind, runs: list[tuple[SpanKind, int]], cls=AllocClass.RECENT_CONTEXT,
                 chunk: int | None = None, check_oracle=True) -> Unit:
        """Prefill one unit (in chunks of ``chunk`` tokens if given) and append it to the history."""
        uid = self.history.next_uid()
        spans, cur = [], 0
        for k, n in runs:
            spans.append(Span(k, cur, cur + n))
            cur += n
        image = sum(n for k, n in runs if k is SpanKind.IMAGE)
        pos = self.unit_positions(cur, image)
        unit = Unit(uid=uid, kind=kind, spans=tuple(spans), positions=pos)
        step = chunk or cur
        for a in range(0, cur, step):
            self.step(uid, pos[:, a:a + step], cls, check_oracle)
        self.history.append(unit)
        return unit

    def add_reply(self, n: int, check_oracle=True) -> Unit:
        """Decode ``n`` tokens one step at a time into a reply unit (the session's decode loop)."""
        uid = self.history.next_uid()
        pos = self.unit_positions(n)
        for j in range(n):
            self.step(uid, pos[:, j:j + 1], AllocClass.RECENT_CONTEXT, check_oracle)
        unit = Unit(uid=uid, kind=UnitKind.REPLY, spans=(Span(SpanKind.RESPONSE, 0, n),), positions=pos)
        self.history.append(unit)
        return unit

    def maintain(self, policy):
        """Retention (and migration when a planner is set), as the session does after each unit."""
        scores = self.cache.token_scores(self.history) if policy.needs_scores else None
        plan = policy.plan(self.history, scores=scores)
        if plan is None:
            return None
        self.cache.evict(plan, self.history)
        keep = plan.keep_mask()
        self.history = apply_plan(self.history, plan)
        self.alive = [i for i, k in zip(self.alive, keep) if k]
        new_pos = self.history.positions()
        for j, tid in enumerate(self.alive):
            self.pos[tid] = new_pos[:, j].copy()
        self.evictions += 1
        if self.planner is not None:
            mplan = self.planner.plan(self.cache.page_table)
            if mplan.accepted:
                self.cache.migrate(mplan)
                self.migrations += 1
        return plan


def media_runs(rng: np.random.Generator, image=(6, 40), audio=(3, 12)) -> list[tuple[SpanKind, int]]:
    return [(SpanKind.BOUNDARY, 1), (SpanKind.IMAGE, int(rng.integers(*image))),
            (SpanKind.AUDIO, int(rng.integers(*audio))), (SpanKind.BOUNDARY, 1)]


def run_session(stream: OracleStream, policy, units: int, rng_seed: int = 0, system: int = 5, reply_every: int = 4,
                chunk: int | None = None, check_oracle=True) -> OracleStream:
    """A system prompt, then media units with a user question and a short decoded reply every few units."""
    rng = np.random.default_rng(rng_seed)
    stream.add_unit(UnitKind.SYSTEM, [(SpanKind.SYSTEM, system)], AllocClass.MUST_KEEP, check_oracle=check_oracle)
    for i in range(units):
        stream.add_unit(UnitKind.MEDIA, media_runs(rng), chunk=chunk, check_oracle=check_oracle)
        stream.maintain(policy)
        if reply_every and i % reply_every == reply_every - 1:
            stream.add_unit(UnitKind.USER, [(SpanKind.BOUNDARY, 1), (SpanKind.TEXT, int(rng.integers(2, 9)))],
                            check_oracle=check_oracle)
            stream.add_reply(int(rng.integers(2, 6)), check_oracle=check_oracle)
            stream.maintain(policy)
    return stream


def max_err(s: OracleStream) -> float:
    """The largest difference between a stream's outputs and its oracle's, over every step and layer."""
    assert len(s.outputs) == len(s.oracle) > 0
    return max(float(np.abs(o - r).max()) for out, ref in zip(s.outputs, s.oracle) for o, r in zip(out, ref))
