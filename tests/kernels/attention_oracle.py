"""A float64 numpy statement of the tile_skip_attention contract, and random paged layouts to test it on."""

from __future__ import annotations

import numpy as np


def oracle_attention(q, k, v, slot_seq, q_seq, tiles, tile, scale):
    """Attention over the slots of the listed tiles, key j visible to query i iff 0 <= seq[j] <= q_seq[i]; float64.

    Returns (output [1, Hq, T, D], per-slot attention summed over heads and queries [capacity]).
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    seq = np.asarray(slot_seq, dtype=np.int64)
    qs = np.asarray(q_seq, dtype=np.int64)
    _, hq, t, d = q.shape
    g = hq // k.shape[1]
    active = np.zeros(seq.shape[0], bool)
    for ti in np.asarray(tiles, dtype=np.int64).reshape(-1):
        active[ti * tile:(ti + 1) * tile] = True
    out = np.zeros_like(q)
    scores = np.zeros(seq.shape[0])
    for i in range(t):
        vis = active & (seq >= 0) & (seq <= qs[i])
        if not vis.any():
            continue
        for h in range(hq):
            s = k[0, h // g][vis] @ q[0, h, i] * scale
            p = np.exp(s - s.max())
            p /= p.sum()
            out[0, h, i] = p @ v[0, h // g][vis]
            scores[vis] += p
    return out, scores


def random_layout(rng, capacity, tile, fill, t, holes_only_in=None):
    """A paged layout: ``fill`` of the slots hold history in a random order of serials, then ``t`` new tokens in
    free slots with the next serials (the chunk being attended). Returns (slot_seq, q_seq, active tiles)."""
    seq = np.full(capacity, -1, np.int64)
    n_hist = int(fill * (capacity - t))
    slots = rng.permutation(capacity)
    seq[slots[:n_hist]] = np.arange(n_hist)
    new = slots[n_hist:n_hist + t]
    seq[new] = n_hist + np.arange(t)
    tiles = np.nonzero((seq.reshape(-1, tile) >= 0).any(axis=1))[0]
    return seq, n_hist + np.arange(t), tiles


def rand(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)
