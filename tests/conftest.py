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
