"""The Qwen3-Omni family record (models/family.py): shape, profile, chat framing and the folder's entry points.

The shape is the released thinker's ``text_config`` (``Qwen/Qwen3-Omni-30B-A3B-Instruct``; the -Thinking and
-Captioner thinkers share it), written down in ``config.released_thinker_config`` and docs/models/qwen3_omni.md.
``intermediate`` is one expert's width (``moe_intermediate_size`` 768; 8 of 128 experts run per token).
Watermarks: the engine's 2500/1800 default; the paper has no figure for this model and none was measured here
(docs/models/qwen3_omni.md, "The family record").
No MLX import here: the functions import the folder's MLX code when called.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ...core.profiles import PICK_DEFAULTS, ChatFraming, ModelProfile
from ...core.shapes import ModelShape
from ..family import ModelFamily

NAME = "qwen3_omni"

# the released chat template has no default system prompt: <|im_start|>system\n<|im_end|>\n, then the
# <|im_start|>user\n that opens the first user turn
SYSTEM_TOKENS = 8

# ChatML as Qwen2.5-Omni's: the user unit closes the turn and opens the reply; finish_reply closes the reply
# (<|im_end|>\n) and the next unit reopens the user turn (<|im_start|>user\n): the reply owns both
FRAMING = ChatFraming(question_open=(), question_close=("<|im_end|>", "\n", "<|im_start|>", "assistant", "\n"),
                      reply_close=("<|im_end|>", "\n", "<|im_start|>", "user", "\n"),
                      turn_open=("<|im_start|>", "user", "\n"))

QWEN3_OMNI_30B_A3B = ModelShape(
    "qwen3-omni-30b-a3b", NAME, layers=48, hidden=2048, intermediate=768, q_heads=32, kv_heads=4, head_dim=128,
    vocab=152064, rope_theta=1e6,
    source="Qwen/Qwen3-Omni-30B-A3B-Instruct config.json thinker_config.text_config (128 experts, 8 active, "
           "moe_intermediate_size 768): omnitide_mlx/models/qwen3_omni/config.py released_thinker_config, "
           "docs/models/qwen3_omni.md")

PROFILES = (
    ModelProfile(name="qwen3-omni-30b-a3b", display="Qwen3-Omni-30B-A3B", rope_axes=3, shape=QWEN3_OMNI_30B_A3B,
                 framing=FRAMING, system_tokens=SYSTEM_TOKENS, pick=dict(PICK_DEFAULTS),
                 aliases=("qwen3-omni", "qwen3omni"), notes="Qwen3-30B-A3B MoE LLM (thinker)"),
)


def load(path: Path, config: dict, **kw):
    from . import load_model

    return load_model(Path(path), config, **kw)


def processor(path: Path):
    from .processor import Processor

    return Processor.from_pretrained(Path(path))


def stream_units(setting, **layout_kw):
    from .adapter import stream_units as units

    return units(setting, **layout_kw)


def checkpoint_units(path: Path, config: dict, media, frame: bool = True, audio: bool = True):
    """The thinker's shape and its media unit at ``media``, from config.json and preprocessor_config.json."""
    from .adapter import FRAME_MAX_PIXELS
    from .adapter import stream_units as units
    from .config import ModelConfig
    from .processor import vision_settings

    cfg = ModelConfig.from_dict(config)
    t = cfg.text_config
    vision, _ = vision_settings(Path(path))
    shape = ModelShape(str(path), NAME, layers=t.num_hidden_layers, hidden=t.hidden_size,
                       intermediate=t.moe_intermediate_size if t.num_experts else t.intermediate_size,
                       q_heads=t.num_attention_heads, kv_heads=t.num_key_value_heads, head_dim=t.head_dim,
                       vocab=t.vocab_size, rope_theta=t.rope_theta, source=f"{path}/config.json")
    return shape, units(replace(media, max_pixels=media.max_pixels or FRAME_MAX_PIXELS), patch=vision.patch_size,
                        merge=vision.merge_size, n_window=cfg.audio_config.n_window, frame=frame, audio=audio)


def language_model(shape: ModelShape, layers: int, vocab: int):
    """The thinker's MoE decoder at ``shape`` (the released 128 experts, 8 active, ``shape.intermediate`` wide)
    with ``layers`` layers and a ``vocab`` vocabulary (random weights)."""
    from .config import TextConfig
    from .language import LanguageModel

    cfg = TextConfig(vocab_size=vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                     moe_intermediate_size=shape.intermediate, num_hidden_layers=layers,
                     num_attention_heads=shape.q_heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
                     rope_theta=shape.rope_theta)
    return LanguageModel(cfg), 3


def voicer(model, checkpoint):
    """The talker, code predictor and Code2Wav of the checkpoint (-Thinking has none: ``load_speech`` says so)."""
    from ..loading import load_config
    from .speech import load_speech

    return load_speech(Path(checkpoint), load_config(Path(checkpoint)))


def convert_extra(src: Path, config: dict):
    """The talker, code predictor and Code2Wav of a full checkpoint for ``omnitide convert``, copied in float under
    ``speech/`` (None: a -Thinking or bare-thinker checkpoint has none). Loaded first, so a broken part fails
    before any weight is written."""
    from .speech import load_speech, save_speech

    if not isinstance(config.get("talker_config"), dict):
        return None
    load_speech(Path(src), config)

    def write(dst: Path) -> str:
        return f"wrote the talker, code predictor and Code2Wav (float) to {save_speech(Path(src), Path(dst))}"

    return write


def write_tiny(dst: Path, speech: bool = False) -> Path:
    """A tiny random checkpoint in the released layout with the real Qwen2 BPE tokenizer and Qwen3-Omni's special
    tokens (tests/data/tokenizers/qwen2); ``speech``: with a tiny talker, code predictor and Code2Wav (the -Instruct
    layout), else the -Thinking layout."""
    from .tiny import make_tiny_checkpoint

    repo = Path(__file__).resolve().parents[3]
    return make_tiny_checkpoint(dst, tokenizer_dir=repo / "tests" / "data" / "tokenizers" / "qwen2", speech=speech,
                                vocab="real")


FAMILY = ModelFamily(
    name=NAME, display="Qwen3-Omni", framing=FRAMING, load=load, processor=processor,
    model_types=("qwen3_omni_moe", "qwen3_omni_moe_thinker"),
    hub_ids=("Qwen/Qwen3-Omni-30B-A3B-Instruct", "Qwen/Qwen3-Omni-30B-A3B-Thinking",
             "Qwen/Qwen3-Omni-30B-A3B-Captioner"),
    profiles=PROFILES, stream_units=stream_units, checkpoint_units=checkpoint_units,
    language_model=language_model, voicer=voicer, write_tiny=write_tiny, convert_extra=convert_extra,
    model_classes=("omnitide_mlx.models.qwen3_omni.model:Model",))
