"""One source of truth for a unit: the unit the simulator and the benchmarks stream for a profile and a media
setting (models/stream_units.py) is the unit the engine's adapter builds from a real frame of that size, span for
span and position for position, for both models, at three frame sizes, with and without MiniCPM-o slices."""

from __future__ import annotations

import numpy as np
import pytest

from omnitide_mlx.core.stream_units import MediaSetting, MediaSettingError, get_preset, parse_frame_size
from omnitide_mlx.models.stream_units import resolve_profile

SIZES = [(448, 448), (640, 480), (1344, 1344)]


def frame(size, seed=0):
    w, h = size
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def second(seed=0, n=16000):
    return (0.1 * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)


def engine_unit(adapter, size, start=500):
    """The second media unit of a turn (the first one also opens the user turn) built from a real frame."""
    first = adapter.media_unit(frame(size, 1), second(1), 0.0, 0)
    return adapter.media_unit(frame(size, 2), second(2), 1.0, start + first.length)


def assert_same(profile, unit):
    sim = profile.media_unit(7, unit.positions.min())
    assert [(s.kind, s.length) for s in unit.spans] == [(s.kind, s.length) for s in sim.spans]
    assert np.array_equal(unit.positions, sim.positions)
    assert profile.units.same_layout(unit.spans, unit.positions, int(unit.positions.min()))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory, data_dir):
    from omnitide_mlx.models import load
    from omnitide_mlx.models.qwen2_5_omni.tiny import make_tiny_checkpoint

    return load(make_tiny_checkpoint(tmp_path_factory.mktemp("q") / "tiny",
                                     tokenizer_dir=data_dir / "tokenizers" / "qwen2"))


@pytest.fixture(scope="module")
def minicpmo(tmp_path_factory):
    import mlx.core as mx

    from omnitide_mlx.models import load
    from omnitide_mlx.models.minicpmo.tiny import make_tiny_checkpoint

    return load(make_tiny_checkpoint(tmp_path_factory.mktemp("m"), seed=3), dtype=mx.float32)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("max_pixels", [None, 1344 * 1344])
def test_qwen_unit_equals_the_engine_unit(qwen, size, max_pixels):
    model, proc = qwen
    adapter = model.stream_adapter(proc, media=MediaSetting(max_pixels=max_pixels))
    unit = engine_unit(adapter, size)
    prof = resolve_profile("qwen2.5-omni-7b", MediaSetting(frame_size=size, max_pixels=max_pixels))
    assert_same(prof, unit)
    assert unit.extras["vision_tokens"] == prof.tokens_by_kind()["image"]
    assert adapter.stream_units().tokens_by_kind() == resolve_profile(
        "qwen2.5-omni-3b", MediaSetting(max_pixels=max_pixels)).tokens_by_kind()


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("max_slice_nums", [None, 9])
def test_minicpmo_unit_equals_the_engine_unit(minicpmo, size, max_slice_nums):
    model, proc = minicpmo
    adapter = model.stream_adapter(proc, media=MediaSetting(max_slice_nums=max_slice_nums))
    unit = engine_unit(adapter, size)
    prof = resolve_profile("minicpm-o-4.5", MediaSetting(frame_size=size, max_slice_nums=max_slice_nums))
    assert_same(prof, unit)
    kinds = prof.tokens_by_kind()
    if max_slice_nums is None or size == (448, 448):  # unsliced: one 64-token image
        assert kinds.get("image") == 64 and "image_slice" not in kinds
    else:
        assert kinds["image_source"] == 64 and kinds["image_slice"] % 64 == 0


def test_paper_preset_resizes_real_frames_to_the_papers_units(qwen, minicpmo):
    """``--preset paper`` on a 448x448 clip streams the paper's units: frames are resized to 1344x1344."""
    paper = get_preset("paper")
    model, proc = qwen
    unit = engine_unit(model.stream_adapter(proc, media=paper), (448, 448))
    assert unit.length == 2333
    assert_same(resolve_profile("qwen2.5-omni-7b", "paper"), unit)
    model, proc = minicpmo
    unit = engine_unit(model.stream_adapter(proc, media=paper), (448, 448))
    assert unit.length == 672
    assert_same(resolve_profile("minicpm-o-4.5", "paper"), unit)


def test_default_units_and_bad_settings():
    """The defaults: the official long-video processing (Qwen frames capped at 128x28x28 px) and unsliced
    MiniCPM-o frames, on the simulator's 640x480 frame."""
    assert resolve_profile("qwen2.5-omni-7b").tokens_by_kind() == {"boundary": 4, "image": 117, "audio": 25}
    assert resolve_profile("minicpm-o-4.5").tokens_by_kind() == {"boundary": 4, "image": 64, "audio": 10}
    assert parse_frame_size("1344x896") == (1344, 896)
    for bad in ("1344", "0x10", "axb"):
        with pytest.raises(MediaSettingError):
            parse_frame_size(bad)
    with pytest.raises(MediaSettingError, match="max_slice_nums"):
        MediaSetting(max_slice_nums=0)
    with pytest.raises(MediaSettingError, match="preset"):
        get_preset("4k")
