"""The CUDA path: OmniTide on PyTorch and transformers (docs/torch.md). Never imports MLX.

- :mod:`.cache`: ``OmniTorchCache``, a transformers ``Cache`` with the core's PageTable (OmniPage), evictions with
  float32 re-rotation, gather-into-scratch migration, and the ``"omnitide"`` attention implementation.
- :mod:`.attention`: attention over active tiles (FlexAttention BlockMask from the page table, SDPA over the span,
  a float32 reference with H2O scores).
- :mod:`.qwen2_5_omni`: transformers' Qwen2.5-Omni thinker with the shared unit layouts; ``load(path, device)``.
- :mod:`.session`: ``TorchSession``, the engine's session API (push / ask / stats / save / restore).
- :mod:`.bench`: ``omnitide bench attention --backend torch``.

Needs the ``torch`` extra (``pip install 'omnitide-mlx[torch]'``: torch and transformers).
"""

from ..lazy import lazy_getattr

_LAZY = {
    "OmniTorchCache": ("omnitide_mlx.torch.cache", "OmniTorchCache"),
    "TorchSession": ("omnitide_mlx.torch.session", "TorchSession"),
    "load": ("omnitide_mlx.torch.qwen2_5_omni", "load"),
}

__all__ = sorted(_LAZY)


__getattr__ = lazy_getattr("omnitide_mlx.torch", _LAZY, globals())
