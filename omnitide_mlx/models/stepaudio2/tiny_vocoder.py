"""A tiny causal vocoder in the released Token2wav layout, for tests: ``config.yaml`` (hyperpyyaml tags, as the
official file has them) and ``hift.safetensors`` (the official ``hift.pt`` state-dict keys and torch layouts, with
weight_norm as ``parametrizations.weight.original0/1``) holding seeded random weights.

The structure is the released one (24 kHz, upsampling 8*5*3 with a 4-sample iSTFT hop = 480 samples per mel frame,
the 8-frame causal delay, 80 mel channels, 9 harmonics); only the channel widths are small. NumPy only (no MLX, no
torch), so the reference scripts can use it too.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

TINY_HIFT = {
    "in_channels": 80,
    "base_channels": 16,
    "nb_harmonics": 8,
    "sampling_rate": 24000,
    "nsf_alpha": 0.1,
    "nsf_sigma": 0.003,
    "nsf_voiced_threshold": 10,
    "upsample_rates": [8, 5, 3],
    "upsample_kernel_sizes": [16, 11, 7],
    "istft_params": {"n_fft": 16, "hop_len": 4},
    "resblock_kernel_sizes": [3, 7, 11],
    "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]],
    "source_resblock_kernel_sizes": [7, 7, 11],
    "source_resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]],
    "lrelu_slope": 0.1,
    "audio_limit": 0.99,
    "conv_pre_look_right": 4,
}
TINY_F0 = {"num_class": 1, "in_channels": 80, "cond_channels": 16}

_CONFIG = """\
# Tiny random CosyVoice3 causal vocoder in the Token2wav config.yaml layout (test fixture).
sample_rate: 24000

hift: !new:cosyvoice.hifigan.generator.CausalHiFTGenerator
{hift}
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.CausalConvRNNF0Predictor
{f0}

feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: 1920
    num_mels: 80
    sampling_rate: !ref <sample_rate>
    hop_size: 480
    win_size: 1920
    fmin: 0
    fmax: 8000
    center: False
"""


def _yaml_value(v) -> str:
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_yaml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_yaml_value(x) for x in v) + "]"
    return str(v)


def config_text(hift: dict | None = None, f0: dict | None = None) -> str:
    hift, f0 = dict(hift or TINY_HIFT), dict(f0 or TINY_F0)
    hift_lines = "\n".join(f"    {k}: {'!ref <sample_rate>' if k == 'sampling_rate' and v == 24000 else _yaml_value(v)}"
                           for k, v in hift.items())
    f0_lines = "\n".join(f"        {k}: {_yaml_value(v)}" for k, v in f0.items())
    return _CONFIG.format(hift=hift_lines, f0=f0_lines)


def official_state_shapes(hift: dict | None = None, f0: dict | None = None) -> dict[str, tuple[tuple, str]]:
    """key -> (torch shape, kind) of the official CausalHiFTGenerator state dict; kind is 'g'/'v' (weight_norm
    parts), 'bias', 'alpha', 'weight' (plain) or 'classifier'."""
    h, f = dict(hift or TINY_HIFT), dict(f0 or TINY_F0)
    out: dict[str, tuple[tuple, str]] = {}

    def conv(name, cin, cout, k, normed=True):
        if normed:
            out[f"{name}.parametrizations.weight.original0"] = ((cout, 1, 1), "g")
            out[f"{name}.parametrizations.weight.original1"] = ((cout, cin, k), "v")
        else:
            out[f"{name}.weight"] = ((cout, cin, k), "weight")
        out[f"{name}.bias"] = ((cout,), "bias")

    def resblock(name, ch, k, dil):
        for i in range(len(dil)):
            conv(f"{name}.convs1.{i}", ch, ch, k)
            conv(f"{name}.convs2.{i}", ch, ch, k)
        for i in range(len(dil)):
            out[f"{name}.activations1.{i}.alpha"] = ((ch,), "alpha")
        for i in range(len(dil)):
            out[f"{name}.activations2.{i}.alpha"] = ((ch,), "alpha")

    base, bins, rates = h["base_channels"], h["istft_params"]["n_fft"] + 2, h["upsample_rates"]
    out["m_source.l_linear.weight"] = ((1, h["nb_harmonics"] + 1), "source")
    out["m_source.l_linear.bias"] = ((1,), "bias")
    conv("conv_pre", h["in_channels"], base, h["conv_pre_look_right"] + 1)
    for i, k in enumerate(h["upsample_kernel_sizes"]):
        conv(f"ups.{i}", base // 2 ** i, base // 2 ** (i + 1), k)
    down = np.cumprod([1] + rates[::-1][:-1])[::-1]
    for i, (u, k, d) in enumerate(zip(down, h["source_resblock_kernel_sizes"], h["source_resblock_dilation_sizes"])):
        conv(f"source_downs.{i}", bins, base // 2 ** (i + 1), 1 if u == 1 else int(u) * 2, normed=False)
    for i, (u, k, d) in enumerate(zip(down, h["source_resblock_kernel_sizes"], h["source_resblock_dilation_sizes"])):
        resblock(f"source_resblocks.{i}", base // 2 ** (i + 1), k, d)
    n = 0
    for i in range(len(rates)):
        for k, d in zip(h["resblock_kernel_sizes"], h["resblock_dilation_sizes"]):
            resblock(f"resblocks.{n}", base // 2 ** (i + 1), k, d)
            n += 1
    conv("conv_post", base // 2 ** len(rates), bins, 7)
    c = f["cond_channels"]
    conv("f0_predictor.condnet.0", f["in_channels"], c, 4)
    for i in (2, 4, 6, 8):
        conv(f"f0_predictor.condnet.{i}", c, c, 3)
    out["f0_predictor.classifier.weight"] = ((f["num_class"], c), "classifier")
    out["f0_predictor.classifier.bias"] = ((f["num_class"],), "classifier_bias")
    return out


def random_state(seed: int = 0, hift: dict | None = None, f0: dict | None = None) -> dict[str, np.ndarray]:
    """Seeded random float32 weights with unit-ish gains; the F0 head is biased so F0 spreads around 60 Hz with a
    few unvoiced (< 10 Hz) frames, so both source branches are exercised."""
    rng = np.random.default_rng(seed)
    state = {}
    for key, (shape, kind) in official_state_shapes(hift, f0).items():
        if kind == "g":
            a = rng.uniform(0.5, 1.2, shape)
        elif kind in ("v", "weight"):
            a = rng.normal(0.0, 1.0 / np.sqrt(np.prod(shape[1:])), shape)
        elif kind == "bias":
            a = rng.normal(0.0, 0.1, shape)
        elif kind == "alpha":
            a = rng.uniform(0.5, 1.5, shape)
        elif kind == "source":
            a = rng.normal(0.0, 0.5, shape)
        elif kind == "classifier":
            a = rng.normal(0.0, 240.0 / np.sqrt(shape[1]), shape)
        else:  # classifier_bias
            a = np.full(shape, 60.0)
        state[key] = np.ascontiguousarray(a, dtype=np.float32)
    return state


def write_tiny_vocoder(folder: str | Path, seed: int = 0) -> Path:
    """Write ``config.yaml`` and ``hift.safetensors`` of the tiny causal vocoder into ``folder``."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(config_text(), encoding="utf-8")
    save_file(random_state(seed), str(folder / "hift.safetensors"))
    return folder
