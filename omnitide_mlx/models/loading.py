"""Checkpoint loading in the Hugging Face layout: a local folder or a Hub id through the local cache.

Weights are safetensors only (pickle-based ``*.bin`` / ``*.pt`` files are refused, never opened). A checkpoint that
does not match its config fails with the missing, unexpected and mis-shaped keys listed. Quantised checkpoints
written by ``omnitide convert`` carry ``"quantization": {"group_size", "bits"}`` in config.json, as mlx-lm's do.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..errors import OmniTideError

if TYPE_CHECKING:  # path resolution and config reading work without MLX (the torch path uses them)
    import mlx.core as mx
    import mlx.nn as nn

ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model", "*.tiktoken"]
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class CheckpointError(OmniTideError, ValueError):
    """A model that cannot be found or does not load: says which and why."""


def resolve_model_path(path_or_id: str | os.PathLike, revision: str | None = None) -> Path:
    """A local folder, or a Hub id resolved through the local Hugging Face cache (downloaded only when it is not
    cached and ``HF_HUB_OFFLINE`` is not set)."""
    text = str(path_or_id)
    p = Path(text).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise CheckpointError(f"{p} has no config.json: not a Hugging Face model folder")
        return p
    if p.exists():
        raise CheckpointError(f"{p} is a file; pass the model folder (the one holding config.json)")
    if not _HUB_ID.match(text) or text.startswith((".", "/", "~")):
        raise CheckpointError(f"no model folder at {p}, and {text!r} is not a Hugging Face id (org/name)")

    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(text, revision=revision, allow_patterns=ALLOW_PATTERNS,
                                      local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError):
        pass
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        raise CheckpointError(f"{text} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set")
    try:
        return Path(snapshot_download(text, revision=revision, allow_patterns=ALLOW_PATTERNS))
    except Exception as e:  # RepositoryNotFoundError, network errors, gated repos, ...
        kind = type(e).__name__
        if "RepositoryNotFound" in kind or "404" in str(e):
            raise CheckpointError(f"unknown model id {text!r} (not on the Hugging Face Hub)") from None
        raise CheckpointError(f"could not fetch {text!r} from the Hugging Face Hub ({kind}: {e}); "
                              "download it on a connected machine or pass a local folder") from None


def load_config(path: Path) -> dict:
    try:
        with open(path / "config.json", encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path / 'config.json'} is not valid JSON: {e}") from None


def config_fields(cls, d: dict, renames: dict[str, str] | None = None, defaults: dict | None = None) -> dict:
    """The keyword arguments of config dataclass ``cls`` that config dict ``d`` gives: its keys that name a field of
    ``cls`` (a key in ``renames`` is read as the field it maps to: file name -> field name), tuples as lists; other
    keys are ignored, and a field ``d`` lacks takes ``defaults``' value where it has one, else the class's own."""
    names = {f.name for f in dataclasses.fields(cls)}
    out = {k: v for k, v in (defaults or {}).items() if k in names}
    for k, v in d.items():
        k = (renames or {}).get(k, k)
        if k in names:
            out[k] = list(v) if isinstance(v, tuple) else v
    return out


def load_safetensors(path: Path) -> dict[str, mx.array]:
    """Every tensor of every ``*.safetensors`` file in the folder."""
    import mlx.core as mx

    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = sorted(f.name for f in path.iterdir() if f.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise CheckpointError(f"{path} holds only pickle-based weights ({', '.join(pickles[:3])}); "
                                  "omnitide loads safetensors only")
        raise CheckpointError(f"{path} holds no *.safetensors weights")
    weights: dict[str, mx.array] = {}
    for f in files:
        try:
            part = mx.load(str(f))
        except Exception as e:
            raise CheckpointError(f"{f.name} is not a readable safetensors file ({e})") from None
        if not isinstance(part, dict):
            raise CheckpointError(f"{f.name} is not a safetensors file")
        weights.update(part)
    return weights


def describe_mismatch(expected: dict[str, tuple], weights: dict[str, mx.array], limit: int = 20) -> str | None:
    """A readable list of missing / unexpected / mis-shaped keys, or None when they match."""
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    misshaped = sorted((k, tuple(weights[k].shape), tuple(expected[k])) for k in set(expected) & set(weights)
                       if tuple(weights[k].shape) != tuple(expected[k]))
    if not (missing or unexpected or misshaped):
        return None
    lines = []

    def block(title, items, fmt):
        if items:
            lines.append(f"{title} ({len(items)}):")
            lines.extend("  " + fmt(i) for i in items[:limit])
            if len(items) > limit:
                lines.append(f"  ... and {len(items) - limit} more")

    block("missing keys", missing, str)
    block("unexpected keys", unexpected, str)
    block("mis-shaped keys", misshaped, lambda t: f"{t[0]}: checkpoint {t[1]}, config expects {t[2]}")
    return "\n".join(lines)


def apply_quantization(model: nn.Module, config: dict, weights: dict[str, mx.array]) -> None:
    """Swap in quantised layers where the checkpoint has ``.scales`` (as mlx-lm does for its conversions)."""
    import mlx.nn as nn

    q = config.get("quantization")
    if not q:
        return

    def predicate(p: str, m: nn.Module) -> bool:
        return hasattr(m, "to_quantized") and f"{p}.scales" in weights

    nn.quantize(model, group_size=q["group_size"], bits=q["bits"], mode=q.get("mode", "affine"),
                class_predicate=predicate)


def load_weights_strict(model: nn.Module, weights: dict[str, mx.array], what: str = "checkpoint") -> None:
    """Load ``weights`` into ``model``; raise CheckpointError listing every mismatch first."""
    from mlx.utils import tree_flatten

    expected = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    problem = describe_mismatch(expected, weights)
    if problem:
        raise CheckpointError(f"the {what} does not match its config:\n{problem}")
    model.load_weights(list(weights.items()), strict=True)


def save_converted(model: nn.Module, config: dict, src: Path, dst: Path, *, bits: int | None = 4,
                   group_size: int = 64, dtype: mx.Dtype | None = None,
                   quant_predicate: Callable[[str, nn.Module], bool] | None = None) -> dict:
    """Write ``model`` (already loaded and sanitised) to ``dst`` as MLX safetensors, quantised when ``bits``.

    Tokenizer and processor files are copied from ``src``. Returns the written config.
    """
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.utils import quantize_model, save_model

    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads(json.dumps(config))
    if dtype is not None:
        model.update(tree_map(lambda a: a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) else a,
                              model.parameters()))
        config["torch_dtype"] = {mx.float16: "float16", mx.bfloat16: "bfloat16", mx.float32: "float32"}[dtype]
    if bits:
        def predicate(p: str, m: nn.Module) -> bool:
            if not hasattr(m, "to_quantized") or getattr(m, "weight", None) is None:
                return False
            if m.weight.shape[-1] % group_size != 0:
                return False
            return quant_predicate(p, m) if quant_predicate else True

        model, config = quantize_model(model, config, group_size, bits, quant_predicate=predicate)
    config["omnitide_converted"] = True  # weights are already in MLX layout: loaders skip sanitising
    save_model(dst, model)
    with open(dst / "config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith(".safetensors") \
                and f.name != "model.safetensors.index.json" and f.suffix in (".json", ".txt", ".jinja", ".model",
                                                                               ".tiktoken"):
            shutil.copy2(f, dst / f.name)
    return config
