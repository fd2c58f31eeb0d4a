"""Audio front end shared by the models: resampling and Whisper-style log-mel features, in numpy.

Whisper's extractor pads every clip to a fixed length (30 s, 300 s for Qwen2.5-Omni) before a centred STFT and
takes the dynamic-range clamp over the whole padded spectrogram. Padding with zeros only changes frames that
touch the padding, so it is enough to pad by one FFT window: ``log_mel`` gives the same numbers as the padded
extractor for the ``ceil(n / hop)`` frames that hold the signal, without computing minutes of silence.
"""

from __future__ import annotations

from functools import lru_cache
from math import gcd

import numpy as np


def _hz_to_mel_slaney(f: np.ndarray) -> np.ndarray:
    f = np.asarray(f, dtype=np.float64)
    f_sp = 200.0 / 3
    mels = f / f_sp
    min_log_hz = 1000.0
    min_log_mel = min_log_hz / f_sp
    logstep = np.log(6.4) / 27.0
    return np.where(f >= min_log_hz, min_log_mel + np.log(np.maximum(f, 1e-10) / min_log_hz) / logstep, mels)


def _mel_to_hz_slaney(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    f_sp = 200.0 / 3
    freqs = f_sp * m
    min_log_hz = 1000.0
    min_log_mel = min_log_hz / f_sp
    logstep = np.log(6.4) / 27.0
    return np.where(m >= min_log_mel, min_log_hz * np.exp(logstep * (m - min_log_mel)), freqs)


@lru_cache(maxsize=8)
def mel_filters(sample_rate: int, n_fft: int, n_mels: int, f_min: float = 0.0, f_max: float | None = None) -> np.ndarray:
    """Slaney-scale, Slaney-normalised triangular filters, shape ``[n_fft // 2 + 1, n_mels]`` (librosa's
    default, which Whisper uses)."""
    f_max = sample_rate / 2 if f_max is None else f_max
    fft_freqs = np.linspace(0, sample_rate / 2, n_fft // 2 + 1)
    mel_pts = np.linspace(_hz_to_mel_slaney(f_min), _hz_to_mel_slaney(f_max), n_mels + 2)
    filter_freqs = _mel_to_hz_slaney(mel_pts)
    fdiff = np.diff(filter_freqs)
    slopes = filter_freqs[None, :] - fft_freqs[:, None]
    down = -slopes[:, :-2] / fdiff[:-1]
    up = slopes[:, 2:] / fdiff[1:]
    fb = np.maximum(0.0, np.minimum(down, up))
    enorm = 2.0 / (filter_freqs[2:n_mels + 2] - filter_freqs[:n_mels])
    return (fb * enorm[None, :]).astype(np.float64)


@lru_cache(maxsize=4)
def _hann(n_fft: int) -> np.ndarray:
    return (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)).astype(np.float64)  # periodic


def power_mel(audio: np.ndarray, n_mels: int, *, sample_rate: int = 16000, n_fft: int = 400,
              hop_length: int = 160) -> np.ndarray:
    """Mel power spectrogram of a centred STFT (reflect padding), one frame per ``hop_length`` samples plus one:
    shape ``[n_mels, 1 + len(audio) // hop_length]``."""
    x = np.asarray(audio, dtype=np.float64)
    pad = n_fft // 2
    if x.shape[0] <= pad:
        x = np.concatenate([x, np.zeros(pad + 1 - x.shape[0])])
    x = np.pad(x, (pad, pad), mode="reflect")
    n_frames = 1 + (x.shape[0] - n_fft) // hop_length
    idx = np.arange(n_fft)[None, :] + hop_length * np.arange(n_frames)[:, None]
    spec = np.abs(np.fft.rfft(x[idx] * _hann(n_fft)[None, :], axis=-1)) ** 2
    return (spec @ mel_filters(sample_rate, n_fft, n_mels)).T


def log_mel(audio: np.ndarray, n_mels: int, *, sample_rate: int = 16000, n_fft: int = 400, hop_length: int = 160,
            floor: float | None = None) -> np.ndarray:
    """Whisper log-mel features ``[n_mels, ceil(n / hop_length)]`` (float32).

    ``log10(max(mel, 1e-10))``, clamped below at ``max - 8`` (dynamic range, the default) or at ``floor`` when
    given (MiniCPM-o's fixed-floor streaming mode), then ``(x + 4) / 4``. Equal to Whisper's extractor with
    ``padding="max_length"`` on the frames that hold the signal.
    """
    x = np.asarray(audio, dtype=np.float64).reshape(-1)
    n = x.shape[0]
    if n == 0:
        raise ValueError("empty audio")
    n_keep = -(-n // hop_length)
    padded = np.concatenate([x, np.zeros(n_fft + hop_length)])
    mel = power_mel(padded, n_mels, sample_rate=sample_rate, n_fft=n_fft, hop_length=hop_length)
    logm = np.log10(np.maximum(mel, 1e-10))
    if floor is None:
        logm = np.maximum(logm, logm.max() - 8.0)
    else:
        logm = np.maximum(logm, floor)
    return ((logm[:, :n_keep] + 4.0) / 4.0).astype(np.float32)


def resample(audio: np.ndarray, sr_in: int, sr_out: int, *, zeros: int = 24) -> np.ndarray:
    """Band-limited resampling (Kaiser-windowed sinc), float32 mono in and out.

    Used to bring microphone and file audio at any rate (8 kHz, 44.1 kHz, 48 kHz, ...) to the models' 16 kHz.
    """
    x = np.asarray(audio, dtype=np.float64).reshape(-1)
    if sr_in <= 0 or sr_out <= 0:
        raise ValueError(f"sample rates must be positive (got {sr_in} -> {sr_out})")
    if sr_in == sr_out or x.size == 0:
        return x.astype(np.float32)
    g = gcd(int(sr_in), int(sr_out))
    up, down = sr_out // g, sr_in // g
    cutoff = min(1.0, sr_out / sr_in)  # in units of the input Nyquist
    half = int(np.ceil(zeros / cutoff))  # taps on each side, in input samples
    n_out = int(np.ceil(x.size * up / down))
    out = np.empty(n_out, dtype=np.float64)
    xp = np.pad(x, (half, half + 1))
    taps = np.arange(-half, half + 1)
    beta = 8.6
    block = 4096
    for b0 in range(0, n_out, block):
        n = np.arange(b0, min(n_out, b0 + block))
        t = n * down / up  # output instants in input samples
        base = np.floor(t).astype(np.int64)
        frac = t - base
        d = taps[None, :] - frac[:, None]  # distance of each tap from the instant
        w = np.i0(beta * np.sqrt(np.clip(1 - (d / (half + 1)) ** 2, 0, 1))) / np.i0(beta)
        h = cutoff * np.sinc(cutoff * d) * w
        out[b0:b0 + n.size] = np.einsum("ij,ij->i", h, xp[base[:, None] + taps[None, :] + half])
    return out.astype(np.float32)
