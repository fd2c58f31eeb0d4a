"""A tiny StepAudio2 token2wav folder in the released layout, for tests (here and in the engine's speech tests).

``write_tiny_token2wav(folder)`` writes ``flow.yaml`` (official tags and keys, tiny widths: 80 mel bins, 192-value
speaker embedding and the 3-token lookahead as released), ``flow.safetensors`` (official ``flow.pt`` key names and
torch layouts, seeded random values: norm gains 1 + 0.1 N, biases 0.05 N, the rest N / sqrt(fan_in)), the voc
helper's tiny vocoder (``config.yaml`` + ``hift.safetensors``) and ``voice.safetensors`` (12 prompt tokens, their
24 prompt mel frames, a speaker embedding). ``Token2Wav.load(folder)`` reads it as it reads the release.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .config import DecoderConfig, DiTConfig, EncoderConfig, FlowConfig, flow_yaml_text


def tiny_flow_config(**overrides) -> FlowConfig:
    cfg = FlowConfig(
        input_size=32, output_size=80, spk_embed_dim=192, vocab_size=6561,
        encoder=EncoderConfig(input_size=32, output_size=32, pre_lookahead_len=3, num_blocks=2, num_up_blocks=2,
                              up_stride=2, up_scale_factor=2, attention_heads=2, linear_units=64),
        decoder=DecoderConfig(inference_cfg_rate=0.7,
                              estimator=DiTConfig(in_channels=320, out_channels=80, mlp_ratio=2.0, depth=2,
                                                  num_heads=2, head_dim=16, hidden_size=32)),
    )
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def official_flow_shapes(cfg: FlowConfig) -> dict[str, tuple]:
    """The official ``flow.pt`` keys and torch shapes for ``cfg`` (convs (out, in, k))."""
    from mlx.utils import tree_flatten

    from .flow import _RENAMES, CausalMaskedDiffWithXvec

    out = {}
    for k, v in tree_flatten(CausalMaskedDiffWithXvec(cfg).parameters()):
        for official, ours in _RENAMES:
            k = k.replace(ours, official)
        shape = tuple(v.shape)
        out[k] = (shape[0], shape[2], shape[1]) if len(shape) == 3 else shape
    return out


def random_flow_state(cfg: FlowConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    state = {}
    for k, shape in sorted(official_flow_shapes(cfg).items()):
        if len(shape) == 1 and k.endswith("weight") and ("norm" in k or ".out.1." in k):
            v = 1 + 0.1 * rng.standard_normal(shape)
        elif k.endswith("bias") or "pos_bias" in k:
            v = 0.05 * rng.standard_normal(shape)
        elif k == "input_embedding.weight":
            v = rng.standard_normal(shape)
        else:
            v = rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))
        state[k] = v.astype(np.float32)
    return state


def tiny_voice(cfg: FlowConfig, seed: int = 1, prompt_tokens: int = 12):
    from .token2wav import Voice

    rng = np.random.default_rng(seed)
    return Voice(rng.integers(0, cfg.vocab_size, prompt_tokens),
                 rng.standard_normal((prompt_tokens * cfg.encoder.up_stride, cfg.output_size)).astype(np.float32) - 4,
                 rng.standard_normal(cfg.spk_embed_dim).astype(np.float32))


def random_original_hift_state(seed: int = 0, width: int = 16) -> dict[str, np.ndarray]:
    """Seeded random weights for the original HiFT (``HiFTGenerator(base_channels=width, f0_predictor=
    ConvRNNF0Predictor(cond_channels=width))``) under the official ``hift.pt`` names, ``generator.``-prefixed as
    Token2wav strips them; F0 biased around 60 Hz as in tiny_vocoder.py."""
    import dataclasses

    from .vocoder import ORIGINAL_HIFT, HiFTGenerator, official_shapes

    args = dataclasses.replace(ORIGINAL_HIFT, base_channels=width,
                               f0_predictor=dataclasses.replace(ORIGINAL_HIFT.f0_predictor, cond_channels=width))
    rng = np.random.default_rng(seed)
    state = {}
    for key, shape in sorted(official_shapes(HiFTGenerator(args)).items()):
        if key.endswith("original0"):
            a = rng.uniform(0.5, 1.2, shape)
        elif key.endswith("alpha"):
            a = rng.uniform(0.5, 1.5, shape)
        elif key == "m_source.l_linear.weight":
            a = rng.normal(0.0, 0.5, shape)
        elif key == "f0_predictor.classifier.weight":
            a = rng.normal(0.0, 240.0 / np.sqrt(shape[1]), shape)
        elif key == "f0_predictor.classifier.bias":
            a = np.full(shape, 60.0)
        elif key.endswith("bias"):
            a = rng.normal(0.0, 0.1, shape)
        else:
            a = rng.normal(0.0, 1.0 / np.sqrt(np.prod(shape[1:])), shape)
        state["generator." + key] = np.ascontiguousarray(a, dtype=np.float32)
    return state


def write_tiny_token2wav(folder: str | Path, seed: int = 0, cfg: FlowConfig | None = None,
                         layout: str = "1.0.7") -> Path:
    """Write a tiny token2wav folder (flow, vocoder, voice); returns it. ``layout`` "1.0.7": the causal vocoder
    (``config.yaml`` + ``hift``); "1.0.6" (the released MiniCPM-o 4.5's): ``hift`` is the original HiFT, no
    ``config.yaml``."""
    from safetensors.numpy import save_file

    from .tiny_vocoder import write_tiny_vocoder

    if layout not in ("1.0.6", "1.0.7"):
        raise ValueError(f"layout must be '1.0.6' or '1.0.7', got {layout!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = cfg or tiny_flow_config()
    (folder / "flow.yaml").write_text(flow_yaml_text(cfg), encoding="utf-8")
    save_file(random_flow_state(cfg, seed), str(folder / "flow.safetensors"))
    if layout == "1.0.7":
        write_tiny_vocoder(folder, seed)
    else:
        save_file(random_original_hift_state(seed), str(folder / "hift.safetensors"))
    tiny_voice(cfg, seed + 1).save(folder / "voice.safetensors")
    return folder
