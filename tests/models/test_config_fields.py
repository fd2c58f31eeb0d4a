"""One helper reads every config dataclass out of a config.json dict (models/loading.py: config_fields)."""

from dataclasses import dataclass, field

from omnitide_mlx.models.loading import config_fields


@dataclass
class _Cfg:
    depth: int = 2
    width: int = 8
    sizes: list = field(default_factory=lambda: [1])


def test_known_keys_renames_tuples_and_defaults():
    d = {"num_layers": 4, "sizes": (3, 4), "junk": 1}
    assert config_fields(_Cfg, d, {"num_layers": "depth"}) == {"depth": 4, "sizes": [3, 4]}
    assert config_fields(_Cfg, {}, defaults={"width": 16, "nope": 1}) == {"width": 16}
    assert config_fields(_Cfg, {"width": 4}, defaults={"width": 16}) == {"width": 4}


def test_minicpmo_slice_config_defaults_to_nine_slices_when_given_without_a_count():
    from omnitide_mlx.models.minicpmo.config import ModelConfig

    assert ModelConfig.from_dict({}).slice.max_slice_nums == 1
    assert ModelConfig.from_dict({"slice_config": {}}).slice.max_slice_nums == 9
    assert ModelConfig.from_dict({"slice_config": {"max_slice_nums": 4}}).slice.max_slice_nums == 4


def test_qwen_vision_config_reads_the_released_field_names():
    from omnitide_mlx.models.qwen2_5_omni.config import VisionConfig

    v = VisionConfig.from_dict({"in_chans": 3, "num_attention_heads": 4, "num_hidden_layers": 2, "hidden_size": 32,
                                "out_hidden_size": 64, "fullatt_block_indexes": [1]})
    assert (v.in_channels, v.num_heads, v.depth) == (3, 4, 2)
