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

StreamingSession is assembled here from its parts in ``omnitide_mlx/streaming/``: ``records`` (UpdateRecord,
counters, Sampling, queue and reply state), ``budget`` (policies, watermarks, KV budgets), ``persist`` (save /
restore), ``inbox`` (the engine lock and the queue of pushed chunks), ``retention`` (a unit's prefill and the
retention step) and ``reply`` (decode steps). Every name they define that was importable from here still is.
"""

from __future__ import annotations

import copy
import os
import sys
import threading
import warnings
from collections import deque
from typing import Callable, Iterator

import numpy as np

from .backend import Backend
from .core.layout import LayoutSpec
from .core.page import AllocClass
from .core.pick import RetentionPolicy
from .core.retention_plan import plan_from_mask
from .core.stream_units import MediaSetting, watermark_guard
from .core.units import History, Span, SpanKind, Unit, UnitKind
from .errors import MediaError, SessionBusyError
from .media_decode import SAMPLE_RATE, as_mono_audio, as_rgb_frame
from .models.base import StreamAdapter, text_positions
from .models.stream_units import profile_for_spec
from .streaming.records import (  # noqa: F401  (the engine's API, defined in its parts)
    RetentionWarning,
    UpdateRecord,
    SessionCounters,
    Sampling,
    _Pending,
    _Waiting,
    _Reply,
    REPLY_CLOSING_RESERVE,
    FRAME_WAIT_UNITS,
)
from .streaming.budget import (  # noqa: F401  (the engine's API, defined in its parts)
    RESERVE_PAGES,
    policy_from,
    _watermark,
    budget_slots,
    watermarks_for_budget,
    parse_bytes,
    machine_memory_bytes,
    kv_budget_bytes,
    _check_budget_args,
)
from .streaming.persist import (  # noqa: F401  (the engine's API, defined in its parts)
    SESSION_FORMAT,
    READABLE_FORMATS,
    SESSION_FILES,
    _Saved,
    model_family,
    _check_model,
    _replace_dir,
    _model_ref,
    Persistence,
)
from .streaming.inbox import Inbox, _check_text, _check_time  # noqa: F401
from .streaming.reply import Replies, _partial_stop, _stop_index  # noqa: F401
from .streaming.retention import Retention
from .streaming.recall import Recall


class StreamingSession(Persistence, Inbox, Retention, Replies, Recall):
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
                 layout: LayoutSpec | str | None = None, recall: int | str | None = None,
                 recall_tokens: int | None = None, recall_bits: int | None = 8, _saved: _Saved | None = None):
        """``media``: the media setting (frame size, ``max_pixels`` / ``max_slice_nums``; ``get_preset("paper")``)
        the adapter lays units out at (default: the official long-video processing). A named policy with no
        ``high`` / ``low`` / ``kv_budget`` gets the model's own watermarks (core/profiles.py, paper figure 14).
        ``layout``: the KV layout (a frozen ``core.layout.LayoutSpec``, or a layout name), default the policy's
        (``omnitide``: OmniPage, ``omnipick``: native, ``eager``), as the backend builds it.
        ``recall``: the byte budget (or a size string, ``"1GiB"``) of a store that keeps the units retention drops
        (quantised to ``recall_bits``) and brings the best of them back for each answer, at most ``recall_tokens``
        tokens (default: the room between the watermarks); streaming/recall.py. A restored session keeps its saved
        store (the arguments apply when it was saved without one).
        ``_saved`` (from ``restore``): the saved session to continue; its settings replace the arguments."""
        self.backend = backend
        recall_opts = self._check_recall(recall, recall_tokens, recall_bits)
        if _saved is None:  # everything that can be checked without the model is checked before it loads
            self.kv_quant = self._check_kv_quant(kv_bits, kv_group_size, kv_keep_sinks_full)
            budget = _check_budget_args(policy, high, low, kv_budget)
            if budget is None:
                self.policy = policy_from(policy, high, low)
            self.layout = _layout_from(layout, backend, (self.policy if budget is None else policy_from(policy)).layout)
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
            table, self.planner = self.layout.build(page_size, subblock_size)
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
        saved_recall = _saved.meta.get("recall") if _saved is not None else None
        self._init_recall(recall_opts, saved_recall, _saved.path if saved_recall else None)
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
                              recent_units=recent, high=self.policy.high)
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
        self._flush_pad = False  # the queued flush pads the buffered audio to a second
        self._inbox_lock = threading.Lock()
        self._inbox: deque[_Pending] = deque()
        self.rejected: deque[str] = deque(maxlen=64)  # errors of queued chunks whose push() had returned
        self._audio_buf = np.zeros(0, dtype=np.float32)
        self._waiting: deque[_Waiting] = deque()  # frames waiting for their audio, oldest first
        self._pending_t: float | None = None
        self._audio_driven = False
        self._seconds = 0.0  # stream time given to units pushed without t
        self._last_logits = None
        self._turn_since: float | None = None  # units from this stream time on are held whole (hold_turn)

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
    def _forward(self, embeds, positions: np.ndarray, extras: dict | None = None):
        """Prefill ``embeds`` ``[T, hidden]`` at ``positions`` ``[axes, T]``; return the last token's logits (and
        keep the hidden states while ``_capture_hidden`` is set). ``extras``: the unit's, for the backend to pass
        the model inputs among them (``Backend.forward``)."""
        logits, hidden = self.backend.forward(self.model, self.cache, embeds, positions, hidden=self._capture_hidden,
                                              extras=extras)
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

    def flush(self, pad_audio: bool = False) -> list[UpdateRecord]:
        """Turn buffered input into units: less than a second of audio (with the oldest waiting frame, if any),
        then every frame still waiting for its audio (with a second of silence). ``pad_audio``: the buffered audio
        is padded with silence to a whole second (counted as silence), as the end of a spoken turn does: every
        model takes a whole unit (MiniCPM-o's streaming audio encoder takes nothing shorter).

        While a reply is open the flush queues and runs when the reply ends (it returns ``[]`` then)."""
        with self._engine():
            self._flush_requested = True
            self._flush_pad = self._flush_pad or bool(pad_audio)
            if self._open is not None and not self._open.abandoned:
                return []
            return self._settle_locked()

    # --- consumer side --------------------------------------------------------------------------------------
    def ask(self, question: str | None, *, max_tokens: int = 256, temp: float = 0.0, top_p: float = 0.0, min_p: float = 0.0,
            top_k: int = 0, repetition_penalty: float | None = None, seed: int | None = None,
            stop: str | list[str] | None = None, on_forward: Callable | None = None) -> Iterator[str]:
        """Ask a question about everything streamed so far; returns the reply as an iterator of text pieces.

        ``question=None`` answers a spoken question: the user's words are the audio streamed since the last reply
        (the open turn's media units), as the model hears speech; the turn is closed and answered (MediaError, at the
        first piece, when nothing has been streamed since the last reply). Sampling options follow mlx-lm (``temp`` 0
        is greedy). The question and the reply become units of the
        history. Queued pushes are processed first, so the answer sees them. One reply at a time: asking again
        (from any thread) ends the open reply where it is, as a stop button would, and its iterator then ends.
        Closing the iterator (or dropping it) ends the reply; pushes made meanwhile are processed then.
        ``on_forward(ids, embeds, hidden)`` is called for the question unit and for every reply token fed back,
        with the backend's final-norm hidden states of those tokens (spoken replies read them; see speech.py).
        """
        if question is None:  # a spoken question: the user's audio already streamed in the open turn
            if not hasattr(self.adapter, "turn_unit"):
                raise ValueError("this model cannot hear a spoken question (no audio input): ask in text")
        else:
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

    def hold_turn(self, since: float) -> None:
        """Keep every unit from stream time ``since`` on whole through retention (the units holding a spoken
        question, from its onset until its reply ends): they are pinned in every plan; ``release_turn`` ends it.
        Under a KV budget the ceiling still wins (budget trims drop pinned units last)."""
        since = float(since)
        if not np.isfinite(since):
            raise ValueError(f"hold_turn needs a finite stream time, got {since!r}")
        with self._engine(settle=False):
            self._turn_since = since

    def release_turn(self) -> None:
        """End ``hold_turn``: the held units become ordinary history again (retention treats them at the next
        update)."""
        with self._engine(settle=False):
            self._turn_since = None

    def truncate_reply(self, uid: int, keep_tokens: int) -> int:
        """Keep only the first ``keep_tokens`` generated tokens of the closed reply ``uid`` (what was voiced before a
        barge-in), its closing tokens stay: the rest leaves the history and the cache like any retention (positions
        shift, keys re-rotate). Returns the tokens removed."""
        with self._engine():
            if self._open is not None and self._open.uid == uid and not self._open.done:
                raise SessionBusyError("the reply is still open: close it before truncating it")
            i = self.history.index_of(uid)
            unit = self.history[i]
            if unit.kind is not UnitKind.REPLY:
                raise ValueError(f"unit {uid} is a {unit.kind.value} unit, not a reply")
            spoken = [s for s in unit.spans if s.kind is SpanKind.RESPONSE]
            if not spoken:
                return 0
            span = spoken[0]
            keep_tokens = max(0, min(int(keep_tokens), span.length))
            if keep_tokens == span.length:
                return 0
            keep = np.ones(self.history.total_tokens, dtype=bool)
            off = self.history.offsets()[i] + span.start
            keep[off + keep_tokens:off + span.length] = False
            plan = plan_from_mask(self.history, keep, "truncate", self.policy.positions)
            self._apply_retention(plan)
            return span.length - keep_tokens

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
            n, embeds = len(ids), self.adapter.embed_tokens(ids)
            positions = text_positions(self.history.next_position(), n, self.adapter.kv_spec.position_axes)
            try:
                positions = positions + self._recall_admit(embeds, positions, 0, "probe")
                cache, history = self.cache, self.history
                uid = history.next_uid()
                collect = cache.collect_scores
                cache.collect_scores = False  # the probe's attention must not count for H2O
                try:
                    cache.set_owner(uid)
                    logits, _ = self.backend.forward(self.model, cache, embeds, positions)
                    out = self.backend.to_numpy(logits)
                finally:
                    cache.collect_scores = collect
                probe = Unit(uid=uid, kind=UnitKind.USER, spans=(Span(SpanKind.TEXT, 0, n),), positions=positions)
                with_probe = History(list(history) + [probe])
                keep = np.ones(with_probe.total_tokens, dtype=bool)
                keep[-n:] = False
                cache.evict(plan_from_mask(with_probe, keep, "probe"), with_probe)
            finally:
                self._recall_release()
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
                "layout": self.layout.name,
                "layout_spec": self.layout.to_json(),
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
                "recall": self._recall_stats(),
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


def _caller_level() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside this package (the user's line, however
    many of the package's constructors are in between), counted from the function that warns."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level


def _layout_from(layout, backend: Backend, policy_layout: str) -> LayoutSpec:
    """The session's layout: a spec as given, a name as the backend builds it, or the policy's layout."""
    if isinstance(layout, LayoutSpec):
        return LayoutSpec.from_json(layout.to_json())  # LayoutError for a spec no layout has
    if layout is None:
        return backend.layout_spec(policy_layout)
    if not isinstance(layout, str):
        raise TypeError(f"layout must be a LayoutSpec or a layout name, got {type(layout).__name__}")
    return backend.layout_spec(layout)

