"""StepAudio2 token2wav flow configuration: dataclasses read from the official ``flow.yaml``.

The released ``flow.yaml`` is a hyperpyyaml file: ``flow: !new:cosyvoice2.flow.flow.CausalMaskedDiffWithXvec`` with
nested ``!new:`` nodes for the encoder (``UpsampleConformerEncoderV2``), the decoder (``CausalConditionalCFM``) and
its estimator (``DiT``). It is read here with PyYAML's safe loader: every ``!tag`` node is kept as plain data (the
tag is recorded, nothing is imported or called), ``!ref <name>`` resolves to a top-level scalar, and the four
``!new:`` targets under ``flow`` are checked by name. Keys the official constructors accept but inference does not
use (dropout rates, ``output_type``) are read and ignored; unknown keys and unsupported layer types are errors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..loading import CheckpointError

FLOW_TAG = "!new:cosyvoice2.flow.flow.CausalMaskedDiffWithXvec"
ENCODER_TAG = "!new:cosyvoice2.transformer.upsample_encoder_v2.UpsampleConformerEncoderV2"
DECODER_TAG = "!new:cosyvoice2.flow.flow_matching.CausalConditionalCFM"
ESTIMATOR_TAG = "!new:cosyvoice2.flow.decoder_dit.DiT"
ACTIVATIONS = ("swish", "relu", "gelu", "tanh")
_IGNORED = {"dropout_rate", "positional_dropout_rate", "attention_dropout_rate", "output_type"}


@dataclass
class EncoderConfig:
    """``UpsampleConformerEncoderV2``: linear embed, pre-lookahead conv, conformer blocks, x2 upsample, more blocks."""
    input_size: int = 512
    output_size: int = 256
    input_layer: str = "linear"
    pre_lookahead_len: int = 3
    num_blocks: int = 6
    num_up_blocks: int = 4
    up_stride: int = 2
    up_scale_factor: float = 2.0
    attention_heads: int = 4
    pos_enc_layer_type: str = "rel_pos_espnet"
    selfattention_layer_type: str = "rel_selfattn"
    key_bias: bool = True
    linear_units: int = 2048
    normalize_before: bool = True
    activation_type: str = "swish"

    def __post_init__(self):
        checks = [
            (self.input_layer == "linear", f"input_layer {self.input_layer!r} (only 'linear')"),
            (self.pos_enc_layer_type == "rel_pos_espnet",
             f"pos_enc_layer_type {self.pos_enc_layer_type!r} (only 'rel_pos_espnet')"),
            (self.selfattention_layer_type == "rel_selfattn",
             f"selfattention_layer_type {self.selfattention_layer_type!r} (only 'rel_selfattn')"),
            (self.activation_type in ACTIVATIONS, f"activation_type {self.activation_type!r} (one of {ACTIVATIONS})"),
            (float(self.up_scale_factor) == float(self.up_stride),
             f"up_scale_factor {self.up_scale_factor} != up_stride {self.up_stride} (nearest upsampling by the stride)"),
            (self.output_size % self.attention_heads == 0,
             f"output_size {self.output_size} not divisible by attention_heads {self.attention_heads}"),
            (self.pre_lookahead_len >= 1, f"pre_lookahead_len {self.pre_lookahead_len} (at least 1)"),
            (self.up_stride >= 1, f"up_stride {self.up_stride} (at least 1)"),
        ]
        bad = [why for ok, why in checks if not ok]
        if bad:
            raise CheckpointError("unsupported flow encoder setting: " + "; ".join(bad))


@dataclass
class DiTConfig:
    """The CFM estimator: a DiT with adaLN-zero modulation, qk-norm attention and a causal conv block per layer."""
    in_channels: int = 320
    out_channels: int = 80
    mlp_ratio: float = 4.0
    depth: int = 28
    num_heads: int = 8
    head_dim: int = 64
    hidden_size: int = 256

    def __post_init__(self):
        if self.in_channels != 4 * self.out_channels:
            raise CheckpointError(f"estimator in_channels {self.in_channels} must be 4 x out_channels "
                                  f"{self.out_channels} (noise, encoder output, speaker, prompt mel)")


@dataclass
class DecoderConfig:
    """``CausalConditionalCFM``: Euler ODE solve with classifier-free guidance."""
    inference_cfg_rate: float = 0.7
    estimator: DiTConfig = field(default_factory=DiTConfig)

    def __post_init__(self):
        if not self.inference_cfg_rate > 0:
            raise CheckpointError(f"inference_cfg_rate {self.inference_cfg_rate} must be > 0 (the official solver "
                                  "asserts it)")


@dataclass
class FlowConfig:
    """``CausalMaskedDiffWithXvec``: token embedding + speaker projection + encoder + CFM decoder."""
    input_size: int = 512
    output_size: int = 80
    spk_embed_dim: int = 192
    vocab_size: int = 5121
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    decoder: DecoderConfig = field(default_factory=DecoderConfig)

    def __post_init__(self):
        if self.encoder.input_size != self.input_size:
            raise CheckpointError(f"flow input_size {self.input_size} != encoder input_size {self.encoder.input_size}")
        if self.encoder.output_size != self.input_size:
            # up_embed is Linear(input_size, output_size) applied to encoder outputs (output_size wide)
            raise CheckpointError(f"encoder output_size {self.encoder.output_size} must equal input_size "
                                  f"{self.input_size} (the upsampled embed reads encoder outputs)")
        if self.decoder.estimator.out_channels != self.output_size:
            raise CheckpointError(f"estimator out_channels {self.decoder.estimator.out_channels} != flow output_size "
                                  f"{self.output_size}")


class _Tagged:
    """A ``!tag`` node kept as data: ``tag`` and its constructed value (mapping, sequence or scalar)."""

    def __init__(self, tag: str, value):
        self.tag, self.value = tag, value

    def __repr__(self):
        return f"_Tagged({self.tag!r})"


class _InertLoader(yaml.SafeLoader):
    """Safe loader that keeps unknown tags as ``_Tagged`` data instead of refusing or executing them."""


def _construct_tagged(loader: _InertLoader, suffix: str, node: yaml.Node):
    tag = "!" + suffix
    if isinstance(node, yaml.MappingNode):
        return _Tagged(tag, loader.construct_mapping(node, deep=True))
    if isinstance(node, yaml.SequenceNode):
        return _Tagged(tag, loader.construct_sequence(node, deep=True))
    return _Tagged(tag, loader.construct_scalar(node))


_InertLoader.add_multi_constructor("!", _construct_tagged)


def _resolve(value, top: dict, where: str):
    """Resolve ``!ref <name>`` to a top-level value; any other tag left inside the flow section is an error."""
    if isinstance(value, _Tagged):
        if value.tag == "!ref" and isinstance(value.value, str):
            name = value.value.strip()
            if name.startswith("<") and name.endswith(">") and name[1:-1] in top:
                return _resolve(top[name[1:-1]], top, where)
            raise CheckpointError(f"flow.yaml: {where}: cannot resolve {value.tag} {value.value!r}")
        raise CheckpointError(f"flow.yaml: {where}: unsupported tag {value.tag}")
    return value


def _fields(cls, node, tag: str, top: dict, where: str, nested: dict) -> dict:
    if not isinstance(node, _Tagged) or node.tag != tag or not isinstance(node.value, dict):
        got = node.tag if isinstance(node, _Tagged) else type(node).__name__
        raise CheckpointError(f"flow.yaml: {where} must be a {tag} mapping, got {got}")
    names = {f.name for f in dataclasses.fields(cls)}
    out = {}
    unknown = []
    for k, v in node.value.items():
        if k in nested:
            out[k] = nested[k](v)
        elif k in names:
            out[k] = _resolve(v, top, f"{where}.{k}")
        elif k not in _IGNORED:
            unknown.append(k)
    if unknown:
        raise CheckpointError(f"flow.yaml: {where} has settings this port does not implement: {sorted(unknown)}")
    return out


def parse_flow_yaml(text: str) -> FlowConfig:
    """``FlowConfig`` from the text of an official ``flow.yaml`` (no code is imported or run)."""
    try:
        top = yaml.load(text, Loader=_InertLoader)
    except yaml.YAMLError as e:
        raise CheckpointError(f"flow.yaml is not valid YAML: {e}") from None
    if not isinstance(top, dict) or "flow" not in top:
        raise CheckpointError("flow.yaml has no top-level 'flow' entry")

    def estimator(node):
        return DiTConfig(**_fields(DiTConfig, node, ESTIMATOR_TAG, top, "flow.decoder.estimator", {}))

    def decoder(node):
        return DecoderConfig(**_fields(DecoderConfig, node, DECODER_TAG, top, "flow.decoder",
                                       {"estimator": estimator}))

    def encoder(node):
        return EncoderConfig(**_fields(EncoderConfig, node, ENCODER_TAG, top, "flow.encoder", {}))

    kw = _fields(FlowConfig, top["flow"], FLOW_TAG, top, "flow", {"encoder": encoder, "decoder": decoder})
    for part in ("encoder", "decoder"):
        if part not in kw:
            raise CheckpointError(f"flow.yaml: flow has no {part}")
    return FlowConfig(**kw)


def load_flow_config(path: str | Path) -> FlowConfig:
    path = Path(path)
    if path.is_dir():
        path = path / "flow.yaml"
    if not path.is_file():
        raise CheckpointError(f"no flow.yaml at {path}")
    return parse_flow_yaml(path.read_text(encoding="utf-8"))


def flow_yaml_text(cfg: FlowConfig) -> str:
    """``flow.yaml`` in the official layout (tags and key names) for ``cfg``: what the tiny builder writes."""
    e, d, s = cfg.encoder, cfg.decoder, cfg.decoder.estimator

    def block(d: dict, indent: int) -> str:
        pad = " " * indent
        return "".join(f"{pad}{k}: {str(v).lower() if isinstance(v, bool) else v}\n" for k, v in d.items())

    return (
        f"flow: {FLOW_TAG}\n"
        + block({"input_size": cfg.input_size, "output_size": cfg.output_size, "spk_embed_dim": cfg.spk_embed_dim,
                 "output_type": "mel", "vocab_size": cfg.vocab_size}, 4)
        + f"    encoder: {ENCODER_TAG}\n"
        + block({"input_size": e.input_size, "output_size": e.output_size, "input_layer": e.input_layer,
                 "pre_lookahead_len": e.pre_lookahead_len, "num_blocks": e.num_blocks,
                 "num_up_blocks": e.num_up_blocks, "up_stride": e.up_stride, "up_scale_factor": e.up_scale_factor,
                 "attention_heads": e.attention_heads, "pos_enc_layer_type": e.pos_enc_layer_type,
                 "selfattention_layer_type": e.selfattention_layer_type, "key_bias": e.key_bias,
                 "linear_units": e.linear_units, "dropout_rate": 0.1, "positional_dropout_rate": 0.1,
                 "attention_dropout_rate": 0.1, "normalize_before": e.normalize_before}, 8)
        + f"    decoder: {DECODER_TAG}\n"
        + block({"inference_cfg_rate": d.inference_cfg_rate}, 8)
        + f"        estimator: {ESTIMATOR_TAG}\n"
        + block({"in_channels": s.in_channels, "out_channels": s.out_channels, "mlp_ratio": s.mlp_ratio,
                 "depth": s.depth, "num_heads": s.num_heads, "head_dim": s.head_dim,
                 "hidden_size": s.hidden_size}, 12)
    )


def released_config() -> FlowConfig:
    """The sizes of the released MiniCPM-o 4.5 / Step-Audio 2 token2wav flow (its flow.yaml spells every one out;
    the dataclass defaults are the official constructors' defaults, which a yaml omitting a key would get)."""
    return FlowConfig(
        input_size=512, output_size=80, spk_embed_dim=192, vocab_size=6561,
        encoder=EncoderConfig(input_size=512, output_size=512, pre_lookahead_len=3, num_blocks=6, num_up_blocks=4,
                              up_stride=2, up_scale_factor=2, attention_heads=8, key_bias=True, linear_units=2048,
                              normalize_before=True),
        decoder=DecoderConfig(inference_cfg_rate=0.7,
                              estimator=DiTConfig(in_channels=320, out_channels=80, mlp_ratio=4.0, depth=16,
                                                  num_heads=8, head_dim=64, hidden_size=512)),
    )
