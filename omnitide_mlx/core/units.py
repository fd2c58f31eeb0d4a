"""Units: the streaming events OmniPick and OmniPage reason about.

A *unit* is the token sequence of one streaming event (an audiovisual chunk, a user turn, a model reply, the
system prompt), described as consecutive typed spans. Model adapters build units from their own token layout;
everything in ``core`` works on these records only, never on tokens or tensors.

Every token of a unit belongs to exactly one span, spans are in token order, and each token carries a logical
position (one axis for plain RoPE, three (t, h, w) for M-RoPE). Positions are what RoPE saw when the token's key
was written, shifted by every eviction since.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Iterable, Iterator, Sequence

import numpy as np

from .errors import OmniTideError


class UnitError(OmniTideError, ValueError):
    """A malformed unit or history (overlapping spans, spans outside the unit, an empty unit, ...)."""


class Modality(str, Enum):
    """What a span carries, for the per-modality retention budgets."""

    TEXT = "text"
    IMAGE = "image"
    AUDIO = "audio"
    STRUCTURE = "structure"  # boundary / delimiter tokens


class SpanKind(str, Enum):
    """The role of a span inside its unit."""

    SYSTEM = "system"  # the protected system prefix
    BOUNDARY = "boundary"  # structural tokens: <unit>, <image>, <|vision_bos|>, <|im_start|>user\n, ...
    TEXT = "text"  # user text
    IMAGE = "image"  # an image (or video frame) with no slices
    IMAGE_SOURCE = "image_source"  # the downsampled whole image of a sliced image
    IMAGE_SLICE = "image_slice"  # one local slice of a sliced image
    AUDIO = "audio"
    RESPONSE = "response"  # text the model generated

    @property
    def modality(self) -> Modality:
        return _MODALITY[self]


_MODALITY = {
    SpanKind.SYSTEM: Modality.TEXT,
    SpanKind.BOUNDARY: Modality.STRUCTURE,
    SpanKind.TEXT: Modality.TEXT,
    SpanKind.IMAGE: Modality.IMAGE,
    SpanKind.IMAGE_SOURCE: Modality.IMAGE,
    SpanKind.IMAGE_SLICE: Modality.IMAGE,
    SpanKind.AUDIO: Modality.AUDIO,
    SpanKind.RESPONSE: Modality.TEXT,
}


class UnitKind(str, Enum):
    """The streaming event a unit stands for."""

    SYSTEM = "system"  # system prompt: never evicted
    MEDIA = "media"  # one chunk (about a second) of camera frame and/or audio
    USER = "user"  # a user's question or text turn
    REPLY = "reply"  # the model's reply


@dataclass(frozen=True)
class Span:
    """Tokens ``[start, end)`` of a unit (unit-local offsets) with one role."""

    kind: SpanKind
    start: int
    end: int

    def __post_init__(self):
        if not isinstance(self.kind, SpanKind):
            object.__setattr__(self, "kind", SpanKind(self.kind))
        if self.start < 0 or self.end <= self.start:
            raise UnitError(f"span {self.kind.value} [{self.start}, {self.end}) is empty or negative")

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def modality(self) -> Modality:
        return self.kind.modality


@dataclass
class Unit:
    """One streaming event: ``length`` tokens split into consecutive typed spans.

    ``positions`` has shape ``(axes, length)``: the logical RoPE position of every token (axes = 1 for plain
    RoPE, 3 for M-RoPE). ``t`` is the stream time in seconds the unit stands for, when it has one.
    ``trimmed`` is set once a retention plan has deleted some of the unit's tokens (OmniPick drops such
    partially retained units before complete ones).
    """

    uid: int
    kind: UnitKind
    spans: tuple[Span, ...]
    positions: np.ndarray
    t: float | None = None
    label: str = ""
    trimmed: bool = False

    def __post_init__(self):
        if not isinstance(self.kind, UnitKind):
            self.kind = UnitKind(self.kind)
        self.spans = tuple(self.spans)
        pos = np.asarray(self.positions, dtype=np.int64)
        if pos.ndim == 1:
            pos = pos[None, :]
        self.positions = pos
        self.validate()

    @classmethod
    def build(
        cls,
        uid: int,
        kind: UnitKind | str,
        spans: Sequence[tuple[SpanKind | str, int]] | Sequence[Span],
        start_position: int = 0,
        axes: int = 1,
        t: float | None = None,
        label: str = "",
    ) -> "Unit":
        """Build a unit from consecutive ``(kind, length)`` pairs with sequential positions on every axis."""
        out: list[Span] = []
        cursor = 0
        for item in spans:
            if isinstance(item, Span):
                out.append(item)
                cursor = item.end
                continue
            kind_, n = item
            if n <= 0:
                raise UnitError(f"span {kind_} of length {n} in unit {uid}")
            out.append(Span(SpanKind(kind_), cursor, cursor + n))
            cursor += n
        length = out[-1].end if out else 0
        positions = np.broadcast_to(np.arange(start_position, start_position + length, dtype=np.int64),
                                    (axes, length)).copy()
        return cls(uid=uid, kind=UnitKind(kind), spans=tuple(out), positions=positions, t=t, label=label)

    @property
    def length(self) -> int:
        return self.spans[-1].end if self.spans else 0

    @property
    def axes(self) -> int:
        return int(self.positions.shape[0])

    def validate(self) -> None:
        """Spans must tile ``[0, length)`` exactly, in order; positions must match the length."""
        if not self.spans:
            raise UnitError(f"unit {self.uid} has no tokens (length 0)")
        cursor = 0
        for s in self.spans:
            if s.start < cursor:
                raise UnitError(f"unit {self.uid}: span {s.kind.value} [{s.start}, {s.end}) overlaps the previous span")
            if s.start > cursor:
                raise UnitError(f"unit {self.uid}: tokens [{cursor}, {s.start}) belong to no span")
            cursor = s.end
        if self.positions.shape[1] != cursor:
            raise UnitError(
                f"unit {self.uid}: {self.positions.shape[1]} positions for {cursor} tokens")
        if self.kind is UnitKind.SYSTEM and any(s.kind is not SpanKind.SYSTEM for s in self.spans):
            raise UnitError(f"unit {self.uid}: a system unit may only hold system spans")

    def spans_of(self, *kinds: SpanKind) -> list[Span]:
        return [s for s in self.spans if s.kind in kinds]

    def token_kinds(self) -> np.ndarray:
        """The span kind of every token, as an object array (for tests and plots)."""
        out = np.empty(self.length, dtype=object)
        for s in self.spans:
            out[s.start:s.end] = s.kind
        return out

    def max_position(self) -> int:
        return int(self.positions.max())

    def to_json(self) -> dict:
        return {
            "uid": self.uid,
            "kind": self.kind.value,
            "spans": [[s.kind.value, s.start, s.end] for s in self.spans],
            "positions": self.positions.tolist(),
            "t": self.t,
            "label": self.label,
            "trimmed": self.trimmed,
        }

    @classmethod
    def from_json(cls, d: dict) -> "Unit":
        return cls(
            uid=int(d["uid"]),
            kind=UnitKind(d["kind"]),
            spans=tuple(Span(SpanKind(k), int(a), int(b)) for k, a, b in d["spans"]),
            positions=np.asarray(d["positions"], dtype=np.int64),
            t=d.get("t"),
            label=d.get("label", ""),
            trimmed=bool(d.get("trimmed", False)),
        )


@dataclass
class History:
    """The retained units of a session, in stream order, with their logical offsets.

    The logical sequence is the concatenation of the units' tokens; a unit's *offset* is the index of its first
    token in that sequence. The first unit may be the protected system prefix.
    """

    units: list[Unit] = field(default_factory=list)

    def __post_init__(self):
        units, self.units = list(self.units), []
        for u in units:
            self.append(u)

    # --- building -------------------------------------------------------------------------------------------
    def append(self, unit: Unit) -> None:
        if self.units:
            if unit.uid <= self.units[-1].uid:
                raise UnitError(f"unit ids must increase: {unit.uid} after {self.units[-1].uid}")
            if unit.axes != self.units[0].axes:
                raise UnitError(f"unit {unit.uid} has {unit.axes} position axes, the history has "
                                f"{self.units[0].axes}")
            if unit.kind is UnitKind.SYSTEM:
                raise UnitError(f"unit {unit.uid}: only the first unit may be the system prefix")
        self.units.append(unit)

    def replace_units(self, units: Iterable[Unit]) -> None:
        """Swap in a new unit list (used when a retention plan is applied)."""
        self.units = []
        for u in units:
            self.append(u)

    # --- queries --------------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Unit]:
        return iter(self.units)

    def __len__(self) -> int:
        return len(self.units)

    def __getitem__(self, i: int) -> Unit:
        return self.units[i]

    @property
    def total_tokens(self) -> int:
        return sum(u.length for u in self.units)

    @property
    def system_unit(self) -> Unit | None:
        return self.units[0] if self.units and self.units[0].kind is UnitKind.SYSTEM else None

    @property
    def system_tokens(self) -> int:
        s = self.system_unit
        return s.length if s is not None else 0

    @property
    def stream_units(self) -> list[Unit]:
        """Every unit but the system prefix."""
        return self.units[1:] if self.system_unit is not None else list(self.units)

    def offsets(self) -> list[int]:
        out, cursor = [], 0
        for u in self.units:
            out.append(cursor)
            cursor += u.length
        return out

    def index_of(self, uid: int) -> int:
        for i, u in enumerate(self.units):
            if u.uid == uid:
                return i
        raise KeyError(f"no unit {uid} in the history")

    def unit(self, uid: int) -> Unit:
        return self.units[self.index_of(uid)]

    def next_position(self) -> int:
        """The position a new token continues at: one past the largest position on any axis."""
        return max((u.max_position() for u in self.units), default=-1) + 1

    def next_uid(self) -> int:
        return self.units[-1].uid + 1 if self.units else 0

    def positions(self) -> np.ndarray:
        """All positions in logical order, shape ``(axes, total_tokens)``."""
        if not self.units:
            return np.zeros((1, 0), dtype=np.int64)
        return np.concatenate([u.positions for u in self.units], axis=1)

    def to_json(self) -> dict:
        return {"units": [u.to_json() for u in self.units]}

    @classmethod
    def from_json(cls, d: dict) -> "History":
        return cls([Unit.from_json(u) for u in d["units"]])
