"""A streaming resampler to 16 kHz: windowed-sinc interpolation at the exact rational ratio, any chunking.

Output sample ``n`` sits at input position ``n * sr_in / 16000``; with ``sr_in / 16000 = down / up`` in lowest
terms the fractional part of that position takes only ``up`` values, so the filter is a table of ``up`` rows
(a Kaiser-windowed sinc, cut off at 0.45 of the lower of the two rates). Each output is the dot product of one
table row with the input samples around its position, computed as soon as the last of them has arrived, so
feeding a signal in any chunking gives the same samples, bit for bit (integer bookkeeping, one reduction per
output). The state (pending input, counters) is plain data for a saved session.
"""

from __future__ import annotations

import math

import numpy as np

TARGET = 16000
_ZEROS = 8  # sinc zero crossings each side, at the lower rate
MIN_RATE, MAX_RATE = 4000, 384000


def check_rate(sample_rate) -> int:
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)) or \
            not MIN_RATE <= int(sample_rate) <= MAX_RATE:
        raise ValueError(f"sample_rate must be an integer number of Hz in [{MIN_RATE}, {MAX_RATE}], "
                         f"got {sample_rate!r}")
    return int(sample_rate)


class Resampler:
    """``push(x) -> y``: input at ``sample_rate`` in, 16 kHz out, with ``half`` input samples of look-ahead."""

    def __init__(self, sample_rate: int):
        self.rate = check_rate(sample_rate)
        g = math.gcd(self.rate, TARGET)
        self.up, self.down = TARGET // g, self.rate // g
        self.identity = self.rate == TARGET
        # taps each side, in input samples: _ZEROS crossings of the lower rate's sinc
        self.half = 0 if self.identity else int(math.ceil(_ZEROS * max(1.0, self.rate / TARGET)))
        if not self.identity:
            cutoff = 0.45 * min(self.rate, TARGET) / self.rate  # cycles per input sample
            offsets = np.arange(-self.half + 1, self.half + 1)[None, :] - \
                (np.arange(self.up)[:, None] * self.down % self.up) / self.up  # [up, 2*half]
            window = np.kaiser(2 * self.half + 1, 8.0)
            # the window evaluated at the fractional offsets (linear in the tap grid)
            w = np.interp(offsets, np.arange(-self.half, self.half + 1), window)
            table = 2 * cutoff * np.sinc(2 * cutoff * offsets) * w
            self.table = table.astype(np.float32)
            # row r of the table is for outputs whose position fraction is (r * down % up) / up: index by n % up
        self.reset()

    def reset(self) -> None:
        # pending input starting at absolute input index self.start (negative: leading zeros)
        self.pending = np.zeros(self.half, np.float32)
        self.start = -self.half
        self.n_out = 0

    def push(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, np.float32)
        if self.identity:
            self.n_out += x.size
            return x.copy()
        self.pending = np.concatenate([self.pending, x])
        end = self.start + self.pending.size  # input samples known: indices < end
        # output n needs input up to floor(n * down / up) + half < end, i.e. n * down < (end - half) * up
        n_hi = -(-((end - self.half) * self.up) // self.down)  # the first output not yet computable
        if n_hi <= self.n_out:
            return np.zeros(0, np.float32)
        n = np.arange(self.n_out, n_hi)
        base = (n * self.down) // self.up
        idx = base[:, None] + np.arange(-self.half + 1, self.half + 1)[None, :] - self.start
        y = (self.pending[idx] * self.table[n % self.up]).sum(axis=1, dtype=np.float32)
        self.n_out = int(n_hi)
        keep_from = (self.n_out * self.down) // self.up - self.half + 1  # the next output's first tap
        drop = max(0, keep_from - self.start)
        self.pending = self.pending[drop:]
        self.start += drop
        return y.astype(np.float32)

    def drain(self) -> np.ndarray:
        """The outputs still waiting for look-ahead, computed with zeros after the end; then reset."""
        if self.identity:
            return np.zeros(0, np.float32)
        total_in = self.start + self.pending.size
        n_end = -(-total_in * self.up // self.down)  # outputs whose position lies inside the input
        y = self.push(np.zeros(2 * self.half + 1, np.float32))
        y = y[:max(0, n_end - (self.n_out - y.size))]
        self.reset()
        return y

    def state_dict(self) -> dict:
        return {"rate": self.rate, "start": int(self.start), "n_out": int(self.n_out), "pending": self.pending.copy()}

    def load_state_dict(self, state: dict) -> None:
        self.start, self.n_out = int(state["start"]), int(state["n_out"])
        self.pending = np.asarray(state["pending"], np.float32).copy()
