"""Units and histories: malformed input is a clear error; JSON round trips keep everything."""

from __future__ import annotations

import numpy as np
import pytest

from omnitide_mlx.core.units import History, Span, SpanKind, Unit, UnitError, UnitKind


def test_malformed_units_are_rejected_with_specific_errors():
    pos = np.arange(6)[None]
    with pytest.raises(UnitError, match="overlaps"):
        Unit(1, UnitKind.MEDIA, (Span(SpanKind.BOUNDARY, 0, 4), Span(SpanKind.IMAGE, 3, 6)), pos)
    with pytest.raises(UnitError, match="belong to no span"):
        Unit(1, UnitKind.MEDIA, (Span(SpanKind.BOUNDARY, 0, 2), Span(SpanKind.IMAGE, 3, 6)), pos)
    with pytest.raises(UnitError, match="positions for"):
        Unit(1, UnitKind.MEDIA, (Span(SpanKind.BOUNDARY, 0, 2), Span(SpanKind.IMAGE, 2, 7)), pos)
    with pytest.raises(UnitError, match="length 0"):
        Unit(1, UnitKind.MEDIA, (), np.zeros((1, 0)))
    with pytest.raises(UnitError, match="empty or negative"):
        Span(SpanKind.TEXT, 3, 3)
    with pytest.raises(UnitError, match="system unit"):
        Unit.build(0, UnitKind.SYSTEM, [(SpanKind.TEXT, 3)])
    h = History([Unit.build(0, UnitKind.SYSTEM, [(SpanKind.SYSTEM, 3)])])
    with pytest.raises(UnitError, match="must increase"):
        h.append(Unit.build(0, UnitKind.USER, [(SpanKind.TEXT, 2)]))
    with pytest.raises(UnitError, match="axes"):
        h.append(Unit.build(1, UnitKind.USER, [(SpanKind.TEXT, 2)], axes=3))
    with pytest.raises(UnitError, match="only the first"):
        h.append(Unit.build(2, UnitKind.SYSTEM, [(SpanKind.SYSTEM, 2)]))


def test_history_offsets_positions_and_json_round_trip():
    h = History([Unit.build(0, UnitKind.SYSTEM, [(SpanKind.SYSTEM, 3)], axes=3)])
    h.append(Unit.build(1, UnitKind.MEDIA, [(SpanKind.BOUNDARY, 1), (SpanKind.IMAGE, 4)], start_position=3,
                        axes=3, t=0.0))
    h.append(Unit(2, UnitKind.REPLY, (Span(SpanKind.RESPONSE, 0, 2),), np.full((3, 2), 9), trimmed=True))
    assert h.offsets() == [0, 3, 8] and h.total_tokens == 10 and h.next_position() == 10
    assert h.system_tokens == 3 and [u.uid for u in h.stream_units] == [1, 2]
    back = History.from_json(h.to_json())
    assert [u.to_json() for u in back] == [u.to_json() for u in h]
    assert back.unit(2).trimmed and not back.unit(1).trimmed
    assert np.array_equal(back.positions(), h.positions())
