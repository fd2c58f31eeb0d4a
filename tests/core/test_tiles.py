"""core/tiles.py: the framework-neutral per-step tile plan both attention paths build on (numpy only)."""

import numpy as np
import pytest

from omnitide_mlx.core.tiles import NO_SEQ, AttentionError, plan_step_tiles

T = 8


def _key_seq():
    key = np.full(4 * T, -1, dtype=np.int64)  # tiles: 0 full, 1 empty, 2 one entry, 3 two entries
    key[:T] = np.arange(T)
    key[2 * T + 3] = 9
    key[3 * T] = 8
    key[3 * T + 5] = 10
    return key


def test_occupied_tiles_span_and_smallest_serial_per_tile():
    key = _key_seq()
    s = plan_step_tiles(key, [9, 10], T)
    assert s.tiles.tolist() == [0, 2, 3] and s.n_tiles == 3 and s.active_slots == 3 * T and s.span == 4 * T
    assert s.tile_min.tolist() == [0, 9, 8]
    assert s.visible_key[T] == NO_SEQ and s.visible_key[3] == 3 and (s.visible_key >= 0).all()
    assert s.capacity == 4 * T and s.q_seq.dtype == np.int64 and s.key_seq.dtype == np.int64
    key[0] = 99  # the plan keeps its own copy (page-table arrays change after the step)
    assert s.key_seq[0] == 0


def test_given_tiles_are_sorted_and_checked():
    key = _key_seq()
    s = plan_step_tiles(key, [10], T, tiles=[3, 0])
    assert s.tiles.tolist() == [0, 3] and s.tile_min.tolist() == [0, 8] and s.span == 4 * T
    empty = plan_step_tiles(key, [10], T, tiles=[])
    assert empty.n_tiles == 0 and empty.span == 0 and empty.tile_min.size == 0
    with pytest.raises(AttentionError, match="tile ids must lie"):
        plan_step_tiles(key, [10], T, tiles=[4])
    with pytest.raises(AttentionError, match="unique"):
        plan_step_tiles(key, [10], T, tiles=[2, 2])


def test_contract_errors():
    with pytest.raises(AttentionError, match="whole pages.*multiple of the tile"):
        plan_step_tiles(np.zeros(T + 1), [1], T)
    with pytest.raises(AttentionError, match="whole pages"):
        plan_step_tiles(np.zeros((2, T)), [1], T)
    with pytest.raises(AttentionError, match="q_seq must be >= 0"):
        plan_step_tiles(np.zeros(T), [-1], T)
    with pytest.raises(AttentionError, match="1-D"):
        plan_step_tiles(np.zeros(T), [[1]], T)
    assert issubclass(AttentionError, ValueError)
