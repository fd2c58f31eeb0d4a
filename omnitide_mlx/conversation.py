"""Spoken turns on a streaming session: the user talks, the session answers aloud, and stops when interrupted.

A :class:`Conversation` is composed with a session (``OmniSession`` or ``TorchSession``) and an utterance detector
(``omnitide_mlx.vad.UtteranceDetector``: Silero VAD plus onset / hangover / length rules). Every push goes to both:
the session streams the audio into its units as always, and the detector decides when the user starts and stops
speaking. Then:

- **speech started**: the units from the onset on are held whole through retention (``session.hold_turn``) until the
  reply ends, so the spoken question is still there when it is answered. If a reply is being generated or played
  (and ``barge_in`` is on), it stops: generation within one decode step, audio at the next chunk boundary, and the
  reply's text in the history is cut to what was voiced (``session.truncate_reply``).
- **speech ended** (after the detector's hangover): the session answers the turn. The question is the audio already
  streamed, in the model's own chat format (``session.ask(None)``: the open turn is closed and the reply opened);
  the reply is text and, with ``speak=True``, audio.

Events (:class:`TurnEvent`) go to ``on_event`` and to a queue an app reads with :meth:`events`. Two ways to run:

- ``threaded=True`` (apps, the live demo, the server): replies run on a worker thread; pushes never wait for them
  (the session queues media while a reply is open). Playback is assumed to run in real time from the first audio
  chunk unless the app reports it with :meth:`played`.
- ``threaded=False`` (files, tests, ``omnitide stream --voice``): a reply runs inside the push that ended the
  utterance, and its audio is taken to play from that stream time on, so a barge-in is decided in stream time:
  speech that starts while the reply would still be playing interrupts it, and the reply keeps the share of its
  text that was voiced by then.

The model's own voice through a loudspeaker: the audio being played is given to the detector as an echo reference
(``detector.push_reference``) when the detector takes one; see docs/usage.md for headphones against speakers.
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from .errors import MediaError
from .media_decode import SAMPLE_RATE, as_mono_audio

EVENT_KINDS = ("speech_started", "speech_ended", "reply_started", "reply_text", "reply_audio", "reply_paused",
               "reply_resumed", "reply_interrupted", "reply_done", "turn_error")

# Speaking rate used to map voiced seconds to reply tokens while a reply's audio is still incomplete (English speech
# at ~150 words a minute is ~3.3 BPE tokens a second); once the whole reply is voiced the reply's own ratio is used.
TOKENS_PER_SECOND = 3.3


@dataclass(frozen=True)
class TurnEvent:
    """One thing that happened in a conversation. ``t``: stream seconds (the audio pushed so far) when it happened;
    ``turn``: the turn it belongs to (1, 2, ...). ``text`` carries a reply piece, ``audio`` an ``AudioChunk``."""

    kind: str
    turn: int
    t: float
    text: str = ""
    audio: object = None
    data: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        out = {"kind": self.kind, "turn": self.turn, "t": round(self.t, 3)}
        if self.text:
            out["text"] = self.text
        if self.audio is not None:
            out["audio_seconds"] = round(self.audio.seconds, 3)
            out["final"] = bool(self.audio.final)
        out.update(self.data)
        return out


@dataclass
class Turn:
    """One question and its reply, as ``--json`` records it (stream seconds; ``*_ms`` are wall-clock latencies
    from the moment the end of the utterance was decided)."""

    index: int
    source: str  # "voice" or "text"
    question: str | None = None
    speech_start: float | None = None
    speech_end: float | None = None
    decided_at: float | None = None
    reply_start: float | None = None
    reply: str = ""
    audio_seconds: float = 0.0
    tokens: int = 0
    interrupted: bool = False
    interrupted_at: float | None = None
    voiced_tokens: int | None = None
    latency_ms: dict = field(default_factory=dict)
    error: str | None = None
    # private bookkeeping
    _decided_wall: float | None = field(default=None, repr=False)
    _first_audio_wall: float | None = field(default=None, repr=False)
    _audio_complete: bool = field(default=False, repr=False)
    _reply_uid: int | None = field(default=None, repr=False)
    _interrupt: threading.Event = field(default_factory=threading.Event, repr=False)
    _generated: bool = field(default=False, repr=False)
    _play_cursor: float | None = field(default=None, repr=False)  # stream time the next reply chunk plays at
    _paused: bool = field(default=False, repr=False)  # a candidate onset paused the player

    def to_json(self) -> dict:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in self.__dict__.items()
                if not k.startswith("_")}


class Conversation:
    """Spoken turns over ``session``; see the module docstring.

    ``detector``: an utterance detector (default: ``omnitide_mlx.vad.UtteranceDetector()``, Silero VAD in MLX);
    ``speak``/``speaker``/``speech``: spoken replies as in ``OmniSession.ask``; ``barge_in``: speech during a reply
    interrupts it; ``echo_reference``: give the reply's audio to the detector as the loudspeaker's echo reference
    (on: speakers; off: headphones, files, or a browser that cancels its own echo); ``step``: a context manager every model step runs in (the server's compute gate; default a lock
    of the conversation's own, so the detector and a reply on the worker thread never run MLX at once);
    ``ask_kwargs``: sampling options for every reply (``max_tokens``, ``temp``, ``seed``, ...).
    """

    def __init__(self, session, *, detector=None, speak: bool = False, speaker: str | None = None, speech=None,
                 barge_in: bool = True, threaded: bool = False, on_event: Callable[[TurnEvent], None] | None = None,
                 step: Callable[[], contextlib.AbstractContextManager] | None = None, echo_reference: bool = True,
                 **ask_kwargs):
        if not hasattr(session.adapter, "turn_unit"):
            raise ValueError("this model cannot hear spoken questions (it takes no audio): a conversation needs an "
                             "omni model")
        if detector is None:
            from .vad import UtteranceDetector

            detector = UtteranceDetector(candidates=True)
        warm_up = getattr(session, "warm_up", None)
        if warm_up is not None:  # the first turn should not pay for imports and loading (SpeechUnavailable here)
            warm_up(speak=bool(speak))
        self.session, self.detector = session, detector
        self.speak, self.barge_in, self.threaded = bool(speak), bool(barge_in), bool(threaded)
        self.on_event = on_event
        self.echo_reference = bool(echo_reference)
        if step is None:
            own = threading.Lock()

            @contextlib.contextmanager
            def step():
                with own:
                    yield
        self._step = step
        self._speech_kwargs = {"speak": True, "speaker": speaker, "speech": speech} if speak else {}
        self.ask_kwargs = dict(ask_kwargs)
        self.turns: list[Turn] = []
        self._events: queue.Queue[TurnEvent] = queue.Queue()
        self._lock = threading.RLock()  # the conversation's own state (turns, the playing reply, the clock)
        self._samples = 0  # audio pushed, at SAMPLE_RATE: the conversation's stream clock
        self._speech: Turn | None = None  # the utterance being spoken (started, not ended)
        self._active: Turn | None = None  # the reply being generated or played
        self._jobs: queue.Queue[Turn | None] = queue.Queue()  # threaded mode: turns for the reply worker
        self._worker: threading.Thread | None = None
        self._played_s: float | None = None  # playback position the app reported for the active reply
        self._closed = False

    # --- the clock ----------------------------------------------------------------------------------------------
    @property
    def stream_time(self) -> float:
        """Seconds of audio pushed so far."""
        return self._samples / SAMPLE_RATE

    # --- producer side ------------------------------------------------------------------------------------------
    def push(self, frame=None, audio=None, sample_rate: int | None = SAMPLE_RATE, t: float | None = None,
             text: str | None = None) -> list[TurnEvent]:
        """Stream a frame and / or audio (any rate) into the session and the detector; returns the events this push
        caused (in inline mode a whole reply's). Bad media raise MediaError before anything is touched."""
        if self._closed:
            raise RuntimeError("the conversation is closed")
        mono = as_mono_audio(audio, sample_rate) if audio is not None else None  # MediaError before anything moves
        events: list[TurnEvent] = []
        with self._step():
            self.session.push(frame=frame, audio=mono, text=text, t=t, sample_rate=SAMPLE_RATE)
        if mono is None:
            return events
        with self._lock, self._step():
            self._samples += mono.shape[0]
            detected = self.detector.feed(mono, SAMPLE_RATE)
        for ev in detected:
            events += self._on_detected(ev)
        return events + self._check_playback()

    def played(self, seconds: float) -> None:
        """The app's player has played ``seconds`` of the active reply (a barge-in keeps the text voiced by then)."""
        with self._lock:
            self._played_s = float(seconds)

    def ask(self, question: str) -> list[TurnEvent]:
        """A typed question beside voice: interrupts a reply being generated or played, then is answered like a
        spoken turn (text question, same events)."""
        if not isinstance(question, str) or not question.strip():
            raise ValueError("a typed question must be a non-empty string")
        events = self._interrupt_active(self.stream_time)
        turn = Turn(index=len(self.turns) + 1, source="text", question=question, decided_at=self.stream_time,
                    _decided_wall=time.perf_counter())
        self.turns.append(turn)
        return events + self._start_reply(turn)

    def flush(self) -> list[TurnEvent]:
        """The end of the input (a file ended, the microphone closed): an utterance still open is ended and answered;
        in threaded mode, waits for the last reply."""
        with self._lock, self._step():
            detected = self.detector.flush()
        events: list[TurnEvent] = []
        for ev in detected:
            events += self._on_detected(ev)
        self.wait()
        return events

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every queued reply has been generated (threaded mode); False on timeout."""
        if self._worker is None:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._jobs.unfinished_tasks:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def interrupt(self) -> list[TurnEvent]:
        """Stop the reply being generated or played (a stop button); never blocks."""
        return self._interrupt_active(self.stream_time)

    def close(self) -> None:
        """Stop the active reply, end the worker and release the held turn; the session stays usable."""
        self._closed = True  # queued turns are dropped
        self._interrupt_active(self.stream_time)
        if self._worker is not None:
            self._jobs.put(None)
            self._worker.join()
            self._worker = None
        self.session.release_turn()
        self._closed = True

    def events(self, timeout: float | None = None) -> Iterator[TurnEvent]:
        """The events as they come (any thread); ends after ``timeout`` seconds without one (None: never)."""
        while True:
            try:
                yield self._events.get(timeout=timeout)
            except queue.Empty:
                return

    def to_json(self) -> list[dict]:
        return [t.to_json() for t in self.turns]

    # --- detector events --------------------------------------------------------------------------------------
    def _emit(self, kind: str, turn: Turn | None, t: float, **kw) -> TurnEvent:
        ev = TurnEvent(kind, turn.index if turn is not None else len(self.turns) + 1, t, **kw)
        self._events.put(ev)
        if self.on_event is not None:
            self.on_event(ev)
        return ev

    def _on_detected(self, ev) -> list[TurnEvent]:
        events: list[TurnEvent] = []
        if ev.kind in ("candidate", "dropped"):  # a possible onset: pause the answer at once, resume if it was not
            return self._pause(ev)
        if ev.kind == "start":
            if getattr(ev, "reason", "onset") != "cap":  # speech that runs on past the cap is the next turn, it
                events += self._interrupt_active(ev.decided_at)  # does not interrupt the answer to its first part
            with self._lock:
                turn = Turn(index=len(self.turns) + 1, source="voice", speech_start=ev.t_start)
                self._speech = turn
                self.turns.append(turn)
            # the unit holding the onset starts at most a second before it (units are a second of audio)
            self.session.hold_turn(max(0.0, math.floor(ev.t_start - 1e-9) - 1.0))
            events.append(self._emit("speech_started", turn, ev.decided_at, data={"speech_start": ev.t_start}))
        elif ev.kind == "end":
            with self._lock:
                turn, self._speech = self._speech, None
            if turn is None:  # an end without its start (a detector restored mid-utterance)
                turn = Turn(index=len(self.turns) + 1, source="voice", speech_start=ev.t_start)
                self.turns.append(turn)
            turn.speech_end, turn.decided_at, turn._decided_wall = ev.t_end, ev.decided_at, time.perf_counter()
            events.append(self._emit("speech_ended", turn, ev.decided_at,
                                     data={"speech_start": ev.t_start, "speech_end": ev.t_end,
                                           "reason": getattr(ev, "reason", "silence")}))
            events += self._start_reply(turn)
        return events

    # --- replies ----------------------------------------------------------------------------------------------
    def _start_reply(self, turn: Turn) -> list[TurnEvent]:
        if not self.threaded:
            return self._run_reply(turn)
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="omnitide-replies", daemon=True)
            self._worker.start()
        self._jobs.put(turn)
        return []

    def _work(self) -> None:
        """The reply worker (threaded mode): one turn at a time, in the order they were decided."""
        while True:
            turn = self._jobs.get()
            try:
                if turn is None:
                    return
                if not turn._interrupt.is_set() and not self._closed:  # interrupted while queued: skipped
                    self._run_reply(turn)
            finally:
                self._jobs.task_done()

    def _run_reply(self, turn: Turn) -> list[TurnEvent]:
        with self._lock:
            self._active, self._played_s = turn, None
            turn.reply_start = self.stream_time
        events: list[TurnEvent] = []
        session = self.session
        model = [0.0]  # wall seconds inside model steps (the rest of a latency is the conversation's own overhead)

        @contextlib.contextmanager
        def step():
            with self._step():
                a = time.perf_counter()
                try:
                    yield
                finally:
                    model[0] += time.perf_counter() - a

        try:
            t0 = time.perf_counter()
            if turn.source == "voice":
                with step():
                    session.flush(pad_audio=True)  # the utterance's last part second becomes a unit first
            t1 = time.perf_counter()
            with step():  # a spoken reply loads the speech models on first use
                pieces = session.ask(turn.question, **self._speech_kwargs, **self.ask_kwargs)
            events.append(self._emit("reply_started", turn, turn.reply_start))
            first_text = None
            model_text = model_audio = None
            text = []
            try:
                while not turn._interrupt.is_set():
                    with step():
                        item = next(pieces, None)
                    if item is None:
                        break
                    now = time.perf_counter()
                    if isinstance(item, str):
                        if first_text is None and item:
                            first_text, model_text = now, model[0]
                        text.append(item)
                        events.append(self._emit("reply_text", turn, self.stream_time, text=item))
                    else:
                        if item.pcm.size and turn._first_audio_wall is None:
                            turn._first_audio_wall, model_audio = now, model[0]
                        if item.pcm.size:
                            self._feed_reference(turn, item)
                        turn.audio_seconds += item.seconds
                        turn._audio_complete = bool(item.final)
                        events.append(self._emit("reply_audio", turn, self.stream_time, audio=item))
            finally:
                with step():
                    pieces.close()
            turn.reply = "".join(text)
            turn._reply_uid = self._last_reply_uid()
            turn.tokens = self._reply_tokens(turn._reply_uid)
            turn.latency_ms = _latency(turn, t0, t1, first_text, model_text, model_audio)
            if turn._interrupt.is_set():
                events += self._cut(turn, turn.interrupted_at if turn.interrupted_at is not None else self.stream_time)
            elif not turn.audio_seconds:
                events += self._done(turn)
            else:  # the reply plays on (in stream time inline, in wall time threaded): done or interrupted later
                turn._generated = True
                events += self._check_playback()
        except Exception as e:  # noqa: BLE001  (a failed turn is reported and the conversation goes on)
            turn.error = f"{type(e).__name__}: {e}"
            session.release_turn()
            events.append(self._emit("turn_error", turn, self.stream_time, data={"error": turn.error}))
            with self._lock:
                if self._active is turn:
                    self._active = None
            if not isinstance(e, (MediaError, ValueError, RuntimeError)):
                raise
        return events

    def _done(self, turn: Turn) -> list[TurnEvent]:
        with self._lock:
            if self._active is turn:
                self._active = None
        if self._speech is None:
            self.session.release_turn()
        return [self._emit("reply_done", turn, self.stream_time,
                           data={"audio_seconds": round(turn.audio_seconds, 3), "tokens": turn.tokens})]

    def _interrupt_active(self, t: float) -> list[TurnEvent]:
        """Speech (or a typed question) at stream time ``t``: stop the active reply if it is still being generated
        or played; an inline reply whose audio has finished playing by ``t`` is done instead."""
        with self._lock:
            turn = self._active
        if turn is None:
            return []
        if self.threaded and not turn._generated:
            if self.barge_in:
                turn.interrupted_at = t
                turn._interrupt.set()  # the worker stops at its next decode step and emits reply_interrupted
            return []
        if not self.barge_in or self._playback_position(turn, t) >= turn.audio_seconds:
            return self._done(turn)
        turn.interrupted_at = t
        return self._cut(turn, t)

    def _pause(self, ev) -> list[TurnEvent]:
        """A candidate onset while an answer plays or is generated: ``reply_paused`` (the player pauses now, one
        detector chunk after the sound began); ``reply_resumed`` when it was not speech. A confirmed onset then
        interrupts as usual."""
        with self._lock:
            turn = self._active
        if turn is None or not self.barge_in:
            return []
        if ev.kind == "candidate":
            if turn._paused:
                return []
            if not self.threaded and self._playback_position(turn, ev.decided_at) >= turn.audio_seconds and \
                    turn._generated:
                return []  # its audio has already played out
            turn._paused = True
            return [self._emit("reply_paused", turn, ev.decided_at, data={"onset": ev.t_start})]
        if turn._paused:
            turn._paused = False
            return [self._emit("reply_resumed", turn, ev.decided_at)]
        return []

    def _playback_position(self, turn: Turn, t: float) -> float:
        """Seconds of ``turn``'s audio played by stream time ``t`` (inline), or by now (threaded: what the app
        reported with ``played``, else real-time playback from the first chunk)."""
        if not self.threaded:
            return max(0.0, t - (turn.reply_start or 0.0))
        if self._played_s is not None:
            return self._played_s
        return time.perf_counter() - turn._first_audio_wall if turn._first_audio_wall else 0.0

    def _check_playback(self) -> list[TurnEvent]:
        """A generated reply whose audio has played out is done."""
        with self._lock:
            turn = self._active
        if turn is None or not turn._generated:
            return []
        if self._playback_position(turn, self.stream_time) >= turn.audio_seconds:
            return self._done(turn)
        return []

    def _cut(self, turn: Turn, t: float) -> list[TurnEvent]:
        """End ``turn``'s reply at stream time ``t``: keep the text voiced by then in the history."""
        with self._lock:
            if self._active is turn:
                self._active = None
        voiced_s = min(self._playback_position(turn, t), turn.audio_seconds)
        if not self.speak:
            keep = turn.tokens  # a text reply was shown whole as it streamed
        elif turn._audio_complete and turn.audio_seconds > 0:
            keep = int(round(turn.tokens * voiced_s / turn.audio_seconds))
        else:
            keep = min(turn.tokens, int(round(voiced_s * TOKENS_PER_SECOND)))
        turn.interrupted, turn.interrupted_at, turn.voiced_tokens = True, t, keep
        if turn._reply_uid is not None and keep < turn.tokens:
            try:
                with self._step():
                    self.session.truncate_reply(turn._reply_uid, keep)
            except (KeyError, ValueError):
                pass  # the reply was already evicted: nothing of it is left to cut
        if self._speech is None:
            self.session.release_turn()
        return [self._emit("reply_interrupted", turn, t,
                           data={"voiced_seconds": round(voiced_s, 3), "voiced_tokens": keep,
                                 "tokens": turn.tokens})]

    def _feed_reference(self, turn: Turn, chunk) -> None:
        """The detector hears the reply's chunk as the loudspeaker will play it: from the reply's start in stream
        time (inline), or from when the first chunk was ready (threaded), chunk after chunk."""
        push = getattr(self.detector, "push_reference", None) if self.echo_reference else None
        if push is None:
            return
        if turn._play_cursor is None:
            turn._play_cursor = turn.reply_start if not self.threaded else self.stream_time
        with self._lock:
            push(np.asarray(chunk.pcm, dtype=np.float32), chunk.sample_rate, turn._play_cursor)
        turn._play_cursor += chunk.seconds

    def _last_reply_uid(self) -> int | None:
        from .core.units import UnitKind

        for u in reversed(list(self.session.history)):
            if u.kind is UnitKind.REPLY:
                return u.uid
        return None

    def _reply_tokens(self, uid: int | None) -> int:
        if uid is None:
            return 0
        from .core.units import SpanKind

        try:
            unit = self.session.history.unit(uid)
        except KeyError:
            return 0
        return sum(s.length for s in unit.spans if s.kind is SpanKind.RESPONSE)


def _latency(turn: Turn, t0: float, t1: float, first_text: float | None, model_text: float | None,
             model_audio: float | None) -> dict:
    """A turn's latencies in ms from the moment the end of the utterance was decided: queueing (decision to the
    reply's start), the last unit's prefill, the first text piece and the first audio, with the model's share of
    each; ``overhead_ms`` is what the conversation itself added (events, hand-offs, copies) before the first audio
    (the first text for a text reply)."""
    base = turn._decided_wall if turn._decided_wall is not None else t0
    ms = lambda a, b: None if a is None else round((a - b) * 1000, 2)  # noqa: E731
    out = {"queue_ms": ms(t0, base), "last_unit_ms": ms(t1, t0), "first_text_ms": ms(first_text, base),
           "first_audio_ms": ms(turn._first_audio_wall, base),
           "model_ms_to_first_text": None if model_text is None else round(model_text * 1000, 2),
           "model_ms_to_first_audio": None if model_audio is None else round(model_audio * 1000, 2)}
    end, model = ((out["first_audio_ms"], out["model_ms_to_first_audio"]) if out["first_audio_ms"] is not None
                  else (out["first_text_ms"], out["model_ms_to_first_text"]))
    out["overhead_ms"] = None if end is None or model is None else round(end - model, 2)
    return out
