"""Reading a token2wav folder's weights: ``NAME.safetensors``, or the released ``NAME.pt`` when torch is installed.

The release ships ``flow.pt`` / ``hift.pt`` (and, for minicpmo-utils 1.0.7, ``hift_original.pt``): torch state dicts.
A ``.safetensors`` file of the same name (``omnitide convert --token2wav DIR`` writes one next to each ``.pt``) is
read first. A ``.pt`` is opened only with ``torch.load(weights_only=True)`` (tensors and plain containers; no
object is unpickled) and only where torch is importable; without torch it is an error that says to convert the
folder on a machine that has torch, or to install torch.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from ..loading import CheckpointError


def weight_file(folder: Path, stem: str) -> Path | None:
    """``stem.safetensors`` if present, else ``stem.pt``, else None."""
    for suffix in (".safetensors", ".pt"):
        path = Path(folder) / f"{stem}{suffix}"
        if path.is_file():
            return path
    return None


def torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def read_weights(folder: str | Path, stem: str) -> dict[str, np.ndarray]:
    """The state dict of ``folder/stem.{safetensors,pt}`` as NumPy arrays (half precision widened to float32),
    official key names and layouts. ``CheckpointError`` when neither file is there or cannot be read."""
    folder = Path(folder)
    path = weight_file(folder, stem)
    if path is None:
        raise CheckpointError(f"{folder} has neither {stem}.safetensors nor {stem}.pt")
    if path.suffix == ".safetensors":
        try:
            state = mx.load(str(path))
        except Exception as e:
            raise CheckpointError(f"{path} is not a readable safetensors file ({e})") from None
        return {k: np.array(v.astype(mx.float32) if v.dtype in (mx.bfloat16, mx.float16) else v)
                for k, v in state.items()}
    if not torch_available():
        raise CheckpointError(f"{path} is a torch file and torch is not installed: install torch (it is read with "
                              f"torch.load(weights_only=True), tensors only) or convert the folder once where torch "
                              f"is, with `omnitide convert --token2wav {folder}` (writes {stem}.safetensors)")
    import torch

    from ...torch.token2wav_convert import Token2wavConvertError, read_state_dict

    try:
        state = read_state_dict(path)
    except Token2wavConvertError as e:
        raise CheckpointError(str(e)) from None
    return {k: (v.float() if v.dtype in (torch.bfloat16, torch.float16) else v).detach().cpu().numpy()
            for k, v in state.items()}
