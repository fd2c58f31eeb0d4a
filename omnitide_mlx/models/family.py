"""Model families: one record per model folder, gathered in one registry (no MLX import: records are plain data
and references to functions that import their folder's MLX code when called).

A record says everything the rest of the package asks of a model without branching on its name: the ``config.json``
``model_type`` values and released Hub ids it accepts, how to load it, the chat framing around questions and
replies, its shapes with their default watermarks and presets (the simulator's profiles), its unit layout at a
media setting, its shape from a checkpoint's config, the shape-true language model the stream benchmark times, its
speech voicer and its tiny-checkpoint writer. Each folder defines its record in ``family.py`` as ``FAMILY``; the one
line a new model adds here is its folder's name in :data:`FOLDERS` (docs/design.md, "Adding a model").
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..core.profiles import ChatFraming, ModelProfile, ProfileError
from ..core.shapes import ModelShape
from ..core.stream_units import MediaSetting, StreamUnits

# the model folders, each with a family.py defining FAMILY (the one line a new model adds)
FOLDERS = ("qwen2_5_omni", "minicpmo", "llama_gguf", "qwen3_omni")


@dataclass(frozen=True)
class ModelFamily:
    """One model folder's record. Functions are called with plain data and import MLX only when they must."""

    name: str  # the folder's name; ModelShape.family, StreamUnits.family and saved sessions use it
    display: str
    framing: ChatFraming  # the boundary tokens around a question and a reply (core/profiles.py)
    load: Callable[..., tuple]  # load(path, config: dict | None, **kw) -> (model, processor)
    processor: Callable[[Path], Any] | None = None  # the processor (tokenizer + media preprocessing) of a checkpoint
    model_types: tuple[str, ...] = ()  # config.json "model_type" values ``omnitide_mlx.load`` hands to ``load``
    hub_ids: tuple[str, ...] = ()  # released checkpoints the port is written for
    profiles: tuple[ModelProfile, ...] = ()  # shapes, default watermarks and OmniPick knobs, as the simulator runs them
    # the media unit at a setting: (setting, **profile.layout_kw) -> StreamUnits (numpy only); None: text only
    stream_units: Callable[..., StreamUnits] | None = None
    # a checkpoint's shape and media unit read from its files: (path, config, media, frame, audio) ->
    # (ModelShape, StreamUnits); the KV budget check calls it before anything loads
    checkpoint_units: Callable[..., tuple[ModelShape, StreamUnits]] | None = None
    # (shape, layers, vocab) -> (the port's language model at that shape, RoPE axes): the stream benchmark's model
    language_model: Callable[..., tuple[Any, int]] | None = None
    voicer: Callable[..., Any] | None = None  # (session, checkpoint path) -> the speech stack; None: no speech
    # writes a tiny random checkpoint in the released layout: (dst, speech=False) -> its path; ``speech``: with the
    # speech stack (families with a voicer)
    write_tiny: Callable[..., Path] | None = None
    # ``omnitide convert``'s extra parts: (src, config) -> None, or a writer (dst) -> the line to print, loaded
    # before the weights are written so a broken part fails first (Qwen2.5-Omni's talker, token2wav and voices)
    convert_extra: Callable[[Path, dict], Callable[[Path], str] | None] | None = None
    model_classes: tuple[str, ...] = ()  # "module:Class" of the loaded models (how a saved session names its model)
    notes: str = ""
    extra: dict = field(default_factory=dict)

    def profile(self, name: str) -> ModelProfile:
        for p in self.profiles:
            if name == p.name or name in p.aliases:
                return p
        raise ProfileError(f"{self.name} has no profile {name!r}; it has {[p.name for p in self.profiles]}")


_FAMILIES: dict[str, ModelFamily] | None = None


def families() -> dict[str, ModelFamily]:
    """Every registered family by name, in :data:`FOLDERS` order (the folders' family.py, imported once)."""
    global _FAMILIES
    if _FAMILIES is None:
        found: dict[str, ModelFamily] = {}
        for folder in FOLDERS:
            record = importlib.import_module(f"{__package__}.{folder}.family").FAMILY
            if record.name != folder:
                raise RuntimeError(f"models/{folder}/family.py registers {record.name!r}: a record is named after "
                                   "its folder")
            found[folder] = record
        _FAMILIES = found
    return _FAMILIES


def get_family(name: str) -> ModelFamily:
    fams = families()
    if name not in fams:
        raise ProfileError(f"unknown model family {name!r}; registered: {sorted(fams)}")
    return fams[name]


def family_for_model_type(model_type: str | None) -> ModelFamily | None:
    """The family that loads checkpoints whose config.json says ``model_type`` (None when none does)."""
    for f in families().values():
        if model_type in f.model_types:
            return f
    return None


def model_types() -> dict[str, str]:
    """``model_type`` -> family name, for every family that loads config.json checkpoints."""
    return {t: f.name for f in families().values() for t in f.model_types}


def profiles() -> dict[str, ModelProfile]:
    """Every family's profiles by name (the simulator's and the benchmarks' ``--profile`` / ``--shape``)."""
    return {p.name: p for f in families().values() for p in f.profiles}


def shapes() -> dict[str, ModelShape]:
    """The released shapes by profile name."""
    return {n: p.shape for n, p in profiles().items()}


def get_profile(name: str) -> ModelProfile:
    """A profile by its name or an alias (case-insensitive), without its media unit
    (``models.stream_units.resolve_profile`` adds it)."""
    key = str(name).lower()
    for p in profiles().values():
        if key == p.name or key in p.aliases:
            return p
    raise ProfileError(f"unknown profile {name!r}; choose one of {sorted(profiles())}")


def family_of(model) -> str:
    """The family name a loaded model belongs to (its class is listed in a record's ``model_classes``), else its
    class name (a benchmark's shape-true model, a test double): what a saved session records."""
    cls = f"{type(model).__module__}:{type(model).__qualname__}"
    for f in families().values():
        if cls in f.model_classes:
            return f.name
    return type(model).__name__
