"""The engine's records and small state types: what one update did (UpdateRecord), the session's counters,
sampling options, and the queued-chunk, waiting-frame and open-reply state the engine keeps between calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..errors import SamplingError


class RetentionWarning(UserWarning):
    """The retention settings will not do what they look like (the low watermark cannot hold the recent units)."""


@dataclass
class UpdateRecord:
    """What one streaming update did: the numbers `omnitide stream --stats / --json` report."""

    t: float | None
    uid: int
    kind: str
    tokens: int
    retained_cells: int
    physical_span: int
    active_pages: int
    active_subblocks: int
    kv_bytes: int
    prefill_ms: float
    maintenance_ms: float
    update_ms: float
    evicted_tokens: int = 0
    migrated_cells: int = 0
    kv_retained_bytes: int = 0  # what the retained tokens hold (``kv_bytes`` is the buffers' allocated capacity)


@dataclass
class SessionCounters:
    units: int = 0
    evictions: int = 0
    evicted_tokens: int = 0
    migrations: int = 0
    migrated_cells: int = 0
    rejected_chunks: int = 0
    frames: int = 0  # frames streamed in media units
    audio_seconds: float = 0.0  # seconds of pushed audio streamed
    silence_seconds: float = 0.0  # seconds of silence given to frames whose audio lagged too far or had ended
    frames_replaced: int = 0  # frames pushed with audio in a second that a newer frame (with audio) then took
    prefill_ms: float = 0.0
    maintenance_ms: float = 0.0
    decode_ms: float = 0.0
    decoded_tokens: int = 0
    peak_physical_span: int = 0


@dataclass
class Sampling:
    """Sampling options, named as mlx-lm names them (``temp`` 0 is greedy)."""

    max_tokens: int = 256
    temp: float = 0.0
    top_p: float = 0.0
    min_p: float = 0.0
    top_k: int = 0
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        """Check every option (SamplingError) and take ``stop`` as one string or a list of strings."""
        def number(name, v, lo, hi=math.inf, *, integer=False):
            ok = (not isinstance(v, bool) and isinstance(v, (int, np.integer) if integer else (int, float, np.number))
                  and math.isfinite(float(v)) and lo <= v <= hi)
            if not ok:
                span = f">= {lo}" if hi == math.inf else f"in [{lo}, {hi}]"
                raise SamplingError(f"{name} must be {'an int' if integer else 'a number'} {span}, got {v!r}")

        number("max_tokens", self.max_tokens, 1, integer=True)
        number("temp", self.temp, 0.0)
        number("top_p", self.top_p, 0.0, 1.0)
        number("min_p", self.min_p, 0.0, 1.0)
        number("top_k", self.top_k, 0, integer=True)
        if self.repetition_penalty is not None:
            number("repetition_penalty", self.repetition_penalty, 1e-6)
        if self.seed is not None:
            number("seed", self.seed, 0, 2**63 - 1, integer=True)
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):  # one stop string, not its characters
            stop = (stop,)
        else:
            try:
                stop = tuple(stop)
            except TypeError:
                raise SamplingError(f"stop must be a string or a list of strings, got {stop!r}") from None
        bad = [x for x in stop if not isinstance(x, str) or not x]
        if bad:
            raise SamplingError(f"stop must hold non-empty strings, got {bad[0]!r}")
        self.stop = stop


@dataclass
class _Pending:
    frame: np.ndarray | None
    audio: np.ndarray | None
    text: str | None
    t: float | None
    waiting: bool = True  # the push() that queued it has not returned yet: an error goes to it, and it processes
    # the chunk itself once the engine is free (other threads leave it to it)
    error: Exception | None = None
    pusher: int = 0  # the thread of that push()
    taken: bool = False  # taken from the queue (processed or rejected)


@dataclass
class _Waiting:
    """A frame waiting for its second of audio (pushed once audio flows)."""

    frame: np.ndarray
    t: float | None
    with_audio: bool  # pushed with audio: it stands for the second that audio completes, so a newer frame pushed
    # with audio before that second is complete replaces it (one frame per second, the newest); a frame pushed
    # without audio stands for a second of its own and only ever queues


@dataclass
class _Reply:
    """An open reply: everything its decode steps share, so that no step keeps state in a suspended generator."""

    question: str
    sampling: Sampling
    uid: int = -1
    start: int = 0
    sample: Callable | None = None
    logits: Any = None
    generated: list[int] = field(default_factory=list)
    emitted: str = ""
    stopped: bool = False
    done: bool = False  # finished: the unit is in the history and nothing more is decoded
    abandoned: bool = False  # its iterator was closed or dropped before the end
    on_forward: Callable | None = None  # (input ids, embeddings, hidden states) of the question and each fed token


REPLY_CLOSING_RESERVE = 8  # slots kept for the tokens that close a reply (2-3 in the supported models)


FRAME_WAIT_UNITS = 3  # frames that may wait for their audio; beyond, the oldest streams with a second of silence
