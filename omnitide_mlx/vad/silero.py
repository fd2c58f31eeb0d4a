"""Silero VAD (16 kHz), ported to MLX from the weights the ``silero-vad`` wheel ships.

The model reads 512-sample chunks (32 ms at 16 kHz), each with the 64 samples before it as left context, and
carries an LSTM state from chunk to chunk; one speech probability per chunk. Per chunk:

  576 samples -> reflect-pad 64 on the right -> STFT as a strided conv (n_fft 256, hop 128, 4 frames, magnitude of
  129 bins) -> conv1 (129->128) -> conv2 (128->64, stride 2) -> conv3 (64->64, stride 2) -> conv4 (64->128), each
  ReLU, one frame left -> LSTMCell 128 -> ReLU -> 1x1 conv -> sigmoid.

Everything before the LSTM depends on the chunk alone, so a run of chunks computes it as one batch and only the
LSTM steps one chunk at a time (``SileroVAD.run``); a whole signal is the same call from a fresh state
(``SileroVAD.probs``). The weights are read from the installed ``silero-vad`` package
(``silero_vad/data/silero_vad_16k.safetensors``) without importing it (its ``__init__`` imports torch).

On MLX's CPU device the same forward runs in NumPy (``_forward_numpy``): one chunk through MLX's CPU backend costs
some 15 small graph ops plus an evaluation per LSTM step, which dominates a streaming call; see
docs/benchmarks.md, "Voice activity detection", for the cost per second of audio of both routes.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

SAMPLE_RATE = 16000
CHUNK = 512  # samples per decision (32 ms)
CONTEXT = 64  # left context carried from the previous chunk
HIDDEN = 128
_N_FFT, _HOP, _PAD = 256, 128, 64
_BINS = _N_FFT // 2 + 1
WEIGHTS_FILE = "silero_vad_16k.safetensors"
PACKAGE = "silero-vad"


def weights_path() -> Path:
    """The 16 kHz safetensors inside the installed ``silero-vad`` package (FileNotFoundError naming it if absent)."""
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"Silero VAD weights need the '{PACKAGE}' package: pip install --no-deps {PACKAGE} "
            f"(or pip install 'omnitide-mlx[voice]')")
    for root in spec.submodule_search_locations:
        path = Path(root) / "data" / WEIGHTS_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"the installed '{PACKAGE}' package has no data/{WEIGHTS_FILE}; "
                            f"reinstall it: pip install --no-deps --force-reinstall {PACKAGE}")


@dataclass
class SileroState:
    """What the model carries between chunks: the last 64 samples and the LSTM's (h, c)."""

    context: np.ndarray  # [64] float32
    h: np.ndarray  # [128] float32
    c: np.ndarray  # [128] float32

    @classmethod
    def zeros(cls) -> "SileroState":
        return cls(np.zeros(CONTEXT, np.float32), np.zeros(HIDDEN, np.float32), np.zeros(HIDDEN, np.float32))

    def copy(self) -> "SileroState":
        return SileroState(self.context.copy(), self.h.copy(), self.c.copy())


class SileroVAD:
    """The 16 kHz Silero VAD with MLX weights (and NumPy copies for the CPU route)."""

    def __init__(self, weights: dict[str, np.ndarray]):
        w = {k: np.asarray(v, np.float32) for k, v in weights.items()}
        expected = {"stft_conv.weight": (2 * _BINS, 1, _N_FFT), "lstm_cell.weight_ih": (4 * HIDDEN, HIDDEN),
                    "final_conv.weight": (1, HIDDEN, 1)}
        for name, shape in expected.items():
            if name not in w or w[name].shape != shape:
                raise ValueError(f"not the Silero VAD 16 kHz layout: {name} is "
                                 f"{w[name].shape if name in w else 'missing'}, expected {shape}")
        # NumPy copies, laid out for the CPU route: convs as [out, k*in] matrices over [k, in] windows
        self._np = {
            "stft": w["stft_conv.weight"][:, 0, :],  # [258, 256]
            **{f"conv{i}": (w[f"conv{i}.weight"].transpose(0, 2, 1).reshape(w[f"conv{i}.weight"].shape[0], -1),
                            w[f"conv{i}.bias"]) for i in range(1, 5)},
            "w_ih": w["lstm_cell.weight_ih"], "w_hh": w["lstm_cell.weight_hh"],
            "b": w["lstm_cell.bias_ih"] + w["lstm_cell.bias_hh"],
            "head": w["final_conv.weight"][0, :, 0], "head_b": w["final_conv.bias"],
        }
        # MLX: conv weights as [out, k, in] (channels last)
        self._mx = {
            "stft": mx.array(w["stft_conv.weight"].transpose(0, 2, 1)),
            **{f"conv{i}": (mx.array(w[f"conv{i}.weight"].transpose(0, 2, 1)), mx.array(w[f"conv{i}.bias"]))
               for i in range(1, 5)},
            "w_ih": mx.array(w["lstm_cell.weight_ih"].T), "w_hh": mx.array(w["lstm_cell.weight_hh"].T),
            "b": mx.array(self._np["b"]),
            "head": mx.array(self._np["head"]), "head_b": mx.array(w["final_conv.bias"]),
        }

    @classmethod
    def load(cls, path: str | Path | None = None) -> "SileroVAD":
        """The model from ``path`` (default: the installed ``silero-vad`` package's 16 kHz safetensors)."""
        from safetensors.numpy import load_file

        return cls(load_file(str(path if path is not None else weights_path())))

    # --- the forward ------------------------------------------------------------------------------------------
    def run(self, chunks: np.ndarray, state: SileroState, *, numpy: bool | None = None
            ) -> tuple[np.ndarray, SileroState]:
        """Speech probabilities ``[N]`` for ``chunks`` ``[N, 512]`` (16 kHz float32) following ``state``; returns
        them with the state after the last chunk (``state`` itself is left as it was). ``numpy`` forces a route
        (default: NumPy on MLX's CPU device, MLX otherwise)."""
        chunks = np.asarray(chunks, np.float32)
        if chunks.ndim != 2 or chunks.shape[1] != CHUNK:
            raise ValueError(f"Silero VAD reads [N, {CHUNK}] chunks at {SAMPLE_RATE} Hz, got {chunks.shape}")
        if chunks.shape[0] == 0:
            return np.zeros(0, np.float32), state.copy()
        # each chunk with its 64 samples of left context: [N, 576]
        flat = np.concatenate([state.context, chunks.reshape(-1)])
        idx = np.arange(chunks.shape[0])[:, None] * CHUNK + np.arange(CHUNK + CONTEXT)[None, :]
        windows = flat[idx]
        use_numpy = (mx.default_device() == mx.cpu) if numpy is None else numpy
        forward = _forward_numpy if use_numpy else _forward_mlx
        probs, h, c = forward(self, windows, state.h, state.c)
        return probs, SileroState(flat[-CONTEXT:].copy(), h, c)

    def probs(self, audio: np.ndarray, *, numpy: bool | None = None) -> np.ndarray:
        """One probability per 512-sample chunk of a whole 16 kHz signal (the last chunk zero-padded)."""
        audio = np.asarray(audio, np.float32).reshape(-1)
        n = -(-audio.size // CHUNK)
        padded = np.zeros(n * CHUNK, np.float32)
        padded[:audio.size] = audio
        return self.run(padded.reshape(n, CHUNK), SileroState.zeros(), numpy=numpy)[0]


def _reflect_right(x, xp):
    """Reflect-pad the last axis by 64 on the right (the edge sample not repeated), as torch's 'reflect'."""
    return xp.concatenate([x, x[:, -_PAD - 1:-1][:, ::-1]], axis=1)


def _forward_mlx(model: SileroVAD, windows: np.ndarray, h0: np.ndarray, c0: np.ndarray):
    w = model._mx
    x = _reflect_right(mx.array(windows), mx)[:, :, None]  # [N, 640, 1]
    spec = mx.conv1d(x, w["stft"], stride=_HOP)  # [N, 4, 258]
    x = mx.sqrt(spec[..., :_BINS] ** 2 + spec[..., _BINS:] ** 2)
    for i, stride in ((1, 1), (2, 2), (3, 2), (4, 1)):
        weight, bias = w[f"conv{i}"]
        x = mx.maximum(mx.conv1d(x, weight, stride=stride, padding=1) + bias, 0)
    feats = x[:, 0, :] @ w["w_ih"] + w["b"]  # [N, 512]: the input half of every LSTM step at once
    h, c = mx.array(h0)[None], mx.array(c0)[None]
    hs = []
    for t in range(feats.shape[0]):
        gates = feats[t:t + 1] + h @ w["w_hh"]
        i, f, g, o = mx.split(gates, 4, axis=-1)
        c = mx.sigmoid(f) * c + mx.sigmoid(i) * mx.tanh(g)
        h = mx.sigmoid(o) * mx.tanh(c)
        hs.append(h)
        if t % 256 == 255:  # a long signal: keep the lazy graph bounded
            mx.eval(hs[-1], c)
    hs = mx.concatenate(hs, axis=0)
    probs = mx.sigmoid(mx.maximum(hs, 0) @ w["head"] + w["head_b"])
    mx.eval(probs, h, c)
    return (np.array(probs, np.float32), np.array(h[0], np.float32), np.array(c[0], np.float32))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # no overflow warning for large |x|


def _conv_np(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, stride: int) -> np.ndarray:
    """A k=3, padding-1 conv on channels-last ``x`` [N, L, C] as one matmul over the gathered windows."""
    n, length, ch = x.shape
    xp = np.zeros((n, length + 2, ch), np.float32)
    xp[:, 1:-1] = x
    out_len = (length - 1) // stride + 1
    starts = np.arange(out_len) * stride
    cols = np.concatenate([xp[:, starts + k] for k in range(3)], axis=-1)  # [N, out, 3*C]
    return np.maximum(cols @ weight.T + bias, 0)


def _forward_numpy(model: SileroVAD, windows: np.ndarray, h0: np.ndarray, c0: np.ndarray):
    w = model._np
    x = _reflect_right(windows, np)  # [N, 640]
    frames = np.stack([x[:, s:s + _N_FFT] for s in range(0, x.shape[1] - _N_FFT + 1, _HOP)], axis=1)  # [N, 4, 256]
    spec = frames @ w["stft"].T  # [N, 4, 258]
    x = np.sqrt(spec[..., :_BINS] ** 2 + spec[..., _BINS:] ** 2)
    for i, stride in ((1, 1), (2, 2), (3, 2), (4, 1)):
        x = _conv_np(x, *w[f"conv{i}"], stride)
    feats = x[:, 0, :] @ w["w_ih"].T + w["b"]  # [N, 512]
    h, c = h0.astype(np.float32), c0.astype(np.float32)
    w_hh_t = np.ascontiguousarray(w["w_hh"].T)
    hs = np.empty((feats.shape[0], HIDDEN), np.float32)
    for t in range(feats.shape[0]):
        gates = feats[t] + h @ w_hh_t
        i, f, g, o = gates[:HIDDEN], gates[HIDDEN:2 * HIDDEN], gates[2 * HIDDEN:3 * HIDDEN], gates[3 * HIDDEN:]
        c = _sigmoid(f) * c + _sigmoid(i) * np.tanh(g)
        h = _sigmoid(o) * np.tanh(c)
        hs[t] = h
    probs = _sigmoid(np.maximum(hs, 0) @ w["head"] + w["head_b"][0])
    return probs.astype(np.float32), h.astype(np.float32), c.astype(np.float32)
