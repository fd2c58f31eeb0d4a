"""The synthetic omni stream (tests/stream_oracle.py) driving an OmniCache the way a model and a session do: per
layer ``cache[i].attend`` inside ``begin_step`` / ``end_step``, checked against the float64 oracle."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from stream_oracle import BASE, OracleStream

from omnitide_mlx.cache import OmniCache
from omnitide_mlx.rope import RopeSpec


@dataclass
class Stream(OracleStream):
    """Drives one OmniCache through units, decode steps and evictions; remembers what the oracle needs."""

    cache: OmniCache

    def forward(self, ids, positions, rq, scale):
        c = self.cache
        c.begin_step(len(ids))
        outs = []
        for layer in range(c.num_layers):
            q, k, v = self.layer_inputs(layer, ids, positions, rq)
            outs.append(c[layer].attend(mx.array(q[None].astype(np.float32)).astype(c.dtype),
                                        mx.array(k[None].astype(np.float32)).astype(c.dtype),
                                        mx.array(v[None].astype(np.float32)).astype(c.dtype), scale))
        c.end_step()
        mx.eval(outs)
        return [np.array(o.astype(mx.float32)) for o in outs]


def make_cache(layers=2, kv_heads=2, head_dim=64, dtype=mx.float32, **kw) -> OmniCache:
    return OmniCache(layers, kv_heads, head_dim, RopeSpec(head_dim, BASE), dtype, **kw)
