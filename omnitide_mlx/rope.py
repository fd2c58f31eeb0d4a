"""RoPE as the cache sees it: enough to re-rotate stored keys when their positions shift.

Models apply their own RoPE (plain, traditional, M-RoPE) when they write keys. After an eviction a kept key must
look as if it had been written at ``position - shift``. Rotations compose, so that is one rotation by ``-shift``
with the same frequencies. For M-RoPE this is exact only when t, h and w all move by the same amount (the shift
rule in docs/design.md guarantees it): every frequency then turns by ``shift * inv_freq``, whatever axis its band
reads, which is plain NeoX RoPE over the whole head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the spec itself is plain data (the torch path uses it); only rotation needs MLX
    import mlx.core as mx


@dataclass(frozen=True)
class RopeSpec:
    """The rotary embedding of a model's keys.

    dims: rotated channels (the first ``dims`` of each head); base: theta; traditional: True for interleaved
    pairs (GPT-J / GGUF llama), False for NeoX halves; scale: position multiplier (linear RoPE scaling).
    """

    dims: int
    base: float
    traditional: bool = False
    scale: float = 1.0

    def to_json(self) -> dict:
        return {"dims": self.dims, "base": self.base, "traditional": self.traditional, "scale": self.scale}

    @classmethod
    def from_json(cls, d: dict) -> "RopeSpec":
        return cls(int(d["dims"]), float(d["base"]), bool(d["traditional"]), float(d.get("scale", 1.0)))

    def rotate_tokens(self, x: mx.array, offsets: mx.array | np.ndarray) -> mx.array:
        """Rotate per token: ``x`` is ``[N, H, D]`` (token-major), ``offsets`` ``[N]`` integer positions.

        Computed in float32 and returned in float32; the caller casts back once (never round-trip half
        precision through an un-rotate / re-rotate pair).
        """
        import mlx.core as mx

        n, h, d = x.shape
        if n == 0:
            return x.astype(mx.float32)
        offsets = mx.array(np.asarray(offsets, dtype=np.int32)) if not isinstance(offsets, mx.array) else offsets
        y = mx.fast.rope(
            x.astype(mx.float32).reshape(n, h, 1, d),
            self.dims,
            traditional=self.traditional,
            base=self.base,
            scale=self.scale,
            offset=offsets.astype(mx.int32),
        )
        return y.reshape(n, h, d)

    def rotate_sequence(self, x: mx.array, positions: mx.array | np.ndarray) -> mx.array:
        """Rotate ``x`` ``[B, H, T, D]`` at arbitrary per-token ``positions`` ``[T]`` (same dtype out)."""
        import mlx.core as mx

        b, h, t, d = x.shape
        pos = positions if isinstance(positions, mx.array) else mx.array(np.asarray(positions, dtype=np.int32))
        y = self.rotate_tokens(x.transpose(0, 2, 1, 3).reshape(b * t, h, d), mx.tile(pos.astype(mx.int32), (b,)))
        return y.reshape(b, t, h, d).transpose(0, 2, 1, 3).astype(x.dtype)
