"""Softmax and SiLU on MLX's CPU backend, with an exponential that stays in the graph.

MLX 0.32's CPU backend evaluates ``exp`` one element at a time, and at a streaming session's context lengths the
softmax is most of a CPU attention call: for SmolLM2-135M (a 100-token unit over 500 keys, 9 x 100 x 500 =
450,000 scores) ``mx.softmax(precise=True)`` takes 5.6-8.4 ms against 0.74 ms for the matmul that made the scores,
30 times per unit. Here ``exp(a) = 2^n e^r``: ``n`` the integer nearest ``a log2 e`` (rounded by adding 1.5 x 2^23,
whose bits also give ``n`` as an integer), ``e^r`` for ``r = a - n ln 2`` a degree-6 polynomial and ``2^n``
written into the float's exponent bits. ``mx.compile`` fuses those multiply-adds: 0.52 ms for the 450,000 values and
1.4 ms for the whole softmax, within 2.4e-7 relative of ``mx.exp`` (one or two float32 ulps).

Score matrices go through it in row chunks of at most ``FAST_CHUNK`` scores (a chunk's intermediates are about 6
times its scores; the chunks are concatenated once). Measured on the shared 2-core x86 machine with the buffer cache a
session sets (``session.keep_cpu_buffers``, 2 GiB), ``softmax_last`` against ``mx.softmax``: 1.6 / 5.6 ms for
(1, 9, 100, 500), 2.9 / 9.2 for (1, 9, 100, 830), 4.0 / 12.6 for 1M scores, 47 / 100 for (1, 28, 64, 4096), 135 /
415 for a 2,333-token chunk's (1, 4, 3584, 2333). With MLX's default 32 MiB cache, chunks above 128K scores ran
slower than ``mx.softmax`` (fresh pages for every intermediate). A 100-token SmolLM2 prefill over 400 cached tokens:
0.63 -> 0.41 s, logits within 6e-5 (of 31).

``silu`` (the decoder blocks' SwiGLU, models/blocks.py) is ``x sigmoid(x)`` with the same ``exp`` of ``-|x|``:
``nn.silu`` takes 2.5-3.5 ms for one SmolLM2 MLP's (1, 100, 1536) gate, 30 times a unit (16 % of a unit's prefill
on one core), this 0.66 ms, within 3e-7 relative (1.22 ms while the numerator was a ``where``: a select in the fused
graph costs more than the exp; the arithmetic blend gives the same bits).

Semantics are ``mx.softmax(s, axis=-1, precise=True)``'s for float32 ``s``: the row maximum is subtracted first,
so every argument of ``exp`` is <= 0; arguments below about -88 (``exp`` under float32's smallest normal) and
``-inf`` (masked keys) give exactly 0; a row of nothing but ``-inf`` gives NaN, as ``mx.softmax`` does (the
reference zeroes such rows itself). Other dtypes, and a GPU default device, use ``mx.softmax``.
"""

from __future__ import annotations

import mlx.core as mx

FAST_CHUNK = 1 << 18  # scores per chunk (1 MB of float32): 256K and 512K measured alike, 64K-128K up to 40 % slower

_LOG2E = 1.4426950408889634
_LN2_HI = 0.693359375  # ln 2 split Cody-Waite style: n * _LN2_HI is exact in float32 for |n| <= 127
_LN2_LO = -2.12194440e-4
_FLOOR = -88.0  # below it n = -127: a zero exponent field, so exp gives exactly 0 (under 2^-126, float32's
#                 smallest normal, from about -87.7 down)
_ROUND = 12582912.0  # 1.5 * 2^23: y + _ROUND rounds y (|y| < 2^22) to the nearest integer, in the low mantissa bits
_ROUND_BITS = 0x4B400000  # the bits of _ROUND: bits(y + _ROUND) - _ROUND_BITS = round(y) as an int32
_POLY = (1 / 720, 1 / 120, 1 / 24, 1 / 6, 1 / 2, 1.0, 1.0)  # e^r on [-ln2/2, ln2/2], highest degree first


@mx.compile
def _exp_nonpositive(a: mx.array) -> mx.array:
    """``exp(a)`` for float32 ``a <= 0``: ``2^n e^r`` with ``n = round(a log2 e)`` and ``r = a - n ln 2`` (so a
    rounding error in ``a log2 e`` only moves ``n``); exactly 0 from about -87.7 down."""
    a = mx.maximum(a, _FLOOR)
    t = a * _LOG2E + _ROUND
    n = t - _ROUND
    r = (a - n * _LN2_HI) - n * _LN2_LO
    p = r * _POLY[0] + _POLY[1]
    for c in _POLY[2:]:
        p = p * r + c
    two_n = ((t.view(mx.int32) - (_ROUND_BITS - 127)) << 23).view(mx.float32)
    return p * two_n


def _softmax_chunk(s: mx.array) -> mx.array:
    e = _exp_nonpositive(s - mx.max(s, axis=-1, keepdims=True))
    return e / mx.sum(e, axis=-1, keepdims=True)


def softmax_last(s: mx.array) -> mx.array:
    """Softmax over the last axis, float32 throughout (``mx.softmax(s, axis=-1, precise=True)``'s semantics)."""
    if s.dtype != mx.float32 or mx.default_device() != mx.cpu or s.ndim < 2:
        return mx.softmax(s, axis=-1, precise=True)
    if s.size <= FAST_CHUNK:
        return _softmax_chunk(s)
    lead, n = s.shape[:-1], s.shape[-1]
    rows = s.reshape(-1, n)
    step = max(1, FAST_CHUNK // n)
    parts = [_softmax_chunk(rows[i:i + step]) for i in range(0, rows.shape[0], step)]
    return mx.concatenate(parts, axis=0).reshape(*lead, n)


def logsumexp_last(s: mx.array) -> mx.array:
    """``mx.logsumexp(s, axis=-1)`` with the fused exp for float32 on the CPU (scoring a unit's tokens: 100 x
    49,152 vocabulary logits)."""
    if s.dtype != mx.float32 or mx.default_device() != mx.cpu:
        return mx.logsumexp(s, axis=-1)
    if s.ndim < 2:
        return _logsumexp_chunk(s[None])[0]
    lead, n = s.shape[:-1], s.shape[-1]
    rows = s.reshape(-1, n)
    step = max(1, FAST_CHUNK // n)
    parts = [_logsumexp_chunk(rows[i:i + step]) for i in range(0, rows.shape[0], step)]
    return (parts[0] if len(parts) == 1 else mx.concatenate(parts)).reshape(lead)


def _logsumexp_chunk(s: mx.array) -> mx.array:
    m = mx.max(s, axis=-1, keepdims=True)
    m = mx.where(mx.isinf(m), 0.0, m)  # a row of -inf gives -inf, as mx.logsumexp (finite logits otherwise)
    return (m + mx.log(mx.sum(_exp_nonpositive(s - m), axis=-1, keepdims=True)))[..., 0]


@mx.compile
def _silu_fused(x: mx.array) -> mx.array:
    e = _exp_nonpositive(-mx.abs(x))  # exp(-|x|) in (0, 1]: sigmoid(x) = 1 / (1 + e) for x >= 0, e / (1 + e) below
    up = (x >= 0).astype(x.dtype)  # the numerator 1 or e as exact arithmetic: a where() in the fused graph ran
    return x * (e * (1.0 - up) + up) / (1.0 + e)  # 1.22 ms for (1, 100, 1536), this 0.66 ms, the same bits


def silu(x: mx.array) -> mx.array:
    """``x * sigmoid(x)`` (``nn.silu``); the fused exp for float32 on the CPU."""
    if x.dtype == mx.float32 and mx.default_device() == mx.cpu:
        return _silu_fused(x)
    return x * mx.sigmoid(x)

