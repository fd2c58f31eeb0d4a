"""StepAudio2 token2wav weights: the released ``flow.pt`` / ``hift.pt`` (torch state dicts) -> safetensors.

MiniCPM-o 4.5 ships its speech decoder as ``assets/token2wav/`` with PyTorch pickles (``flow.pt``, ``hift.pt``,
``hift_original.pt``). The MLX runtime reads safetensors only, so ``omnitide convert --token2wav DIR`` runs this
once: each ``NAME.pt`` present is read with
``torch.load(weights_only=True)`` (tensors only, no code) and written next to it as ``NAME.safetensors`` with the
same key names, dtypes and layouts (the MLX loaders map names and conv layouts themselves). Never imports MLX.
"""

from __future__ import annotations

from pathlib import Path

from ..core.errors import OmniTideError

# flow matching, the streaming CausalHiFT vocoder (config.yaml) and the whole-utterance HiFT
TOKEN2WAV_WEIGHTS = ("flow", "hift", "hift_original")


class Token2wavConvertError(OmniTideError, ValueError):
    """A token2wav folder or state dict that cannot be converted: says which and why."""


def read_state_dict(path: Path) -> dict:
    """A ``.pt`` state dict of tensors, read with ``weights_only=True``; nested ``{"state_dict": ...}`` is refused."""
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError for anything beyond tensors and containers, OSError, ...
        raise Token2wavConvertError(f"{path} is not a tensors-only torch state dict ({type(e).__name__}: {e})") \
            from None
    if not isinstance(state, dict) or not state:
        raise Token2wavConvertError(f"{path} holds a {type(state).__name__}, not a non-empty state dict")
    bad = sorted(str(k) for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor))
    if bad:
        raise Token2wavConvertError(f"{path}: entries that are not named tensors: {bad[:5]}")
    return state


def convert_state_dict(src: Path, dst: Path) -> int:
    """``src`` (.pt) -> ``dst`` (.safetensors), every tensor copied as is (contiguous, own storage). Returns the
    number of tensors."""
    from safetensors.torch import save_file

    state = read_state_dict(src)
    save_file({k: v.detach().cpu().contiguous().clone() for k, v in state.items()}, str(dst),
              metadata={"source": src.name, "format": "pt"})
    return len(state)


def convert_token2wav(folder: str | Path, overwrite: bool = False) -> list[tuple[Path, int]]:
    """Write ``NAME.safetensors`` next to each ``NAME.pt`` of ``TOKEN2WAV_WEIGHTS`` in ``folder``.

    A ``.safetensors`` that already exists is kept unless ``overwrite``. Returns the files written with their tensor
    counts; raises Token2wavConvertError when the folder has neither checkpoint.
    """
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise Token2wavConvertError(f"no token2wav folder at {folder}")
    found = [name for name in TOKEN2WAV_WEIGHTS if (folder / f"{name}.pt").is_file()]
    if not found:
        have = [name for name in TOKEN2WAV_WEIGHTS if (folder / f"{name}.safetensors").is_file()]
        if "flow" in have and "hift" in have:
            return []
        raise Token2wavConvertError(f"{folder} has none of {', '.join(n + '.pt' for n in TOKEN2WAV_WEIGHTS)}: "
                                    "pass MiniCPM-o 4.5's assets/token2wav folder")
    written = []
    for name in found:
        dst = folder / f"{name}.safetensors"
        if dst.exists() and not overwrite:
            continue
        written.append((dst, convert_state_dict(folder / f"{name}.pt", dst)))
    return written
