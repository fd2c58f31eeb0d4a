import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("default", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", deadline=None, max_examples=1000,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

import pathlib  # noqa: E402

import pytest  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"  # vendored: real tokenizer files, the MiniCPM-o official-code fixtures
MEDIA = REPO / "assets" / "media"  # bundled sample media


@pytest.fixture(scope="session")
def data_dir() -> pathlib.Path:
    return DATA


@pytest.fixture(scope="session")
def media_dir() -> pathlib.Path:
    return MEDIA


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, pathlib.Path]:
    """Tiny random checkpoints of both models in the released layout, with the real tokenizers (built once)."""
    from omnitide_mlx.models.minicpmo.tiny import make_tiny_checkpoint as make_minicpmo
    from omnitide_mlx.models.qwen2_5_omni.tiny import make_tiny_checkpoint as make_qwen

    root = tmp_path_factory.mktemp("tiny_checkpoints")
    return {
        "qwen": make_qwen(root / "tiny-qwen2.5-omni", tokenizer_dir=DATA / "tokenizers/qwen2", vocab="real"),
        "minicpmo": make_minicpmo(root / "tiny-minicpm-o-4.5", tokenizer_dir=DATA / "tokenizers/minicpm-o-4_5"),
    }
