"""A stream's media setting and the media unit a model builds at it, as plain data.

Why this exists: the engine, the simulator, both benchmarks and the eval harness must stream the *same* unit. Its
token layout (typed spans and their lengths, and the RoPE positions relative to the unit's first position) is
computed once, by the model's own layout code (``models/qwen2_5_omni/layout.py``, ``models/minicpmo/layout.py``)
from the real processor arithmetic, and handed to ``core`` as a :class:`StreamUnits` record, so core never needs
MLX, a tokenizer or the model package. ``models/stream_units.py`` resolves a profile name and a setting to a
:class:`~.profiles.ModelProfile` carrying its units.

A :class:`MediaSetting` is what a stream feeds per unit: the frame size entering the processor (frames are resized
to it when it is set), the model's resolution knob (``max_pixels`` for Qwen2.5-Omni, ``max_slice_nums`` for
MiniCPM-o, as the official processors name them; None = the model's streaming default) and the audio per unit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import numpy as np

from .errors import OmniTideError
from .units import Span, SpanKind, Unit, UnitKind


class MediaSettingError(OmniTideError, ValueError):
    """A bad frame size, resolution knob or preset name."""


# the simulator's frame when the setting names none: a VGA camera frame (the live demo's webcam default)
DEFAULT_FRAME_SIZE = (640, 480)


@dataclass(frozen=True)
class MediaSetting:
    """What enters the processor per unit (one unit a second).

    ``frame_size`` (width, height): frames are resized to it before the processor (None: as they arrive; the
    simulator then assumes :data:`DEFAULT_FRAME_SIZE`). ``max_pixels``: Qwen2.5-Omni's per-frame pixel cap (None:
    the long-video floor of 128x28x28 the official video processing gives long streams). ``max_slice_nums``:
    MiniCPM-o's slice limit (None: 1, unsliced, as the official streaming calls do). ``audio_seconds``: audio per
    unit. ``name``: the preset it came from, for reports.
    """

    frame_size: tuple[int, int] | None = None
    max_pixels: int | None = None
    max_slice_nums: int | None = None
    audio_seconds: float = 1.0
    name: str = "default"

    def __post_init__(self):
        if self.frame_size is not None:
            w, h = (int(x) for x in self.frame_size)
            if w < 28 or h < 28:
                raise MediaSettingError(f"frame size {w}x{h} is too small (each side needs >= 28 pixels)")
            object.__setattr__(self, "frame_size", (w, h))
        if self.max_pixels is not None and int(self.max_pixels) < 4 * 28 * 28:
            raise MediaSettingError(f"max_pixels must be >= {4 * 28 * 28} (4 merged patches), got {self.max_pixels}")
        if self.max_slice_nums is not None and int(self.max_slice_nums) < 1:
            raise MediaSettingError(f"max_slice_nums must be >= 1, got {self.max_slice_nums}")
        if not self.audio_seconds > 0:
            raise MediaSettingError(f"audio_seconds must be > 0, got {self.audio_seconds}")

    @property
    def sim_frame_size(self) -> tuple[int, int]:
        """The frame size a stream without real frames assumes."""
        return self.frame_size or DEFAULT_FRAME_SIZE

    def with_overrides(self, *, frame_size=None, max_pixels=None, max_slice_nums=None) -> "MediaSetting":
        """This setting with the given knobs replaced (None keeps the setting's own)."""
        kw = {k: v for k, v in (("frame_size", frame_size), ("max_pixels", max_pixels),
                                 ("max_slice_nums", max_slice_nums)) if v is not None}
        if not kw:
            return self
        return replace(self, name=f"{self.name}+custom", **kw)

    def to_json(self) -> dict:
        return {"name": self.name, "frame_size": list(self.frame_size) if self.frame_size else None,
                "max_pixels": self.max_pixels, "max_slice_nums": self.max_slice_nums,
                "audio_seconds": self.audio_seconds}


PAPER_FRAME = 1344  # paper table 1: one 1344x1344 frame and one second of audio a unit, one unit a second
PRESETS: dict[str, MediaSetting] = {
    "default": MediaSetting(),
    # the paper's media setting: 1344x1344 frames at full resolution (Qwen 48x48 merged patches), MiniCPM-o with
    # the offline processor's 9 slices (3x3 for a square frame)
    "paper": MediaSetting(frame_size=(PAPER_FRAME, PAPER_FRAME), max_pixels=PAPER_FRAME * PAPER_FRAME,
                          max_slice_nums=9, name="paper"),
}


def get_preset(name: str) -> MediaSetting:
    if name not in PRESETS:
        raise MediaSettingError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]


def parse_frame_size(text: str) -> tuple[int, int]:
    """``--frame-size WxH`` -> (width, height); a MediaSettingError says what is wrong."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", str(text))
    if not m:
        raise MediaSettingError(f"bad frame size {text!r}: want WIDTHxHEIGHT, e.g. 1344x1344")
    size = (int(m.group(1)), int(m.group(2)))
    MediaSetting(frame_size=size)  # validates
    return size


def watermark_guard(*, low: int, system_tokens: int, unit_tokens: int, recent_units: int = 2,
                    high: int | None = None) -> str | None:
    """None when the watermarks hold the system prefix plus ``recent_units`` media units of the stream's size;
    otherwise the warning to give once, saying what retention will do. A ``high`` watermark that cannot hold the
    prefix plus one unit is the worse case and is reported first: the newest unit alone then keeps the history over
    it, so every unit triggers a trim and the history never gets back under the watermark."""
    one = system_tokens + unit_tokens
    if high is not None and unit_tokens and high < one:
        return (f"the high watermark ({high} tokens) cannot hold the system prefix ({system_tokens}) plus one unit of "
                f"{unit_tokens} tokens ({one}): after every trim the newest unit alone keeps the history over it, so "
                f"each unit triggers a trim, about {one} tokens stay retained, and every frame before the newest is "
                f"dropped at once; raise --high (and --low) to at least {system_tokens + recent_units * unit_tokens}, "
                "or lower the resolution (--max-pixels / --max-slice-nums / --frame-size)")
    need = system_tokens + recent_units * unit_tokens
    if low >= need:
        return None
    keep = max(1, (low - system_tokens) // unit_tokens) if unit_tokens else 1
    return (f"the low watermark ({low} tokens) cannot hold the system prefix ({system_tokens}) plus {recent_units} "
            f"recent units of {unit_tokens} tokens ({need}): each trim will keep the prefix and only the newest "
            f"{keep} unit{'s' if keep > 1 else ''} whole, and the frames before {'them' if keep > 1 else 'it'} are "
            f"dropped within seconds; raise --low (and --high) to at least {need}, or lower the resolution "
            "(--max-pixels / --max-slice-nums / --frame-size)")


def merge_runs(runs) -> tuple[tuple[SpanKind, int], ...]:
    """``[(kind, length), ...]`` with empty runs dropped and neighbours of one kind merged (how units are typed)."""
    out: list[tuple[SpanKind, int]] = []
    for kind, n in runs:
        kind = SpanKind(kind)
        if n <= 0:
            continue
        if out and out[-1][0] is kind:
            out[-1] = (kind, out[-1][1] + int(n))
        else:
            out.append((kind, int(n)))
    return tuple(out)


@dataclass(frozen=True, eq=False)
class StreamUnits:
    """One model's media unit (a frame plus ``audio_seconds`` of audio, inside an open user turn) at a setting.

    ``runs``: the typed spans in token order, as ``(kind, length)``; ``positions``: ``[axes, tokens]`` RoPE
    positions relative to the unit's first position (plain 1-D RoPE: ``arange``; Qwen's TMRoPE: the 3-axis
    layout); ``frame_size``: the frame the processor saw; ``detail``: the model's own figures (merged grid,
    slice grid, ...), for reports.
    """

    family: str
    setting: MediaSetting
    runs: tuple[tuple[SpanKind, int], ...]
    positions: np.ndarray
    frame_size: tuple[int, int] | None = None
    detail: tuple[tuple[str, object], ...] = ()

    def __post_init__(self):
        runs = merge_runs(self.runs)
        object.__setattr__(self, "runs", runs)
        pos = np.asarray(self.positions, dtype=np.int64)
        if pos.ndim == 1:
            pos = pos[None, :]
        n = sum(k for _, k in runs)
        if not runs or pos.shape[1] != n:
            raise MediaSettingError(f"{self.family} unit: {pos.shape[1]} positions for {n} tokens")
        pos.setflags(write=False)
        object.__setattr__(self, "positions", pos)

    @classmethod
    def sequential(cls, family: str, setting: MediaSetting, runs, axes: int = 1, **kw) -> "StreamUnits":
        """A unit whose tokens take consecutive positions on every axis (plain 1-D RoPE)."""
        n = sum(k for _, k in merge_runs(runs))
        return cls(family, setting, runs, np.broadcast_to(np.arange(n, dtype=np.int64), (axes, n)), **kw)

    @property
    def tokens(self) -> int:
        return int(self.positions.shape[1])

    @property
    def axes(self) -> int:
        return int(self.positions.shape[0])

    def tokens_by_kind(self) -> dict[str, int]:
        """Tokens per span kind (``image``, ``image_source``, ``image_slice``, ``audio``, ``boundary``, ...)."""
        out: dict[str, int] = {}
        for kind, n in self.runs:
            out[kind.value] = out.get(kind.value, 0) + n
        return out

    def spans(self) -> tuple[Span, ...]:
        out, cursor = [], 0
        for kind, n in self.runs:
            out.append(Span(kind, cursor, cursor + n))
            cursor += n
        return tuple(out)

    def unit(self, uid: int, start: int, t: float | None = None) -> Unit:
        """The media unit with positions starting at ``start`` (the history's next position)."""
        return Unit(uid=uid, kind=UnitKind.MEDIA, spans=self.spans(), positions=self.positions + int(start), t=t,
                    label="av")

    def same_layout(self, spans, positions, start: int = 0) -> bool:
        """Whether a unit with ``spans`` (Span records or (kind, start, end)) and absolute ``positions`` starting
        at ``start`` is this unit."""
        got = tuple((SpanKind(s.kind), s.end - s.start) if isinstance(s, Span) else (SpanKind(s[0]), s[2] - s[1])
                    for s in spans)
        pos = np.asarray(positions, dtype=np.int64)
        return got == self.runs and pos.shape == self.positions.shape and bool(
            np.array_equal(pos - int(start), self.positions))

    def to_json(self) -> dict:
        return {"family": self.family, "setting": self.setting.to_json(),
                "frame_size": list(self.frame_size) if self.frame_size else None, "tokens": self.tokens,
                "tokens_by_kind": self.tokens_by_kind(), **{k: v for k, v in self.detail}}
