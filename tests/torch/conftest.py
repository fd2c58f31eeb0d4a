"""The torch tests run on the CPU here and on CUDA in scripts/cuda_check.sh (OMNITIDE_TORCH_DEVICE=cuda)."""

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))  # torch_stream.py
from torch_stream import DEVICE  # noqa: E402

if DEVICE.type == "cuda":
    if not torch.cuda.is_available():
        raise pytest.UsageError("OMNITIDE_TORCH_DEVICE=cuda, but torch sees no CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32: the tolerances are for full precision
    torch.backends.cudnn.allow_tf32 = False


@pytest.fixture(scope="session")
def device():
    return DEVICE


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory, data_dir):
    """A random tiny Qwen2.5-Omni checkpoint in the released layout (``thinker.`` names, talker weights)."""
    from omnitide_mlx.models.qwen2_5_omni.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("torch_qwen") / "tiny", tokenizer_dir=data_dir /
                                "tokenizers" / "qwen2", vocab="tiny")


@pytest.fixture(scope="session")
def torch_qwen(tiny_qwen):
    """(TorchQwenOmni, Processor) of the tiny checkpoint, float32 on the test device."""
    from omnitide_mlx.torch.qwen2_5_omni import load

    return load(tiny_qwen, device=DEVICE, dtype=torch.float32)


@pytest.fixture(scope="session")
def clip_chunks(media_dir):
    """Six seconds of the bundled clip, frames shrunk 4x (the tiny models' vision cost; the layout is unchanged)."""
    from omnitide_mlx.media import iter_chunks

    return [(c.frame[::4, ::4].copy(), c.audio, c.t) for c in iter_chunks(media_dir / "video_10s_av.mp4", seconds=6)]
