"""Configuration of the Qwen2.5-Omni thinker (LLM + vision encoder + audio encoder).

Reads every config.json style the checkpoints come in: the released full model (``model_type`` "qwen2_5_omni",
the thinker under ``thinker_config``), a bare thinker ("qwen2_5_omni_thinker"), 4.x files (``rope_scaling`` +
``rope_theta``) and 5.x files (``rope_parameters``). The thinker-level ``tie_word_embeddings`` decides tying;
the text config's own flag is ignored, as in transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..loading import CheckpointError, config_fields


@dataclass
class TextConfig:
    vocab_size: int = 152064
    hidden_size: int = 3584
    intermediate_size: int = 18944
    num_hidden_layers: int = 28
    num_attention_heads: int = 28
    num_key_value_heads: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    mrope_section: list[int] = field(default_factory=lambda: [16, 24, 24])
    max_position_embeddings: int = 32768
    head_dim: int | None = None

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(f"text_config: {self.num_attention_heads} attention heads are not a multiple of "
                                  f"{self.num_key_value_heads} key/value heads")
        if sum(self.mrope_section) * 2 != self.head_dim:
            raise CheckpointError(f"text_config: mrope_section {self.mrope_section} must sum to head_dim / 2 = "
                                  f"{self.head_dim // 2}")

    @classmethod
    def from_dict(cls, d: dict) -> "TextConfig":
        kw = config_fields(cls, d)
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if "rope_theta" in rope:
            kw["rope_theta"] = rope["rope_theta"]
        if "mrope_section" in rope:
            kw["mrope_section"] = list(rope["mrope_section"])
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope"):
            raise CheckpointError(f"text_config: rope type {rope_type!r} is not supported (only default M-RoPE)")
        if d.get("use_sliding_window"):
            raise CheckpointError("text_config: use_sliding_window is not supported (released models have it off)")
        return cls(**kw)


@dataclass
class VisionConfig:
    depth: int = 32
    hidden_size: int = 1280
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112  # pixels
    out_hidden_size: int = 3584
    fullatt_block_indexes: list[int] = field(default_factory=lambda: [7, 15, 23, 31])
    rope_theta: float = 10000.0
    hidden_act: str = "silu"

    def __post_init__(self):
        if self.hidden_act != "silu":
            raise CheckpointError(f"vision_config: hidden_act {self.hidden_act!r} is not supported (silu only)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @classmethod
    def from_dict(cls, d: dict) -> "VisionConfig":
        kw = config_fields(cls, d, {"in_chans": "in_channels", "num_attention_heads": "num_heads",
                                    "num_hidden_layers": "depth"})
        if "hidden_size" not in d and "embed_dim" in d:
            kw["hidden_size"] = d["embed_dim"]
        rope = d.get("rope_parameters") or {}
        if "rope_theta" in rope:
            kw["rope_theta"] = rope["rope_theta"]
        kw["fullatt_block_indexes"] = list(kw.get("fullatt_block_indexes", [7, 15, 23, 31]))
        return cls(**kw)


@dataclass
class AudioConfig:
    num_mel_bins: int = 128
    encoder_layers: int = 32
    encoder_attention_heads: int = 20
    encoder_ffn_dim: int = 5120
    d_model: int = 1280
    n_window: int = 100
    max_source_positions: int = 1500
    output_dim: int = 3584
    activation_function: str = "gelu"
    scale_embedding: bool = False

    def __post_init__(self):
        if self.activation_function != "gelu":
            raise CheckpointError(f"audio_config: activation {self.activation_function!r} is not supported (gelu)")
        if self.scale_embedding:
            raise CheckpointError("audio_config: scale_embedding is not supported (released models have it off)")

    @classmethod
    def from_dict(cls, d: dict) -> "AudioConfig":
        return cls(**config_fields(cls, d))


@dataclass
class ModelConfig:
    """The thinker: its three sub-configs, the special token ids and TMRoPE's time scale."""

    text_config: TextConfig = field(default_factory=TextConfig)
    vision_config: VisionConfig = field(default_factory=VisionConfig)
    audio_config: AudioConfig = field(default_factory=AudioConfig)
    audio_token_id: int = 151646
    image_token_id: int = 151655
    video_token_id: int = 151656
    audio_start_token_id: int = 151647
    audio_end_token_id: int = 151648
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    position_id_per_seconds: int = 25
    seconds_per_chunk: int = 2
    user_token_id: int = 872
    tie_word_embeddings: bool = False
    model_type: str = "qwen2_5_omni"

    @classmethod
    def from_dict(cls, config: dict) -> "ModelConfig":
        """From a config.json dict: a full model (thinker under ``thinker_config``) or a bare thinker."""
        model_type = config.get("model_type", "qwen2_5_omni")
        thinker = config.get("thinker_config", config) if model_type == "qwen2_5_omni" else config
        for sub in ("text_config", "vision_config", "audio_config"):
            if not isinstance(thinker.get(sub), dict):
                raise CheckpointError(f"config.json: the thinker config has no {sub}")
        kw = config_fields(cls, thinker, {"audio_token_index": "audio_token_id", "image_token_index": "image_token_id",
                                          "video_token_index": "video_token_id"})
        for k in ("text_config", "vision_config", "audio_config"):
            kw.pop(k, None)
        kw["model_type"] = model_type
        return cls(text_config=TextConfig.from_dict(thinker["text_config"]),
                   vision_config=VisionConfig.from_dict(thinker["vision_config"]),
                   audio_config=AudioConfig.from_dict(thinker["audio_config"]), **kw)
