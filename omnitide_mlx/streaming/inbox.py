"""The engine lock and the inbox of pushed chunks: a push is queued, and whoever holds the engine processes the
queue, one bounded piece of work at a time, never across a yield (engine.py's module docstring: threads). Media
chunks become units here: one per second of audio, each with the frame waiting for it.
"""

from __future__ import annotations

import math
import threading
import warnings
from contextlib import contextmanager

import numpy as np

from ..errors import MediaError, SessionError
from ..media_decode import SAMPLE_RATE
from .records import UpdateRecord, _Pending, _Waiting, FRAME_WAIT_UNITS


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


class Inbox:
    """The engine lock and the queue of pushed chunks: who processes what, and when.

    A part of StreamingSession (engine.py), which holds the state these methods use."""

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
            pad = SAMPLE_RATE - audio.size if self._flush_pad else 0
            if pad:
                audio = np.concatenate([audio, np.zeros(pad, dtype=np.float32)])
            records += self._media(self._take_frame(), audio, padding=pad)
        self._flush_pad = False
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
               silence: bool = False, padding: int = 0) -> list[UpdateRecord]:
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
                c.audio_seconds += (audio.shape[0] - padding) / SAMPLE_RATE
                c.silence_seconds += padding / SAMPLE_RATE
        return records
