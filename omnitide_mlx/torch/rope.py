"""Re-rotating stored keys in PyTorch, with the model's :class:`~omnitide_mlx.rope.RopeSpec`.

After an eviction a kept key must look as if it had been written ``shift`` positions earlier. Rotations compose, so
that is one rotation by ``-shift`` with the key's own frequencies; for M-RoPE it is exact because the shift rule
moves t, h and w together (omnitide_mlx/rope.py explains why). Keys are rotated once, in float32, and rounded back
to the cache dtype once: never un-rotated and re-rotated in half precision. Rounding to float16 / bfloat16 is
stochastic by default (unbiased), as in the MLX cache: with round-to-nearest a small shift turns the low-frequency
pairs by less than half an ulp and the rounding undoes it every time.
"""

from __future__ import annotations

import torch

from ..rope import RopeSpec


def rotate_tokens(x: torch.Tensor, offsets: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Rotate ``x`` ``[N, H, D]`` (token-major) by integer ``offsets`` ``[N]``; float32 in, float32 out.

    NeoX style (``traditional=False``) rotates the halves of the first ``dims`` channels, traditional style the
    interleaved pairs; channels past ``dims`` are left alone. Angles are computed in float64 so a large offset
    loses no precision before the single float32 rotation.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"rotate_tokens works in float32, got {x.dtype}")
    if x.ndim != 3 or offsets.shape != (x.shape[0],):
        raise ValueError(f"x must be [N, H, D] and offsets [N]; got {tuple(x.shape)} and {tuple(offsets.shape)}")
    dims = spec.dims
    if dims % 2 or dims > x.shape[-1]:
        raise ValueError(f"RoPE dims {dims} must be even and at most the head dim {x.shape[-1]}")
    half = dims // 2
    inv_freq = spec.base ** (-torch.arange(0, dims, 2, dtype=torch.float64, device=x.device) / dims)
    angles = (offsets.to(torch.float64)[:, None] * spec.scale) * inv_freq[None]  # [N, half]
    cos = angles.cos().to(torch.float32)[:, None, :]
    sin = angles.sin().to(torch.float32)[:, None, :]
    if spec.traditional:
        a, b = x[..., 0:dims:2], x[..., 1:dims:2]
        rot = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    else:
        a, b = x[..., :half], x[..., half:dims]
        rot = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
    return torch.cat([rot, x[..., dims:]], dim=-1) if dims < x.shape[-1] else rot


def stochastic_round(y: torch.Tensor, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Round float32 ``y`` to ``dtype`` (float16 / bfloat16) up or down with the probabilities that make the result
    unbiased: E[result] = y. The other neighbour comes from the bit pattern (sign-magnitude: +1 moves away from
    zero)."""
    if dtype == torch.float32:
        return y
    if dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"stochastic rounding targets float16 or bfloat16, not {dtype}")
    near = y.to(dtype)
    base = near.to(torch.float32)
    rest = y - base
    bits = near.view(torch.int16).to(torch.int32) & 0xFFFF
    away = (rest > 0) == (bits < 0x8000)  # the remainder points away from zero
    other = torch.where(away, bits + 1, bits - 1)
    other = torch.where((bits & 0x7FFF) == 0, torch.where(rest < 0, 0x8001, 0x0001), other)  # from +-0: subnormal
    other = torch.where(other >= 0x8000, other - 0x10000, other).to(torch.int16).view(dtype)
    gap = (other.to(torch.float32) - base).abs()
    p = torch.where(gap > 0, rest.abs() / gap.clamp_min(1e-38), torch.zeros_like(gap))
    u = torch.rand(y.shape, generator=generator, device=y.device, dtype=torch.float32)
    return torch.where(u < p, other, near)
