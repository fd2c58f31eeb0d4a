"""Shared fixtures: the official-code tiny fixture model and a tiny checkpoint with the real tokenizer."""

import json

import mlx.core as mx
import numpy as np
import pytest

from omnitide_mlx.models.loading import load_safetensors, load_weights_strict
from omnitide_mlx.models.minicpmo.config import ModelConfig
from omnitide_mlx.models.minicpmo.model import Model


@pytest.fixture(scope="session")
def fixture_dir(data_dir):
    return data_dir / "fixtures" / "minicpmo45-tiny"


@pytest.fixture(scope="session")
def fixture_config(fixture_dir) -> dict:
    cfg = json.loads((fixture_dir / "config.json").read_text())
    cfg["drop_vision_last_layer"] = False  # how the official model was built for the fixture (see its README)
    return cfg


@pytest.fixture(scope="session")
def fixture_model(fixture_dir, fixture_config) -> Model:
    """The fixture's weights (official names and layouts) through Model.sanitize."""
    model = Model(ModelConfig.from_dict(fixture_config))
    load_weights_strict(model, model.sanitize(load_safetensors(fixture_dir)))
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="session")
def golden(fixture_dir):
    return np.load(fixture_dir / "golden.npz")


@pytest.fixture(scope="session")
def official(fixture_dir):
    return np.load(fixture_dir / "golden_official.npz")


@pytest.fixture(scope="session")
def official_extra(fixture_dir):
    return np.load(fixture_dir / "golden_official_extra.npz")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny checkpoint in the released layout with the real 151,748-token tokenizer and query_num 64 (the
    configuration of stream_ref.json's model, weights drawn from seed 3)."""
    from omnitide_mlx.models.minicpmo.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("minicpmo-tiny"), seed=3)


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    from omnitide_mlx.models import load

    return load(tiny_dir, dtype=mx.float32)
