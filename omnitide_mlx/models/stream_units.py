"""Profiles with their media unit, from the models' own layout code (numpy-only: no MLX, no weights).

``resolve_profile("qwen2.5-omni-7b", "paper")`` is the profile the simulator, both benchmarks and the eval harness
stream: the family record's profile (``models/<family>/family.py``: shape, framing, retention defaults) with the
:class:`~..core.stream_units.StreamUnits` its layout code (``models/<family>/layout.py``) computes for the setting
(the same functions the engine's adapters assemble units with; tests/models/test_stream_units.py checks the
equality on real frames).
"""

from __future__ import annotations

from ..core.profiles import ModelProfile, ProfileError
from ..core.stream_units import MediaSetting, StreamUnits, get_preset
from .family import get_family, get_profile, profiles

__all__ = ["get_profile", "media_setting", "profile_for_spec", "resolve_profile", "stream_units"]


def media_setting(setting: MediaSetting | str | None = None) -> MediaSetting:
    if setting is None:
        return get_preset("default")
    if isinstance(setting, str):
        return get_preset(setting)
    return setting


def stream_units(profile: ModelProfile | str, setting: MediaSetting | str | None = None) -> StreamUnits:
    """The media unit ``profile``'s model builds at ``setting`` (a MediaSetting or a preset name)."""
    prof = get_profile(profile) if isinstance(profile, str) else profile
    family = get_family(prof.family)
    if family.stream_units is None:
        raise ProfileError(f"{prof.name}: the {family.name} family streams no media unit")
    return family.stream_units(media_setting(setting), **prof.layout_kw)


def resolve_profile(profile: ModelProfile | str, setting: MediaSetting | str | None = None) -> ModelProfile:
    """``profile`` (a name or a profile) carrying the media unit its model builds at ``setting``; a profile that
    already carries its units keeps them when ``setting`` is None."""
    prof = get_profile(profile) if isinstance(profile, str) else profile
    if setting is None and prof.units is not None:
        return prof
    return prof.with_units(stream_units(prof, setting))


def profile_for_spec(spec) -> ModelProfile | None:
    """The profile of a loaded model from its KV shape (a ``KVSpec``: position axes, layers, KV heads, head dim), or
    None (tiny test models, text-only models): how a session finds the model's default watermarks."""
    axes = getattr(spec, "position_axes", 1)
    for p in profiles().values():
        if (p.rope_axes, p.layers, p.kv_heads, p.head_dim) == (axes, spec.num_layers, spec.kv_heads, spec.head_dim):
            return p
    return None
