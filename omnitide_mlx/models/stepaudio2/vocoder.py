"""StepAudio2's streaming vocoder in MLX: CosyVoice3's causal HiFT generator and the bounded streaming wrapper.

MiniCPM-o 4.5 speaks through StepAudio2's ``Token2wav`` (24 kHz). For streaming it vocodes mel with the causal
``CausalHiFTGenerator`` (``hift.pt`` + the ``hift`` section of ``config.yaml``) wrapped in ``BoundedVocoder``:
bounded mel/source history, an F0 predictor run in float64, and a continuous float64 modulo excitation phase.

Layout: activations are channels-last (batch, frames, channels) inside the model, as MLX convolutions want; the
public entry points take mel as the official code does, ``[1, channels, frames]``.

The pieces, top to bottom:
  * config: ``HiFTArgs`` from ``config.yaml`` (PyYAML, any ``!tag`` tolerated, ``!ref <key>`` resolved);
  * layers: the causal convolutions, Snake, the residual block, the causal F0 predictor;
  * the neural source: per-frame sine phase, the voiced/unvoiced mask, the fixed noise table;
  * ``CausalHiFTGenerator``: ``decode`` (mel + source -> STFT fusion -> iSTFT) and the offline ``inference``;
  * ``HiFTGenerator``: the original non-causal HiFT Token2wav runs on whole utterances (``hift_original.pt``);
  * ``BoundedVocoder``: ``reset()``, ``stream(mel_chunk, finalize)``, ``cache``;
  * loading: ``load_causal_vocoder(folder)`` / ``load_original_vocoder(folder)`` with weight-norm materialisation
    and strict key checks.
"""

from __future__ import annotations

import ast
import math
import operator
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import yaml

from ..loading import CheckpointError
from . import cpu_math

# ----------------------------------------------------------------------------------------------------------- config

# What Token2wav requires of the feature extractor in config.yaml (StepAudio2's 24 kHz mel).
STEP_AUDIO2_MEL = dict(n_fft=1920, num_mels=80, sampling_rate=24000, hop_size=480, win_size=1920, fmin=0, fmax=8000,
                       center=False)


@dataclass
class F0PredictorArgs:
    num_class: int = 1
    in_channels: int = 80
    cond_channels: int = 512


@dataclass
class HiFTArgs:
    """The ``CausalHiFTGenerator`` keyword arguments (official defaults; the release overrides them in config.yaml)."""

    in_channels: int = 80
    base_channels: int = 512
    nb_harmonics: int = 8
    sampling_rate: int = 22050
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    nsf_voiced_threshold: float = 10
    upsample_rates: list = field(default_factory=lambda: [8, 8])
    upsample_kernel_sizes: list = field(default_factory=lambda: [16, 16])
    istft_params: dict = field(default_factory=lambda: {"n_fft": 16, "hop_len": 4})
    resblock_kernel_sizes: list = field(default_factory=lambda: [3, 7, 11])
    resblock_dilation_sizes: list = field(default_factory=lambda: [[1, 3, 5], [1, 3, 5], [1, 3, 5]])
    source_resblock_kernel_sizes: list = field(default_factory=lambda: [7, 11])
    source_resblock_dilation_sizes: list = field(default_factory=lambda: [[1, 3, 5], [1, 3, 5]])
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    conv_pre_look_right: int = 4
    f0_predictor: F0PredictorArgs = field(default_factory=F0PredictorArgs)

    @property
    def n_fft(self) -> int:
        return int(self.istft_params["n_fft"])

    @property
    def hop_len(self) -> int:
        return int(self.istft_params["hop_len"])

    @property
    def upsample_factor(self) -> int:
        return int(math.prod(self.upsample_rates))

    @property
    def hop(self) -> int:
        """Output samples per mel frame (480 in the release)."""
        return self.upsample_factor * self.hop_len

    @classmethod
    def from_dict(cls, d: dict) -> "HiFTArgs":
        names = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(d) - names)
        if unknown:
            raise CheckpointError(f"config.yaml hift section has keys the causal HiFT generator does not take: "
                                  f"{unknown}")
        kw = {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}
        f0 = kw.pop("f0_predictor", None)
        if f0 is None:
            raise CheckpointError("config.yaml hift section has no f0_predictor")
        if not isinstance(f0, dict):
            raise CheckpointError(f"config.yaml hift.f0_predictor must be a mapping, got {type(f0).__name__}")
        tag = getattr(f0, "tag", "")
        if tag and not tag.endswith("CausalConvRNNF0Predictor"):
            raise CheckpointError(f"the causal vocoder needs CausalConvRNNF0Predictor, config.yaml has {tag}")
        f0_unknown = sorted(set(f0) - set(F0PredictorArgs.__dataclass_fields__))
        if f0_unknown:
            raise CheckpointError(f"config.yaml hift.f0_predictor has unknown keys: {f0_unknown}")
        args = cls(**kw, f0_predictor=F0PredictorArgs(**dict(f0)))
        args.istft_params = {"n_fft": int(args.istft_params["n_fft"]), "hop_len": int(args.istft_params["hop_len"])}
        return args


class TaggedDict(dict):
    """A YAML mapping that carried a hyperpyyaml tag (``!new:module.Class``); ``tag`` keeps it."""

    def __init__(self, tag: str, items):
        super().__init__(items)
        self.tag = tag


@dataclass
class _Ref:
    text: str


class _TagTolerantLoader(yaml.SafeLoader):
    """SafeLoader that accepts hyperpyyaml's tags."""


def _construct_tagged(loader, suffix, node):
    if suffix == "ref":
        return _Ref(loader.construct_scalar(node))
    if isinstance(node, yaml.MappingNode):
        return TaggedDict("!" + suffix, loader.construct_mapping(node, deep=True))
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    return loader.construct_scalar(node)


_TagTolerantLoader.add_multi_constructor("!", _construct_tagged)

_ARITH = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


def _arith(expr: str):
    def ev(n):
        if isinstance(n, ast.Expression):
            return ev(n.body)
        if isinstance(n, ast.Constant) and isinstance(n.value, (int, float)):
            return n.value
        if isinstance(n, ast.BinOp) and type(n.op) in _ARITH:
            return _ARITH[type(n.op)](ev(n.left), ev(n.right))
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
            return -ev(n.operand)
        raise ValueError(expr)
    return ev(ast.parse(expr, mode="eval"))


def read_config_yaml(path: str | Path) -> dict:
    """A hyperpyyaml file read with plain PyYAML: ``!new:``/``!name:`` mappings become ``TaggedDict`` and
    ``!ref <key>`` (with simple arithmetic around it) resolves against top-level keys."""
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as f:
            root = yaml.load(f, Loader=_TagTolerantLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        raise CheckpointError(f"{path} is not valid YAML: {e}") from None
    if not isinstance(root, dict):
        raise CheckpointError(f"{path} is not a YAML mapping")

    def resolve(v, depth=0):
        if depth > 20:
            raise CheckpointError(f"{path}: !ref cycle")
        if isinstance(v, _Ref):
            text = v.text
            names = [t.split(">")[0] for t in text.split("<")[1:]]
            values = {}
            for name in names:
                node = root
                for part in name.split("."):
                    if not isinstance(node, dict) or part not in node:
                        raise CheckpointError(f"{path}: !ref {text} names an unknown key {name!r}")
                    node = node[part]
                values[name] = resolve(node, depth + 1)
            if text.strip() == f"<{names[0]}>" and len(names) == 1:
                return values[names[0]]
            for name, value in values.items():
                text = text.replace(f"<{name}>", repr(value))
            try:
                return _arith(text)
            except (ValueError, SyntaxError, ZeroDivisionError):
                raise CheckpointError(f"{path}: cannot evaluate !ref {v.text}") from None
        if isinstance(v, TaggedDict):
            return TaggedDict(v.tag, {k: resolve(x, depth) for k, x in v.items()})
        if isinstance(v, dict):
            return {k: resolve(x, depth) for k, x in v.items()}
        if isinstance(v, list):
            return [resolve(x, depth) for x in v]
        return v

    return resolve(root)


def causal_args_from_config(path: str | Path) -> HiFTArgs:
    """``HiFTArgs`` from config.yaml's ``hift`` section, with the checks Token2wav makes on that file."""
    cfg = read_config_yaml(path)
    hift = cfg.get("hift")
    if not isinstance(hift, dict):
        raise CheckpointError(f"{path} has no hift section")
    tag = getattr(hift, "tag", "")
    if tag and not tag.endswith("CausalHiFTGenerator"):
        raise CheckpointError(f"{path}: hift is {tag}, the streaming vocoder needs CosyVoice3's CausalHiFTGenerator")
    feat = cfg.get("feat_extractor")
    if feat is not None:
        wrong = {k: (feat.get(k), v) for k, v in STEP_AUDIO2_MEL.items() if feat.get(k) != v}
        if wrong:
            raise CheckpointError(f"{path}: the vocoder's mel configuration must match Step-Audio2 {STEP_AUDIO2_MEL}; "
                                  f"differs at {wrong}")
    return HiFTArgs.from_dict(dict(hift))


# ----------------------------------------------------------------------------------------------------------- layers


def causal_padding(kernel_size: int, dilation: int = 1) -> int:
    """The official CausalConv1d's padding formula (odd kernels: (k-1)*d; even kernels: k-1 when d == 1)."""
    return int((kernel_size * dilation - dilation) / 2) * 2 + (kernel_size + 1) % 2


def unfolded_conv1d(x: mx.array, weight: mx.array, dilation: int = 1) -> mx.array:
    """Valid stride-1 convolution of (B, T, C_in) by an MLX weight (C_out, K, C_in) as one matmul over the unfolded
    taps (B, T_out, K C_in). Used where ``mx.conv1d`` is slow or inexact on the CPU: it falls back to a direct loop
    for dilation > 1 (measured on this 2-core EPYC at 256 channels, 1000 frames: 423 ms for kernel 3 dilation 3 and
    1051 ms for kernel 7 dilation 5, against 8 and 20 ms unfolded) and accumulates float64 at float32 precision
    (6e-7 relative; MLX's float64 matmul is exact)."""
    k = weight.shape[1]
    t = x.shape[1] - (k - 1) * dilation
    if k == 1:
        taps = x
    else:
        taps = mx.concatenate([x[:, j * dilation:j * dilation + t] for j in range(k)], axis=-1)
    return taps @ weight.reshape(weight.shape[0], -1).T


def conv1d(x: mx.array, weight: mx.array, stride: int = 1, dilation: int = 1, padding: int = 0) -> mx.array:
    """``mx.conv1d`` (no bias), unfolded into a matmul for dilated and float64 stride-1 convolutions (see
    ``unfolded_conv1d``); the same numbers up to float32 summation order."""
    if stride == 1 and (dilation > 1 or x.dtype == mx.float64):
        if padding:
            x = mx.pad(x, [(0, 0), (padding, padding), (0, 0)])
        return unfolded_conv1d(x, weight, dilation)
    return mx.conv1d(x, weight, stride=stride, padding=padding, dilation=dilation)


def conv_transpose1d(x: mx.array, weight: mx.array, stride: int, padding: int = 0) -> mx.array:
    """``mx.conv_transpose1d`` (no bias, weight (C_out, K, C_in)) as one matmul and an overlap-add: input frame t
    tap j lands on output t stride + j - padding. MLX's CPU transposed convolution is a slow direct loop (measured:
    222 ms for 40 frames 512 -> 256 channels, kernel 16, stride 8, 0.17 GFLOP)."""
    b, t, _ = x.shape
    c_out, k, _ = weight.shape
    groups = -(-k // stride)
    w = weight
    if groups * stride != k:
        w = mx.pad(w, [(0, 0), (0, groups * stride - k), (0, 0)])
    # (B, T, groups, stride, C_out): tap g * stride + r of frame t goes to output (t + g) * stride + r
    y = (x @ w.transpose(1, 0, 2).reshape(groups * stride * c_out, -1).T).reshape(b, t, groups, stride * c_out)
    out = None
    for g in range(groups):
        part = mx.pad(y[:, :, g], [(0, 0), (g, groups - 1 - g), (0, 0)])
        out = part if out is None else out + part
    out = out.reshape(b, (t + groups - 1) * stride, c_out)
    length = (t - 1) * stride + k - 2 * padding
    return out[:, padding:padding + length]


class CausalConv1d(nn.Module):
    """Stride-1 convolution padded on one side: ``left`` (causal) or ``right`` (look-ahead). A ``cache`` of exactly
    ``causal_padding`` frames replaces the zero padding (the official streaming hook)."""

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int, dilation: int = 1, causal_type: str = "left"):
        super().__init__()
        if causal_type not in ("left", "right"):
            raise ValueError(f"causal_type must be 'left' or 'right', got {causal_type!r}")
        self.weight = mx.zeros((out_ch, kernel_size, in_ch))
        self.bias = mx.zeros((out_ch,))
        self.kernel_size, self.dilation, self.causal_type = kernel_size, dilation, causal_type
        self.causal_padding = causal_padding(kernel_size, dilation)
        if self.causal_padding != (kernel_size - 1) * dilation:
            raise ValueError(f"kernel {kernel_size} with dilation {dilation} does not keep the length "
                             "(the official layer asserts the same)")

    def __call__(self, x: mx.array, cache: mx.array | None = None) -> mx.array:
        if cache is None:
            cache = mx.zeros((x.shape[0], self.causal_padding, x.shape[2]), dtype=x.dtype)
        if cache.shape[1] != self.causal_padding:
            raise ValueError(f"cache has {cache.shape[1]} frames, the layer needs {self.causal_padding}")
        x = mx.concatenate([cache, x] if self.causal_type == "left" else [x, cache], axis=1)
        return conv1d(x, self.weight, dilation=self.dilation) + self.bias


class CausalConv1dDownSample(nn.Module):
    """Strided convolution (kernel 2*stride) with stride-1 frames of left zero padding."""

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int, stride: int):
        super().__init__()
        if stride == 1 or kernel_size % stride:
            raise ValueError("CausalConv1dDownSample needs stride > 1 dividing the kernel size")
        self.weight = mx.zeros((out_ch, kernel_size, in_ch))
        self.bias = mx.zeros((out_ch,))
        self.kernel_size, self.stride, self.dilation = kernel_size, stride, 1
        self.causal_padding = stride - 1

    def __call__(self, x: mx.array) -> mx.array:
        x = mx.pad(x, [(0, 0), (self.causal_padding, 0), (0, 0)])
        return mx.conv1d(x, self.weight, stride=self.stride) + self.bias


class _Memo:
    """A plain holder for a value derived from a parameter (not an array, list or dict, so never a parameter)."""

    def __init__(self):
        self.weight = self.value = None


class CausalConv1dUpsample(nn.Module):
    """Nearest upsampling by ``stride``, then a left-padded (causal) convolution."""

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int, stride: int):
        super().__init__()
        self.weight = mx.zeros((out_ch, kernel_size, in_ch))
        self.bias = mx.zeros((out_ch,))
        self.kernel_size, self.stride = kernel_size, stride
        self.causal_padding = kernel_size - 1
        self._memo = _Memo()

    def _phase_weights(self, p: int) -> mx.array:
        """The weight as ((p + 1) in, stride out) per-phase taps, rebuilt only when ``weight`` is replaced."""
        memo = self._memo
        if memo.weight is not self.weight:
            s, k = self.stride, self.kernel_size
            c_out, _, c_in = self.weight.shape
            # tap j of phase r reads the repeated frame q s + r + j - (k - 1): input frame q + (r + j - k + 1) // s
            select = np.zeros((s, p + 1, k), dtype=np.float32)
            for r in range(s):
                for j in range(k):
                    select[r, p + (r + j - k + 1) // s, j] = 1.0
            w = mx.array(select.reshape(s * (p + 1), k)) @ self.weight.transpose(1, 0, 2).reshape(k, c_out * c_in)
            w = w.reshape(s, p + 1, c_out, c_in).transpose(1, 3, 0, 2).reshape((p + 1) * c_in, s * c_out)
            mx.eval(w)
            memo.weight, memo.value = self.weight, w
        return memo.value

    def __call__(self, x: mx.array) -> mx.array:
        """Computed per output phase (polyphase) instead of on the repeated frames: output sample q stride + r sees
        input frames q - p .. q through the taps summed per frame, one matmul of ``p + 1`` frames against all
        phases (p = ceil((kernel - 1) / stride): 3 taps instead of 16, 11 and 7 in the release, the same sums up to
        float32 rounding; the repeated-input convolution took 45 ms for 48 frames 512 -> 256 channels)."""
        s, c_out = self.stride, self.weight.shape[0]
        b, t, _ = x.shape
        p = -(-(self.kernel_size - 1) // s)
        w = self._phase_weights(p)
        x = mx.pad(x, [(0, 0), (p, 0), (0, 0)])
        taps = mx.concatenate([x[:, o:o + t] for o in range(p + 1)], axis=-1) if p else x
        bias = mx.broadcast_to(self.bias, (s, c_out)).reshape(-1)
        return (taps @ w + bias).reshape(b, t * s, c_out)


class Conv1d(nn.Module):
    """Plain 1-D convolution with symmetric zero padding (the non-causal original HiFT's layers)."""

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int, stride: int = 1, dilation: int = 1,
                 padding: int = 0):
        super().__init__()
        self.weight = mx.zeros((out_ch, kernel_size, in_ch))
        self.bias = mx.zeros((out_ch,))
        self.stride, self.dilation, self.padding = stride, dilation, padding

    def __call__(self, x):
        return conv1d(x, self.weight, stride=self.stride, dilation=self.dilation, padding=self.padding) + self.bias


class Snake(nn.Module):
    """x + 1/(alpha + 1e-9) * sin(alpha x)^2 with a per-channel alpha (linear scale, as the vocoder configures)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = mx.ones((channels,))

    def __call__(self, x):
        return cpu_math.snake(x, self.alpha)


class ResBlock(nn.Module):
    """HiFi-GAN residual block with Snake activations; causal (left-padded) in the causal generator."""

    def __init__(self, channels: int, kernel_size: int, dilations: list, causal: bool = True):
        super().__init__()
        if causal:
            self.convs1 = [CausalConv1d(channels, channels, kernel_size, d) for d in dilations]
            self.convs2 = [CausalConv1d(channels, channels, kernel_size, 1) for _ in dilations]
        else:
            self.convs1 = [Conv1d(channels, channels, kernel_size, dilation=d, padding=(kernel_size * d - d) // 2)
                           for d in dilations]
            self.convs2 = [Conv1d(channels, channels, kernel_size, padding=(kernel_size - 1) // 2)
                           for _ in dilations]
        self.activations1 = [Snake(channels) for _ in dilations]
        self.activations2 = [Snake(channels) for _ in dilations]

    def __call__(self, x):
        for c1, c2, a1, a2 in zip(self.convs1, self.convs2, self.activations1, self.activations2):
            x = c2(a2(c1(a1(x)))) + x
        return x

    @property
    def history(self) -> int:
        return sum(c.causal_padding for c in (*self.convs1, *self.convs2))


def _elu(x):
    return mx.where(x > 0, x, mx.expm1(x))


class CausalConvF0Predictor(nn.Module):
    """CosyVoice3's ``CausalConvRNNF0Predictor``: a right-padded first convolution (3 frames of look-ahead), four
    causal convolutions, ELUs, a linear head, ``|.|``. Its parameters are float64 and it runs on the CPU stream:
    the official code runs it in float64 ("f0_predictor precision is crucial for causal inference") and MLX has
    float64 on the CPU only."""

    def __init__(self, args: F0PredictorArgs):
        super().__init__()
        c = args.cond_channels
        convs = [CausalConv1d(args.in_channels, c, 4, causal_type="right")] + [CausalConv1d(c, c, 3) for _ in range(4)]
        self.condnet = []
        for conv in convs:  # the official nn.Sequential interleaves ELU modules: conv weights sit at 0, 2, 4, 6, 8
            self.condnet += [conv, nn.Module()]
        self.classifier = nn.Linear(c, args.num_class)
        self.set_dtype(mx.float64)

    @property
    def right(self) -> int:
        return self.condnet[0].causal_padding

    @property
    def left(self) -> int:
        return sum(self.condnet[i].causal_padding for i in range(2, len(self.condnet), 2))

    def __call__(self, mel: mx.array, finalize: bool = True) -> mx.array:
        """mel (B, T, C) -> f0 (B, T) float64, or (B, T - right) when not ``finalize`` (the last ``right`` frames
        are look-ahead only)."""
        with mx.stream(mx.cpu):
            x = mel.astype(mx.float64)
            first = self.condnet[0]
            if finalize:
                x = first(x)
            else:
                if x.shape[1] <= first.causal_padding:
                    raise ValueError(f"a non-final F0 call needs more than {first.causal_padding} frames")
                x = first(x[:, :-first.causal_padding], x[:, -first.causal_padding:])
            x = _elu(x)
            for i in range(2, len(self.condnet), 2):
                x = _elu(self.condnet[i](x))
            return mx.abs(self.classifier(x)[..., 0])


# ------------------------------------------------------------------------------------------------------ the source


class NoiseTable:
    """The excitation noise: rows of ``nb_harmonics + 1`` uniform [0, 1) values indexed by output sample.

    The official causal source draws a ``torch.rand(1, 300 * 24000, 9)`` table when the model is built (it is not
    in the checkpoint) and reads rows by absolute sample position, wrapping past its end in the bounded streamer.
    Here the table is a fixed function of ``seed``, generated one second (``block`` rows) at a time so it costs no
    memory up front. ``array`` replaces it with given values (parity tests inject the reference's table)."""

    def __init__(self, width: int, length: int = 300 * 24000, seed: int = 0, array=None, block: int = 24000):
        if array is not None:
            array = np.asarray(array, dtype=np.float32).reshape(-1, width)
            self.array, self.length = mx.array(array), array.shape[0]
        else:
            self.array, self.length = None, int(length)
        self.width, self.block = width, block
        self._keys = None if array is not None else mx.random.split(mx.random.key(seed), -(-self.length // block))
        self._cached: dict[int, mx.array] = {}

    def _block(self, i: int) -> mx.array:
        if i not in self._cached:
            if len(self._cached) > 4:
                self._cached.pop(next(iter(self._cached)))
            n = min(self.block, self.length - i * self.block)
            self._cached[i] = mx.random.uniform(shape=(n, self.width), key=self._keys[i])
        return self._cached[i]

    def rows(self, start: int, count: int, wrap: bool = True) -> mx.array:
        """``count`` rows from absolute sample ``start``; positions wrap modulo the table length when ``wrap``."""
        if not wrap and start + count > self.length:
            raise ValueError(f"the utterance has {start + count} samples, more than the noise table's {self.length} "
                             "(the official offline path is limited the same way; stream it instead)")
        pos = np.arange(start, start + count) % self.length
        if self.array is not None:
            return self.array[mx.array(pos)]
        out, i = [], 0
        while i < count:
            p = int(pos[i])
            b, off = divmod(p, self.block)
            blk = self._block(b)
            take = min(count - i, blk.shape[0] - off)
            out.append(blk[off:off + take])
            i += take
        return mx.concatenate(out, axis=0) if len(out) > 1 else out[0]


class SourceModule(nn.Module):
    """``SourceModuleHnNSF``'s learned part: a linear merge of the harmonics, then tanh."""

    def __init__(self, nb_harmonics: int):
        super().__init__()
        self.l_linear = nn.Linear(nb_harmonics + 1, 1)

    def __call__(self, excitation):
        return cpu_math.tanh(self.l_linear(excitation))


# --------------------------------------------------------------------------------------------------- the generator


def hann_window(n: int) -> np.ndarray:
    """scipy's ``get_window('hann', n, fftbins=True)`` (periodic), as float32."""
    return (0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(n) / n)).astype(np.float32)


class _ISTFTNet:
    """The STFT of the source and the output iSTFT, shared by both generators (torch.stft / torch.istft with
    center=True, reflect padding, a periodic Hann window). Needs ``self.args``, ``self._window``, ``self._envelope``."""

    def _stft(self, s: mx.array) -> mx.array:
        """torch.stft(center=True, reflect) of (B, L) -> (B, frames, n_fft + 2): real bins then imaginary bins."""
        n, hop = self.args.n_fft, self.args.hop_len
        pad = n // 2
        if s.shape[1] <= pad:
            raise ValueError(f"the source has {s.shape[1]} samples; the STFT needs more than {pad}")
        s = mx.concatenate([s[:, pad:0:-1], s, s[:, -2:-pad - 2:-1]], axis=1)
        frames = 1 + (s.shape[1] - n) // hop
        idx = mx.arange(frames)[:, None] * hop + mx.arange(n)[None, :]
        spec = mx.fft.rfft(s[:, idx] * mx.array(self._window), axis=-1)
        return mx.concatenate([mx.real(spec), mx.imag(spec)], axis=-1)

    def _istft(self, magnitude: mx.array, phase: mx.array) -> mx.array:
        """torch.istft(center=True) of (B, frames, bins) magnitude/phase -> (B, hop_len * (frames - 1))."""
        n, hop = self.args.n_fft, self.args.hop_len
        magnitude = mx.minimum(magnitude, 1e2)
        spec = magnitude * cpu_math.cos(phase) + 1j * (magnitude * cpu_math.sin(phase))
        frames = mx.fft.irfft(spec, n=n, axis=-1) * mx.array(self._window)
        b, f = frames.shape[:2]
        r = n // hop
        parts = frames.reshape(b, f, r, hop)
        y = sum(mx.pad(parts[:, :, j], [(0, 0), (j, r - 1 - j), (0, 0)]) for j in range(r))
        y = y.reshape(b, (f + r - 1) * hop)
        if f not in self._envelope:
            w2 = (self._window.astype(np.float64) ** 2).reshape(r, hop)
            env = np.zeros((f + r - 1, hop))
            for j in range(r):
                env[j:j + f] += w2[j]
            env = env.reshape(-1)[n // 2:n // 2 + hop * (f - 1)]
            if env.min() < 1e-11:
                raise ValueError("the iSTFT window does not satisfy the overlap-add condition")
            if len(self._envelope) > 64:
                self._envelope.clear()
            self._envelope[f] = env.astype(np.float32)  # NumPy, so the module's parameter tree never holds it
        return y[:, n // 2:n // 2 + hop * (f - 1)] / mx.array(self._envelope[f])


class CausalHiFTGenerator(_ISTFTNet, nn.Module):
    """CosyVoice3's causal HiFT vocoder: F0 -> sine source -> STFT fused into an upsampling conv net -> iSTFT."""

    def __init__(self, args: HiFTArgs, noise: NoiseTable | None = None):
        super().__init__()
        if args.n_fft % args.hop_len:
            raise ValueError(f"iSTFT n_fft {args.n_fft} must be a multiple of hop_len {args.hop_len}")
        self.args = args
        self.num_kernels = len(args.resblock_kernel_sizes)
        self.num_upsamples = len(args.upsample_rates)
        if not (len(args.upsample_kernel_sizes) == self.num_upsamples == len(args.source_resblock_kernel_sizes)
                == len(args.source_resblock_dilation_sizes)):
            raise ValueError("upsample_rates, upsample_kernel_sizes and the source resblock lists must have one entry "
                             "per upsampling stage")
        self.m_source = SourceModule(args.nb_harmonics)
        self.noise = noise or NoiseTable(args.nb_harmonics + 1)
        base, bins = args.base_channels, args.n_fft + 2
        self.conv_pre = CausalConv1d(args.in_channels, base, args.conv_pre_look_right + 1, causal_type="right")
        self.ups = [CausalConv1dUpsample(base // 2 ** i, base // 2 ** (i + 1), k, u)
                    for i, (u, k) in enumerate(zip(args.upsample_rates, args.upsample_kernel_sizes))]
        down_rates = np.cumprod([1] + list(args.upsample_rates[::-1][:-1]))[::-1]
        self.source_downs, self.source_resblocks = [], []
        for i, (u, k, d) in enumerate(zip(down_rates, args.source_resblock_kernel_sizes,
                                          args.source_resblock_dilation_sizes)):
            ch = base // 2 ** (i + 1)
            self.source_downs.append(CausalConv1d(bins, ch, 1) if u == 1 else
                                     CausalConv1dDownSample(bins, ch, int(u) * 2, int(u)))
            self.source_resblocks.append(ResBlock(ch, k, d))
        self.resblocks = []
        for i in range(self.num_upsamples):
            ch = base // 2 ** (i + 1)
            self.resblocks += [ResBlock(ch, k, d) for k, d in zip(args.resblock_kernel_sizes,
                                                                  args.resblock_dilation_sizes)]
        self.conv_post = CausalConv1d(ch, bins, 7)
        self.f0_predictor = CausalConvF0Predictor(args.f0_predictor)
        self._window = hann_window(args.n_fft)
        self._envelope: dict[int, mx.array] = {}

    # -- the network ----------------------------------------------------------------------------------------------

    def decode(self, mel: mx.array, source: mx.array, finalize: bool = True) -> mx.array:
        """mel (B, T, C) and source samples (B, T * hop) -> speech (B, samples).

        ``finalize``: the last mel frames are zero-padded (end of utterance) and every sample is returned.
        Otherwise the last ``conv_pre_look_right`` frames are look-ahead only and the last frame's samples are
        held back (the iSTFT overlap is incomplete): (T - look_right - 1) * hop samples come out."""
        a = self.args
        s_stft = self._stft(source)
        lr = a.conv_pre_look_right
        if finalize:
            x = self.conv_pre(mel)
        else:
            x = self.conv_pre(mel[:, :-lr], mel[:, -lr:])
            s_stft = s_stft[:, :-(a.upsample_factor * lr)]
        for i in range(self.num_upsamples):
            x = nn.leaky_relu(x, a.lrelu_slope)
            x = self.ups[i](x)
            if i == self.num_upsamples - 1:
                x = mx.concatenate([x[:, 1:2], x], axis=1)  # ReflectionPad1d((1, 0))
            si = self.source_resblocks[i](self.source_downs[i](s_stft))
            x = x + si
            xs = None
            for j in range(self.num_kernels):
                y = self.resblocks[i * self.num_kernels + j](x)
                xs = y if xs is None else xs + y
            x = xs / self.num_kernels
        x = nn.leaky_relu(x, 0.01)  # F.leaky_relu's default slope, as the official code calls it
        x = self.conv_post(x)
        half = a.n_fft // 2 + 1
        speech = self._istft(cpu_math.exp(x[..., :half]), cpu_math.sin(x[..., half:]))
        if not finalize:
            speech = speech[:, :-a.hop]
        return mx.clip(speech, -a.audio_limit, a.audio_limit)

    def voiced(self, f0: mx.array) -> mx.array:
        return (f0 > self.args.nsf_voiced_threshold).astype(mx.float32)

    def excitation(self, sine: mx.array, f0: mx.array, start_sample: int, wrap: bool) -> mx.array:
        """Per-frame sine (B, T, H) and f0 (B, T) -> the merged source samples (B, T * hop), in the official order of
        operations: sine * amp * uv + noise_amp * noise, then the linear merge and tanh."""
        a, hop = self.args, self.args.hop
        sine = mx.repeat(sine, hop, axis=1)
        uv = mx.repeat(self.voiced(f0)[..., None], hop, axis=1)
        noise_amp = uv * a.nsf_sigma + ((1 - uv) * a.nsf_alpha) / 3
        noise = self.noise.rows(start_sample, sine.shape[1], wrap=wrap)[None]
        exc = sine * a.nsf_alpha * uv + noise_amp * noise
        return self.m_source(exc)[..., 0]

    def harmonic_increments(self, f0: mx.array) -> mx.array:
        """f0 (B, T) float32 -> (f0 * h / sr) mod 1 for h = 1..H, float32 (B, T, H)."""
        harmonics = mx.arange(1, self.args.nb_harmonics + 2, dtype=mx.float32)
        return mx.remainder(f0[..., None] * harmonics / self.args.sampling_rate, 1.0)

    def offline_source(self, f0: mx.array) -> mx.array:
        """The official causal ``SineGen2`` path for a whole utterance: the per-frame phase is
        2 pi * hop * cumsum(increments) in float32 (torch's CPU cumsum accumulates float32 in double; MLX does the
        sum in float64 on the CPU and rounds the same way), nearest-upsampled, so the sine holds one value per frame.
        The streaming path below keeps the phase modulo 1 in float64 instead, which stays exact over long streams.
        The official random initial phase reaches only sample 0, which the frame-midpoint downsampling skips."""
        with mx.stream(mx.cpu):
            cum = mx.cumsum(self.harmonic_increments(f0).astype(mx.float64), axis=1).astype(mx.float32)
        phase = cum * 2 * np.float32(np.pi) * np.float32(self.args.hop)
        return self.excitation(cpu_math.sin(phase), f0, 0, wrap=False)

    def inference(self, mel: mx.array, finalize: bool = True) -> tuple[mx.array, mx.array]:
        """The official ``CausalHiFTGenerator.inference``: mel [1, C, T] -> (speech [1, samples], source [1, 1, N]).

        ``finalize=False`` treats the last ``f0 right + look_right`` frames as look-ahead and withholds the last
        emitted frame, as the official chunked use does."""
        x = _check_mel(mel, self.args.in_channels)
        f0 = self.f0_predictor(x, finalize=finalize).astype(mx.float32)
        source = self.offline_source(f0)
        if not finalize:
            x = x[:, :-self.f0_predictor.right]
        return self.decode(x, source, finalize=finalize), source[:, None, :]


def _check_mel(mel, channels: int) -> mx.array:
    if not isinstance(mel, mx.array):
        mel = mx.array(np.asarray(mel, dtype=np.float32))
    if mel.ndim != 3 or mel.shape[0] != 1 or mel.shape[1] != channels:
        raise ValueError(f"mel must have shape [1, {channels}, frames], got {list(mel.shape)}")
    return mel.astype(mx.float32).transpose(0, 2, 1)


# ---------------------------------------------------------------------------------------- the original HiFT


class ConvTranspose1d(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, kernel_size: int, stride: int, padding: int):
        super().__init__()
        self.weight = mx.zeros((out_ch, kernel_size, in_ch))
        self.bias = mx.zeros((out_ch,))
        self.stride, self.padding = stride, padding

    def __call__(self, x):
        return conv_transpose1d(x, self.weight, self.stride, self.padding) + self.bias


class ConvF0Predictor(nn.Module):
    """The non-causal ``ConvRNNF0Predictor`` (five k=3 convolutions, ELUs, a linear head, ``|.|``), float32."""

    def __init__(self, args: F0PredictorArgs):
        super().__init__()
        c = args.cond_channels
        self.condnet = []
        for cin in [args.in_channels] + [c] * 4:
            self.condnet += [Conv1d(cin, c, 3, padding=1), nn.Module()]
        self.classifier = nn.Linear(c, args.num_class)

    def __call__(self, mel):
        x = mel
        for i in range(0, len(self.condnet), 2):
            x = _elu(self.condnet[i](x))
        return mx.abs(self.classifier(x)[..., 0])


# Token2wav builds the original vocoder as HiFTGenerator() with these (its defaults), not from config.yaml.
ORIGINAL_HIFT = HiFTArgs(sampling_rate=24000, upsample_rates=[8, 5, 3], upsample_kernel_sizes=[16, 11, 7],
                         source_resblock_kernel_sizes=[7, 7, 11],
                         source_resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5], [1, 3, 5]])


class HiFTGenerator(_ISTFTNet, nn.Module):
    """The original non-causal HiFT (CosyVoice2's, ``hift_original.pt``) that Token2wav uses for whole utterances:
    symmetric convolutions, transposed-convolution upsampling, a float32 F0 predictor, and the 24 kHz ``SineGen2``
    source whose phase is linearly interpolated between frames. Its source noise is Gaussian and drawn on every
    call (``mx.random``; pass ``noise`` [samples, harmonics + 1] to fix it)."""

    def __init__(self, args: HiFTArgs = ORIGINAL_HIFT):
        super().__init__()
        if args.n_fft % args.hop_len:
            raise ValueError(f"iSTFT n_fft {args.n_fft} must be a multiple of hop_len {args.hop_len}")
        if args.sampling_rate == 22050:
            raise ValueError("the 22.05 kHz SineGen source of CosyVoice 1 is not ported; Step-Audio2 runs at 24 kHz")
        self.args = args
        self.num_kernels, self.num_upsamples = len(args.resblock_kernel_sizes), len(args.upsample_rates)
        self.m_source = SourceModule(args.nb_harmonics)
        base, bins = args.base_channels, args.n_fft + 2
        self.conv_pre = Conv1d(args.in_channels, base, 7, padding=3)
        self.ups = [ConvTranspose1d(base // 2 ** i, base // 2 ** (i + 1), k, u, (k - u) // 2)
                    for i, (u, k) in enumerate(zip(args.upsample_rates, args.upsample_kernel_sizes))]
        down_rates = np.cumprod([1] + list(args.upsample_rates[::-1][:-1]))[::-1]
        self.source_downs, self.source_resblocks = [], []
        for i, (u, k, d) in enumerate(zip(down_rates, args.source_resblock_kernel_sizes,
                                          args.source_resblock_dilation_sizes)):
            ch, u = base // 2 ** (i + 1), int(u)
            self.source_downs.append(Conv1d(bins, ch, 1) if u == 1 else Conv1d(bins, ch, u * 2, u, padding=u // 2))
            self.source_resblocks.append(ResBlock(ch, k, d, causal=False))
        self.resblocks = []
        for i in range(self.num_upsamples):
            ch = base // 2 ** (i + 1)
            self.resblocks += [ResBlock(ch, k, d, causal=False) for k, d in zip(args.resblock_kernel_sizes,
                                                                                args.resblock_dilation_sizes)]
        self.conv_post = Conv1d(ch, bins, 7, padding=3)
        self.f0_predictor = ConvF0Predictor(args.f0_predictor)
        self._window = hann_window(args.n_fft)
        self._envelope: dict[int, np.ndarray] = {}

    def source(self, f0: mx.array, noise=None) -> mx.array:
        """f0 (1, T) -> source samples (1, T * hop): the 24 kHz ``SineGen2`` + merge. The per-frame phase
        2 pi * cumsum((f0 * h / sr) mod 1) (float32; torch's CPU cumsum accumulates in double) times hop is linearly
        interpolated to samples with torch's half-pixel weights, computed in float32 as torch does (in NumPy: this
        is bookkeeping on a few values per sample). The random initial phase of the official code lands on sample 0,
        which the frame-midpoint downsampling skips."""
        a, hop = self.args, self.args.hop
        f0_np = np.array(f0.astype(mx.float32))[0]
        t = f0_np.shape[0]
        harmonics = np.arange(1, a.nb_harmonics + 2, dtype=np.float32)
        rad = np.remainder(f0_np[:, None] * harmonics / np.float32(a.sampling_rate), np.float32(1.0))
        phase = np.cumsum(rad.astype(np.float64), axis=0).astype(np.float32) * np.float32(2) * np.float32(np.pi)
        phase = phase * np.float32(hop)
        src = np.float32(1.0 / hop) * (np.arange(t * hop, dtype=np.float32) + np.float32(0.5)) - np.float32(0.5)
        src = np.maximum(src, np.float32(0))
        i0 = src.astype(np.int64)
        i1 = np.minimum(i0 + 1, t - 1)
        lam1 = np.clip(src - i0.astype(np.float32), 0, 1).astype(np.float32)[:, None]
        lam0 = np.float32(1) - lam1
        sine = mx.array(np.sin(phase[i0] * lam0 + phase[i1] * lam1))[None]
        if noise is None:
            noise = mx.random.normal(sine.shape)
        else:
            noise = mx.array(np.asarray(noise, dtype=np.float32).reshape(sine.shape))
        uv = mx.repeat((f0 > a.nsf_voiced_threshold).astype(mx.float32)[..., None], hop, axis=1)
        noise_amp = uv * a.nsf_sigma + ((1 - uv) * a.nsf_alpha) / 3
        exc = sine * a.nsf_alpha * uv + noise_amp * noise
        return self.m_source(exc)[..., 0]

    def decode(self, mel: mx.array, source: mx.array) -> mx.array:
        a = self.args
        s_stft = self._stft(source)
        x = self.conv_pre(mel)
        for i in range(self.num_upsamples):
            x = self.ups[i](nn.leaky_relu(x, a.lrelu_slope))
            if i == self.num_upsamples - 1:
                x = mx.concatenate([x[:, 1:2], x], axis=1)  # ReflectionPad1d((1, 0))
            x = x + self.source_resblocks[i](self.source_downs[i](s_stft))
            xs = None
            for j in range(self.num_kernels):
                y = self.resblocks[i * self.num_kernels + j](x)
                xs = y if xs is None else xs + y
            x = xs / self.num_kernels
        x = self.conv_post(nn.leaky_relu(x, 0.01))
        half = a.n_fft // 2 + 1
        speech = self._istft(cpu_math.exp(x[..., :half]), cpu_math.sin(x[..., half:]))
        return mx.clip(speech, -a.audio_limit, a.audio_limit)

    def __call__(self, mel, noise=None, cache_source=None) -> tuple[mx.array, mx.array]:
        """The official ``HiFTGenerator.forward``: mel [1, C, T] -> (speech [1, T * hop], source [1, 1, T * hop]).
        ``cache_source`` [1, 1, n] replaces the first n source samples (the 1.0.6 stream's glitch guard)."""
        x = _check_mel(mel, self.args.in_channels)
        f0 = self.f0_predictor(x)
        source = self.source(f0, noise)
        if cache_source is not None and cache_source.shape[-1]:
            n = min(cache_source.shape[-1], source.shape[1])
            source = mx.concatenate([cache_source.reshape(1, -1)[:, :n].astype(source.dtype), source[:, n:]], axis=1)
        return self.decode(x, source), source[:, None, :]


class OverlapVocoder:
    """The vocoder half of minicpmo-utils 1.0.6's ``Token2wav.stream``: the original HiFT run on the last 8 mel
    frames of the previous call plus the new chunk's mel, the previous call's last 3840 source samples pinned over
    the new source's first ones, and the first 3840 samples cross-faded (Hamming window of 7680) with the previous
    call's last 3840 samples. A non-final call holds its last 3840 samples back for that fade; the first non-final
    call puts 3840 samples of silence in front instead. ``noise(shape)`` (None: ``mx.random``) supplies the source's
    Gaussian noise per call, for tests against recorded draws.

    An empty final call (which the official code would hand to the flow as an empty chunk and fail on) returns the
    held-back samples as they are."""

    mel_cache_frames = 8

    def __init__(self, model: HiFTGenerator, noise=None):
        self.model, self.noise, self.hop = model, noise, model.args.hop
        self.cache_samples = self.mel_cache_frames * self.hop
        self.delay = self.mel_cache_frames  # frames of silence in front of the first chunk, as BoundedVocoder's
        window = np.hamming(2 * self.cache_samples)  # float64, as the official torch.from_numpy(np.hamming(...))
        self._fade_in = mx.array(window[:self.cache_samples].astype(np.float32))
        self._fade_out = mx.array(window[self.cache_samples:].astype(np.float32))
        self.reset()

    def reset(self) -> None:
        self.cache = {"mel": mx.zeros((1, self.model.args.in_channels, 0)), "source": mx.zeros((1, 1, 0)),
                      "speech": mx.zeros((1, 0))}

    def stream(self, mel, finalize: bool = False) -> mx.array:
        """Fresh mel [1, C, frames] -> the samples that are final now, [1, N]."""
        c = self.cache
        if mel.shape[2] == 0:
            if not finalize:
                return mx.zeros((1, 0))
            out, c["speech"] = c["speech"], mx.zeros((1, 0))
            return out
        full = mx.concatenate([c["mel"], mel.astype(mx.float32)], axis=2)
        samples = full.shape[2] * self.hop
        noise = None if self.noise is None else self.noise((1, samples, self.model.args.nb_harmonics + 1))
        speech, source = self.model(full, noise=noise, cache_source=c["source"])
        first = c["speech"].shape[1] == 0
        if not first and c["speech"].shape[1] < self.cache_samples:
            raise ValueError(f"the 1.0.6 stream cross-fades {self.cache_samples} samples: its first chunk must make at "
                             f"least {self.mel_cache_frames} mel frames ({self.mel_cache_frames // 2} fresh tokens), "
                             f"it made {c['speech'].shape[1] // self.hop}")
        if not first:
            n = self.cache_samples
            head = speech[:, :n] * self._fade_in + c["speech"][:, -n:] * self._fade_out
            speech = mx.concatenate([head, speech[:, n:]], axis=1)
        self.cache = {"mel": full[:, :, -self.mel_cache_frames:], "source": source[:, :, -self.cache_samples:],
                      "speech": speech[:, -self.cache_samples:]}
        if not finalize:
            speech = speech[:, :-self.cache_samples]
            if first:
                speech = mx.concatenate([mx.zeros((1, self.cache_samples)), speech], axis=1)
        mx.eval(speech, *self.cache.values())
        return speech


# ---------------------------------------------------------------------------------------------- streaming wrapper


def context_sizes(model: CausalHiFTGenerator) -> tuple[int, int, int]:
    """(F0 left frames, F0 right frames, decoder history frames): the official conservative receptive field,
    counting the source STFT and the output iSTFT, plus two frames for grid alignment."""
    a = model.args
    rate = a.upsample_factor
    transform = Fraction(a.n_fft, a.hop)
    history, scale = Fraction(0), 1
    for stage, up in enumerate(model.ups):
        scale *= a.upsample_rates[stage]
        history += Fraction(up.causal_padding, scale)
        down = model.source_downs[stage]
        source_history = (transform + Fraction((down.kernel_size - 1) * down.dilation, rate)
                          + Fraction(model.source_resblocks[stage].history, scale))
        residuals = model.resblocks[stage * model.num_kernels:(stage + 1) * model.num_kernels]
        history = max(history, source_history) + Fraction(max(r.history for r in residuals), scale)
    history += Fraction(model.conv_post.causal_padding + 1, rate) + transform
    return model.f0_predictor.left, model.f0_predictor.right, int(math.ceil(history) + 2)


class BoundedVocoder:
    """One stream of the causal vocoder with bounded state (the official ``BoundedVocoder``).

    ``stream(mel, finalize)`` takes only fresh mel [1, C, frames] and returns the samples that are final so far
    ([1, N] float32 mx.array, N a multiple of 480); the output trails the input by ``delay`` (8) frames until the
    ``finalize`` call returns the rest. ``reset()`` starts a new utterance. ``cache`` is a dict of immutable values
    (mx arrays and ints): a shallow copy is a snapshot, and assigning a snapshot back restores it.
    """

    def __init__(self, model: CausalHiFTGenerator, block_frames: int = 16):
        if model.args.sampling_rate != 24000:
            raise ValueError("the bounded vocoder needs the 24 kHz causal SineGen2 path")
        if not isinstance(block_frames, int) or block_frames < 1:
            raise ValueError("block_frames must be a positive integer")
        if model.args.hop != 480:
            raise ValueError(f"the bounded vocoder needs 480 samples per mel frame, the config gives {model.args.hop}")
        self.model, self.hop, self.block_frames = model, model.args.hop, block_frames
        self.f0_left, self.f0_right, self.history = context_sizes(model)
        self.decoder_right = model.args.conv_pre_look_right + 1
        self.delay = self.f0_right + self.decoder_right
        self.reset()

    @property
    def limits(self) -> dict[str, int]:
        mel_history = max(self.history, self.f0_left - self.decoder_right)
        return {
            "mel_cache_frames": mel_history + self.delay,
            "source_cache_frames": self.history + self.decoder_right,
            "mel_buffer_frames": mel_history + self.delay + self.block_frames,
            "source_buffer_frames": self.history + self.decoder_right + self.block_frames,
            "f0_input_frames": self.f0_left + self.f0_right + self.block_frames,
            "decoder_input_frames": self.history + self.decoder_right + self.block_frames,
            "cumsum_frames": self.block_frames,
            "phase_values": self.model.args.nb_harmonics + 1,
        }

    def reset(self) -> None:
        a = self.model.args
        self.cache = {
            "mel": mx.zeros((1, 0, a.in_channels)),   # channels-last
            "source": mx.zeros((1, 0)),
            "phase": np.zeros((1, 1, a.nb_harmonics + 1), dtype=np.float64),
            "mel_offset": 0, "source_offset": 0, "source_end": 0, "speech_offset": 0, "finalized": False,
        }
        self.maxima = {k: 0 for k in self.limits}
        self._observe(phase_values=self.cache["phase"].size)

    def _observe(self, **values):
        for key, value in values.items():
            if value > self.limits[key]:
                raise RuntimeError(f"bounded vocoder exceeded {key}: {value} > {self.limits[key]}")
            self.maxima[key] = max(self.maxima[key], value)

    def _source(self, f0: mx.array, frame_offset: int) -> mx.array:
        """Source samples for f0 frames starting at ``frame_offset``. The phase (in cycles) is carried modulo 1 in
        float64 between calls. Done in numpy float64: this is a few values per frame, and the carried phase must
        stay float64 on every device (MLX has float64 on the CPU only)."""
        self._observe(cumsum_frames=f0.shape[1])
        inc = np.array(self.model.harmonic_increments(f0)).astype(np.float64)
        cycles = np.cumsum(inc, axis=1) * self.hop + self.cache["phase"]
        self.cache["phase"] = np.remainder(cycles[:, -1:], 1.0)
        sine = mx.array(np.sin(np.remainder(cycles, 1.0) * (2 * math.pi)).astype(np.float32))
        return self.model.excitation(sine, f0, frame_offset * self.hop, wrap=True)

    def _process(self, finalize: bool) -> mx.array:
        c, model = self.cache, self.model
        mel_offset, source_offset, source_end = c["mel_offset"], c["source_offset"], c["source_end"]
        emitted = c["speech_offset"] // self.hop
        received = mel_offset + c["mel"].shape[1]
        available_source = max(0, received - (0 if finalize else self.f0_right))
        if available_source > source_end:
            start = max(0, source_end - self.f0_left)
            features = c["mel"][:, start - mel_offset:]
            self._observe(f0_input_frames=features.shape[1])
            f0 = model.f0_predictor(features, finalize=finalize).astype(mx.float32)[:, source_end - start:]
            sources = [c["source"]]
            for i in range(0, f0.shape[1], self.block_frames):
                part = f0[:, i:i + self.block_frames]
                sources.append(self._source(part, source_end))
                source_end += part.shape[1]
            c["source"] = mx.concatenate(sources, axis=1)
            c["source_end"] = source_end
            self._observe(source_buffer_frames=c["source"].shape[1] // self.hop)
        available_speech = max(0, source_end - (0 if finalize else self.decoder_right))
        speech = mx.zeros((1, 0))
        if available_speech > emitted:
            start = max(0, emitted - self.history)
            features = c["mel"][:, start - mel_offset:source_end - mel_offset]
            source = c["source"][:, (start - source_offset) * self.hop:]
            self._observe(decoder_input_frames=features.shape[1])
            speech = model.decode(features, source, finalize=finalize)[:, (emitted - start) * self.hop:]
            if speech.shape[1] != (available_speech - emitted) * self.hop:
                raise RuntimeError("bounded vocoder returned an unexpected sample count")
            emitted = available_speech
            c["speech_offset"] = emitted * self.hop
        keep_mel = max(0, min(emitted - self.history, source_end - self.f0_left))
        keep_source = max(0, emitted - self.history)
        c["mel"] = c["mel"][:, keep_mel - mel_offset:]
        c["source"] = c["source"][:, (keep_source - source_offset) * self.hop:]
        c["mel_offset"], c["source_offset"] = keep_mel, keep_source
        self._observe(mel_cache_frames=c["mel"].shape[1], source_cache_frames=c["source"].shape[1] // self.hop)
        mx.eval(speech, c["mel"], c["source"])
        return speech

    def stream(self, mel, finalize: bool = False) -> mx.array:
        """Fresh mel [1, C, frames] (frames may be 0) -> the newly final samples [1, N]."""
        x = _check_mel(mel, self.model.args.in_channels)
        if self.cache["finalized"]:
            if x.shape[1] or not finalize:
                raise ValueError("stream already finalized; call reset() for a new utterance")
            return mx.zeros((1, 0))
        chunks = []
        for i in range(0, x.shape[1], self.block_frames):
            self.cache["mel"] = mx.concatenate([self.cache["mel"], x[:, i:i + self.block_frames]], axis=1)
            self._observe(mel_buffer_frames=self.cache["mel"].shape[1])
            chunks.append(self._process(False))
        if finalize:
            chunks.append(self._process(True))
            self.cache["finalized"] = True
        chunks = [s for s in chunks if s.shape[1]]
        return mx.concatenate(chunks, axis=1) if chunks else mx.zeros((1, 0))


# -------------------------------------------------------------------------------------------------------- loading

_WN_NEW = (".parametrizations.weight.original0", ".parametrizations.weight.original1")
_WN_OLD = (".weight_g", ".weight_v")


def _weight_normed(model) -> set[str]:
    """Module paths whose ``weight`` the official model wraps in weight_norm (source_downs, the linear layers and
    Snake are plain)."""
    names = {"conv_pre", "conv_post"}
    names |= {f"ups.{i}" for i in range(len(model.ups))}
    names |= {f"f0_predictor.condnet.{i}" for i in range(0, len(model.f0_predictor.condnet), 2)}
    for group, blocks in (("resblocks", model.resblocks), ("source_resblocks", model.source_resblocks)):
        for b, block in enumerate(blocks):
            for kind in ("convs1", "convs2"):
                names |= {f"{group}.{b}.{kind}.{i}" for i in range(len(getattr(block, kind)))}
    return names


def _transposed(model, key: str) -> bool:
    """The original HiFT upsamples with ConvTranspose1d, whose torch weight is (in, out, kernel)."""
    return isinstance(model, HiFTGenerator) and key.startswith("ups.")


def official_shapes(model, style: str = "parametrizations") -> dict[str, tuple]:
    """The official state-dict keys and shapes (torch layout) of this model's config: weight-normed weights as
    ``parametrizations.weight.original0/1`` (``style='parametrizations'``) or ``weight_g``/``weight_v``."""
    from mlx.utils import tree_flatten

    normed = _weight_normed(model)
    out = {}
    for key, value in tree_flatten(model.parameters()):
        shape = tuple(value.shape)
        if len(shape) == 3:  # MLX (out, kernel, in) -> torch Conv1d (out, in, kernel) / ConvTranspose1d (in, out, k)
            shape = (shape[2], shape[0], shape[1]) if _transposed(model, key) else (shape[0], shape[2], shape[1])
        prefix = key[:-len(".weight")] if key.endswith(".weight") else None
        if prefix in normed:  # torch's weight_norm(dim=0): one gain per index of the torch weight's first axis
            g, v = _WN_NEW if style == "parametrizations" else _WN_OLD
            out[prefix + g] = (shape[0],) + (1,) * (len(shape) - 1)
            out[prefix + v] = shape
        else:
            out[key] = shape
    return out


def official_to_mlx(model, state: dict) -> dict[str, mx.array]:
    """Official hift state dict (numpy or mx arrays, torch layout) -> this model's parameters: weight_norm
    materialised as g * v / ||v|| (norm over all but dim 0, computed in float64), conv weights moved to MLX's
    (out, kernel, in) layout, the causal F0 predictor kept float64 (the official code casts its g and v to float64
    and recomputes the weight there), the rest float32. Raises ``CheckpointError`` listing every key mismatch."""
    from ..loading import describe_mismatch

    state = {k: np.asarray(v) for k, v in state.items()}
    style = "weight_g" if any(k.endswith(_WN_OLD[0]) for k in state) else "parametrizations"
    expected = official_shapes(model, style)
    problem = describe_mismatch(expected, state)
    if problem:
        raise CheckpointError(f"hift weights do not match the vocoder's config:\n{problem}")
    g_suffix, v_suffix = _WN_NEW if style == "parametrizations" else _WN_OLD
    out = {}
    for key, value in state.items():
        if key.endswith(v_suffix):
            continue
        if key.endswith(g_suffix):
            prefix = key[:-len(g_suffix)]
            g, v = value.astype(np.float64), state[prefix + v_suffix].astype(np.float64)
            norm = np.sqrt(np.sum(v * v, axis=tuple(range(1, v.ndim)), keepdims=True))
            key, value = prefix + ".weight", g * v / norm
        if key.endswith(".weight") and value.ndim == 3:
            value = value.transpose(1, 2, 0) if _transposed(model, key) else value.transpose(0, 2, 1)
        f64 = key.startswith("f0_predictor.") and isinstance(model, CausalHiFTGenerator)
        out[key] = mx.array(value.astype(np.float64 if f64 else np.float32), dtype=mx.float64 if f64 else mx.float32)
    return out


def load_causal_weights(model: CausalHiFTGenerator, state: dict) -> CausalHiFTGenerator:
    params = official_to_mlx(model, state)
    model.load_weights(list(params.items()), strict=True)
    mx.eval(model.parameters())
    return model


def load_causal_vocoder(folder: str | Path, noise: NoiseTable | None = None) -> CausalHiFTGenerator:
    """The streaming vocoder of a 1.0.7 Token2wav folder: ``config.yaml`` (its ``hift`` and ``feat_extractor``
    sections) and ``hift.safetensors`` (or ``hift.pt`` read with torch, see weights.py). Makes Token2wav's checks:
    24 kHz, 480 samples per mel frame, the 8-frame causal delay."""
    from .weights import read_weights

    folder = Path(folder)
    cfg = folder / "config.yaml"
    if not cfg.is_file():
        raise CheckpointError(f"missing {cfg} (the causal vocoder of minicpmo-utils 1.0.7 is configured there; a "
                              "1.0.6 folder has flow.yaml only and runs the original HiFT)")
    args = causal_args_from_config(cfg)
    if args.sampling_rate != 24000 or args.hop != 480:
        raise CheckpointError(f"{cfg}: the streaming vocoder needs 24 kHz audio and 480 samples per mel frame, "
                              f"the config gives {args.sampling_rate} Hz and {args.hop}")
    model = CausalHiFTGenerator(args, noise=noise)
    delay = model.f0_predictor.right + args.conv_pre_look_right + 1
    if delay != 8:
        raise CheckpointError(f"{cfg}: Token2wav needs the validated 8-frame causal delay, the config gives {delay}")
    return load_causal_weights(model, read_weights(folder, "hift"))


def _to_numpy(state: dict) -> dict[str, np.ndarray]:
    """mx arrays -> float32 NumPy (bfloat16 has no NumPy type; half-precision checkpoints widen losslessly)."""
    return {k: np.array(v.astype(mx.float32) if v.dtype in (mx.bfloat16, mx.float16) else v) for k, v in state.items()}


def original_args_for(state: dict, args: HiFTArgs = ORIGINAL_HIFT) -> HiFTArgs:
    """``args`` with the widths a state dict holds (``conv_pre`` outputs = base_channels, the F0 predictor's first
    conv outputs = cond_channels): the official ``HiFTGenerator()`` defaults for the release, smaller for tiny
    checkpoints in the same layout. Any other difference is left for the strict key check to name."""
    import dataclasses

    def out_channels(prefix):
        for suffix in (".parametrizations.weight.original1", ".weight_v", ".weight"):
            if prefix + suffix in state:
                return int(np.asarray(state[prefix + suffix]).shape[0])
        return None

    base, cond = out_channels("conv_pre"), out_channels("f0_predictor.condnet.0")
    if base is not None:
        args = dataclasses.replace(args, base_channels=base)
    if cond is not None:
        args = dataclasses.replace(args, f0_predictor=dataclasses.replace(args.f0_predictor, cond_channels=cond))
    return args


def load_original_vocoder(folder: str | Path, args: HiFTArgs | None = None, stem: str = "hift_original") \
        -> HiFTGenerator:
    """The original HiFT of a Token2wav folder: ``hift_original`` (1.0.7, whole utterances) or ``hift`` (1.0.6, also
    streaming), ``.safetensors`` or ``.pt`` (weights.py); a ``generator.`` key prefix is dropped, as Token2wav does.
    Token2wav builds it with ``HiFTGenerator()``'s defaults (``ORIGINAL_HIFT``); ``args`` None takes those with
    the widths of the weights (``original_args_for``)."""
    from .weights import read_weights

    state = {k.removeprefix("generator."): v for k, v in read_weights(folder, stem).items()}
    model = HiFTGenerator(original_args_for(state) if args is None else args)
    model.load_weights(list(official_to_mlx(model, state).items()), strict=True)
    mx.eval(model.parameters())
    return model
