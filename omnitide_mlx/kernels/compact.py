"""page_compact: gather the K/V rows an OmniPage migration moves (Metal kernel + MLX-ops reference, one contract).

``page_compact(k_buf, v_buf, src) -> (k_rows, v_rows)``: ``k_buf``, ``v_buf`` [1, Hkv, capacity, D], ``src`` [n]
int32 source slots; the rows come back as fresh [1, Hkv, n, D] arrays. The cache evaluates them, then scatters them
into its own buffers: with the gather evaluated first MLX updates the buffers in place, so migration memory grows
with the rows moved, never with the cache (``metal_kernel`` outputs are always fresh buffers, so the scatter cannot
be a kernel output).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from . import attention as _attention
from .attention import AttentionError, backend, metal_source

COMPACT_BODY = """
    page_compact_impl<T>(k, v, src, dims, k_rows, v_rows, thread_position_in_grid);
"""


def _check(k_buf: mx.array, v_buf: mx.array, src: np.ndarray) -> None:
    if k_buf.ndim != 4 or k_buf.shape[0] != 1 or tuple(k_buf.shape) != tuple(v_buf.shape):
        raise AttentionError(f"k_buf and v_buf must both be [1, Hkv, capacity, D], got {tuple(k_buf.shape)} "
                             f"and {tuple(v_buf.shape)}")
    if k_buf.dtype != v_buf.dtype:
        raise AttentionError(f"k_buf is {k_buf.dtype}, v_buf {v_buf.dtype}")
    if src.size and (src.min() < 0 or src.max() >= k_buf.shape[2]):
        raise AttentionError(f"source slots must lie in [0, {k_buf.shape[2]})")


def page_compact_spec(k_buf: mx.array, v_buf: mx.array, src) -> dict:
    """Constructor and call arguments of the Metal gather (shared by the runtime path and tests/metal_check)."""
    src_np = np.asarray(src, dtype=np.int32).reshape(-1)
    _, hkv, cap, d = k_buf.shape
    n = int(src_np.shape[0])
    return dict(
        name="omnitide_page_compact",
        input_names=["k", "v", "src", "dims"],
        output_names=["k_rows", "v_rows"],
        source=COMPACT_BODY,
        header=metal_source("page_compact"),
        inputs=[k_buf, v_buf, mx.array(src_np), mx.array([cap, n, d], dtype=mx.int32)],
        output_shapes=[(1, hkv, n, d), (1, hkv, n, d)],
        output_dtypes=[k_buf.dtype, k_buf.dtype],
        template=[("T", k_buf.dtype)],
        grid=(d, n, hkv),
        threadgroup=(min(d, 256), 1, 1),
    )


def page_compact_reference(k_buf: mx.array, v_buf: mx.array, src) -> tuple[mx.array, mx.array]:
    idx = mx.array(np.asarray(src, dtype=np.int32).reshape(-1))
    return k_buf[:, :, idx, :], v_buf[:, :, idx, :]


def page_compact(k_buf: mx.array, v_buf: mx.array, src) -> tuple[mx.array, mx.array]:
    """Gather rows ``src`` of both buffers (lazy arrays; the caller evaluates them before scattering)."""
    src_np = np.asarray(src, dtype=np.int64).reshape(-1)
    _check(k_buf, v_buf, src_np)
    if src_np.size == 0 or backend() == "reference":
        return page_compact_reference(k_buf, v_buf, src_np)
    from . import dispatch, selftest

    if dispatch.forced() is None and not selftest.passed("page_compact", k_buf.dtype, k_buf.shape[-1], 0):
        return page_compact_reference(k_buf, v_buf, src_np)
    return _metal_page_compact(k_buf, v_buf, src_np)


def _metal_page_compact(k_buf: mx.array, v_buf: mx.array, src) -> tuple[mx.array, mx.array]:
    k_rows, v_rows = _attention.run_metal_spec(page_compact_spec(k_buf, v_buf, src))
    return k_rows, v_rows
