"""TorchSession: the streaming engine on PyTorch (CUDA, or the CPU for tests). Same API as the MLX OmniSession.

    session = TorchSession("Qwen/Qwen2.5-Omni-3B", device="cuda", policy="omnitide", high=2500, low=1800)
    session.push(frame=rgb, audio=samples, sample_rate=48000)
    for piece in session.ask("What colour is the square?"):
        print(piece, end="")

Units, retention, replies, threads and save / restore are the engine's (engine.py); this module supplies the
PyTorch backend (backend.py's protocol): transformers' thinker with the ``"omnitide"`` attention, the OmniTorchCache, sampling, safetensors.

The OmniPage layout defaults to the ordered-suffix migration (paper 6.2: "for the selected CUDA configurations"),
because the SDPA / FlashAttention-style kernels traverse the physical span and only a shorter span saves them work;
``migration="class_aware"`` keeps the tile-skipping layout of the Metal path (FlexAttention skips empty pages, so it
profits from both). Only policies whose layout is ``"omnipage"`` migrate at all.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from ..core.layout import OMNIPAGE_MIGRATIONS, layout_spec
from ..engine import Sampling, StreamingSession
from .cache import OmniTorchCache

MIGRATIONS = tuple(reversed(OMNIPAGE_MIGRATIONS))  # the default first: ordered_suffix


class TorchBackend:
    """The PyTorch backend (backend.py's protocol): transformers' Qwen2.5-Omni thinker with the ``"omnitide"``
    attention, the OmniTorchCache, torch sampling and safetensors. ``device`` / ``dtype``: where and in what a
    model loaded from a path goes (default: CUDA when available; float32 on the CPU, the checkpoint's on CUDA);
    ``kernel``: the cache's attention kernel (default by device); ``migration``: the OmniPage planner mode."""

    name = "torch"
    quantised_kv = False

    def __init__(self, device=None, dtype=None, kernel: str | None = None, migration: str = "ordered_suffix"):
        if migration not in MIGRATIONS:
            raise ValueError(f"migration must be one of {MIGRATIONS}, got {migration!r}")
        self.device = torch.device(device) if device is not None else None
        self.load_dtype = dtype
        self.kernel = kernel
        self.migration = migration

    def load_model(self, path):
        from .qwen2_5_omni import load

        return load(path, device=self.device or _default_device(), dtype=self.load_dtype)

    def default_kv_dtype(self, model) -> torch.dtype:
        return model.dtype

    def dtype_from_name(self, name: str) -> torch.dtype:
        if name not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"unknown KV dtype {name!r} in the saved session")
        return getattr(torch, name)

    def dtype_name(self, dtype) -> str:
        return str(dtype).split(".")[-1]

    def layout_spec(self, name: str):
        return layout_spec(name, migration=self.migration)

    def kv_bytes_per_token(self, spec, dtype, kv_quant: dict) -> int:
        return spec.bytes_per_token(dtype)

    def make_cache(self, model, spec, *, dtype, placement, page_size, subblock_size, collect_scores,
                   kv_quant) -> OmniTorchCache:
        return OmniTorchCache.for_spec(spec, dtype=dtype, device=model.device, page_size=page_size,
                                       subblock_size=subblock_size, placement=placement, kernel=self.kernel,
                                       collect_scores=collect_scores)

    def load_cache(self, model, path: Path) -> OmniTorchCache:
        """The saved cache; ``kernel`` (when set) overrides the saved one, and the OmniPage migration mode follows
        the saved table (ordered-suffix tables are first-fit, class-aware ones class-aware)."""
        cache = OmniTorchCache.load(path, device=model.device)
        if self.kernel is not None:
            cache.set_kernel(self.kernel)
        self.device, self.kernel = model.device, cache.kernel
        self.migration = "class_aware" if cache.page_table.placement == "class_aware" else "ordered_suffix"
        return cache

    def forward(self, model, cache, embeds: torch.Tensor, positions: np.ndarray, *, hidden: bool = False,
                extras: dict | None = None):
        """The torch ports take no model inputs beside the embeddings: ``extras`` is bookkeeping here."""
        try:
            return model.step_logits(embeds, positions, cache), None
        except BaseException:
            if cache.in_step:
                cache.abort_step()
            raise

    def eval(self, *arrays) -> None:
        if any(isinstance(a, torch.Tensor) and a.is_cuda for a in arrays):
            torch.cuda.synchronize()

    def sampler(self, sampling: Sampling):
        return make_sampler(sampling)

    def to_numpy(self, array) -> np.ndarray:
        return array.detach().to("cpu", torch.float32).numpy()

    def save_arrays(self, path: Path, arrays: dict) -> None:
        from safetensors.torch import save_file

        out = {}
        for k, v in arrays.items():
            t = v if isinstance(v, torch.Tensor) else torch.as_tensor(np.ascontiguousarray(v))
            out[k] = t.detach().to("cpu").contiguous()
        save_file(out, str(path))

    def load_arrays(self, path: Path) -> dict:
        from safetensors.torch import load_file

        return load_file(str(path))


class TorchSession(StreamingSession):
    """A streaming session over transformers' Qwen2.5-Omni thinker: push media, ask questions, bounded KV.

    ``model`` is a local path / Hugging Face id, or a ``(TorchQwenOmni, Processor)`` pair from
    :func:`omnitide_mlx.torch.qwen2_5_omni.load`. ``device``: ``"cuda"``, ``"cpu"``, ... (used when loading from a
    path; default CUDA when available); ``dtype``: the model's dtype when loading (default: float32 on the CPU,
    the checkpoint's on CUDA); ``kernel``: the cache's attention kernel (``flex`` / ``sdpa`` / ``reference``;
    default by device); ``migration``: the OmniPage planner mode. Other arguments are the engine's; the engine
    with a :class:`TorchBackend`.
    """

    def __init__(self, model, processor=None, *, device=None, dtype=None, kernel: str | None = None,
                 migration: str = "ordered_suffix", **kwargs):
        super().__init__(model, processor, backend=TorchBackend(device, dtype, kernel, migration), **kwargs)

    device = property(lambda self: self.backend.device, doc="The model's device.")
    kernel = property(lambda self: self.backend.kernel, doc="The attention kernel asked for (None: by device).")
    migration = property(lambda self: self.backend.migration, doc="The OmniPage migration mode.")

    @classmethod
    def restore(cls, path: str | os.PathLike, model=None, processor=None, on_update=None, *, device=None,
                dtype=None, kernel: str | None = None):
        """Load a session written by ``save`` (the engine's restore). ``model`` defaults to the saved model path,
        loaded on ``device`` in ``dtype``; ``kernel`` overrides the saved attention kernel. The OmniPage migration
        mode follows the saved layout (ordered-suffix tables are first-fit, class-aware ones class-aware)."""
        return super().restore(path, model, processor, on_update, device=device, dtype=dtype, kernel=kernel)


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def make_sampler(sampling: Sampling):
    """``(logits, generated ids) -> next id`` with mlx-lm's semantics: ``temp`` 0 is greedy; otherwise repetition
    penalty, then top-k, top-p (nucleus) and min-p filters, then a draw at temperature ``temp``."""
    gen = None
    if sampling.seed is not None:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(int(sampling.seed))

    def sample(logits: torch.Tensor, generated: list[int]) -> int:
        lg = logits.detach().to(torch.float32).reshape(-1).clone()
        if sampling.repetition_penalty and generated:
            idx = torch.as_tensor(sorted(set(generated)), device=lg.device)
            vals = lg[idx]
            lg[idx] = torch.where(vals < 0, vals * sampling.repetition_penalty, vals / sampling.repetition_penalty)
        if sampling.temp == 0:
            return int(torch.argmax(lg).item())
        logp = torch.log_softmax(lg, dim=-1)
        if sampling.top_k and sampling.top_k > 0:
            kth = torch.topk(logp, min(sampling.top_k, logp.numel())).values[-1]
            logp = logp.masked_fill(logp < kth, float("-inf"))
        if 0 < sampling.top_p < 1:
            probs, order = torch.sort(logp.exp(), descending=True)
            drop = torch.cumsum(probs, 0) - probs > sampling.top_p  # keep the smallest prefix reaching top_p
            logp[order[drop]] = float("-inf")
        if sampling.min_p and sampling.min_p > 0:
            logp = logp.masked_fill(logp < logp.max() + float(np.log(sampling.min_p)), float("-inf"))
        probs = torch.softmax(logp / sampling.temp, dim=-1).to("cpu")
        return int(torch.multinomial(probs, 1, generator=gen).item())

    return sample
