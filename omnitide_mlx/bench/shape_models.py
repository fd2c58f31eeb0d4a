"""Shape-true models for ``omnitide bench stream``: the ports' own LanguageModel classes at the real per-layer
shapes, random weights, fewer layers, fed units of random embeddings laid out like the model's real units.

Why this is enough to time a streaming update: the cost of one update depends on the shapes (hidden size, heads,
KV heads, head_dim, intermediate size), the chunk length and the keys each query visits, never on the weights or
the values in the cache. Layers repeat, so per-layer cost ratios are what matter: the benchmark runs ``layers``
of them (default 1) and says so. The vocabulary is reduced (default 4096): a streaming prefill computes logits for
the last position only, so the real vocabulary would only add memory, and its cost is counted in ``flops``.

``ShapeTrueModel`` is what ``OmniSession`` needs from a model (``language_model``, ``kv_spec()``,
``stream_adapter()``, ``dtype``); ``RandomUnitAdapter`` turns a second of camera + microphone into the profile's
media unit (the unit the model's layout code builds at the media setting: models/stream_units.py, with its typed
spans and TMRoPE or 1-D positions) with random
embeddings drawn once and reused, so no encoder runs (their cost does not depend on the retention policy) and
"input processing" is the engine's own validation and unit assembly. Questions carry one text token per word.
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np

from ..core.profiles import ModelProfile
from ..core.shapes import ModelShape
from ..core.stream_units import MediaSetting, StreamUnits
from ..core.units import SpanKind, UnitKind
from ..models.base import KVSpec, PreparedUnit, StreamAdapter, spans_from_runs, text_positions
from ..models.family import get_family, profiles
from ..models.minicpmo.family import FRAMING as MINICPMO_FRAMING
from ..models.stream_units import resolve_profile
from ..rope import RopeSpec


# for the CI smoke test only: a small Qwen3-style model with MiniCPM-style units (seconds, not minutes); its units
# are made up (a 32-token source image, 2 slices of 16, 4 audio tokens), so they are written here. head_dim 32: the
# smallest MLX quantisation group (--kv-bits needs head_dim divisible by --kv-group-size 32, 64 or 128)
TINY_SHAPE = ModelShape("tiny", "minicpmo", layers=2, hidden=64, intermediate=128, q_heads=4, kv_heads=2, head_dim=32,
                        vocab=256, rope_theta=1e4, source="made up for the CI smoke test")
TINY_PROFILE = ModelProfile(
    name="tiny", display="tiny (CI)", rope_axes=1, shape=TINY_SHAPE, framing=MINICPMO_FRAMING, system_tokens=8,
    high=200, low=140,
    pick={"recent_units": 2, "image_sink": 4, "audio_sink": 2, "slice_sink": 2, "text_budget": 32},
    units=StreamUnits.sequential("minicpmo", MediaSetting(name="tiny"), [
        (SpanKind.BOUNDARY, 2), (SpanKind.IMAGE_SOURCE, 32), (SpanKind.BOUNDARY, 2), (SpanKind.IMAGE_SLICE, 16),
        (SpanKind.BOUNDARY, 2), (SpanKind.IMAGE_SLICE, 16), (SpanKind.BOUNDARY, 1), (SpanKind.AUDIO, 4),
        (SpanKind.BOUNDARY, 2)]),
    notes="benchmark smoke tests only")

# the real shapes (the family records', one per profile of a family that builds its language model at a shape) and
# the CI one
SHAPES: dict[str, ModelShape] = {**{n: p.shape for n, p in profiles().items()
                                    if get_family(p.family).language_model is not None}, "tiny": TINY_SHAPE}


def profile_for(shape: str, setting: MediaSetting | str | None = None) -> ModelProfile:
    """The shape's profile with the media unit its model builds at ``setting`` (default: the default setting)."""
    return TINY_PROFILE if shape == "tiny" else resolve_profile(shape, setting)


def update_flops(shape: ModelShape, layers: int, vocab: int, chunk: int, keys_visited: float) -> float:
    """FLOPs of one prefill of ``chunk`` tokens: per layer the projections and MLP (2 x MACs x tokens) and attention
    (QK^T and PV: 4 x q_heads x head_dim x the keys each query visits, summed over queries), plus the logits of
    the last position."""
    linear = 2.0 * shape.linear_macs_per_token() * chunk
    attention = 4.0 * shape.q_heads * shape.head_dim * keys_visited
    return layers * (linear + attention) + 2.0 * shape.hidden * vocab


class ShapeTrueModel:
    """A port's LanguageModel at a real shape with random float32 weights; what OmniSession needs of a model."""

    def __init__(self, shape: str, layers: int = 1, vocab: int = 4096, seed: int = 0, dtype=mx.float32,
                 setting: MediaSetting | str | None = None):
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r}; choose one of {sorted(SHAPES)}")
        if layers < 1 or vocab < 16:
            raise ValueError("layers must be >= 1 and vocab >= 16")
        self.real = SHAPES[shape]
        self.shape = replace(self.real, layers=layers, vocab=vocab)
        self.profile = profile_for(shape, setting)
        self.dtype = dtype
        mx.random.seed(seed)
        s = self.shape
        self.language_model, self.position_axes = get_family(s.family).language_model(s, layers, vocab)
        self.language_model.set_dtype(dtype)
        mx.eval(self.language_model.parameters())
        from mlx.utils import tree_flatten

        self.weights_bytes = sum(p.nbytes for _, p in tree_flatten(self.language_model.parameters()))


    def kv_spec(self) -> KVSpec:
        s = self.shape
        return KVSpec(num_layers=s.layers, kv_heads=s.kv_heads, head_dim=s.head_dim,
                      rope=RopeSpec(s.head_dim, s.rope_theta, traditional=False), position_axes=self.position_axes)

    def stream_adapter(self, processor=None) -> "RandomUnitAdapter":
        return RandomUnitAdapter(self)


class RandomUnitAdapter(StreamAdapter):
    """Units with the profile's layout and random embeddings (drawn once per length and reused)."""

    sample_rate = 16000

    def __init__(self, model: ShapeTrueModel):
        self.model = model
        self.profile = model.profile
        self.kv_spec = model.kv_spec()
        self.stop_token_ids = frozenset()  # replies run to max_tokens: the stream decides their length
        self._pool: dict[int, mx.array] = {}
        self._rng = np.random.default_rng(1234)

    def embeddings(self, n: int) -> mx.array:
        """``[n, hidden]`` random embeddings of unit-like scale (evaluated once, reused)."""
        if n not in self._pool:
            x = self._rng.standard_normal((n, self.model.shape.hidden), dtype=np.float32)
            self._pool[n] = mx.array(x).astype(self.model.dtype)
            mx.eval(self._pool[n])
        return self._pool[n]

    def _prepared(self, kind: UnitKind, spans, positions: np.ndarray, t=None, label="") -> PreparedUnit:
        n = int(positions.shape[1])
        return PreparedUnit(kind=kind, input_ids=np.zeros(n, dtype=np.int32), inputs_embeds=self.embeddings(n),
                            spans=list(spans), positions=positions, t=t, label=label)

    def system_unit(self, prompt: str | None, start: int) -> PreparedUnit:
        u = self.profile.system_unit(0)
        return self._prepared(UnitKind.SYSTEM, u.spans, u.positions + start, label="system")

    def media_unit(self, frame, audio, t, start: int) -> PreparedUnit:
        u = self.profile.media_unit(0, start, t)
        return self._prepared(UnitKind.MEDIA, u.spans, u.positions, t=t, label="av")

    def user_unit(self, text: str, start: int) -> PreparedUnit:
        runs = self.profile.framing.question_runs(len(text.split()))
        n = sum(k for _, k in runs)
        positions = text_positions(start, n, self.kv_spec.position_axes)
        return self._prepared(UnitKind.USER, spans_from_runs(runs), positions, label=text[:40])

    def context_unit(self, text: str, start: int) -> PreparedUnit:
        n = len(text.split())
        return self._prepared(UnitKind.USER, spans_from_runs([(SpanKind.TEXT, n)]),
                              text_positions(start, n, self.kv_spec.position_axes), label=text[:40])

    def embed_tokens(self, ids) -> mx.array:
        return self.model.language_model.embed_tokens(mx.array(np.asarray(ids, dtype=np.int32)))

    def finish_reply(self, generated: list[int], stopped: bool) -> list[int]:
        return [0] * len(self.profile.framing.reply_close)

    def decode(self, ids) -> str:
        return " ".join(f"t{int(i)}" for i in ids)
