"""MiniCPM-o 4.5 configuration, read from the released config.json (Hugging Face layout).

The released config is a ``Qwen3Config`` subclass: the LLM fields sit at the root, next to the MiniCPM-o fields
(``query_num``, ``slice_config``, ...) and the ``vision_config`` (SigLIP) / ``audio_config`` (Whisper) dicts.
Missing fields take the defaults of the official config classes, so a config that omits one behaves as the
official code would.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..loading import CheckpointError, config_fields


class ConfigError(CheckpointError):
    """A config.json the port cannot run (inconsistent sizes, unsupported options)."""


@dataclass
class TextConfig:
    """Qwen3 language model (``Qwen3Config`` defaults for anything missing)."""

    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    vocab_size: int = 151936
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                              f"num_key_value_heads {self.num_key_value_heads}")

    @classmethod
    def from_root(cls, d: dict) -> "TextConfig":
        kw = config_fields(cls, d)
        rope = d.get("rope_parameters") or {}
        if "rope_theta" not in d and "rope_theta" in rope:
            kw["rope_theta"] = rope["rope_theta"]
        scaling = d.get("rope_scaling") or rope
        kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
        if kind not in ("default", None):
            raise ConfigError(f"rope scaling {kind!r} is not supported (MiniCPM-o 4.5 uses plain RoPE)")
        if d.get("attention_bias"):
            raise ConfigError("attention_bias=true is not a MiniCPM-o 4.5 (Qwen3) checkpoint")
        return cls(**kw)


@dataclass
class VisionConfig:
    """SigLIP (navit) vision tower (``SiglipVisionConfig`` defaults for missing keys of a given dict)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 16
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    # MiniCPMOConfig.default_vision_config: the so400m-14-980 tower, used when config.json has no vision_config
    RELEASED = {"hidden_size": 1152, "image_size": 980, "intermediate_size": 4304, "num_attention_heads": 16,
                "num_hidden_layers": 27, "patch_size": 14}

    @classmethod
    def from_dict(cls, d: dict | None) -> "VisionConfig":
        d = cls.RELEASED if d is None else d
        cfg = cls(**config_fields(cls, d))
        if cfg.hidden_act != "gelu_pytorch_tanh":
            raise ConfigError(f"vision hidden_act {cfg.hidden_act!r} is not supported (SigLIP uses gelu_pytorch_tanh)")
        if cfg.hidden_size % cfg.num_attention_heads:
            raise ConfigError(f"vision hidden_size {cfg.hidden_size} is not a multiple of its "
                              f"{cfg.num_attention_heads} heads")
        return cfg

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


@dataclass
class AudioConfig:
    """Whisper encoder (``WhisperConfig`` defaults for anything missing)."""

    d_model: int = 256
    encoder_layers: int = 4
    encoder_attention_heads: int = 4
    encoder_ffn_dim: int = 1536
    num_mel_bins: int = 80
    max_source_positions: int = 1500
    activation_function: str = "gelu"

    @classmethod
    def from_dict(cls, d: dict | None) -> "AudioConfig":
        cfg = cls(**config_fields(cls, d or {}))
        if cfg.activation_function != "gelu":
            raise ConfigError(f"audio activation {cfg.activation_function!r} is not supported (Whisper uses gelu)")
        if cfg.d_model % cfg.encoder_attention_heads:
            raise ConfigError(f"audio d_model {cfg.d_model} is not a multiple of its "
                              f"{cfg.encoder_attention_heads} heads")
        return cfg


@dataclass
class SliceConfig:
    max_slice_nums: int = 1
    scale_resolution: int = 448
    patch_size: int = 14


@dataclass
class ModelConfig:
    """Everything the MLX port reads from config.json."""

    text: TextConfig
    vision: VisionConfig | None
    audio: AudioConfig | None
    query_num: int = 64
    drop_vision_last_layer: bool = True  # the official class default; the released value is unverified
    vision_batch_size: int = 16
    audio_pool_step: int = 5
    audio_chunk_length: float = 1.0
    stream_input: bool = False
    slice: SliceConfig = field(default_factory=SliceConfig)
    eos_token_id: Any = None
    converted: bool = False  # written by `omnitide convert`: weights already in MLX layout
    tts_config: dict | None = None  # config.json's tts_config when init_tts (default true); None: no TTS asked for
    tts: Any = None  # the TTS args (tts.TTSArgs), set by the loader when the checkpoint also holds tts.* weights

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        if d.get("model_type") not in (None, "minicpmo"):
            raise ConfigError(f"model_type {d.get('model_type')!r} is not minicpmo")
        text = TextConfig.from_root(d)
        vision = VisionConfig.from_dict(d.get("vision_config")) if d.get("init_vision", True) else None
        audio = AudioConfig.from_dict(d.get("audio_config")) if d.get("init_audio", True) else None
        sc = d.get("slice_config")  # MiniCPMVSliceConfig: 9 slices when given without a count, 1 when absent
        slice_cfg = SliceConfig() if sc is None else SliceConfig(
            **config_fields(SliceConfig, sc, defaults={"max_slice_nums": 9}))
        cfg = cls(
            text=text, vision=vision, audio=audio,
            query_num=int(d.get("query_num", 64)),
            drop_vision_last_layer=bool(d.get("drop_vision_last_layer", True)),
            vision_batch_size=int(d.get("vision_batch_size", 16)),
            audio_pool_step=int(d.get("audio_pool_step", 5)),
            audio_chunk_length=float(d.get("audio_chunk_length", 1.0)),
            stream_input=bool(d.get("stream_input", False)),
            slice=slice_cfg,
            eos_token_id=d.get("eos_token_id"),
            converted=bool(d.get("omnitide_converted", False)),
            tts_config=dict(d.get("tts_config") or {}) if d.get("init_tts", True) else None,
        )
        if vision is not None:
            if text.hidden_size % 128:
                raise ConfigError(f"hidden_size {text.hidden_size} is not a multiple of 128: the resampler has "
                                  "hidden_size // 128 heads (the official code fails the same way)")
            if cfg.drop_vision_last_layer and vision.num_hidden_layers < 2:
                raise ConfigError("drop_vision_last_layer=true needs at least 2 vision layers")
        return cfg

    @property
    def resampler_heads(self) -> int:
        return self.text.hidden_size // 128

    @property
    def vision_layers_used(self) -> int:
        return self.vision.num_hidden_layers - (1 if self.drop_vision_last_layer else 0)
