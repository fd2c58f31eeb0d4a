"""Configuration of the Qwen3-Omni thinker (MoE LLM + vision encoder + AuT audio encoder).

Reads the released ``config.json`` of ``Qwen/Qwen3-Omni-30B-A3B-Instruct`` (and its -Thinking / -Captioner
siblings): ``model_type`` "qwen3_omni_moe" with the thinker under ``thinker_config``, or a bare thinker
("qwen3_omni_moe_thinker"). Rope settings come as 4.x ``rope_scaling`` + ``rope_theta`` (the released files) or 5.x
``rope_parameters``. numpy-free and MLX-free: the tiny checkpoint writer and the docs read it too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..loading import CheckpointError, config_fields


@dataclass
class TextConfig:
    vocab_size: int = 152064
    hidden_size: int = 2048
    intermediate_size: int = 768  # the dense MLP of mlp_only_layers / non-sparse layers
    moe_intermediate_size: int = 768
    num_hidden_layers: int = 48
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int | None = 128
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    mrope_section: list[int] = field(default_factory=lambda: [24, 20, 20])
    mrope_interleaved: bool = True
    attention_bias: bool = False
    max_position_embeddings: int = 65536
    hidden_act: str = "silu"

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
        if self.hidden_act != "silu":
            raise CheckpointError(f"text_config: hidden_act {self.hidden_act!r} is not supported (silu only)")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise CheckpointError(f"text_config: num_experts_per_tok {self.num_experts_per_tok} is not in "
                                  f"1..{self.num_experts}")
        if self.decoder_sparse_step < 1:
            raise CheckpointError(f"text_config: decoder_sparse_step must be >= 1, not {self.decoder_sparse_step}")

    def is_sparse(self, layer: int) -> bool:
        """transformers' rule: a layer is MoE unless listed in mlp_only_layers, when experts exist and
        ``(layer + 1) % decoder_sparse_step == 0``."""
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_dict(cls, d: dict) -> "TextConfig":
        kw = config_fields(cls, d)
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if "rope_theta" in rope:
            kw["rope_theta"] = rope["rope_theta"]
        if "mrope_section" in rope:
            kw["mrope_section"] = list(rope["mrope_section"])
        # the released file says both "interleaved" and "mrope_interleaved"; transformers 5.24 interleaves
        # whatever they say (its rotary embedding has no other layout), so a False here is refused, not ignored
        for key in ("mrope_interleaved", "interleaved"):
            if key in rope and not rope[key]:
                raise CheckpointError(f"text_config: rope {key}=False (sectioned M-RoPE) is not what Qwen3-Omni "
                                      "releases and is not supported")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope"):
            raise CheckpointError(f"text_config: rope type {rope_type!r} is not supported (only default M-RoPE)")
        if d.get("use_sliding_window") or d.get("sliding_window"):
            raise CheckpointError("text_config: sliding-window attention is not supported (released models have "
                                  "none)")
        if d.get("shared_expert_intermediate_size"):
            raise CheckpointError("text_config: a shared expert is not supported (the released thinker has none)")
        kw["mlp_only_layers"] = list(kw.get("mlp_only_layers") or [])
        return cls(**kw)


@dataclass
class VisionConfig:
    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 2048
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: list[int] = field(default_factory=lambda: [8, 16, 24])
    rope_theta: float = 10000.0
    hidden_act: str = "gelu_pytorch_tanh"

    def __post_init__(self):
        if self.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
            raise CheckpointError(f"vision_config: hidden_act {self.hidden_act!r} is not supported")
        side = int(self.num_position_embeddings ** 0.5)
        if side * side != self.num_position_embeddings:
            raise CheckpointError(f"vision_config: num_position_embeddings {self.num_position_embeddings} is not a "
                                  "square")
        bad = [i for i in self.deepstack_visual_indexes if not 0 <= i < self.depth]
        if bad:
            raise CheckpointError(f"vision_config: deepstack_visual_indexes {bad} are outside 0..{self.depth - 1}")

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
        rope = d.get("rope_parameters") or {}
        if "rope_theta" in rope:
            kw["rope_theta"] = rope["rope_theta"]
        kw["deepstack_visual_indexes"] = list(kw.get("deepstack_visual_indexes", [8, 16, 24]))
        return cls(**kw)


@dataclass
class AudioConfig:
    num_mel_bins: int = 128
    encoder_layers: int = 32
    encoder_attention_heads: int = 20
    encoder_ffn_dim: int = 5120
    d_model: int = 1280
    n_window: int = 50
    n_window_infer: int = 800
    conv_chunksize: int = 500
    downsample_hidden_size: int = 480
    max_source_positions: int = 1500
    output_dim: int = 2048
    activation_function: str = "gelu"
    scale_embedding: bool = False

    def __post_init__(self):
        if self.activation_function != "gelu":
            raise CheckpointError(f"audio_config: activation {self.activation_function!r} is not supported (gelu)")
        if self.scale_embedding:
            raise CheckpointError("audio_config: scale_embedding is not supported (released models have it off)")
        if self.n_window_infer % (2 * self.n_window):
            raise CheckpointError(f"audio_config: n_window_infer {self.n_window_infer} is not a multiple of "
                                  f"2 * n_window = {2 * self.n_window}")

    @property
    def conv_out_features(self) -> int:
        f = self.num_mel_bins
        for _ in range(3):
            f = (f + 1) // 2
        return self.downsample_hidden_size * f

    @classmethod
    def from_dict(cls, d: dict) -> "AudioConfig":
        return cls(**config_fields(cls, d))


@dataclass
class ModelConfig:
    """The thinker: its three sub-configs, the special token ids and the M-RoPE time scale."""

    text_config: TextConfig = field(default_factory=TextConfig)
    vision_config: VisionConfig = field(default_factory=VisionConfig)
    audio_config: AudioConfig = field(default_factory=AudioConfig)
    audio_token_id: int = 151675
    image_token_id: int = 151655
    video_token_id: int = 151656
    audio_start_token_id: int = 151669
    audio_end_token_id: int = 151670
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    position_id_per_seconds: int = 13
    seconds_per_chunk: int = 2
    user_token_id: int = 872
    tie_word_embeddings: bool = False
    model_type: str = "qwen3_omni_moe"

    @classmethod
    def from_dict(cls, config: dict) -> "ModelConfig":
        """From a config.json dict: a full model (thinker under ``thinker_config``) or a bare thinker."""
        model_type = config.get("model_type", "qwen3_omni_moe")
        if model_type not in ("qwen3_omni_moe", "qwen3_omni_moe_thinker"):
            raise CheckpointError(f"config.json: model_type {model_type!r} is not Qwen3-Omni")
        thinker = config.get("thinker_config", config) if model_type == "qwen3_omni_moe" else config
        if not isinstance(thinker, dict):
            raise CheckpointError("config.json: thinker_config is not an object")
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


def released_thinker_config() -> dict:
    """The ``thinker_config`` of ``Qwen/Qwen3-Omni-30B-A3B-Instruct``'s config.json (the sizes that matter for shape
    and memory figures; the -Thinking and -Captioner thinkers share them). For sizing without weights."""
    return {
        "model_type": "qwen3_omni_moe_thinker", "audio_token_id": 151675, "image_token_id": 151655,
        "video_token_id": 151656, "audio_start_token_id": 151669, "audio_end_token_id": 151670,
        "vision_start_token_id": 151652, "vision_end_token_id": 151653, "position_id_per_seconds": 13,
        "seconds_per_chunk": 2, "user_token_id": 872,
        "text_config": {"vocab_size": 152064, "hidden_size": 2048, "intermediate_size": 768,
                        "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
                        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                        "rms_norm_eps": 1e-6, "rope_theta": 1000000,
                        "rope_scaling": {"interleaved": True, "mrope_interleaved": True,
                                         "mrope_section": [24, 20, 20], "rope_type": "default"},
                        "max_position_embeddings": 65536, "tie_word_embeddings": False},
        "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                          "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2,
                          "out_hidden_size": 2048, "num_position_embeddings": 2304,
                          "deepstack_visual_indexes": [8, 16, 24], "hidden_act": "gelu_pytorch_tanh"},
        "audio_config": {"num_mel_bins": 128, "encoder_layers": 32, "encoder_attention_heads": 20,
                         "encoder_ffn_dim": 5120, "d_model": 1280, "n_window": 50, "n_window_infer": 800,
                         "conv_chunksize": 500, "downsample_hidden_size": 480, "max_source_positions": 1500,
                         "output_dim": 2048},
    }
