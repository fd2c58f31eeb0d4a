"""What every language model shares: attention through whatever cache it was handed, 1-D RoPE at arbitrary
positions, and one forward step of an OmniCache.

A model's attention calls ``cached_attention`` (docs/design.md): an ``OmniLayerCache`` attends over its page table
(tile skipping, holes masked), an mlx-lm ``KVCache`` / ``RotatingKVCache`` appends and returns the whole K/V for
``mx.fast.scaled_dot_product_attention``, an mlx-lm ``QuantizedKVCache`` returns packed K/V for mlx-lm's own
quantised attention (``quantized_matmul``, as mlx-lm's models call it), and None attends over the chunk alone.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import mlx.core as mx
import numpy as np

from ..cache import OmniCache, OmniLayerCache


def cached_attention(q: mx.array, k: mx.array, v: mx.array, cache, scale: float, mask=None) -> mx.array:
    """``q`` [B, Hq, T, D], ``k`` / ``v`` [B, Hkv, T, D] of this step (RoPE applied) -> [B, Hq, T, D]."""
    if isinstance(cache, OmniLayerCache):
        return cache.attend(q, k, v, scale)
    if cache is not None:
        k, v = cache.update_and_fetch(k, v)
    if mask is None and q.shape[2] > 1:
        mask = "causal"
    if cache is not None and hasattr(cache, "bits"):  # mlx-lm's QuantizedKVCache: (packed, scales, biases) K/V
        from mlx_lm.models.base import quantized_scaled_dot_product_attention

        return quantized_scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, group_size=cache.group_size,
                                                      bits=cache.bits)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


@contextmanager
def forward_step(cache, tokens: int, num_layers: int) -> Iterator[list]:
    """The per-layer caches of one forward over ``tokens`` new tokens.

    With an OmniCache this opens the step (slots for the new tokens, the step's tile list) and closes it after the
    last layer; a forward that raises gives the step's slots back, so the cache is as it was before.
    """
    if isinstance(cache, OmniCache):
        cache.begin_step(tokens)
        try:
            yield cache.layers
        except BaseException:
            if cache.in_step:
                cache.abort_step()
            raise
        cache.end_step()
    else:
        yield cache if cache is not None else [None] * num_layers


def sequential_positions(positions, length: int, cache) -> int | mx.array:
    """The 1-D RoPE positions of ``length`` new tokens: an int start when they are contiguous (the fast path of
    ``mx.fast.rope``), else an int32 array of them.

    ``positions`` may be None (continue after an mlx-lm cache), an int start, or a [T] / [1, T] array.
    """
    if positions is None:
        if cache is None:
            return 0
        if isinstance(cache, OmniCache):
            raise ValueError("pass positions explicitly with an OmniCache (the cache stores no logical positions)")
        return int(cache[0].offset)
    if isinstance(positions, (int, np.integer)):
        return int(positions)
    p = np.asarray(positions, dtype=np.int64).reshape(-1)
    if p.shape[0] != length:
        raise ValueError(f"{p.shape[0]} positions for {length} tokens")
    if length and np.array_equal(p, p[0] + np.arange(length)):
        return int(p[0])
    return mx.array(p.astype(np.int32))


def rope_at(x: mx.array, positions: int | mx.array, dims: int, base: float, traditional: bool = False) -> mx.array:
    """RoPE on ``x`` [B, H, T, D] at a start offset (contiguous tokens) or one position per token ([T] int array).

    Per-token positions lay the tokens out as the batch axis, so ``mx.fast.rope`` takes one offset per token.
    """
    if isinstance(positions, int):
        return mx.fast.rope(x, dims, traditional=traditional, base=base, scale=1.0, offset=positions)
    b, h, t, d = x.shape
    y = x.transpose(2, 0, 1, 3).reshape(t, b * h, 1, d)
    y = mx.fast.rope(y, dims, traditional=traditional, base=base, scale=1.0, offset=positions.astype(mx.int32))
    return y.reshape(t, b, h, d).transpose(1, 2, 0, 3)
