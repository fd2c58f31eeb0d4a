"""The streaming engine, backend-neutral: what OmniSession (MLX) and TorchSession (PyTorch) share.

Every push assembles one unit per second of input, prefills it through the model into the session's paged KV
cache, and then runs retention: above the policy's high watermark the policy plans which tokens stay, the cache
frees the others and re-rotates the kept keys, and (OmniTide) OmniPage migrates entries when that frees tiles.
A question and its reply become units of the history too.

Threads: one producer (push) and one consumer (ask) may run at once. Pushes are validated in the caller's thread
(bad media raise MediaError there and never reach the cache) and queued; whoever holds the engine lock processes
the queue, so a capture loop never waits for a reply to finish. The lock is held for one bounded piece of work at
a time (a unit's prefill and retention, one decode step), never across a yield: while a reply is open, pushes and
``flush()`` from any thread (the consumer's own included) queue and run when the reply ends, a new question ends
the open reply first (a stop button), and a reply's iterator that is closed or dropped ends its reply cleanly.

A backend object (backend.py: the model calls, the cache, sampling and array persistence of one framework) is
what a session is composed with; this module imports no array framework.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import sys
import threading
import time
import warnings
from collections import deque
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from .backend import Backend
from .core.page import AllocClass
from .core.page import MigrationPlanner
from .core.pick import RetentionPlan, RetentionPolicy, apply_plan, make_policy, plan_from_mask
from .core.stream_units import MediaSetting, watermark_guard
from .core.units import History, Span, SpanKind, Unit, UnitKind
from .errors import InputTooLargeError, MediaError, RestoreError, SamplingError, SessionBusyError, SessionError
from .media import SAMPLE_RATE, as_mono_audio, as_rgb_frame
from .models.base import PreparedUnit, StreamAdapter, spans_from_runs, text_positions
from .models.stream_units import profile_for_spec


class RetentionWarning(UserWarning):
    """The retention settings will not do what they look like (the low watermark cannot hold the recent units)."""

SESSION_FORMAT = 2  # 2: records the model's family and KV shape, and the names of the saved arrays
READABLE_FORMATS = (1, 2)
SESSION_FILES = ("session.json", "kv.safetensors", "session.safetensors")


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


RESERVE_PAGES = 2  # a KV budget's high watermark sits this many pages under its ceiling (see watermarks_for_budget)
REPLY_CLOSING_RESERVE = 8  # slots kept for the tokens that close a reply (2-3 in the supported models)
FRAME_WAIT_UNITS = 3  # frames that may wait for their audio; beyond, the oldest streams with a second of silence


def policy_from(policy: RetentionPolicy | str | None, high: int | None = None, low: int | None = None) -> RetentionPolicy:
    """A policy from a name (``omnitide``, ``omnipick``, ``full``, ``fifo``, ``token``, ``streamingllm``, ``h2o``,
    ``eager``) or an instance (returned as is; ``high`` / ``low`` with an instance are an error, not ignored)."""
    if policy is None:
        policy = "omnitide"
    if isinstance(policy, str):
        kw = {}
        if high is not None:
            kw["high"] = _watermark("high", high)
        if low is not None:
            kw["low"] = _watermark("low", low)
        return make_policy(policy, **kw)
    if not isinstance(policy, RetentionPolicy):
        raise ValueError(f"policy must be a policy name or a RetentionPolicy, got {type(policy).__name__}")
    if high is not None or low is not None:
        raise ValueError(f"high= / low= go with a policy name; {policy!r} is an instance: set its watermarks there "
                         f"({type(policy).__name__}(high=..., low=...))")
    return policy


def _watermark(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} watermark must be a positive int (tokens), got {value!r}")
    return int(value)


def budget_slots(budget_bytes: int, bytes_per_token: int, page_size: int = 64) -> int:
    """The KV slots a budget pays for, in whole pages: the cache's buffers never hold more."""
    return budget_bytes // bytes_per_token // page_size * page_size


def watermarks_for_budget(budget_bytes: int, bytes_per_token: int, low_ratio: float = 0.72, *,
                          page_size: int = 64, low: int | None = None) -> tuple[int, int]:
    """High / low watermarks (tokens) under a KV budget: users think in memory.

    The budget pays for ``budget_slots`` slots (whole pages); the cache never grows past them. ``high`` sits
    ``RESERVE_PAGES`` pages under that ceiling (the room class-aware placement may leave in pages of another class)
    and ``low`` keeps the paper's 1800 / 2500 ratio unless given. A unit that would not fit the free room is
    preceded by an early trim (the session's ``_make_room``), so the ceiling holds whatever the unit sizes.
    """
    budget_bytes = kv_budget_bytes(budget_bytes, check_memory=False)
    slots = budget_slots(budget_bytes, bytes_per_token, page_size)
    high = slots - RESERVE_PAGES * page_size
    if high < 64:
        raise ValueError(f"a KV budget of {budget_bytes} bytes holds only {slots} tokens ({bytes_per_token} bytes per "
                         f"token, whole pages of {page_size}); raise it to at least "
                         f"{(64 + RESERVE_PAGES * page_size) * bytes_per_token} bytes")
    if low is None:
        low = max(1, int(high * low_ratio))
    elif _watermark("low", low) > high:
        raise ValueError(f"low watermark {low} is above the KV budget's high watermark {high}")
    return int(high), int(low)


def parse_bytes(text: str) -> int:
    """``512MiB``, ``2GB``, ``1.5GiB``, ``100000`` -> bytes."""
    units = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
             "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}
    s = str(text).strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    try:
        value = float(num) * units[unit]
    except (KeyError, ValueError):
        raise ValueError(f"cannot read {text!r} as a size (examples: 512MiB, 2GB)") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"a size must be positive and finite, got {text!r}")
    return int(value)


def machine_memory_bytes() -> int | None:
    """Physical memory of this machine (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def kv_budget_bytes(value, check_memory: bool = True) -> int:
    """A KV budget (bytes, or a size string like ``"512MiB"``) as a positive int, checked before anything loads:
    not a bool, NaN, negative, or (``check_memory``) more than the machine's memory."""
    if isinstance(value, str):
        budget = parse_bytes(value)
    elif isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"kv_budget must be bytes or a size like '512MiB', got {value!r}")
    else:
        if not math.isfinite(float(value)) or value <= 0:
            raise ValueError(f"kv_budget must be a positive, finite number of bytes, got {value!r}")
        budget = int(value)
    total = machine_memory_bytes() if check_memory else None
    if total and budget > total:
        raise ValueError(f"a KV budget of {value!r} ({budget / 2**30:.3g} GiB) is more than this machine's memory "
                         f"({total / 2**30:.1f} GiB)")
    return budget


def _check_budget_args(policy, high, low, kv_budget) -> int | None:
    """The KV budget in bytes (None without one), its combination with the policy arguments checked."""
    budget = kv_budget_bytes(kv_budget) if kv_budget is not None else None
    if budget is not None:
        if high is not None:
            raise ValueError("kv_budget sets the high watermark: give kv_budget (and optionally low) or high / low")
        name = policy if isinstance(policy, str) or policy is None else policy_from(policy).name
        if policy_from(name).name == "full":
            raise ValueError("policy 'full' never evicts, so it cannot stay under a kv_budget; give it high / low "
                             "or choose an evicting policy")
        if low is not None and not isinstance(policy, (str, type(None))):
            raise ValueError("low= goes with a policy name; with a policy instance, kv_budget sets both watermarks")
        if low is not None:
            _watermark("low", low)
    return budget


@dataclass
class _Saved:
    """A saved session being restored: its folder and checked JSON (``restore`` hands it to ``__init__``)."""

    path: Path
    meta: dict

    @property
    def file(self) -> Path:
        return self.path / "session.json"

    def media(self) -> MediaSetting | None:
        """The media setting the session streamed at (format-2 files from before it was recorded: the default)."""
        try:
            media = self.meta.get("media")
            return None if not media else MediaSetting(
                frame_size=tuple(media["frame_size"]) if media.get("frame_size") else None,
                max_pixels=media.get("max_pixels"), max_slice_nums=media.get("max_slice_nums"),
                audio_seconds=float(media.get("audio_seconds", 1.0)), name=str(media.get("name", "default")))
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise RestoreError(f"{self.file} records a malformed media setting: {type(e).__name__}: {e}") from e


class StreamingSession:
    """Push media, ask questions, bounded KV: the engine, independent of the array framework.

    A session is composed of a ``backend`` (:class:`~omnitide_mlx.backend.Backend`: the model calls, the cache,
    sampling and array I/O of one framework); ``OmniSession`` (MLX) and ``TorchSession`` (PyTorch) are this class
    with their backend. ``__init__`` builds a new session and, given a saved one (``restore``), that session:
    one setup path for both.
    """

    def __init__(self, model, processor=None, *, backend: Backend, system_prompt: str | None = None,
                 policy: RetentionPolicy | str | None = "omnitide", high: int | None = None, low: int | None = None,
                 kv_budget: int | str | None = None, kv_dtype=None, page_size: int = 64, subblock_size: int = 32,
                 on_update: Callable[[UpdateRecord], None] | None = None, media: MediaSetting | None = None,
                 kv_bits: int | None = None, kv_group_size: int = 64, kv_keep_sinks_full: bool = False,
                 _saved: _Saved | None = None):
        """``media``: the media setting (frame size, ``max_pixels`` / ``max_slice_nums``; ``get_preset("paper")``)
        the adapter lays units out at (default: the official long-video processing). A named policy with no
        ``high`` / ``low`` / ``kv_budget`` gets the model's own watermarks (core/profiles.py, paper figure 14).
        ``_saved`` (from ``restore``): the saved session to continue; its settings replace the arguments."""
        self.backend = backend
        if _saved is None:  # everything that can be checked without the model is checked before it loads
            self.kv_quant = self._check_kv_quant(kv_bits, kv_group_size, kv_keep_sinks_full)
            budget = _check_budget_args(policy, high, low, kv_budget)
            if budget is None:
                self.policy = policy_from(policy, high, low)
        else:
            media = _saved.media()
        self.model_path = _saved.meta.get("model_path") if _saved is not None else None
        if isinstance(model, (str, os.PathLike)):
            self.model_path = _model_ref(model)
            model, processor = backend.load_model(model)
        elif isinstance(model, tuple):
            model, processor = model
        self.model, self.processor = model, processor
        self.media = media
        self.adapter: StreamAdapter = (model.stream_adapter(processor) if media is None
                                       else model.stream_adapter(processor, media=media))
        spec = self.adapter.kv_spec
        if _saved is not None:
            _check_model(_saved.file, _saved.meta.get("model"), model, spec)
        self.profile = profile_for_spec(spec)
        self.on_update = on_update
        self.warnings: list[str] = []
        if _saved is None:
            if self.profile is not None and budget is None and high is None and low is None \
                    and not isinstance(policy, RetentionPolicy):
                self.policy = policy_from(policy, self.profile.high, self.profile.low)
            self.kv_dtype = kv_dtype or backend.default_kv_dtype(model)
            self.kv_budget = budget
            if budget is not None:
                bh, bl = watermarks_for_budget(budget, backend.kv_bytes_per_token(spec, self.kv_dtype, self.kv_quant),
                                               page_size=page_size, low=low)
                if isinstance(policy, RetentionPolicy):  # applied, not ignored: a copy with the budget's watermarks
                    self.policy = copy.copy(policy)
                    self.policy.high, self.policy.low = bh, bl
                else:
                    self.policy = policy_from(policy, bh, bl)
            self.system_prompt = system_prompt
            table, self.planner = backend.layout(self.policy.layout, page_size, subblock_size)
            self.cache = backend.make_cache(model, spec, dtype=self.kv_dtype, placement=table.placement,
                                            page_size=page_size, subblock_size=subblock_size,
                                            collect_scores=self.policy.needs_scores, kv_quant=self.kv_quant)
            self.history = History()
            self.counters = SessionCounters()
            self.records: list[UpdateRecord] = []
        else:
            self._load_saved(_saved)
        self._apply_budget()
        self._init_stream_state()
        if _saved is None:
            with self._lock:
                system = self.adapter.system_unit(system_prompt, 0)
                self._check_size(system)
                self._prefill(system, AllocClass.MUST_KEEP)
            self._guard_watermarks(system.length)
        else:
            self._load_saved_stream(_saved)

    def stream_units(self):
        """The media unit this session's adapter builds (a StreamUnits record), or None for text-only models."""
        fn = getattr(self.adapter, "stream_units", None)
        return fn() if fn is not None else None

    def _guard_watermarks(self, system_tokens: int) -> None:
        """Warn once when the low watermark cannot hold the system prefix plus the recent units at this stream's
        unit size (each trim would then keep the newest unit only)."""
        recent = getattr(self.policy, "recent_units", None)
        units = self.stream_units() if recent else None
        if units is None:
            return
        msg = watermark_guard(low=self.policy.low, system_tokens=system_tokens, unit_tokens=units.tokens,
                              recent_units=recent)
        if msg:
            self.warnings.append(msg)
            warnings.warn(msg, RetentionWarning, stacklevel=_caller_level())

    def _apply_budget(self) -> None:
        self._max_slots = (budget_slots(self.kv_budget, self.cache.bytes_per_token, self.cache.table.page_size)
                           if self.kv_budget is not None else None)
        self.cache.max_capacity = self._max_slots

    def _init_stream_state(self) -> None:
        self._lock = threading.Lock()  # the engine: held for one bounded piece of work, never across a yield
        self._holder: int | None = None  # the thread holding it (a call from that thread would wait for itself)
        self._open: _Reply | None = None  # the reply being decoded; units wait for it to end
        self._capture_hidden = False  # keep the last forward's hidden states (a reply with on_forward)
        self._hidden = None  # those hidden states
        self._flush_requested = False
        self._inbox_lock = threading.Lock()
        self._inbox: deque[_Pending] = deque()
        self.rejected: deque[str] = deque(maxlen=64)  # errors of queued chunks whose push() had returned
        self._audio_buf = np.zeros(0, dtype=np.float32)
        self._waiting: deque[_Waiting] = deque()  # frames waiting for their audio, oldest first
        self._pending_t: float | None = None
        self._audio_driven = False
        self._seconds = 0.0  # stream time given to units pushed without t
        self._last_logits = None

    def _check_kv_quant(self, bits, group_size, keep_sinks_full) -> dict:
        """Quantised KV options (mlx-lm's --kv-bits / --kv-group-size), checked before the model loads; {} for
        float KV. The MLX session holds them (session.py); a backend that cannot says so here."""
        if bits is None:
            if keep_sinks_full:
                raise ValueError("kv_keep_sinks_full keeps the sinks in full precision in a quantised cache: set "
                                 "kv_bits")
            return {}
        if bits not in (4, 8):
            raise ValueError(f"kv_bits must be 8 or 4, got {bits!r}")
        if group_size not in (32, 64, 128):
            raise ValueError(f"kv_group_size must be 32, 64 or 128, got {group_size!r}")
        if not self.backend.quantised_kv:
            raise ValueError(f"the {self.backend.name} backend holds float K/V only (kv_bits is MLX's)")
        return {"kv_bits": int(bits), "kv_group_size": int(group_size), "keep_sinks_full": bool(keep_sinks_full)}

    # --- the backend's steps, as the engine takes them ---------------------------------------------------------
    def _forward(self, embeds, positions: np.ndarray):
        """Prefill ``embeds`` ``[T, hidden]`` at ``positions`` ``[axes, T]``; return the last token's logits (and
        keep the hidden states while ``_capture_hidden`` is set)."""
        logits, hidden = self.backend.forward(self.model, self.cache, embeds, positions, hidden=self._capture_hidden)
        if self._capture_hidden:
            self._hidden = hidden
        return logits

    def _captured_hidden(self):
        """The final-norm hidden states ``[T, hidden]`` of the last ``_forward`` while ``_capture_hidden`` is set
        (None from a backend that does not keep them)."""
        return self._hidden if self._capture_hidden else None

    # --- producer side --------------------------------------------------------------------------------------
    def push(self, frame=None, audio=None, text: str | None = None, t: float | None = None,
             sample_rate: int | None = SAMPLE_RATE) -> list[UpdateRecord]:
        """Queue a camera frame, a piece of audio (any rate, any length) and/or user text (context, no reply).

        Units are assembled at one per second of audio (each with the newest frame pushed with that audio);
        without audio every frame is a unit. Once audio flows, a frame pushed without audio waits for its second of
        audio (a microphone that lags the camera): waiting frames queue in order, and when more than
        ``FRAME_WAIT_UNITS`` wait (the audio has ended or lags further) the oldest streams with a second of
        silence; audio without frames streams as units without one. ``flush()`` streams whatever still waits, and
        ``stats()["media"]`` counts what was streamed. Input is validated here: a bad chunk raises MediaError and the session goes on unchanged.
        Returns the updates this call processed (empty when another thread holds the engine: it processes the
        queued chunk when it finishes).
        """
        if frame is None and audio is None and not text:
            raise MediaError("push() needs a frame, audio or text")
        pending = _Pending(
            frame=as_rgb_frame(frame) if frame is not None else None,
            audio=as_mono_audio(audio, sample_rate) if audio is not None else None,
            text=_check_text(text) if text else None,
            t=_check_time(t),
            pusher=threading.get_ident(),
        )
        with self._inbox_lock:
            self._inbox.append(pending)
        records = self._settle(own=pending)
        with self._inbox_lock:
            pending.waiting = False
            error = pending.error
        records += self._settle()  # a settler may have left the chunk to this call just as it returned
        if error is not None:
            raise error
        return records

    def flush(self) -> list[UpdateRecord]:
        """Turn buffered input into units: less than a second of audio (with the oldest waiting frame, if any),
        then every frame still waiting for its audio (with a second of silence).

        While a reply is open the flush queues and runs when the reply ends (it returns ``[]`` then)."""
        with self._engine():
            self._flush_requested = True
            if self._open is not None and not self._open.abandoned:
                return []
            return self._settle_locked()

    # --- consumer side --------------------------------------------------------------------------------------
    def ask(self, question: str, *, max_tokens: int = 256, temp: float = 0.0, top_p: float = 0.0, min_p: float = 0.0,
            top_k: int = 0, repetition_penalty: float | None = None, seed: int | None = None,
            stop: str | list[str] | None = None, on_forward: Callable | None = None) -> Iterator[str]:
        """Ask a question about everything streamed so far; returns the reply as an iterator of text pieces.

        Sampling options follow mlx-lm (``temp`` 0 is greedy). The question and the reply become units of the
        history. Queued pushes are processed first, so the answer sees them. One reply at a time: asking again
        (from any thread) ends the open reply where it is, as a stop button would, and its iterator then ends.
        Closing the iterator (or dropping it) ends the reply; pushes made meanwhile are processed then.
        ``on_forward(ids, embeds, hidden)`` is called for the question unit and for every reply token fed back,
        with the backend's final-norm hidden states of those tokens (spoken replies read them; see speech.py).
        """
        question = _check_text(question)
        sampling = Sampling(max_tokens, temp, top_p, min_p, top_k, repetition_penalty, seed, stop)

        def reply() -> Iterator[str]:
            r = _Reply(question, sampling, on_forward=on_forward)
            try:
                with self._engine(settle=False):
                    if self._open is not None:
                        self._finish_reply(self._open)
                    self._settle_locked()
                    self._begin_reply(r)
                while True:
                    with self._engine(settle=False):
                        if r.done:
                            return
                        piece = self._reply_step(r)
                    if piece:
                        yield piece
            finally:
                if not r.done:
                    r.abandoned = True
                self._settle()

        return reply()

    def answer(self, question: str, **kwargs) -> str:
        """``ask`` collected into one string."""
        return "".join(self.ask(question, **kwargs))

    def probe_logits(self, ids: list[int]) -> np.ndarray:
        """Next-token logits (float32 numpy) after ``ids`` appended to the retained history, the session left as
        it was: the probe's KV slots are freed again by a plan that drops them, and its attention does not count
        for H2O, so many questions can be asked of one stream state and none of them steers later retention
        (eval/probe.py, eval/study.py). Queued pushes are processed first, as for ``ask``; with a reply open it
        raises SessionBusyError (the probe would land inside the reply)."""
        ids = [int(i) for i in ids]
        if not ids:
            raise ValueError("a probe needs at least one token")
        with self._engine():
            if self._open is not None and not self._open.abandoned:
                raise SessionBusyError("cannot probe while a reply is open: read it to the end or close() its "
                                       "iterator first")
            self._settle_locked()
            cache, history = self.cache, self.history
            n, uid = len(ids), history.next_uid()
            positions = text_positions(history.next_position(), n, self.adapter.kv_spec.position_axes)
            collect = cache.collect_scores
            cache.collect_scores = False  # the probe's attention must not count for H2O
            try:
                cache.set_owner(uid)
                logits, _ = self.backend.forward(self.model, cache, self.adapter.embed_tokens(ids), positions)
                out = self.backend.to_numpy(logits)
            finally:
                cache.collect_scores = collect
            probe = Unit(uid=uid, kind=UnitKind.USER, spans=(Span(SpanKind.TEXT, 0, n),), positions=positions)
            with_probe = History(list(history) + [probe])
            keep = np.ones(with_probe.total_tokens, dtype=bool)
            keep[-n:] = False
            cache.evict(plan_from_mask(with_probe, keep, "probe"), with_probe)
            return out

    # --- introspection ----------------------------------------------------------------------------------------
    @property
    def queued(self) -> int:
        """Chunks pushed and not yet turned into units (a capture loop that outruns the model sees this grow)."""
        with self._inbox_lock:
            return len(self._inbox)

    def stats(self) -> dict:
        with self._engine(read=True):
            layout = self.cache.layout_stats()
            c = self.counters
            return {
                "backend": self.backend.name,
                "policy": self.policy.name,
                "layout": self.policy.layout,
                "high": self.policy.high,
                "low": self.policy.low,
                "profile": self.profile.name if self.profile is not None else None,
                "tokens_per_unit": self._units_json(),
                "units": len(self.history),
                "retained_cells": layout.retained_cells,
                "logical_tokens": self.history.total_tokens,
                "physical_span": layout.physical_span,
                "peak_physical_span": c.peak_physical_span,
                "active_pages": layout.active_pages,
                "active_subblocks": layout.active_subblocks,
                "capacity": layout.capacity,
                "kv_bytes": self.cache.nbytes,
                "kv_bytes_retained": layout.retained_cells * self.cache.bytes_per_token,
                "kv_budget": self.kv_budget,
                "capacity_bound": self.capacity_bound(),
                "kv_bytes_per_token": self.cache.bytes_per_token,
                "next_position": self.history.next_position(),
                "evictions": c.evictions,
                "evicted_tokens": c.evicted_tokens,
                "migrations": c.migrations,
                "migrated_cells": c.migrated_cells,
                "rejected_chunks": c.rejected_chunks,
                "media": {"frames": c.frames, "audio_seconds": c.audio_seconds, "silence_seconds": c.silence_seconds,
                          "frames_waiting": len(self._waiting), "frames_replaced": c.frames_replaced},
                "timings": {
                    "prefill_ms": c.prefill_ms,
                    "maintenance_ms": c.maintenance_ms,
                    "decode_ms": c.decode_ms,
                    "decode_tokens_per_s": (c.decoded_tokens / (c.decode_ms / 1000)) if c.decode_ms else 0.0,
                },
            }

    def _units_json(self) -> dict | None:
        u = self.stream_units()
        return None if u is None else {"tokens": u.tokens, "by_kind": u.tokens_by_kind(),
                                       "setting": u.setting.to_json()}

    # --- persistence --------------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """Write the whole state (KV, page table, units, positions, adapter protocol state, buffered input) to a
        folder: safetensors for arrays, JSON for the rest. Atomic: everything is written to a temporary folder
        next to ``path`` that then takes its place, so a crash or a full disk never leaves a half-written session
        (an older save at ``path`` stays whole until the new one is complete)."""
        path = Path(path)
        if path.exists() and (not path.is_dir() or set(p.name for p in path.iterdir()) - set(SESSION_FILES)):
            raise SessionError(f"{path} exists and is not a saved session: choose a new folder (save replaces "
                               "the folder as a whole)")
        with self._engine(settle=False):
            if self._open is not None and not self._open.abandoned:
                raise SessionBusyError(f"cannot save to {path} while a reply is open: read it to the end or close() "
                                       "its iterator first")
            self._settle_locked()
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.parent / f".{path.name}.saving-{os.getpid()}-{threading.get_ident()}"
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            try:
                self._write(tmp)
                _replace_dir(tmp, path)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
        return path

    def _write(self, path: Path) -> None:
        self.cache.save(path / "kv.safetensors")
        meta_adapter, arrays = self.adapter.state()
        arrays = dict(arrays)
        if self._audio_buf.size:
            arrays["session.audio_buf"] = self._audio_buf
        for i, w in enumerate(self._waiting):
            arrays[f"session.waiting_frame.{i}"] = w.frame
        if self._last_logits is not None:
            arrays["session.last_logits"] = self._last_logits
        if arrays:
            self.backend.save_arrays(path / "session.safetensors", arrays)
        spec = self.adapter.kv_spec
        meta = {
            "format": SESSION_FORMAT,
            "backend": self.backend.name,
            "model_path": _model_ref(self.model_path) if self.model_path else None,
            "model": {"family": model_family(self.model), "num_layers": spec.num_layers, "kv_heads": spec.kv_heads,
                      "head_dim": spec.head_dim, "position_axes": spec.position_axes},
            "system_prompt": self.system_prompt,
            "media": self.media.to_json() if self.media is not None else None,
            "policy": self.policy.config(),
            "kv_budget": self.kv_budget,
            "kv_dtype": self.backend.dtype_name(self.kv_dtype),
            "history": self.history.to_json(),
            "adapter": meta_adapter,
            "arrays": sorted(arrays),
            "counters": asdict(self.counters),
            "records": [asdict(r) for r in self.records],
            "stream": {"seconds": self._seconds, "audio_driven": self._audio_driven,
                       "pending_t": self._pending_t,
                       "waiting": [{"t": w.t, "with_audio": w.with_audio} for w in self._waiting]},
        }
        with open(path / "session.json", "w", encoding="utf-8") as f:
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())

    @classmethod
    def read_meta(cls, path: str | os.PathLike) -> dict:
        """The JSON side of a saved session, checked (format version, required keys); RestoreError otherwise."""
        path = Path(path)
        file = path / "session.json"
        if not file.is_file():
            raise RestoreError(f"{path} holds no saved session ({file.name} missing)")
        try:
            with open(file, encoding="utf-8") as f:
                meta = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RestoreError(f"{file} is not valid JSON (truncated or corrupted?): {e}") from None
        if not isinstance(meta, dict):
            raise RestoreError(f"{file} does not hold a saved session")
        if meta.get("format") not in READABLE_FORMATS:
            raise RestoreError(f"{file}: session format {meta.get('format')!r}; this version reads "
                               f"{', '.join(map(str, READABLE_FORMATS))} (saved by another omnitide-mlx version?)")
        missing = [k for k in ("kv_dtype", "policy", "history", "counters") if k not in meta]
        if missing:
            raise RestoreError(f"{file} is incomplete: missing {', '.join(missing)}")
        return meta

    @classmethod
    def restore(cls, path: str | os.PathLike, model=None, processor=None,
                on_update: Callable[[UpdateRecord], None] | None = None, **kwargs):
        """Load a session written by ``save``. ``model`` defaults to the model the session was created from (its
        absolute path, or Hub id). Every problem with the saved files raises RestoreError naming the file; a
        model of another family or shape than the saved one raises it too, before any state is built.
        ``kwargs`` go to the constructor (``backend=`` for this class; a subclass's own options)."""
        saved = _Saved(Path(path), cls.read_meta(path))
        if model is None:
            if not saved.meta.get("model_path"):
                raise RestoreError(f"{saved.file} does not record its model; pass model=")
            model = saved.meta["model_path"]
        return cls(model, processor, on_update=on_update, _saved=saved, **kwargs)

    def _load_saved(self, saved: _Saved) -> None:
        """The saved settings, history, counters and cache (``__init__`` of a restored session)."""
        meta, file = saved.meta, saved.file
        try:
            self.kv_dtype = self.backend.dtype_from_name(meta["kv_dtype"])
            cfg = dict(meta["policy"])
            self.policy = make_policy(cfg.pop("name"), **cfg)
            self.history = History.from_json(meta["history"])
            self.counters = SessionCounters(**meta["counters"])
            self.records = [UpdateRecord(**r) for r in meta.get("records", [])]
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise RestoreError(f"{file} is malformed: {type(e).__name__}: {e}") from e
        self.system_prompt = meta.get("system_prompt")
        kv_file = saved.path / "kv.safetensors"
        if not kv_file.is_file():
            raise RestoreError(f"{kv_file} is missing: the saved session has no KV cache")
        try:
            self.cache = self.backend.load_cache(self.model, kv_file)
        except Exception as e:  # safetensors, MLX and CacheError all say it differently
            raise RestoreError(f"{kv_file} cannot be read (truncated or corrupted?): {e}") from e
        spec = self.adapter.kv_spec
        if (self.cache.num_layers, self.cache.kv_heads, self.cache.head_dim) != (spec.num_layers, spec.kv_heads,
                                                                               spec.head_dim):
            raise RestoreError(f"{kv_file} holds a KV cache of {self.cache.num_layers} layers x {self.cache.kv_heads} "
                               f"heads x {self.cache.head_dim}; the model needs {spec.num_layers} x {spec.kv_heads} x "
                               f"{spec.head_dim}: restore it with the model it was saved with")
        try:
            self.cache.page_table.check_history(self.history)
        except ValueError as e:
            raise RestoreError(f"{kv_file} and {file} disagree (files from different saves?): {e}") from e
        q = self.cache.meta_state.get("kv_quant")
        self.kv_quant = {} if not q else {"kv_bits": q["bits"], "kv_group_size": q["group_size"],
                                          "keep_sinks_full": q["keep_sinks_full"]}
        self.kv_budget = meta.get("kv_budget")
        table = self.cache.page_table
        _, self.planner = self.backend.layout(self.policy.layout, table.page_size, table.subblock_size)

    def _load_saved_stream(self, saved: _Saved) -> None:
        """The saved buffered input, last logits and adapter state (``__init__`` of a restored session)."""
        meta, file = saved.meta, saved.file
        arrays_file = saved.path / "session.safetensors"
        want = set(meta.get("arrays", []))
        try:
            arrays = self.backend.load_arrays(arrays_file) if arrays_file.exists() else {}
        except Exception as e:
            raise RestoreError(f"{arrays_file} cannot be read (truncated or corrupted?): {e}") from e
        if want - set(arrays):
            what = "is missing" if not arrays_file.exists() else f"lacks {', '.join(sorted(want - set(arrays)))}"
            raise RestoreError(f"{arrays_file} {what}: the saved session is incomplete")
        try:
            if "session.audio_buf" in arrays:
                self._audio_buf = np.asarray(arrays.pop("session.audio_buf"), dtype=np.float32)
            stream = meta.get("stream", {})
            if "session.pending_frame" in arrays:  # saved before frames queued: one frame waiting
                self._waiting.append(_Waiting(np.asarray(arrays.pop("session.pending_frame"), dtype=np.uint8),
                                              None, True))
            for i, w in enumerate(stream.get("waiting", [])):
                self._waiting.append(_Waiting(np.asarray(arrays.pop(f"session.waiting_frame.{i}"), dtype=np.uint8),
                                              None if w["t"] is None else float(w["t"]), bool(w["with_audio"])))
            self._last_logits = arrays.pop("session.last_logits", None)
            self._seconds = float(stream.get("seconds", 0.0))
            self._audio_driven = bool(stream.get("audio_driven", False))
            self._pending_t = stream.get("pending_t")
            self.adapter.load_state(meta.get("adapter", {}), arrays)
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise RestoreError(f"{arrays_file} or the adapter state in {file} is malformed: "
                               f"{type(e).__name__}: {e}") from e

    # --- engine (lock held) -----------------------------------------------------------------------------------
    @contextmanager
    def _engine(self, settle: bool = True, read: bool = False):
        """Hold the engine for one bounded piece of work. A call from the thread that already holds it (from inside
        ``on_update``) would wait for itself: it raises instead, except a read (``stats``), which goes on. After
        the work, ``settle`` processes what others queued meanwhile."""
        me = threading.get_ident()
        if self._holder == me:
            if read:
                yield
                return
            raise SessionError("the session was called from inside its own update (an on_update callback?): "
                               "push() from there queues; flush(), ask() and save() must wait until it returns")
        with self._lock:
            self._holder = me
            try:
                yield
            finally:
                self._holder = None
        if settle:
            self._settle()

    def _settle(self, own: _Pending | None = None) -> list[UpdateRecord]:
        """Do what is waiting (an abandoned reply to end, queued chunks, a queued flush) if the engine is free;
        otherwise leave it to whoever holds the engine, who settles after letting go.

        A push() (``own``: its chunk) whose chunk is still queued while another thread holds the engine waits for
        that one bounded piece of work and then processes the queue itself; any other caller never blocks here and
        processes only chunks whose push() has returned. So the thread that ends a reply processes what was queued
        during it and then goes back to its caller, instead of working on for a producer that keeps pushing
        meanwhile (the engine soak's consumer asked 23 questions in 2,000 units that way)."""
        me = threading.get_ident()
        records: list[UpdateRecord] = []
        while self._has_work():
            if not self._lock.acquire(blocking=False):
                if own is None or own.taken or self._holder == me:
                    return records
                self._lock.acquire()  # held for one bounded piece of work, which leaves our chunk to us
            self._holder = me
            try:
                records += self._settle_locked(own)
                stalled = own is None and self._left_to_pusher()
            finally:
                self._holder = None
                self._lock.release()
            if stalled:
                return records
        return records

    def _left_to_pusher(self) -> bool:
        """Whether the next queued chunk is left to the push() that queued it (still running, in another thread)."""
        with self._inbox_lock:
            head = self._inbox[0] if self._inbox else None
            return head is not None and head.waiting and head.pusher != threading.get_ident()

    def _has_work(self) -> bool:
        if self._open is not None:
            return self._open.abandoned
        return bool(self._inbox) or self._flush_requested

    def _settle_locked(self, own: _Pending | None = None) -> list[UpdateRecord]:
        records: list[UpdateRecord] = []
        if self._open is not None and self._open.abandoned:
            self._finish_reply(self._open)
        if self._open is not None:
            return records  # units wait for the reply to end
        records += self._drain_locked(own)
        if self._flush_requested:
            self._flush_requested = False
            records += self._stream_waiting()
        return records

    def _stream_waiting(self) -> list[UpdateRecord]:
        """Stream what waits: the buffered audio (less than a second) with the oldest waiting frame, then every
        other waiting frame with a second of silence."""
        records: list[UpdateRecord] = []
        if self._audio_buf.size:
            audio, self._audio_buf = self._audio_buf, np.zeros(0, dtype=np.float32)
            records += self._media(self._take_frame(), audio)
        while self._waiting:
            records += self._media(self._take_frame(), self._silence(), silence=True)
        return records

    def _drain_locked(self, own: _Pending | None = None) -> list[UpdateRecord]:
        """Process the queued chunks in order: all of them for a push() (``own``), else up to the first one whose
        push() is still running in another thread (it processes that one itself). A chunk the model rejects is
        counted and skipped; its error goes to the push() that queued it when that call is still waiting, else to
        ``rejected`` and a warning."""
        records: list[UpdateRecord] = []
        me = threading.get_ident()
        while True:
            with self._inbox_lock:
                if not self._inbox:
                    return records
                head = self._inbox[0]
                if own is None and head.waiting and head.pusher != me:
                    return records
                item = self._inbox.popleft()
                item.taken = True
            try:
                records += self._process(item)
            except MediaError as e:
                self.counters.rejected_chunks += 1
                with self._inbox_lock:
                    item.error = e
                    waiting = item.waiting
                if not waiting:
                    self.rejected.append(str(e))
                    warnings.warn(f"a queued chunk was rejected: {e}", RuntimeWarning, stacklevel=2)

    def _process(self, item: _Pending) -> list[UpdateRecord]:
        records: list[UpdateRecord] = []
        if item.frame is not None:
            if item.audio is None and not self._audio_driven:
                records += self._media(_Waiting(item.frame, item.t, False), None)
            elif item.audio is not None and any(not w.with_audio for w in self._waiting):
                # audio comes with frames again: the frames that waited without it had none (a gap in the audio)
                records += self._stream_waiting()
                self._waiting.append(_Waiting(item.frame, item.t, True))
            elif item.audio is not None and self._waiting:
                # the one frame waiting came with audio that has not made a second yet: this frame's audio continues
                # that second, for which the newest frame stands
                last = self._waiting[-1]
                last.frame, last.t = item.frame, item.t if item.t is not None else last.t
                self.counters.frames_replaced += 1
            else:
                self._waiting.append(_Waiting(item.frame, item.t, item.audio is not None))
        elif item.t is not None:
            self._pending_t = item.t
        if item.audio is not None:
            self._audio_driven = True
            self._audio_buf = np.concatenate([self._audio_buf, item.audio])
            while self._audio_buf.size >= SAMPLE_RATE:
                second, self._audio_buf = self._audio_buf[:SAMPLE_RATE], self._audio_buf[SAMPLE_RATE:]
                records += self._media(self._take_frame(), second)
        while len(self._waiting) > FRAME_WAIT_UNITS:  # the audio has ended or lags too far: never drop the frame
            records += self._media(self._take_frame(), self._silence(), silence=True)
        if item.text:
            records.append(self._unit(self.adapter.context_unit(item.text, self.history.next_position())))
        return records

    def _take_frame(self) -> _Waiting | None:
        """The oldest frame waiting for its audio (None when none waits)."""
        return self._waiting.popleft() if self._waiting else None

    def _silence(self) -> np.ndarray:
        return np.zeros(SAMPLE_RATE, dtype=np.float32)

    def _media(self, frame: _Waiting | np.ndarray | None, audio: np.ndarray | None,
               silence: bool = False) -> list[UpdateRecord]:
        """One media unit (``silence``: ``audio`` is padding for a frame whose audio lagged or ended). Its time:
        the frame's own ``t``, else the ``t`` pushed with its audio, else one second after the previous unit."""
        t = None
        if isinstance(frame, _Waiting):
            frame, t = frame.frame, frame.t
        if t is None:
            t = self._pending_t if self._pending_t is not None else self._seconds
        self._pending_t = None
        prepared = self.adapter.media_unit(frame, audio, t, self.history.next_position())
        self._seconds = t + 1.0
        records = [self._unit(prepared)]
        c = self.counters  # counted once the unit is in: a rejected unit streamed nothing
        c.frames += frame is not None
        if audio is not None:
            if silence:
                c.silence_seconds += audio.shape[0] / SAMPLE_RATE
            else:
                c.audio_seconds += audio.shape[0] / SAMPLE_RATE
        return records

    def _unit(self, prepared: PreparedUnit, alloc_class: AllocClass = AllocClass.RECENT_CONTEXT,
              reserve: int = 0, question: bool = False) -> UpdateRecord:
        """Prefill one unit and run retention. ``reserve``: slots that must stay free after it (a reply's)."""
        self._check_size(prepared, reserve, question)
        t0 = time.perf_counter()
        self._make_room(prepared.length + reserve)
        uid = self._prefill(prepared, alloc_class)
        t1 = time.perf_counter()
        evicted, migrated = self._maintain()
        t2 = time.perf_counter()
        layout = self.cache.layout_stats()
        rec = UpdateRecord(
            t=prepared.t, uid=uid, kind=prepared.kind.value, tokens=prepared.length,
            retained_cells=layout.retained_cells, physical_span=layout.physical_span,
            active_pages=layout.active_pages, active_subblocks=layout.active_subblocks, kv_bytes=self.cache.nbytes,
            prefill_ms=(t1 - t0) * 1000, maintenance_ms=(t2 - t1) * 1000, update_ms=(t2 - t0) * 1000,
            evicted_tokens=evicted, migrated_cells=migrated,
            kv_retained_bytes=layout.retained_cells * self.cache.bytes_per_token)
        self.records.append(rec)
        if self.on_update is not None:
            self.on_update(rec)
        return rec

    def _check_size(self, prepared: PreparedUnit, reserve: int = 0, question: bool = False) -> None:
        """Reject (InputTooLargeError, nothing touched) a unit the session could not keep: under a KV budget, one
        that does not fit next to the system prefix (with ``reserve``: a question and its reply); without one,
        text longer than the high watermark leaves room for (it would be computed only to be evicted)."""
        n = prepared.length
        what = {UnitKind.USER: "the question" if question else "the text", UnitKind.MEDIA: "the media unit",
                UnitKind.SYSTEM: "the system prompt"}.get(prepared.kind, f"the {prepared.kind.value} unit")
        page = self.cache.table.page_size
        if self._max_slots is not None:
            room = self._max_slots - (-(-self.history.system_tokens // page) * page if len(self.history) else 0)
            if n + reserve > room:
                extra = f" plus {reserve} slots for its reply (max_tokens)" if reserve else ""
                raise InputTooLargeError(
                    f"{what} is {n} tokens{extra}; the KV budget of {self.kv_budget} bytes holds {self._max_slots} "
                    f"tokens, {room} of them for one input next to the system prompt: shorten it"
                    f"{', lower max_tokens' if reserve else ''} or raise kv_budget")
        elif (prepared.kind is UnitKind.USER and self.policy.name != "full"
              and n > self.policy.high - self.history.system_tokens):
            raise InputTooLargeError(
                f"{what} is {n} tokens; the high watermark {self.policy.high} leaves "
                f"{self.policy.high - self.history.system_tokens} next to the system prompt, so it would be evicted "
                "as soon as it was computed: shorten it or raise high")

    def _room(self) -> int:
        return self.cache.table.free_slots_for(AllocClass.RECENT_CONTEXT, self._max_slots)

    def _make_room(self, n: int) -> None:
        """Under a KV budget, make sure ``n`` new tokens fit below the ceiling before they are computed: trim early
        (the policy's own choice toward a lower target, then whole units oldest first), then compact the layout.
        Without a budget the cache grows as it needs (and gives the room back in ``_trim_capacity``)."""
        if self._max_slots is None or self._room() >= n:
            return
        t0 = time.perf_counter()
        target = max(0, self._max_slots - RESERVE_PAGES * self.cache.table.page_size - n)
        keep = self._trim_mask(target)
        plan = plan_from_mask(self.history, keep, self.policy.name)
        if plan.deleted_tokens:
            self._apply_retention(plan)
        if self._room() < n:
            mplan = MigrationPlanner("eager").plan(self.cache.page_table)
            if mplan.accepted:
                self.counters.migrations += 1
                self.counters.migrated_cells += self.cache.migrate(mplan)
        self.counters.maintenance_ms += (time.perf_counter() - t0) * 1000
        if self._room() < n:  # _check_size admitted it, so this is a bug, not bad input
            raise SessionError(f"could not make room for {n} tokens under the KV ceiling of {self._max_slots} slots "
                               f"({self.cache.table!r})")

    def _trim_mask(self, target: int) -> np.ndarray:
        """Which tokens to keep so that at most ``target`` remain (the system prefix always stays)."""
        h = self.history
        if h.stream_units:
            policy = copy.copy(self.policy)
            policy.low = max(1, min(policy.low, target))
            scores = self.cache.token_scores(h) if policy.needs_scores else None
            keep = np.asarray(policy.keep_mask(h, scores), dtype=bool).copy()
        else:
            keep = np.ones(h.total_tokens, dtype=bool)
        offsets = h.offsets()
        for i, u in enumerate(h):
            if keep.sum() <= target:
                break
            if u.kind is not UnitKind.SYSTEM:
                keep[offsets[i]:offsets[i] + u.length] = False
        return keep

    def _prefill(self, prepared: PreparedUnit, alloc_class: AllocClass = AllocClass.RECENT_CONTEXT) -> int:
        uid = self.history.next_uid()
        unit = prepared.to_unit(uid)  # validates spans / positions before the cache is touched
        t0 = time.perf_counter()
        self.cache.set_owner(uid, alloc_class)
        logits = self._forward(prepared.inputs_embeds, prepared.positions)
        self.backend.eval(logits)
        self.counters.prefill_ms += (time.perf_counter() - t0) * 1000
        self.history.append(unit)
        self.counters.units += 1
        self._last_logits = logits
        return uid

    def _apply_retention(self, plan: RetentionPlan) -> tuple[int, int]:
        """Evict what ``plan`` deletes (cache and history), then let the layout migrate; returns (evicted, moved)."""
        self.cache.evict(plan, self.history)
        self.history = apply_plan(self.history, plan)
        evicted = plan.tokens_before - plan.tokens_after
        self.counters.evictions += 1
        self.counters.evicted_tokens += evicted
        migrated = 0
        mplan = self.planner.plan(self.cache.page_table)
        if mplan.accepted:
            migrated = self.cache.migrate(mplan)
            self.counters.migrations += 1
            self.counters.migrated_cells += migrated
        return evicted, migrated

    def _maintain(self) -> tuple[int, int]:
        """Retention after a prefill: the policy's plan, the cache's eviction, and the layout's migration."""
        t0 = time.perf_counter()
        evicted = migrated = 0
        scores = self.cache.token_scores(self.history) if self.policy.needs_scores else None
        plan = self.policy.plan(self.history, scores=scores)
        if plan is not None and plan.tokens_after < plan.tokens_before:
            evicted, migrated = self._apply_retention(plan)
        span = self.cache.layout_stats().physical_span
        self.counters.peak_physical_span = max(self.counters.peak_physical_span, span)
        self._trim_capacity()
        self.counters.maintenance_ms += (time.perf_counter() - t0) * 1000
        return evicted, migrated

    def capacity_bound(self) -> int | None:
        """The slots the cache's buffers return to after a large input has gone: the budget's ceiling, or the high
        watermark plus the cache's growth step (None for a policy that never evicts)."""
        if self._max_slots is not None:
            return self._max_slots
        if self.policy.name == "full":
            return None
        page = self.cache.table.page_size
        return (-(-self.policy.high // page) + self.cache.grow_pages) * page

    def _trim_capacity(self) -> None:
        bound = self.capacity_bound()
        if bound is None or self.cache.capacity <= bound:
            return
        target = max(bound, self.cache.layout_stats().physical_span)
        if self.cache.capacity > target:
            self.cache.shrink(target)

    def _begin_reply(self, r: _Reply) -> None:
        """Prefill the question as a unit and open the reply (its tokens will belong to the next uid)."""
        prepared = self.adapter.user_unit(r.question, self.history.next_position())
        self._capture_hidden = r.on_forward is not None
        self._unit(prepared, reserve=r.sampling.max_tokens + REPLY_CLOSING_RESERVE if self._max_slots is not None
                   else 0, question=True)
        if r.on_forward is not None:
            r.on_forward(prepared.input_ids, prepared.inputs_embeds, self._captured_hidden())
        r.logits = self._last_logits
        r.sample = self.backend.sampler(r.sampling)
        r.uid = self.history.next_uid()
        r.start = self.history.next_position()
        self.cache.set_owner(r.uid, AllocClass.RECENT_CONTEXT)
        self._open = r

    def _reply_step(self, r: _Reply) -> str:
        """Decode one token of the open reply; returns the new text (possibly empty). Ends the reply at a stop token,
        a stop string or ``max_tokens``; the text still held back (an incomplete character) comes with the end."""
        if len(r.generated) >= r.sampling.max_tokens:
            return self._finish_reply(r)
        t0 = time.perf_counter()
        try:
            token = r.sample(r.logits, r.generated)
            if token in self.adapter.stop_token_ids:
                r.stopped = True
                return self._finish_reply(r)
            r.generated.append(token)
            axes = self.adapter.kv_spec.position_axes
            embeds = self.adapter.embed_tokens([token])
            r.logits = self._forward(embeds, text_positions(r.start + len(r.generated) - 1, 1, axes))
            if r.on_forward is not None:
                r.on_forward(np.asarray([token]), embeds, self._captured_hidden())
        finally:
            self.counters.decode_ms += (time.perf_counter() - t0) * 1000
        text = self.adapter.decode(r.generated)
        cut = _stop_index(text, r.sampling.stop)
        if cut is not None:
            r.stopped = True
            return self._finish_reply(r)
        return self._emit(r, text[:len(text) - _partial_stop(text, r.sampling.stop)])

    def _emit(self, r: _Reply, text: str) -> str:
        if text.endswith("\ufffd") or len(text) <= len(r.emitted):
            return ""
        piece, r.emitted = text[len(r.emitted):], text
        return piece

    def _finish_reply(self, r: _Reply) -> str:
        """Close the reply: the adapter's closing tokens, the reply unit into the history, retention. Returns the
        text not yet emitted. Called at the reply's end, by a new question, or for an abandoned reply."""
        if r.done:
            return ""
        r.done = True
        self._capture_hidden = False
        if self._open is r:
            self._open = None
        t0 = time.perf_counter()
        axes = self.adapter.kv_spec.position_axes
        fed = len(r.generated)
        self.counters.decoded_tokens += fed
        closing = list(self.adapter.finish_reply(r.generated, r.stopped))
        logits = r.logits
        if closing:
            logits = self._forward(self.adapter.embed_tokens(closing), text_positions(r.start + fed, len(closing), axes))
        self.backend.eval(logits)
        self._last_logits = logits
        self.counters.decode_ms += (time.perf_counter() - t0) * 1000
        if fed + len(closing):
            spans = spans_from_runs([(SpanKind.RESPONSE, fed), (SpanKind.BOUNDARY, len(closing))])
            self.history.append(Unit(uid=r.uid, kind=UnitKind.REPLY, spans=tuple(spans),
                                     positions=text_positions(r.start, fed + len(closing), axes),
                                     label=r.question[:40]))
            self.counters.units += 1
            self._maintain()
        text = self.adapter.decode(r.generated)
        cut = _stop_index(text, r.sampling.stop)
        if cut is not None:
            text = text[:cut]
        return self._emit(r, text)


def model_family(model) -> str:
    """A model's family for saved sessions: its port's package (``qwen2_5_omni``, ``minicpmo``, ...), the same for
    the MLX and the torch port of one model, else its class name."""
    parts = type(model).__module__.split(".")
    for anchor in ("models", "torch"):
        if anchor in parts[:-1]:
            return parts[parts.index(anchor) + 1]
    return type(model).__name__


def _check_model(file: Path, saved: dict | None, model, spec) -> None:
    if not saved:  # format 1 recorded neither; the KV cache's shape is still checked
        return
    family = model_family(model)
    if saved.get("family") != family:
        raise RestoreError(f"{file} was saved from a {saved.get('family')} model; this one is {family}: restore it "
                           "with the model it was saved with")
    got = {"num_layers": spec.num_layers, "kv_heads": spec.kv_heads, "head_dim": spec.head_dim,
           "position_axes": spec.position_axes}
    diff = {k: (saved.get(k), v) for k, v in got.items() if saved.get(k) != v}
    if diff:
        raise RestoreError(f"{file} was saved from another {family} size (saved vs this model: "
                           + ", ".join(f"{k} {a} vs {b}" for k, (a, b) in diff.items()) + ")")


def _replace_dir(new: Path, path: Path) -> None:
    """Put the folder ``new`` at ``path``: a rename; an older folder there is moved aside first and removed after."""
    if not path.exists():
        os.replace(new, path)
        return
    old = path.parent / f".{path.name}.old-{os.getpid()}-{threading.get_ident()}"
    os.replace(path, old)
    try:
        os.replace(new, path)
    except OSError:
        os.replace(old, path)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _model_ref(model) -> str:
    """What a saved session records as its model: an existing local path made absolute (a relative one would be
    looked up on the Hub when restored from another folder), anything else (a Hub id) as given."""
    p = Path(os.fspath(model)).expanduser()
    return str(p.resolve()) if p.exists() else os.fspath(model)


def _caller_level() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside this package (the user's line, however
    many of the package's constructors are in between), counted from the function that warns."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level


def _check_time(t) -> float | None:
    """A chunk's stream time: None, or a finite number of seconds >= 0 (not a string, not a bool)."""
    if t is None:
        return None
    if isinstance(t, bool) or not isinstance(t, (int, float, np.integer, np.floating)):
        raise MediaError(f"t must be a number of seconds, got {t!r}")
    if not math.isfinite(float(t)) or t < 0:
        raise MediaError(f"t must be a finite number of seconds >= 0, got {t!r}")
    return float(t)


def _check_text(text) -> str:
    if not isinstance(text, str):
        raise MediaError(f"text must be a string (got {type(text).__name__})")
    if not text.strip():
        raise MediaError("text is empty")
    return text


def _partial_stop(text: str, stop) -> int:
    """Length of the longest end of ``text`` that begins a stop string: held back until the next token says
    whether the stop string follows, so a stop string is never printed in part."""
    longest = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


def _stop_index(text: str, stop) -> int | None:
    hits = [text.find(s) for s in stop if s and s in text]
    return min(hits) if hits else None
