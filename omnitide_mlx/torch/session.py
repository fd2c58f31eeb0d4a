"""TorchSession: the streaming engine on PyTorch (CUDA, or the CPU for tests). Same API as the MLX OmniSession.

    session = TorchSession("Qwen/Qwen2.5-Omni-3B", device="cuda", policy="omnitide", high=2500, low=1800)
    session.push(frame=rgb, audio=samples, sample_rate=48000)
    for piece in session.ask("What colour is the square?"):
        print(piece, end="")

Units, retention, replies, threads and save / restore are the engine's (engine.py); this module supplies the
PyTorch pieces: transformers' thinker with the ``"omnitide"`` attention, the OmniTorchCache, sampling, safetensors.

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

from ..core.layout import OMNIPAGE_MIGRATIONS, make_layout
from ..engine import Sampling, StreamingSession, _model_ref
from ..errors import RestoreError
from .cache import OmniTorchCache

MIGRATIONS = tuple(reversed(OMNIPAGE_MIGRATIONS))  # the default first: ordered_suffix


class TorchSession(StreamingSession):
    """A streaming session over transformers' Qwen2.5-Omni thinker: push media, ask questions, bounded KV.

    ``model`` is a local path / Hugging Face id, or a ``(TorchQwenOmni, Processor)`` pair from
    :func:`omnitide_mlx.torch.qwen2_5_omni.load`. ``device``: ``"cuda"``, ``"cpu"``, ... (used when loading from a
    path; default CUDA when available); ``dtype``: the model's dtype when loading (default: float32 on the CPU,
    the checkpoint's on CUDA); ``kernel``: the cache's attention kernel (``flex`` / ``sdpa`` / ``reference``;
    default by device); ``migration``: the OmniPage planner mode. Other arguments are the engine's.
    """

    backend = "torch"
    device = None  # set per instance; class defaults let the engine's restore build an instance first
    kernel = None
    migration = "ordered_suffix"
    _load_dtype = None

    def __init__(self, model, processor=None, *, device=None, dtype=None, kernel: str | None = None,
                 migration: str = "ordered_suffix", **kwargs):
        if migration not in MIGRATIONS:
            raise ValueError(f"migration must be one of {MIGRATIONS}, got {migration!r}")
        self.device = torch.device(device) if device is not None else None
        self._load_dtype = dtype
        self.kernel = kernel
        self.migration = migration
        super().__init__(model, processor, **kwargs)
        _, self.planner = make_layout(self.policy.layout, self.cache.page_table.page_size,
                                      self.cache.page_table.subblock_size, migration=migration)

    # --- backend hooks ------------------------------------------------------------------------------------------
    def _load_model(self, path):
        from .qwen2_5_omni import load

        return load(path, device=self.device or _default_device(), dtype=self._load_dtype)

    def _default_kv_dtype(self, model) -> torch.dtype:
        return model.dtype

    def _dtype_from_name(self, name: str) -> torch.dtype:
        if name not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"unknown KV dtype {name!r} in the saved session")
        return getattr(torch, name)

    def _make_cache(self, spec, *, placement, page_size, subblock_size, collect_scores) -> OmniTorchCache:
        if self.policy.layout == "omnipage":  # the engine asked for the class-aware layout's placement: use ours
            table, _ = make_layout("omnipage", page_size, subblock_size, migration=self.migration)
            placement = table.placement
        return OmniTorchCache.for_spec(spec, dtype=self.kv_dtype, device=self.model.device, page_size=page_size,
                                       subblock_size=subblock_size, placement=placement, kernel=self.kernel,
                                       collect_scores=collect_scores)

    def _load_cache(self, path: Path) -> OmniTorchCache:
        return OmniTorchCache.load(path, device=self.model.device, kernel=self.kernel)

    def _forward(self, embeds: torch.Tensor, positions: np.ndarray) -> torch.Tensor:
        try:
            return self.model.step_logits(embeds, positions, self.cache)
        except BaseException:
            if self.cache.in_step:
                self.cache.abort_step()
            raise

    def _eval(self, *arrays) -> None:
        if any(isinstance(a, torch.Tensor) and a.is_cuda for a in arrays):
            torch.cuda.synchronize()

    def _sampler(self, sampling: Sampling):
        return make_sampler(sampling)

    def _save_arrays(self, path: Path, arrays: dict) -> None:
        from safetensors.torch import save_file

        out = {}
        for k, v in arrays.items():
            t = v if isinstance(v, torch.Tensor) else torch.as_tensor(np.ascontiguousarray(v))
            out[k] = t.detach().to("cpu").contiguous()
        save_file(out, str(path))

    def _load_arrays(self, path: Path) -> dict:
        from safetensors.torch import load_file

        return load_file(str(path))

    @classmethod
    def restore(cls, path: str | os.PathLike, model=None, processor=None, on_update=None, *, device=None,
                dtype=None, kernel: str | None = None):
        """Load a session written by ``save`` (the engine's restore). ``model`` defaults to the saved model path,
        loaded on ``device`` in ``dtype``; ``kernel`` overrides the saved attention kernel. The OmniPage migration
        mode follows the saved layout (ordered-suffix tables are first-fit, class-aware ones class-aware)."""
        if model is None or isinstance(model, (str, os.PathLike)):
            from .qwen2_5_omni import load

            if model is None:
                model = cls.read_meta(path).get("model_path")
                if not model:
                    raise RestoreError(f"{Path(path) / 'session.json'} does not record its model; pass model=")
            model_path = _model_ref(model)
            model = load(model, device=device or _default_device(), dtype=dtype)
        else:
            model_path = None
        self = super().restore(path, model=model, processor=processor, on_update=on_update)
        if model_path is not None:
            self.model_path = model_path
        self.device, self._load_dtype = self.model.device, dtype
        if kernel is not None:
            self.cache.set_kernel(kernel)
        self.kernel = self.cache.kernel
        table = self.cache.page_table
        self.migration = "class_aware" if table.placement == "class_aware" else "ordered_suffix"
        _, self.planner = make_layout(self.policy.layout, table.page_size, table.subblock_size,
                                      migration=self.migration)
        return self


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
