"""The utterance detector: microphone audio in, "user started / stopped speaking" events out.

``UtteranceDetector.feed(audio, sample_rate)`` takes mono float audio at any rate and in chunks of any length,
resamples it to 16 kHz, runs the Silero VAD on each 32 ms chunk (``vad/silero.py``) and turns the per-chunk speech
probabilities into utterances with the rules of ``VADConfig``:

- **onset**: a chunk with probability >= ``threshold`` opens a candidate; the candidate becomes an utterance (a
  ``start`` event) once ``min_speech_s`` of audio since its first chunk has passed without a chunk below
  ``neg_threshold`` (a click or a cough shorter than that is dropped);
- **end of utterance**: inside an utterance, a chunk below ``neg_threshold`` starts a silence; a chunk >=
  ``threshold`` cancels it; ``hangover_s`` of silence ends the utterance (an ``end`` event, reason "silence");
- **cap**: an utterance reaching ``max_utterance_s`` ends there (reason "cap"); if the user is still speaking a new
  utterance starts at once at the cut (a ``start`` with reason "cap"), so a user who never stops is answered in
  ``max_utterance_s`` pieces and no audio falls between two utterances;
- ``flush()`` (end of stream, microphone closed) runs what is buffered and ends an open utterance (reason "flush").

Times are stream seconds: the audio fed so far, at its own rate. An event's ``t_start`` / ``t_end`` bound the
utterance, widened by ``speech_pad_s`` (never before the previous utterance's end nor past the decision);
``decided_at`` is the stream time of the chunk that decided it, so ``decided_at - t_end`` of an end event is the
hangover the caller waited.

With a loudspeaker, ``push_reference(audio, rate, t)`` tells the detector what the player plays from stream time
``t``, so the reply's own voice coming back does not start an utterance (vad/echo.py; measured in
docs/benchmarks.md, "Voice activity detection").
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from omnitide_mlx.vad.echo import EchoReference
from omnitide_mlx.vad.resample import Resampler, check_rate
from omnitide_mlx.vad.silero import CHUNK, SAMPLE_RATE, SileroState, SileroVAD

_STATE_VERSION = 1


@dataclass(frozen=True)
class VADConfig:
    """The utterance rules (seconds of stream time). Defaults: Silero's own threshold 0.5 / 0.35; 0.1 s of speech to
    start (three 32 ms chunks), 0.5 s of silence to end; see docs/benchmarks.md for the latency each costs."""

    threshold: float = 0.5
    neg_threshold: float | None = None  # default: threshold - 0.15 (Silero's), at least 0.01
    min_speech_s: float = 0.1
    hangover_s: float = 0.5
    speech_pad_s: float = 0.03
    max_utterance_s: float = 30.0
    # the echo gate (vad/echo.py), active only while push_reference has told of playback:
    echo_delay_s: float = 0.25  # the longest loudspeaker-to-microphone delay covered
    echo_gain_db: float = -6.0  # the echo's starting gain estimate (worst case; it adapts to the room)
    echo_margin_db: float = 1.5  # how far above the expected echo a chunk must be to start an utterance

    def __post_init__(self):
        for name in ("threshold", "min_speech_s", "hangover_s", "speech_pad_s", "max_utterance_s", "echo_delay_s",
                     "echo_gain_db", "echo_margin_db"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"VADConfig.{name} must be a finite number, got {v!r}")
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(f"VADConfig.threshold must be in (0, 1), got {self.threshold}")
        if self.neg_threshold is not None and not 0.0 < self.neg_threshold <= self.threshold:
            raise ValueError(f"VADConfig.neg_threshold must be in (0, threshold={self.threshold}], "
                             f"got {self.neg_threshold}")
        if min(self.min_speech_s, self.hangover_s, self.speech_pad_s, self.echo_delay_s, self.echo_margin_db) < 0:
            raise ValueError("VADConfig.min_speech_s, hangover_s, speech_pad_s, echo_delay_s and echo_margin_db "
                             "must be >= 0")
        if self.echo_gain_db > 0:
            raise ValueError(f"VADConfig.echo_gain_db must be <= 0 dB, got {self.echo_gain_db}")
        if self.max_utterance_s <= max(self.min_speech_s, CHUNK / SAMPLE_RATE):
            raise ValueError(f"VADConfig.max_utterance_s ({self.max_utterance_s}) must exceed min_speech_s and "
                             f"one {CHUNK / SAMPLE_RATE * 1000:.0f} ms chunk")

    @property
    def off_threshold(self) -> float:
        return self.neg_threshold if self.neg_threshold is not None else max(self.threshold - 0.15, 0.01)


@dataclass(frozen=True)
class SpeechEvent:
    """A detected utterance's start or end. ``t_start`` is set on both; ``t_end`` only on an end event."""

    kind: str  # "start" | "end"; with candidates on, also "candidate" (a possible onset) and "dropped" (not one)
    t_start: float
    t_end: float | None
    decided_at: float
    reason: str  # start: "onset" | "cap" (continues a capped one); end: "silence" | "cap" | "flush"


@dataclass
class _Track:
    """The utterance state machine, in 16 kHz samples of stream time (integers: exact in a saved session)."""

    phase: str = "idle"  # "idle" | "candidate" | "speech"
    onset: int = 0  # candidate: its first speech chunk's start; speech: the utterance start (padded)
    silence_from: int = -1  # speech: where the current silence began (-1: none)
    last_end: int = 0  # the previous utterance's end (padding never reaches back past it)


class UtteranceDetector:
    """Silero VAD + the utterance rules over a live audio stream. Not thread-safe: one caller feeds it."""

    def __init__(self, config: VADConfig | None = None, model: SileroVAD | None = None, candidates: bool = False):
        """``candidates``: also report a possible onset as soon as one chunk crosses the threshold ("candidate"),
        and "dropped" when it does not last ``min_speech_s``: what a player needs to pause an answer within one
        chunk of the user's first sound (a conversation's barge-in), before the onset is confirmed."""
        self.candidates = bool(candidates)
        self.config = config if config is not None else VADConfig()
        if not isinstance(self.config, VADConfig):
            raise TypeError(f"config must be a VADConfig, got {type(self.config).__name__}")
        self.model = model if model is not None else SileroVAD.load()
        self.reset()

    # --- public -----------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget everything: stream time 0, no utterance, fresh model state."""
        self._rate: int | None = None
        self._resampler: Resampler | None = None
        self._in_samples = 0  # input samples at self._rate since the rate was set
        self._in_offset = 0.0  # stream seconds before the current rate began
        self._buffer = np.zeros(0, np.float32)  # 16 kHz samples not yet in a chunk
        self._pos = 0  # 16 kHz samples run through the model (the buffer starts here)
        self._state = SileroState.zeros()
        self._rules = UtteranceRules(self.config, candidates=self.candidates)
        self._echo = _echo(self.config)
        self.last_probs = np.zeros(0, np.float32)  # the probabilities of the last feed's chunks (for plots, tests)

    @property
    def in_speech(self) -> bool:
        """Whether an utterance is open (a start was emitted and no end yet)."""
        return self._rules.track.phase == "speech"

    @property
    def stream_time(self) -> float:
        """Seconds of audio fed so far (at the rates it came in)."""
        if self._rate is None:
            return self._in_offset
        return self._in_offset + self._in_samples / self._rate

    def feed(self, audio, sample_rate: int) -> list[SpeechEvent]:
        """Add microphone audio (mono float, any length, any rate from 4 kHz); returns the events it decided.
        Bad audio (not 1-D mono, not float, NaN / inf) or a rate that changes without ``flush()`` raises
        ValueError before anything changes."""
        x = _check_audio(audio)
        rate = check_rate(sample_rate)
        if self._rate is not None and rate != self._rate:
            raise ValueError(f"sample rate changed from {self._rate} to {rate} Hz mid-stream; call flush() "
                             f"before feeding audio at another rate")
        if x.size == 0:
            return []
        if self._rate is None:
            self._rate, self._resampler, self._in_samples = rate, Resampler(rate), 0
        self._in_samples += x.size
        self._buffer = np.concatenate([self._buffer, self._resampler.push(x)])
        return self._run(final=False)

    def push_reference(self, audio, sample_rate: int, t: float) -> None:
        """The loudspeaker plays ``audio`` (mono float, any rate) from stream time ``t`` seconds: while it (or its
        echo, up to ``echo_delay_s`` later) sounds, an utterance starts only on microphone audio louder than the
        echo explains (vad/echo.py). Audio pushed again for the same time replaces what was queued. Not needed
        with headphones."""
        self._echo.push(_check_audio(audio), sample_rate, t)

    def flush(self) -> list[SpeechEvent]:
        """End of stream: run the buffered audio (zero-padded to a chunk) and end an open utterance (reason
        "flush"); a candidate not yet long enough is dropped. The detector then takes audio again, at any rate,
        with the model state kept."""
        if self._resampler is not None:
            self._buffer = np.concatenate([self._buffer, self._resampler.drain()])
        events = self._run(final=True) + self._rules.close(self._pos)
        # the next audio starts a new stretch of stream time where this one really ended
        self._in_offset = self.stream_time
        self._rate, self._resampler, self._in_samples = None, None, 0
        return events

    def state_dict(self) -> dict:
        """Everything needed to continue this stream elsewhere: plain JSON-able values and NumPy arrays."""
        t = self._rules.track
        return {
            "version": _STATE_VERSION,
            "config": asdict(self.config),
            "rate": self._rate, "in_samples": int(self._in_samples), "in_offset": float(self._in_offset),
            "resampler": self._resampler.state_dict() if self._resampler is not None else None,
            "buffer": self._buffer.copy(), "pos": int(self._pos),
            "context": self._state.context.copy(), "h": self._state.h.copy(), "c": self._state.c.copy(),
            "phase": t.phase, "onset": int(t.onset), "silence_from": int(t.silence_from),
            "last_end": int(t.last_end), "echo": self._echo.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue a stream saved by ``state_dict`` (ValueError, nothing changed, if it is not one)."""
        try:
            if state.get("version") != _STATE_VERSION:
                raise ValueError(f"unknown VAD state version {state.get('version')!r}")
            config = VADConfig(**state["config"])
            rate = None if state["rate"] is None else check_rate(state["rate"])
            resampler = None
            if rate is not None:
                resampler = Resampler(rate)
                resampler.load_state_dict(state["resampler"])
            silero = SileroState(*(np.asarray(state[k], np.float32).reshape(n).copy()
                                   for k, n in (("context", 64), ("h", 128), ("c", 128))))
            if state["phase"] not in ("idle", "candidate", "speech"):
                raise ValueError(f"unknown phase {state['phase']!r}")
            track = _Track(state["phase"], int(state["onset"]), int(state["silence_from"]), int(state["last_end"]))
            buffer = _check_audio(state["buffer"])
            echo = _echo(config)
            echo.load_state_dict(state["echo"])
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"not a saved UtteranceDetector state: {e!r}") from e
        self.config, self._rate, self._resampler = config, rate, resampler
        self._in_samples, self._in_offset = int(state["in_samples"]), float(state["in_offset"])
        self._buffer, self._pos, self._state = buffer, int(state["pos"]), silero
        self._rules = UtteranceRules(config, candidates=self.candidates)
        self._rules.track, self._echo = track, echo

    # --- internals --------------------------------------------------------------------------------------------
    def _run(self, final: bool) -> list[SpeechEvent]:
        n = self._buffer.size // CHUNK
        if final and self._buffer.size % CHUNK:
            n += 1
        if n == 0:
            self.last_probs = np.zeros(0, np.float32)
            return []
        chunks = np.zeros(n * CHUNK, np.float32)
        chunks[:min(self._buffer.size, n * CHUNK)] = self._buffer[:n * CHUNK]
        probs, self._state = self.model.run(chunks.reshape(n, CHUNK), self._state)
        real = self._buffer.size if final else n * CHUNK  # samples of real audio in these chunks
        self._buffer = self._buffer[n * CHUNK:] if not final else np.zeros(0, np.float32)
        self.last_probs = probs  # before the echo gate
        events = []
        for i, p in enumerate(probs):
            start, end = self._pos + i * CHUNK, self._pos + min((i + 1) * CHUNK, real)
            p = self._echo.gate(chunks[i * CHUNK:(i + 1) * CHUNK], start, end, float(p),
                                self._rules.track.phase != "speech")
            events += self._rules.step(p, start, end)
        self._pos += real
        self._echo.trim(self._pos)
        return events


class UtteranceRules:
    """The utterance state machine of ``VADConfig`` over per-frame speech probabilities, any frame length.

    Positions are integers in 16 kHz samples of stream time (exact in a saved session); ``step(p, start, end)``
    takes one frame ``[start, end)`` with speech probability ``p`` and returns the events it decides. The
    detector feeds it Silero's 32 ms chunks; the VAD benchmark feeds it the other detectors' frames, so all are
    timed by the same rules."""

    def __init__(self, config: VADConfig, candidates: bool = False):
        self.config = config
        self.candidates = candidates  # also "candidate" / "dropped" events (UtteranceDetector's ``candidates``)
        self.track = _Track()

    @property
    def pad(self) -> int:
        return int(round(self.config.speech_pad_s * SAMPLE_RATE))

    def step(self, p: float, start: int, end: int) -> list[SpeechEvent]:
        cfg, t, events = self.config, self.track, []
        on, off = p >= cfg.threshold, p < cfg.off_threshold
        if t.phase == "idle":
            if on:
                t.phase, t.onset = "candidate", start
                if self.candidates:
                    events.append(SpeechEvent("candidate", _seconds(start), None, _seconds(end), "onset"))
        if t.phase == "candidate":
            if off:
                t.phase = "idle"
                if self.candidates:
                    events.append(SpeechEvent("dropped", _seconds(t.onset), None, _seconds(end), "onset"))
            elif end - t.onset >= round(cfg.min_speech_s * SAMPLE_RATE):
                t.phase, t.silence_from = "speech", -1
                t.onset = max(t.last_end, t.onset - self.pad)
                events.append(SpeechEvent("start", _seconds(t.onset), None, _seconds(end), "onset"))
            return events
        if t.phase != "speech":
            return events
        if on:
            t.silence_from = -1
        elif off and t.silence_from < 0:
            t.silence_from = start
        if t.silence_from >= 0 and end - t.silence_from >= round(cfg.hangover_s * SAMPLE_RATE):
            events.append(self._end(min(end, t.silence_from + self.pad), end, "silence"))
            return events
        if end >= t.onset + round(cfg.max_utterance_s * SAMPLE_RATE):
            speaking = t.silence_from < 0
            events.append(self._end(end, end, "cap"))
            if speaking:  # the user goes on: the next piece starts at the cut
                t.phase, t.onset, t.silence_from = "speech", end, -1
                events.append(SpeechEvent("start", _seconds(end), None, _seconds(end), "cap"))
        return events

    def close(self, end: int) -> list[SpeechEvent]:
        """End of stream at ``end``: an open utterance ends (reason "flush"), a candidate is dropped."""
        t = self.track
        if t.phase == "speech":
            stop = end if t.silence_from < 0 else min(end, t.silence_from + self.pad)
            return [self._end(stop, end, "flush")]
        dropped = t.phase == "candidate" and self.candidates
        t.phase = "idle"
        return [SpeechEvent("dropped", _seconds(t.onset), None, _seconds(end), "flush")] if dropped else []

    def _end(self, stop: int, decided: int, reason: str) -> SpeechEvent:
        t = self.track
        ev = SpeechEvent("end", _seconds(t.onset), _seconds(stop), _seconds(decided), reason)
        t.phase, t.last_end, t.silence_from = "idle", stop, -1
        return ev


def _seconds(samples16: int) -> float:
    """Stream seconds of a 16 kHz position."""
    return samples16 / SAMPLE_RATE


def _echo(config: VADConfig) -> EchoReference:
    return EchoReference(config.echo_delay_s, config.echo_gain_db, config.echo_margin_db)


def _check_audio(audio) -> np.ndarray:
    """Mono float audio as a float32 1-D array; ValueError for anything else."""
    if not isinstance(audio, np.ndarray):
        raise ValueError(f"audio must be a NumPy array of float samples, got {type(audio).__name__}")
    if audio.ndim == 2 and audio.shape[1] == 1:
        audio = audio[:, 0]
    if audio.ndim != 1:
        raise ValueError(f"audio must be mono, shape (n,) or (n, 1), got shape {audio.shape}; mix channels down first")
    if not np.issubdtype(audio.dtype, np.floating):
        raise ValueError(f"audio must be float samples in [-1, 1], got dtype {audio.dtype} "
                         f"(int16 PCM: divide by 32768)")
    x = audio.astype(np.float32)
    if x.size and not np.isfinite(x).all():
        raise ValueError("audio contains NaN or inf samples")
    return x
