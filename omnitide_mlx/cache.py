"""OmniCache: the KV cache of a streaming session, in tile-aligned pages (OmniPage) with unit-aware eviction.

Every layer keeps one K and one V buffer ``[1, kv_heads, capacity, head_dim]``; row ``i`` of every buffer is slot
``i`` of one shared :class:`~omnitide_mlx.core.page.PageTable`, which decides where each new token goes, which
pages are active, and how entries move. Models call the cache like an mlx-lm cache, except that attention goes
through it so the kernel sees the page table (docs/design.md)::

    cache.set_owner(uid, AllocClass.RECENT_CONTEXT)   # who the next tokens belong to
    cache.begin_step(T)                                # T slots allocated, the step's active tiles computed
    out = cache[i].attend(q, k, v, scale)              # per layer: write k, v, then tile-skip attention
    cache.end_step()

After the model, the session trims: ``cache.evict(plan, history)`` frees the deleted tokens' slots and re-rotates
every kept key once by its shift, in float32 (never un-rotate then re-rotate in half precision), rounding back to a
half-precision cache stochastically: with round-to-nearest, a small shift's change of a low-frequency pair is below
half an ulp and is lost every time, so a key shifted often drifts linearly (measured: tests/cache/test_cache_drift.py);
unbiased rounding turns that into a random walk that grows like the square root of the number of shifts;
``cache.migrate(migration_plan)`` moves entries with a gather into scratch, an ``mx.eval``, and an in-place scatter.

Keys are stored rotated at the positions their tokens had when written, shifted by every eviction since. The cache
stores no positions: the History does. A cache's tokens in ``seq`` order are the history's tokens in logical order.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .core.page import AllocClass, LayoutError, LayoutStats, MigrationPlan, PageTable, check_move_order
from .kernels import DECODE_TILE, PREFILL_TILE, TilePlan, page_compact, plan_tiles, tile_skip_attention
from .rope import RopeSpec

CACHE_FORMAT = "omnitide-cache/1"
DECODE_MAX_TOKENS = 19  # steps of fewer than 20 tokens take the decode path (32-slot subblocks), as llama.cpp does
_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


class CacheError(ValueError):
    """Misuse of the cache: a step left open, shapes that do not match, a plan for another layout, ..."""


def stochastic_round(y: mx.array, dtype, key: mx.array) -> mx.array:
    """Round float32 ``y`` to ``dtype`` (float16 / bfloat16) up or down with probabilities that make the result
    unbiased: E[result] = y. Neighbours come from the bit pattern (sign-magnitude: +1 moves away from zero)."""
    if dtype == mx.float32:
        return y
    near = y.astype(dtype)
    base = near.astype(mx.float32)
    rest = y - base
    bits = near.view(mx.uint16).astype(mx.int32)
    away = (rest > 0) == (bits < 0x8000)  # the remainder points away from zero
    other = mx.where(away, bits + 1, bits - 1)
    other = mx.where((bits & 0x7FFF) == 0, mx.where(rest < 0, 0x8001, 0x0001), other)  # from +-0: smallest subnormal
    other = other.astype(mx.uint16).view(dtype)
    gap = mx.abs(other.astype(mx.float32) - base)
    p = mx.where(gap > 0, mx.abs(rest) / mx.maximum(gap, 1e-38), 0.0)
    return mx.where(mx.random.uniform(shape=y.shape, key=key) < p, other, near)


def _dtype_name(dtype) -> str:
    for name, d in _DTYPES.items():
        if d == dtype:
            return name
    raise CacheError(f"KV dtype must be float16, bfloat16 or float32, got {dtype}")


@dataclass
class _Step:
    """What every layer of one forward step shares: the new tokens' slots and the attention plan."""

    slots: np.ndarray
    write: slice | mx.array  # a slice when the slots are consecutive (cheaper update)
    plan: TilePlan
    tokens: int
    written: int = 0


class OmniLayerCache:
    """One layer's K/V buffers. ``attend`` writes this step's K/V into the step's slots, then runs tile-skipping
    attention over the active tiles."""

    def __init__(self, parent: "OmniCache", index: int):
        self._parent = parent
        self.index = index
        self.keys: mx.array | None = None
        self.values: mx.array | None = None

    def attend(self, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        """``q`` [1, Hq, T, D], ``k`` / ``v`` [1, Hkv, T, D] (RoPE already applied at the tokens' positions)."""
        p = self._parent
        step = p._step
        if step is None:
            raise CacheError("attend() outside a step: call cache.begin_step(T) first")
        want = (1, p.kv_heads, step.tokens, p.head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise CacheError(f"layer {self.index}: k / v must be {want}, got {tuple(k.shape)} / {tuple(v.shape)}")
        if q.ndim != 4 or q.shape[0] != 1 or q.shape[2] != step.tokens or q.shape[3] != p.head_dim:
            raise CacheError(f"layer {self.index}: q must be [1, Hq, {step.tokens}, {p.head_dim}], got "
                             f"{tuple(q.shape)}")
        self.keys[:, :, step.write, :] = k.astype(p.dtype)
        self.values[:, :, step.write, :] = v.astype(p.dtype)
        step.written += 1
        if p.collect_scores:
            out, scores = tile_skip_attention(q, self.keys, self.values, scale=scale, plan=step.plan,
                                              return_scores=True)
            p._step_scores = scores if p._step_scores is None else p._step_scores + scores
            return out
        return tile_skip_attention(q, self.keys, self.values, scale=scale, plan=step.plan)

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        return self.keys, self.values

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def _grow(self, capacity: int) -> None:
        p = self._parent
        if self.keys is None:
            shape = (1, p.kv_heads, capacity, p.head_dim)
            self.keys, self.values = mx.zeros(shape, p.dtype), mx.zeros(shape, p.dtype)
            return
        extra = capacity - self.keys.shape[2]
        if extra > 0:
            pad = mx.zeros((1, p.kv_heads, extra, p.head_dim), p.dtype)
            self.keys = mx.concatenate([self.keys, pad], axis=2)
            self.values = mx.concatenate([self.values, pad], axis=2)


class OmniCache:
    """Per-layer paged K/V buffers with one shared page table (see the module docstring for the protocol).

    ``placement``: ``"class_aware"`` (OmniPage: new tokens never share a page with another class) or
    ``"first_fit"`` (a plain cache: new tokens fill any hole). ``grow_pages``: buffers grow by at least this many
    pages at a time, so a growing cache copies its buffers rarely (mlx-lm grows by 256 slots). With
    ``collect_scores`` every attention also accumulates the attention each slot receives (for H2O). ``rounding``:
    how re-rotated keys return to a half-precision cache ("stochastic", seeded by ``seed`` and the eviction count,
    or "nearest" for comparison).
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, rope: RopeSpec | None = None,
                 dtype=mx.float16, *, page_size: int = PREFILL_TILE, subblock_size: int = DECODE_TILE,
                 placement: str = "class_aware", grow_pages: int = 4, collect_scores: bool = False,
                 rounding: str = "stochastic", seed: int = 0):
        for name, val in (("num_layers", num_layers), ("kv_heads", kv_heads), ("head_dim", head_dim),
                          ("grow_pages", grow_pages)):
            if not isinstance(val, (int, np.integer)) or val <= 0:
                raise CacheError(f"{name} must be a positive int, got {val!r}")
        _dtype_name(dtype)
        if rounding not in ("stochastic", "nearest"):
            raise CacheError(f"rounding must be 'stochastic' or 'nearest', got {rounding!r}")
        self.rounding = rounding
        self.seed = int(seed)
        self.evictions = 0  # evict() calls so far (also numbers the rounding streams: reproducible)
        self.num_layers, self.kv_heads, self.head_dim = int(num_layers), int(kv_heads), int(head_dim)
        self.rope = rope
        self.dtype = dtype
        self.grow_pages = int(grow_pages)
        self.collect_scores = bool(collect_scores)
        self.table = PageTable(page_size, subblock_size, placement=placement)
        self.layers = [OmniLayerCache(self, i) for i in range(self.num_layers)]
        self._capacity = 0  # slots backed by the buffers (>= table.capacity)
        self._owner: tuple[int, AllocClass] | None = None
        self._step: _Step | None = None
        self._scores = np.zeros(0, dtype=np.float32)  # accumulated attention per slot (collect_scores)
        self._step_scores: mx.array | None = None
        self.moved_rows = 0  # entries copied by migrations so far
        self.rotated_rows = 0  # kept keys re-rotated by evictions so far

    @classmethod
    def for_spec(cls, spec, dtype=mx.float16, **kw) -> "OmniCache":
        """A cache for a model's ``KVSpec`` (models/base.py)."""
        return cls(spec.num_layers, spec.kv_heads, spec.head_dim, spec.rope, dtype, **kw)

    # --- mlx-lm style access ----------------------------------------------------------------------------------
    def __getitem__(self, i: int) -> OmniLayerCache:
        return self.layers[i]

    def __len__(self) -> int:
        return self.num_layers

    def __iter__(self):
        return iter(self.layers)

    @property
    def page_table(self) -> PageTable:
        return self.table

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def retained(self) -> int:
        return self.table.retained

    # --- one forward step -------------------------------------------------------------------------------------
    def set_owner(self, uid: int, alloc_class: AllocClass | int = AllocClass.RECENT_CONTEXT) -> None:
        """The unit (and allocation class) the next written tokens belong to. Decode steps of a reply keep the
        reply's uid: their tokens append to that unit in order."""
        if self._step is not None:
            raise CacheError("set_owner() inside an open step")
        if not isinstance(uid, (int, np.integer)) or uid < 0:
            raise CacheError(f"owner uid must be a non-negative int, got {uid!r}")
        self._owner = (int(uid), AllocClass(alloc_class))

    @property
    def in_step(self) -> bool:
        """Whether a step is open (between begin_step and end_step / abort_step)."""
        return self._step is not None

    def begin_step(self, tokens: int) -> np.ndarray:
        """Allocate ``tokens`` slots for the owner and plan this step's attention; returns the slots."""
        if self._step is not None:
            raise CacheError("begin_step() while a step is open: call end_step() first")
        if self._owner is None:
            raise CacheError("begin_step() before set_owner(uid, alloc_class)")
        if not isinstance(tokens, (int, np.integer)) or tokens <= 0:
            raise CacheError(f"a step writes a positive number of tokens, got {tokens!r}")
        uid, cls = self._owner
        slots = self.table.allocate(int(tokens), uid, cls)
        self._ensure_capacity(self.table.capacity)
        decode = tokens <= DECODE_MAX_TOKENS
        tiles = self.table.active_subblocks() if decode else self.table.active_pages()
        tile = self.table.subblock_size if decode else self.table.page_size
        plan = plan_tiles(self._slot_seq(), self.table.seq[slots], tiles, tile)
        contiguous = bool(np.all(np.diff(slots) == 1))
        write = slice(int(slots[0]), int(slots[-1]) + 1) if contiguous else mx.array(slots.astype(np.int32))
        self._step = _Step(slots=slots, write=write, plan=plan, tokens=int(tokens))
        self._step_scores = None
        return slots

    def end_step(self) -> None:
        """Close the step. Every layer must have attended once; otherwise the step is aborted and this raises."""
        step = self._step
        if step is None:
            raise CacheError("end_step() without begin_step()")
        if step.written != self.num_layers:
            self.abort_step()
            raise CacheError(f"{step.written} of {self.num_layers} layers attended in this step: the step's slots "
                             "were given back")
        self._step = None
        if self.collect_scores and self._step_scores is not None:
            self._scores[: self._capacity] += np.array(self._step_scores, dtype=np.float32)
            self._step_scores = None

    def abort_step(self) -> None:
        """Give back the open step's slots (a forward that failed half way); the cache is as before the step."""
        step = self._step
        if step is None:
            raise CacheError("abort_step() without begin_step()")
        self._step = None
        self._step_scores = None
        self.table.free(step.slots)

    def _slot_seq(self) -> np.ndarray:
        seq = self.table.seq
        if seq.shape[0] == self._capacity:
            return seq
        out = np.full(self._capacity, -1, dtype=np.int64)
        out[: seq.shape[0]] = seq
        return out

    def _ensure_capacity(self, needed: int) -> None:
        if needed <= self._capacity:
            return
        page = self.table.page_size
        new = max(needed, self._capacity + self.grow_pages * page)
        new = -(-new // page) * page
        for layer in self.layers:
            layer._grow(new)
        self._scores = np.concatenate([self._scores, np.zeros(new - self._capacity, dtype=np.float32)])
        self._capacity = new

    # --- eviction -----------------------------------------------------------------------------------------------
    def logical_slots(self) -> np.ndarray:
        """The occupied slots in logical (seq) order: slot of the history's k-th token."""
        seq = self.table.seq
        occ = np.flatnonzero(seq >= 0)
        return occ[np.argsort(seq[occ], kind="stable")]

    def slots_of_unit(self, uid: int) -> np.ndarray:
        return self.table.slots_of_unit(uid)

    def evict(self, plan, history=None) -> np.ndarray:
        """Apply a :class:`~omnitide_mlx.core.pick.RetentionPlan`: free the deleted tokens' slots and re-rotate each
        kept key by ``-shift`` once, in float32, with the model's RopeSpec. ``history`` is the history the plan was
        made for (before ``apply_plan``); when given, the cache is checked against it. Returns the freed slots."""
        if self._step is not None:
            raise CacheError("evict() inside an open step")
        if history is not None:
            plan.validate(history)
            self.table.check_history(history)
        order = self.logical_slots()
        if order.size != plan.tokens_before:
            raise CacheError(f"the cache holds {order.size} tokens, the plan was made for {plan.tokens_before}")
        shifts = plan.kept_token_shifts()
        kept = order[plan.keep_mask()]
        moving = shifts != 0
        if moving.any():
            if self.rope is None:
                raise CacheError("this plan shifts positions, but the cache has no RopeSpec to re-rotate keys")
            self._rerotate(kept[moving], shifts[moving])
        freed = self.table.apply_retention(plan)
        self.evictions += 1
        if self.collect_scores and freed.size:
            self._scores[freed] = 0.0
        return freed

    def _rerotate(self, slots: np.ndarray, shifts: np.ndarray) -> None:
        """Rotate the keys at ``slots`` by ``-shifts`` (one rotation per key, float32, one rounding back)."""
        idx = mx.array(slots.astype(np.int32))
        offsets = mx.array((-shifts).astype(np.int32))
        for layer in self.layers:
            rows = layer.keys[:, :, idx, :][0].transpose(1, 0, 2)  # [n, Hkv, D]
            rot = self.rope.rotate_tokens(rows, offsets)
            if self.rounding == "stochastic":
                key = mx.random.key((self.seed * 1_000_003 + self.evictions) * 4096 + layer.index)
                rot = stochastic_round(rot, self.dtype, key)
            rot = rot.astype(self.dtype).transpose(1, 0, 2)[None]
            mx.eval(rot)  # evaluated before the scatter: the buffer is then updated in place, not copied
            layer.keys[:, :, idx, :] = rot
            mx.eval(layer.keys)
        self.rotated_rows += int(slots.size)

    # --- migration ----------------------------------------------------------------------------------------------
    def migrate(self, plan: MigrationPlan) -> int:
        """Execute an accepted OmniPage migration plan on every layer: gather the moved rows into scratch, evaluate
        them, scatter them into the cache's own buffers in place; then move the metadata. Returns rows moved."""
        if self._step is not None:
            raise CacheError("migrate() inside an open step")
        if not plan.accepted:
            raise CacheError(f"migration plan ({plan.mode}) was not accepted: {plan.reason}")
        if plan.before != self.table.stats():
            raise CacheError("migration plan was made for a different layout (plan it on this cache's table, now)")
        check_move_order(plan.src, plan.dst, self.table.occupancy())
        if plan.src.size:
            dst = mx.array(plan.dst.astype(np.int32))
            for layer in self.layers:
                k_rows, v_rows = page_compact(layer.keys, layer.values, plan.src)
                mx.eval(k_rows, v_rows)
                layer.keys[:, :, dst, :] = k_rows
                layer.values[:, :, dst, :] = v_rows
                del k_rows, v_rows
                mx.eval(layer.keys, layer.values)
            if self.collect_scores:
                moved = self._scores[plan.src].copy()
                self._scores[plan.src] = 0.0
                self._scores[plan.dst] = moved
        self.table.apply_migration(plan)
        self.moved_rows += int(plan.src.size)
        return int(plan.src.size)

    def migration_bytes(self, plan: MigrationPlan) -> int:
        """K and V bytes a plan copies across all layers."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim * self.dtype.size * int(plan.src.size)

    # --- H2O ----------------------------------------------------------------------------------------------------
    def token_scores(self, history=None) -> np.ndarray:
        """Accumulated attention per token of the history, in logical order (needs ``collect_scores``)."""
        if not self.collect_scores:
            raise CacheError("token_scores() needs OmniCache(..., collect_scores=True)")
        if history is not None:
            self.table.check_history(history)
        return self._scores[self.logical_slots()].copy()

    # --- introspection ------------------------------------------------------------------------------------------
    def layout_stats(self) -> LayoutStats:
        return self.table.stats()

    @property
    def nbytes(self) -> int:
        """Bytes of the K/V buffers (allocated capacity, all layers)."""
        return sum(layer.nbytes for layer in self.layers)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.kv_heads * self.head_dim * self.dtype.size

    def stats(self) -> dict:
        """Layout (retained cells, physical span, active pages / subblocks, holes, capacity) and KV bytes."""
        s = self.table.stats().to_json()
        s.update(buffer_capacity=self._capacity, kv_bytes=self.nbytes,
                 kv_bytes_retained=s["retained_cells"] * self.bytes_per_token,
                 kv_bytes_span=s["physical_span"] * self.bytes_per_token,
                 moved_rows=self.moved_rows, rotated_rows=self.rotated_rows)
        return s

    # --- persistence (safetensors + JSON, like mlx-lm prompt caches) --------------------------------------------
    @property
    def state(self) -> dict[str, mx.array]:
        """Every array needed to restore the cache exactly."""
        if self._step is not None:
            raise CacheError("state of a cache with an open step")
        arrays: dict[str, mx.array] = {}
        for layer in self.layers:
            if layer.keys is not None:
                arrays[f"layers.{layer.index}.keys"] = layer.keys
                arrays[f"layers.{layer.index}.values"] = layer.values
        t = self.table.state()
        for name in ("slots", "seq", "unit", "cls"):
            arrays[f"table.{name}"] = mx.array(np.asarray(t[name], dtype=np.int64).astype(np.int32))
        if self.collect_scores:
            arrays["scores"] = mx.array(self._scores)
        return arrays

    @property
    def meta_state(self) -> dict:
        """The JSON side: configuration, page-table scalars, owner, counters."""
        t = self.table.state()
        return {
            "format": CACHE_FORMAT,
            "num_layers": self.num_layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
            "dtype": _dtype_name(self.dtype),
            "rope": self.rope.to_json() if self.rope is not None else None,
            "grow_pages": self.grow_pages, "collect_scores": self.collect_scores,
            "rounding": self.rounding, "seed": self.seed, "evictions": self.evictions,
            "capacity": self._capacity,
            "owner": list(self._owner) if self._owner is not None else None,
            "moved_rows": self.moved_rows, "rotated_rows": self.rotated_rows,
            "table": {k: t[k] for k in ("page_size", "subblock_size", "placement", "capacity", "next_seq",
                                        "partial")},
        }

    @classmethod
    def from_state(cls, arrays: dict[str, mx.array], meta: dict) -> "OmniCache":
        if meta.get("format") != CACHE_FORMAT:
            raise CacheError(f"not an OmniCache state (format {meta.get('format')!r}, want {CACHE_FORMAT!r})")
        try:
            tm = meta["table"]
            cache = cls(meta["num_layers"], meta["kv_heads"], meta["head_dim"],
                        RopeSpec.from_json(meta["rope"]) if meta["rope"] else None, _DTYPES[meta["dtype"]],
                        page_size=tm["page_size"], subblock_size=tm["subblock_size"], placement=tm["placement"],
                        grow_pages=meta["grow_pages"], collect_scores=meta["collect_scores"],
                        rounding=meta["rounding"], seed=meta["seed"])
            cache.evictions = int(meta["evictions"])
            table_state = dict(tm)
            for name in ("slots", "seq", "unit", "cls"):
                table_state[name] = np.array(arrays[f"table.{name}"]).astype(np.int64).tolist()
            cache.table = PageTable.from_state(table_state)
            cap = int(meta["capacity"])
            for layer in cache.layers:
                if cap:
                    layer.keys = arrays[f"layers.{layer.index}.keys"]
                    layer.values = arrays[f"layers.{layer.index}.values"]
                    want = (1, cache.kv_heads, cap, cache.head_dim)
                    if tuple(layer.keys.shape) != want or tuple(layer.values.shape) != want:
                        raise CacheError(f"layer {layer.index}: saved buffers are {tuple(layer.keys.shape)}, "
                                         f"expected {want}")
                    if layer.keys.dtype != cache.dtype or layer.values.dtype != cache.dtype:
                        raise CacheError(f"layer {layer.index}: saved buffers are {layer.keys.dtype}, expected "
                                         f"{cache.dtype}")
            cache._capacity = cap
            if cap < cache.table.capacity:
                raise CacheError(f"buffers hold {cap} slots, the page table {cache.table.capacity}")
            cache._scores = (np.array(arrays["scores"], dtype=np.float32) if cache.collect_scores
                             else np.zeros(cap, dtype=np.float32))
            cache._owner = (int(meta["owner"][0]), AllocClass(meta["owner"][1])) if meta["owner"] else None
            cache.moved_rows, cache.rotated_rows = int(meta["moved_rows"]), int(meta["rotated_rows"])
        except KeyError as e:
            raise CacheError(f"incomplete OmniCache state: missing {e}") from e
        except LayoutError as e:
            raise CacheError(f"bad page table in the saved state: {e}") from e
        return cache

    def save(self, path: str | os.PathLike, metadata: dict | None = None) -> None:
        """Write the cache to one safetensors file: arrays as tensors, configuration as JSON metadata."""
        mx.save_safetensors(str(path), self.state, {"omnitide_cache": json.dumps(self.meta_state),
                                                    "user": json.dumps(metadata or {})})

    @classmethod
    def load(cls, path: str | os.PathLike, return_metadata: bool = False):
        """Restore a cache written by :meth:`save` (and the user metadata when asked)."""
        arrays, meta = mx.load(str(path), return_metadata=True)
        if "omnitide_cache" not in meta:
            raise CacheError(f"{path} holds no OmniCache (no 'omnitide_cache' metadata)")
        cache = cls.from_state(arrays, json.loads(meta["omnitide_cache"]))
        if return_metadata:
            return cache, json.loads(meta.get("user", "{}"))
        return cache
