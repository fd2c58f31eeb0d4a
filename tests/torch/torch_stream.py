"""A synthetic omni stream driving an OmniTorchCache the way transformers and the session do, with a float64 oracle.

Every token ever written gets raw (pre-RoPE) keys and values per layer; queries are random per step. The "model"
rotates q and k at the tokens' positions (NeoX RoPE, or M-RoPE with t/h/w sections) and calls the cache exactly as
a transformers attention layer does: ``cache.update(k, v, layer)`` then (attention="omnitide") the registered
attention function, or (attention="transformers") SDPA over the returned K/V with the causal mask transformers builds
from ``get_mask_sizes``. The oracle keeps every token ever written, masks the deleted ones, rotates each kept key at
its *current* (shifted) position in float64 and attends with a causal mask inside the new chunk.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

from omnitide_mlx.core.page import AllocClass, MigrationPlanner
from omnitide_mlx.core.pick import apply_plan
from omnitide_mlx.core.units import History, Span, SpanKind, Unit, UnitKind
from omnitide_mlx.rope import RopeSpec
from omnitide_mlx.torch.cache import OmniTorchCache, omnitide_attention

BASE = 10000.0
DEVICE = torch.device(os.environ.get("OMNITIDE_TORCH_DEVICE", "cpu"))


def rope64(x: np.ndarray, pos: np.ndarray, sections=None) -> np.ndarray:
    """NeoX RoPE in float64; ``x`` [..., n, D], ``pos`` [axes, n]; with ``sections`` band f reads its M-RoPE axis."""
    d = x.shape[-1]
    f = BASE ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    pos = np.asarray(pos, dtype=np.float64).reshape(-1, x.shape[-2])
    axis_of = np.zeros(d // 2, dtype=int) if sections is None else np.repeat(np.arange(len(sections)), sections)
    ang = pos[axis_of, :].T * f[None, :]
    c, s = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1)


@dataclass
class Stream:
    cache: OmniTorchCache
    q_heads: int
    seed: int = 0
    sections: tuple[int, ...] | None = None
    planner: MigrationPlanner | None = None
    history: History = field(default_factory=History)
    raw_k: dict = field(default_factory=dict)
    raw_v: dict = field(default_factory=dict)
    alive: list = field(default_factory=list)
    pos: dict = field(default_factory=dict)
    next_id: int = 0
    outputs: list = field(default_factory=list)
    oracle: list = field(default_factory=list)
    scores: dict = field(default_factory=dict)
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

    def step(self, uid: int, positions: np.ndarray, cls=AllocClass.RECENT_CONTEXT, check_oracle=True):
        c = self.cache
        t = positions.shape[1]
        ids = list(range(self.next_id, self.next_id + t))
        self.next_id += t
        c.set_owner(uid, cls)
        rq = np.random.default_rng([self.seed, 2, ids[0]]).standard_normal((c.num_layers, self.q_heads, t, c.head_dim))
        scale = c.head_dim ** -0.5
        kept_before = c.retained
        outs = []
        for layer in range(c.num_layers):
            k = rope64(np.stack([self._raw(i)[0][layer] for i in ids], axis=1), positions, self.sections)
            v = np.stack([self._raw(i)[1][layer] for i in ids], axis=1)
            q = torch.as_tensor(rope64(rq[layer], positions, self.sections)[None], dtype=torch.float32, device=DEVICE)
            kk, vv = c.update(torch.as_tensor(k[None], dtype=torch.float32, device=DEVICE).to(c.dtype),
                              torch.as_tensor(v[None], dtype=torch.float32, device=DEVICE).to(c.dtype), layer)
            if c.attention == "omnitide":
                out, _ = omnitide_attention(SimpleNamespace(layer_idx=layer), q, kk, vv, None, scaling=scale)
                out = out.transpose(1, 2)
            else:  # transformers' mask from get_mask_sizes: key j visible to query i iff j <= kept + i
                n = kk.shape[2]
                mask = torch.arange(n, device=DEVICE)[None, :] <= kept_before + torch.arange(t, device=DEVICE)[:, None]
                out = F.scaled_dot_product_attention(q.to(kk.dtype), kk, vv, attn_mask=mask, scale=scale,
                                                     enable_gqa=True)
            outs.append(out.to(torch.float32).cpu().numpy())
        self.outputs.append(outs)
        for j, tid in enumerate(ids):
            self.pos[tid] = positions[:, j].copy()
        self.alive.extend(ids)
        if check_oracle:
            self.oracle.append(self._oracle(rq, ids, positions, scale))
        return outs

    def _oracle(self, rq, new_ids, positions, scale):
        c = self.cache
        ids = self.alive
        n_new, n = len(new_ids), len(self.alive)
        pos = np.stack([self.pos[i] for i in ids], axis=1)
        g = self.q_heads // c.kv_heads
        mask = np.ones((n_new, n), bool)
        mask[:, n - n_new:] = np.tril(np.ones((n_new, n_new), bool))
        out = []
        for layer in range(c.num_layers):
            k = rope64(np.stack([self.raw_k[i][layer] for i in ids], axis=1), pos, self.sections)
            v = np.stack([self.raw_v[i][layer] for i in ids], axis=1)
            q = rope64(rq[layer], positions, self.sections)
            o = np.zeros_like(q)
            for h in range(self.q_heads):
                s = np.where(mask, q[h] @ k[h // g].T * scale, -np.inf)
                p = np.exp(s - s.max(axis=1, keepdims=True))
                p /= p.sum(axis=1, keepdims=True)
                o[h] = p @ v[h // g]
                for tid, w in zip(ids, p.sum(axis=0)):
                    self.scores[tid] = self.scores.get(tid, 0.0) + w
            out.append(o[None])
        return out

    def unit_positions(self, n: int, image: int = 0) -> np.ndarray:
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

    def add_unit(self, kind: UnitKind, runs, cls=AllocClass.RECENT_CONTEXT, chunk: int | None = None,
                 check_oracle=True) -> Unit:
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
        uid = self.history.next_uid()
        pos = self.unit_positions(n)
        for j in range(n):
            self.step(uid, pos[:, j:j + 1], AllocClass.RECENT_CONTEXT, check_oracle)
        unit = Unit(uid=uid, kind=UnitKind.REPLY, spans=(Span(SpanKind.RESPONSE, 0, n),), positions=pos)
        self.history.append(unit)
        return unit

    def maintain(self, policy):
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


def media_runs(rng: np.random.Generator, image=(6, 40), audio=(3, 12)):
    return [(SpanKind.BOUNDARY, 1), (SpanKind.IMAGE, int(rng.integers(*image))),
            (SpanKind.AUDIO, int(rng.integers(*audio))), (SpanKind.BOUNDARY, 1)]


def run_session(stream: Stream, policy, units: int, rng_seed: int = 0, system: int = 5, reply_every: int = 4,
                chunk: int | None = None, check_oracle=True) -> Stream:
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


def make_cache(layers=2, kv_heads=2, head_dim=64, dtype=torch.float32, **kw) -> OmniTorchCache:
    return OmniTorchCache(layers, kv_heads, head_dim, RopeSpec(head_dim, BASE), dtype, DEVICE, **kw)


def max_err(s: Stream) -> float:
    assert len(s.outputs) == len(s.oracle) > 0
    return max(float(np.abs(o - r).max()) for out, ref in zip(s.outputs, s.oracle) for o, r in zip(out, ref))
