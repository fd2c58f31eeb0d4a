"""The evicted-unit store of an MLX session: the tensors half of recall (core/recall.py holds the bookkeeping).

When retention drops a unit whole, :meth:`RecallStore.capture` reads its rows out of the OmniCache (every layer,
keys as rotated at the unit's positions then, a deferred shift applied), quantises K and V with the KV-quant code
(kernels/quantized.py: ``bits`` 8 or 4, groups along the head dimension; float in the cache's dtype when
``bits`` is None or the head dimension has no group size) and keeps a Quest-style summary for scoring: per layer
and KV head, the mean, minimum and maximum key, rotated as if the unit started at position 0. At a question,
:meth:`score` bounds each stored unit's attention logits from the question's queries at a few layers (Quest's upper
bound ``sum_d max(q_d * min_d, q_d * max_d)``, queries rotated as if the question started at 0, so the bound
compares content, not distance), and :meth:`rows` gives a chosen unit's K/V back in float32 with its keys rotated
to the unit's new positions. Saved with the session as one safetensors file.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from .cache_storage import rotate_rows
from .core.recall import RecallError, RecallIndex, StoredUnit
from .kernels.quantized import dequantize_rows, quantize_rows

RECALL_FILE = "recall.safetensors"
PARTS = ("", ".scales", ".biases")
SCORE_CHUNK = 128  # units scored at a time (bounds the [units, heads, queries, D] product)


def default_layers(num_layers: int) -> tuple[int, ...]:
    """The layers whose queries score stored units: a quarter, half, three quarters of the depth, and the last."""
    return tuple(sorted({max(0, num_layers * i // 4 - (i == 4)) for i in (1, 2, 3, 4)}))


def group_for(head_dim: int) -> int | None:
    """mlx-lm's default group size (64) when it divides the head dimension, else 32 or 128; None when none does."""
    for g in (64, 32, 128):
        if head_dim % g == 0:
            return g
    return None


class RecallStore:
    """Stored evicted units of one session's cache: ``index`` (a :class:`RecallIndex`: order, bytes, budget) and
    their arrays (quantised K / V ``[L, Hkv, n, ...]``, summary ``[L, Hkv, 3, D]`` float32)."""

    def __init__(self, cache, budget: int, bits: int | None = 8, layers: tuple[int, ...] | None = None):
        if bits not in (None, 4, 8):
            raise ValueError(f"recall_bits must be 8, 4 or None (the cache's dtype), got {bits!r}")
        self.index = RecallIndex(budget)
        self.group_size = group_for(cache.head_dim) if bits else None
        self.bits = bits if self.group_size else None
        self.dtype = cache.dtype
        self.rope = cache.rope
        self.layers = tuple(layers) if layers is not None else default_layers(cache.num_layers)
        if any(not 0 <= i < cache.num_layers for i in self.layers):
            raise ValueError(f"recall layers {self.layers} outside the model's {cache.num_layers}")
        self.arrays: dict[int, dict[str, mx.array]] = {}

    # --- storing ------------------------------------------------------------------------------------------------
    def capture(self, cache, unit, slots: np.ndarray) -> list[int]:
        """Store ``unit`` (its tokens at ``slots``, token order) before the cache frees them; returns the uids
        forgotten to stay under the budget."""
        keys, values = cache.storage.read_rows(slots)
        rel = rotate_rows(self.rope, keys, np.full(slots.size, -int(unit.positions.min())))
        summary = mx.stack([rel.mean(axis=2), rel.min(axis=2), rel.max(axis=2)], axis=2)
        arrays = {"summary": summary}
        for name, x in (("keys", keys), ("values", values)):
            if self.bits:
                for suffix, part in zip(PARTS, quantize_rows(x, self.group_size, self.bits, self.dtype)):
                    arrays[name + suffix] = part
            else:
                arrays[name] = x.astype(self.dtype)
        mx.eval(arrays)
        entry = StoredUnit(unit, np.asarray(cache.table.seq[slots], dtype=np.int64),
                           sum(a.nbytes for a in arrays.values()))
        gone = self.index.add(entry)
        if entry.uid not in gone:
            self.arrays[entry.uid] = arrays
        for uid in gone:
            self.arrays.pop(uid, None)
        return gone

    # --- recalling ----------------------------------------------------------------------------------------------
    def score(self, queries: dict[int, mx.array], q_start: int, entries: list[StoredUnit]) -> np.ndarray:
        """One score per entry: Quest's bound of its keys' logits, averaged over the scoring layers, query heads
        and question tokens. ``queries``: layer -> ``[1, Hq, T, D]`` as RoPE left them (from ``q_start``)."""
        if not entries:
            return np.zeros(0)
        total = mx.zeros((len(entries),), dtype=mx.float32)
        for layer in self.layers:
            q = queries[layer][0].astype(mx.float32)  # [Hq, T, D]
            hq, t, d = q.shape
            q = self.rope.rotate_tokens(q.transpose(1, 0, 2), np.full(t, -int(q_start))).transpose(1, 0, 2)
            summ = mx.stack([self.arrays[e.uid]["summary"][layer] for e in entries])  # [U, Hkv, 3, D]
            hkv = summ.shape[1]
            qg = q.reshape(hkv, (hq // hkv) * t, d)[None]  # [1, Hkv, G*T, D]
            parts = []
            for a in range(0, len(entries), SCORE_CHUNK):
                lo, hi = summ[a:a + SCORE_CHUNK, :, 1:2, :], summ[a:a + SCORE_CHUNK, :, 2:3, :]
                bound = mx.maximum(qg * lo, qg * hi).sum(axis=-1)  # [u, Hkv, G*T]
                parts.append(bound.mean(axis=(1, 2)))
            total = total + mx.concatenate(parts) / (d ** 0.5)
        return np.array(total / len(self.layers))

    def rows(self, entry: StoredUnit, delta: int) -> tuple[mx.array, mx.array]:
        """The entry's K and V, float32 ``[L, Hkv, n, D]``, keys rotated forward by ``delta`` positions."""
        a = self.arrays[entry.uid]
        if self.bits:
            keys = dequantize_rows([a["keys" + s] for s in PARTS], self.group_size, self.bits)
            values = dequantize_rows([a["values" + s] for s in PARTS], self.group_size, self.bits)
        else:
            keys, values = a["keys"].astype(mx.float32), a["values"].astype(mx.float32)
        if delta:
            keys = rotate_rows(self.rope, keys, np.full(entry.tokens, int(delta)))
        return keys, values

    # --- introspection and persistence --------------------------------------------------------------------------
    def stats(self) -> dict:
        return {"budget": self.index.budget, "bytes": self.index.total_bytes, "units": len(self.index),
                "tokens": self.index.tokens, "forgotten": self.index.dropped, "bits": self.bits,
                "group_size": self.group_size, "layers": list(self.layers)}

    def config(self) -> dict:
        return {"budget": self.index.budget, "bits": self.bits, "layers": list(self.layers)}

    def save(self, path: Path) -> dict:
        """Write the arrays to ``path`` (safetensors); returns the JSON side (config and index)."""
        flat = {f"units.{uid}.{name}": arr for uid, a in self.arrays.items() for name, arr in a.items()}
        mx.save_safetensors(str(path), flat, {"omnitide_recall": json.dumps({"units": len(self.arrays)})})
        return {**self.config(), "group_size": self.group_size, "index": self.index.state()}

    @classmethod
    def load(cls, cache, path: Path, meta: dict) -> "RecallStore":
        """A store saved by :meth:`save` (``meta`` its JSON side) for ``cache``; RecallError when the two disagree."""
        try:
            store = cls(cache, int(meta["budget"]), meta["bits"], tuple(meta["layers"]))
            store.index = RecallIndex.from_state(meta["index"])
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, RecallError):
                raise
            raise RecallError(f"bad recall state: {type(e).__name__}: {e}") from e
        if store.bits != meta["bits"] or store.group_size != meta.get("group_size"):
            raise RecallError("the saved recall store was quantised for another head dimension")
        flat = dict(mx.load(str(path))) if store.index.budget and len(store.index) else {}
        names = ("summary", *(["keys" + s for s in PARTS] + ["values" + s for s in PARTS] if store.bits
                              else ["keys", "values"]))
        for e in store.index:
            try:
                store.arrays[e.uid] = {n: flat[f"units.{e.uid}.{n}"] for n in names}
            except KeyError as err:
                raise RecallError(f"{path} lacks the arrays of stored unit {e.uid} ({err})") from None
            got = store.arrays[e.uid]["keys"].shape
            if got[0] != cache.num_layers or got[1] != cache.kv_heads or got[2] != e.tokens:
                raise RecallError(f"stored unit {e.uid}'s keys are {tuple(got)}: another model's, or corrupted")
        return store
