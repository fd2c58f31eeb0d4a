"""The echo gate: keep the assistant's own voice, played through a loudspeaker and heard by the microphone, from
starting an utterance.

The player reports what it plays (``UtteranceDetector.push_reference(audio, rate, t)``: this audio from stream
time ``t``). For each 32 ms microphone chunk the gate takes the loudest reference power in the chunk-sized windows
from ``echo_delay_s`` before the chunk to its end (the echo of anything played then may be arriving now); while
that is above a floor, an onset needs the microphone chunk to carry more power than the echo explains:
``mic power > echo gain x reference power x margin``, the echo gain being the largest microphone / reference
ratio seen over recent playback chunks that were not speech onsets (it starts at ``echo_gain_db`` and adapts
to the room within a second of playback). A chunk that fails has its speech probability set to 0 for the
utterance rules. Inside an utterance the gate does not apply (the user is talking; the caller stops the reply).

Why a gate and not subtraction: measured in docs/benchmarks.md ("Voice activity detection", echo), with speakers
simulated at 20-150 ms and -20 to -6 dB; with headphones there is no echo and no reference is needed.
"""

from __future__ import annotations

import math

import numpy as np

from omnitide_mlx.vad.resample import Resampler, check_rate
from omnitide_mlx.vad.silero import CHUNK, SAMPLE_RATE

_FLOOR = 1e-6  # reference power below this (-60 dBFS) is silence: no gate
_LEARN = 47  # the echo gain is the largest ratio over the last 1.5 s of echo-only chunks...
_WARM = 16  # ...once 0.5 s of them were seen (until then, at least the configured starting gain)


class EchoReference:
    """The played audio on the stream's 16 kHz timeline, and the gate's echo-gain estimate."""

    def __init__(self, delay_s: float, gain_db: float, margin_db: float):
        self.delay = int(round(delay_s * SAMPLE_RATE))
        self.gain0 = 10 ** (gain_db / 10)
        self.margin = 10 ** (margin_db / 10)
        self.reset()

    def reset(self) -> None:
        self.start = 0  # 16 kHz position of self.audio[0]
        self.audio = np.zeros(0, np.float32)
        self.ratios = np.zeros(0, np.float64)  # mic / reference power of recent echo-only chunks
        self.seen = 0

    @property
    def gain(self) -> float:
        learned = float(self.ratios.max()) if self.ratios.size else 0.0
        return learned if self.seen >= _WARM else max(self.gain0, learned)

    def push(self, audio: np.ndarray, sample_rate: int, t: float) -> None:
        rate = check_rate(sample_rate)
        if isinstance(t, bool) or not isinstance(t, (int, float, np.floating)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"reference time must be a finite number of stream seconds >= 0, got {t!r}")
        r = Resampler(rate)
        x = np.concatenate([r.push(audio), r.drain()])
        if x.size == 0:
            return
        pos = int(round(t * SAMPLE_RATE))
        end = max(self.start + self.audio.size, pos + x.size)
        if self.audio.size == 0:
            self.start = pos
        new_start = min(self.start, pos)
        buf = np.zeros(end - new_start, np.float32)
        buf[self.start - new_start:self.start - new_start + self.audio.size] = self.audio
        buf[pos - new_start:pos - new_start + x.size] = x  # what was played last replaces a queued plan
        self.start, self.audio = new_start, buf

    def power(self, start: int, end: int) -> float:
        """The loudest reference power over CHUNK windows that may echo into [start, end)."""
        lo, hi = start - self.delay - self.start, end - self.start
        lo, hi = max(lo, 0), min(hi, self.audio.size)
        if hi - lo <= 0:
            return 0.0
        seg = self.audio[lo:hi].astype(np.float64) ** 2
        if seg.size <= CHUNK:
            return float(seg.mean())
        c = np.concatenate([[0.0], np.cumsum(seg)])
        return float(((c[CHUNK:] - c[:-CHUNK]) / CHUNK).max())

    def gate(self, chunk: np.ndarray, start: int, end: int, p: float, onset_phase: bool) -> float:
        """The probability the utterance rules see for this microphone chunk."""
        ref = self.power(start, end)
        if ref < _FLOOR:
            return p
        mic = float((chunk.astype(np.float64) ** 2).mean())
        expected = self.gain * ref
        passes = mic > expected * self.margin
        if onset_phase and not passes:  # explained by the echo: learn the room's echo gain from it
            self.ratios = np.append(self.ratios, min(mic / ref, 1.0))[-_LEARN:]
            self.seen += 1
        return p if passes or not onset_phase else 0.0

    def trim(self, before: int) -> None:
        """Drop reference audio that can no longer echo into positions >= ``before``."""
        drop = before - self.delay - CHUNK - self.start
        if drop > 0:
            self.audio = self.audio[drop:]
            self.start += drop

    def state_dict(self) -> dict:
        return {"start": int(self.start), "audio": self.audio.copy(), "ratios": self.ratios.copy(),
                "seen": int(self.seen)}

    def load_state_dict(self, state: dict) -> None:
        audio = np.asarray(state["audio"], np.float32).reshape(-1)
        ratios = np.asarray(state["ratios"], np.float64).reshape(-1)
        if not (np.isfinite(audio).all() and np.isfinite(ratios).all()):
            raise ValueError("echo reference state holds NaN or inf")
        self.start, self.audio = int(state["start"]), audio.copy()
        self.ratios, self.seen = ratios[-_LEARN:].copy(), int(state["seen"])
