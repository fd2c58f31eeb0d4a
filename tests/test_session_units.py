"""The session's media setting, per-model watermarks and the low-watermark guard (issue 12)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from omnitide_mlx.core.stream_units import MediaSetting, get_preset
from omnitide_mlx.engine import RetentionWarning
from omnitide_mlx.models.base import KVSpec
from omnitide_mlx.models.stream_units import profile_for_spec
from omnitide_mlx.rope import RopeSpec


def spec(layers, kv, axes):
    return KVSpec(num_layers=layers, kv_heads=kv, head_dim=128, rope=RopeSpec(128, 1e6), position_axes=axes)


def test_models_are_recognised_by_their_kv_shape():
    assert profile_for_spec(spec(28, 4, 3)).name == "qwen2.5-omni-7b"
    assert (profile_for_spec(spec(28, 4, 3)).high, profile_for_spec(spec(28, 4, 3)).low) == (8000, 6000)
    assert (profile_for_spec(spec(36, 2, 3)).high, profile_for_spec(spec(36, 2, 3)).low) == (5000, 3500)
    assert (profile_for_spec(spec(36, 8, 1)).high, profile_for_spec(spec(36, 8, 1)).low) == (2500, 1800)
    assert profile_for_spec(spec(2, 2, 3)) is None  # a tiny test model keeps the policy's defaults


@pytest.fixture(scope="module")
def qwen(tmp_path_factory, data_dir):
    from omnitide_mlx.models import load
    from omnitide_mlx.models.qwen2_5_omni.tiny import make_tiny_checkpoint

    return load(make_tiny_checkpoint(tmp_path_factory.mktemp("q") / "tiny",
                                     tokenizer_dir=data_dir / "tokenizers" / "qwen2"))


def test_the_guard_warns_once_at_the_papers_units_and_the_default_watermarks(qwen):
    from omnitide_mlx.session import OmniSession

    with pytest.warns(RetentionWarning, match="cannot hold the system prefix"):
        s = OmniSession(qwen, high=2500, low=1800, media=get_preset("paper"))
    assert len(s.warnings) == 1 and "units of 2333 tokens" in s.warnings[0]
    frame = np.zeros((448, 448, 3), np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RetentionWarning)  # once: streaming does not repeat it
        s.push(frame=frame, audio=np.zeros(16000, np.float32), t=0.0)
        s.flush()
    st = s.stats()
    assert st["tokens_per_unit"]["tokens"] == 2333 and st["tokens_per_unit"]["by_kind"]["image"] == 2304
    with warnings.catch_warnings():
        warnings.simplefilter("error", RetentionWarning)
        quiet = OmniSession(qwen, media=MediaSetting(max_pixels=200704))  # 234 image tokens at 640x480: fits 1800
    assert quiet.warnings == [] and quiet.stats()["tokens_per_unit"]["by_kind"]["image"] == 234
