"""Hypothesis strategies for random unit streams (1-D RoPE and M-RoPE position layouts)."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from omnitide_mlx.core.units import History, Span, SpanKind, Unit, UnitKind

# a unit's spans as (kind, length) pairs; image spans carry a grid for M-RoPE positions
media_spec = st.tuples(
    st.integers(1, 3),  # leading boundary tokens
    st.one_of(st.none(), st.tuples(st.integers(1, 5), st.integers(1, 6))),  # image grid (rows, cols)
    st.one_of(st.none(), st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(1, 3))),  # src, slices, len
    st.integers(0, 12),  # audio tokens
    st.integers(0, 6),  # text tokens
    st.integers(1, 2),  # trailing boundary tokens
)
unit_spec = st.one_of(
    st.tuples(st.just("media"), media_spec),
    st.tuples(st.just("user"), st.integers(1, 30)),
    st.tuples(st.just("reply"), st.integers(1, 40)),
)


def _positions_for(pieces: list[tuple[SpanKind, int, tuple | None]], start: int, axes: int) -> np.ndarray:
    """Sequential positions on every axis, except image grids under M-RoPE: (t, h, w) = (st, st+r, st+c)."""
    cols: list[np.ndarray] = []
    nxt = start
    for kind, n, grid in pieces:
        if axes == 3 and grid is not None:
            rows, cs = grid
            r, c = np.divmod(np.arange(rows * cs), cs)
            p = np.stack([np.full(rows * cs, nxt), nxt + r, nxt + c])
            nxt = int(p.max()) + 1
        else:
            p = np.broadcast_to(np.arange(nxt, nxt + n), (axes, n))
            nxt += n
        cols.append(np.asarray(p, dtype=np.int64))
    return np.concatenate(cols, axis=1)


def build_unit(uid: int, spec, start: int, axes: int) -> Unit:
    kind, arg = spec
    pieces: list[tuple[SpanKind, int, tuple | None]] = []
    if kind == "media":
        lead, grid, sliced, audio, text, trail = arg
        pieces.append((SpanKind.BOUNDARY, lead, None))
        if grid is not None:
            pieces.append((SpanKind.IMAGE, grid[0] * grid[1], grid))
        if sliced is not None:
            src, n_slices, slen = sliced
            pieces.append((SpanKind.IMAGE_SOURCE, src, None))
            for _ in range(n_slices):
                pieces.append((SpanKind.BOUNDARY, 1, None))
                pieces.append((SpanKind.IMAGE_SLICE, slen, None))
                pieces.append((SpanKind.BOUNDARY, 1, None))
        if audio:
            pieces.append((SpanKind.AUDIO, audio, None))
        if text:
            pieces.append((SpanKind.TEXT, text, None))
        pieces.append((SpanKind.BOUNDARY, trail, None))
        ukind = UnitKind.MEDIA
    elif kind == "user":
        pieces = [(SpanKind.BOUNDARY, 3, None), (SpanKind.TEXT, arg, None), (SpanKind.BOUNDARY, 2, None)]
        ukind = UnitKind.USER
    else:
        pieces = [(SpanKind.RESPONSE, arg, None), (SpanKind.BOUNDARY, 2, None)]
        ukind = UnitKind.REPLY
    spans, cursor = [], 0
    for k, n, _ in pieces:
        spans.append(Span(k, cursor, cursor + n))
        cursor += n
    return Unit(uid=uid, kind=ukind, spans=tuple(spans), positions=_positions_for(pieces, start, axes))


@st.composite
def histories(draw, min_units: int = 1, max_units: int = 12, axes=None):
    axes = draw(st.sampled_from([1, 3])) if axes is None else axes
    system = draw(st.one_of(st.none(), st.integers(1, 12)))
    units: list[Unit] = []
    uid = 0
    if system is not None:
        units.append(Unit.build(uid, UnitKind.SYSTEM, [(SpanKind.SYSTEM, system)], axes=axes))
        uid += 1
    h = History(units)
    for spec in draw(st.lists(unit_spec, min_size=min_units, max_size=max_units)):
        h.append(build_unit(uid, spec, h.next_position(), axes))
        uid += 1
    return h
