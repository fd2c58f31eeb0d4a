"""The synthetic omni stream (tests/stream_oracle.py) driving an OmniTorchCache exactly as a transformers attention
layer does: ``cache.update(k, v, layer)`` then (attention="omnitide") the registered attention function, or
(attention="transformers") SDPA over the returned K/V with the causal mask transformers builds from
``get_mask_sizes``; checked against the float64 oracle."""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from stream_oracle import BASE, OracleStream

from omnitide_mlx.rope import RopeSpec
from omnitide_mlx.torch.cache import OmniTorchCache, omnitide_attention

DEVICE = torch.device(os.environ.get("OMNITIDE_TORCH_DEVICE", "cpu"))


@dataclass
class Stream(OracleStream):
    """Drives one OmniTorchCache through units, decode steps and evictions; remembers what the oracle needs."""

    cache: OmniTorchCache

    def forward(self, ids, positions, rq, scale):
        c = self.cache
        t = len(ids)
        kept_before = c.retained
        outs = []
        for layer in range(c.num_layers):
            q, k, v = self.layer_inputs(layer, ids, positions, rq)
            q = torch.as_tensor(q[None], dtype=torch.float32, device=DEVICE)
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
        return outs


def make_cache(layers=2, kv_heads=2, head_dim=64, dtype=torch.float32, **kw) -> OmniTorchCache:
    return OmniTorchCache(layers, kv_heads, head_dim, RopeSpec(head_dim, BASE), dtype, DEVICE, **kw)
