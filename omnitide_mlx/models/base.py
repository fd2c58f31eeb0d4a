"""What every model port offers the engine: its KV shape and a per-session stream adapter.

The session never looks at a model's token layout. It asks the adapter for a ``PreparedUnit`` (token ids, the
merged input embeddings with every encoder already run, typed spans for OmniPick, logical positions), prefills
it through ``model.language_model`` with an ``OmniCache``, and appends ``prepared.to_unit(uid)`` to the history.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.shapes import kv_bytes_per_token
from ..core.units import Span, SpanKind, Unit, UnitKind
from ..errors import MediaError  # noqa: F401  (re-exported: adapters raise it)
from ..rope import RopeSpec

if TYPE_CHECKING:  # this module stays importable without MLX (the torch path reuses the adapters' layouts)
    import mlx.core as mx


@dataclass(frozen=True)
class KVSpec:
    """The KV cache a model's language model needs."""

    num_layers: int
    kv_heads: int
    head_dim: int
    rope: RopeSpec
    position_axes: int = 1  # 1 for plain RoPE, 3 for M-RoPE (t, h, w)

    def bytes_per_token(self, dtype=None, kv_bits: int | None = None, kv_group_size: int = 64) -> int:
        """K and V bytes of one token over all layers (``core.shapes.kv_bytes_per_token``); ``dtype`` an MLX or
        torch dtype (default: 2 bytes); ``kv_bits``: quantised, with scales and biases in ``dtype``."""
        size = 2 if dtype is None else getattr(dtype, "itemsize", None) or dtype.size
        return kv_bytes_per_token(self.num_layers, self.kv_heads, self.head_dim, int(size), kv_bits, kv_group_size)


@dataclass
class PreparedUnit:
    """A unit ready to prefill: everything the model needs, nothing in the cache yet."""

    kind: UnitKind
    input_ids: np.ndarray  # [T] int32, media placeholders included
    inputs_embeds: mx.array  # [T, hidden]: token embeddings with encoder outputs merged in
    spans: list[Span]  # typed spans tiling [0, T)
    positions: np.ndarray  # [axes, T] logical RoPE positions (absolute)
    t: float | None = None
    label: str = ""
    extras: dict[str, Any] = field(default_factory=dict)  # adapter-specific (e.g. encoder timings)

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])

    def to_unit(self, uid: int) -> Unit:
        return Unit(uid=uid, kind=self.kind, spans=tuple(self.spans), positions=self.positions, t=self.t,
                    label=self.label)


def text_positions(start: int, n: int, axes: int) -> np.ndarray:
    """Sequential positions for ``n`` text tokens on every axis."""
    return np.broadcast_to(np.arange(start, start + n, dtype=np.int64), (axes, n)).copy()


def spans_from_runs(runs: list[tuple[SpanKind, int]]) -> list[Span]:
    """``[(kind, length), ...]`` -> consecutive spans, merging neighbours of the same kind."""
    out: list[Span] = []
    cursor = 0
    for kind, n in runs:
        if n <= 0:
            continue
        if out and out[-1].kind is kind:
            out[-1] = Span(kind, out[-1].start, cursor + n)
        else:
            out.append(Span(kind, cursor, cursor + n))
        cursor += n
    return out


class StreamAdapter(ABC):
    """One session's view of a model's streaming protocol.

    It holds protocol state (is a user turn open, a streaming audio encoder's cache, ...), so a session creates
    its own with ``model.stream_adapter(processor)``. Every ``*_unit`` method validates its input and raises
    ``MediaError`` before anything is computed into the session's cache; ``start`` is the logical position the
    unit begins at (``history.next_position()``).
    """

    kv_spec: KVSpec
    sample_rate: int = 16000  # audio handed to media_unit is mono float32 at this rate
    stop_token_ids: frozenset[int] = frozenset()

    @abstractmethod
    def system_unit(self, prompt: str | None, start: int) -> PreparedUnit:
        """The system prefix (``prompt`` None: the model's default system prompt)."""

    @abstractmethod
    def media_unit(self, frame: np.ndarray | None, audio: np.ndarray | None, t: float | None,
                   start: int) -> PreparedUnit:
        """One streaming chunk: an ``HxWx3`` uint8 RGB frame and/or about one second of audio."""

    @abstractmethod
    def user_unit(self, text: str, start: int) -> PreparedUnit:
        """A user's question or text turn, ending with the tokens that open the model's reply."""

    @abstractmethod
    def context_unit(self, text: str, start: int) -> PreparedUnit:
        """User text that joins the stream as context without asking for a reply (a caption, a note); it sits
        in the user turn like a media unit does."""

    @abstractmethod
    def embed_tokens(self, ids: list[int] | np.ndarray) -> mx.array:
        """Token embeddings ``[T, hidden]`` (used for decode steps and closing tokens)."""

    @abstractmethod
    def finish_reply(self, generated: list[int], stopped: bool) -> list[int]:
        """Called when a reply ends (``stopped``: on a stop token, else on max tokens). Returns the tokens to
        append to the reply unit as boundary tokens (may be empty when the model's protocol puts them at the
        start of the next unit) and updates the protocol state."""

    @abstractmethod
    def decode(self, ids: list[int]) -> str:
        """Text of generated token ids (special tokens dropped)."""

    def state(self) -> tuple[dict, dict[str, mx.array]]:
        """Protocol state for ``OmniSession.save``: JSON-able dict and named arrays."""
        return {}, {}

    def load_state(self, meta: dict, arrays: dict[str, mx.array]) -> None:
        """Restore what ``state`` returned."""
