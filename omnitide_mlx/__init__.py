"""omnitide-mlx: streaming omni-modal LLM inference on MLX with OmniPick retention and OmniPage paging.

    import omnitide_mlx as ot
    model, processor = ot.load("Qwen/Qwen2.5-Omni-3B")
    session = ot.OmniSession((model, processor), policy=ot.OmniTide(high=2500, low=1800))
"""

__version__ = "0.1.0"

# Before anything imports MLX: on Linux, the system's OpenBLAS instead of the mlx-cpu wheel's reference BLAS
# (20x faster float32 matmul; blas.py). Nothing on macOS.
from .blas import preload as _preload_blas

_preload_blas()

# Lazy attributes: `omnitide --help` and the pure-Python core do not import MLX.
from .lazy import lazy_getattr

_LAZY = {
    "load": ("omnitide_mlx.models", "load"),
    "OmniSession": ("omnitide_mlx.session", "OmniSession"),
    "Conversation": ("omnitide_mlx.conversation", "Conversation"),
    "TurnEvent": ("omnitide_mlx.conversation", "TurnEvent"),
    "OmniCache": ("omnitide_mlx.cache", "OmniCache"),
    "OmniTideError": ("omnitide_mlx.errors", "OmniTideError"),
    "MediaError": ("omnitide_mlx.errors", "MediaError"),
    "SessionError": ("omnitide_mlx.errors", "SessionError"),
    "SessionBusyError": ("omnitide_mlx.errors", "SessionBusyError"),
    "InputTooLargeError": ("omnitide_mlx.errors", "InputTooLargeError"),
    "RestoreError": ("omnitide_mlx.errors", "RestoreError"),
    "SamplingError": ("omnitide_mlx.errors", "SamplingError"),
    "CheckpointError": ("omnitide_mlx.models.loading", "CheckpointError"),
    "OmniTide": ("omnitide_mlx.core.pick", "OmniTide"),
    "OmniPick": ("omnitide_mlx.core.pick", "OmniPick"),
    "FullContext": ("omnitide_mlx.core.pick", "FullContext"),
    "UnitFIFO": ("omnitide_mlx.core.pick", "UnitFIFO"),
    "TokenSliding": ("omnitide_mlx.core.pick", "TokenSliding"),
    "StreamingLLM": ("omnitide_mlx.core.pick", "StreamingLLM"),
    "H2O": ("omnitide_mlx.core.pick", "H2O"),
    "make_policy": ("omnitide_mlx.core.pick", "make_policy"),
}

__all__ = sorted(_LAZY) + ["__version__"]


__getattr__ = lazy_getattr("omnitide_mlx", _LAZY, globals())
