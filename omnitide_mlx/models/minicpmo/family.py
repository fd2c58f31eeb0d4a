"""The MiniCPM-o family record (models/family.py): shapes, profiles, chat framing and the folder's entry points.

Shapes are the released ``config.json`` figures: MiniCPM-o 4.5 (a Qwen3-8B LLM, ``shared/reference/minicpm_o_4_5.md``
1.2 "Sizes") and MiniCPM-o 2.6 (a Qwen2.5-7B LLM; no port, a simulator profile with 4.5's units and 2-frame audio
pooling). Watermarks: the paper's figure 14 measures MiniCPM-o 4.5 best at its 2500/1800 default (75.0 %); 2.6 was
not measured (the default). No MLX import here: the functions import the folder's MLX code when called.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from ...core.profiles import PICK_DEFAULTS, ChatFraming, ModelProfile
from ...core.shapes import ModelShape
from ..family import ModelFamily

NAME = "minicpmo"

# <|im_start|>system\nYou are a helpful assistant.\n<|im_end|>\n (12) + <|im_start|>user\n (3)
SYSTEM_TOKENS = 15

# the duplex unit protocol the simulator models (shared/reference/minicpm_o_4_5.md, streaming_prefill /
# streaming_generate): a question is a text unit, <unit> text </unit>, and the reply's unit opens with
# <unit><|speak|>, fed with the question; the reply ends the turn (<|turn_eos|>) and its unit (</unit>).
# turn_open: the simplex adapter's <|im_start|>user\n in front of the first media unit of a turn (adapter.py).
FRAMING = ChatFraming(question_open=("<unit>",), question_close=("</unit>", "<unit>", "<|speak|>"),
                      reply_close=("<|turn_eos|>", "</unit>"), turn_open=("<|im_start|>", "user", "\n"))

MINICPM_O_4_5 = ModelShape(
    "minicpm-o-4.5", NAME, layers=36, hidden=4096, intermediate=12288, q_heads=32, kv_heads=8, head_dim=128,
    vocab=151748, rope_theta=1e6,
    source="openbmb/MiniCPM-o-4_5 config.json (a Qwen3-8B LLM): shared/reference/minicpm_o_4_5.md, 1.2 'Sizes'")
MINICPM_O_2_6 = ModelShape(
    "minicpm-o-2.6", NAME, layers=28, hidden=3584, intermediate=18944, q_heads=28, kv_heads=4, head_dim=128,
    vocab=151700, rope_theta=1e6,
    source="openbmb/MiniCPM-o-2_6 config.json (a Qwen2.5-7B LLM; no port, simulator profile only)")

PROFILES = (
    ModelProfile(name="minicpm-o-4.5", display="MiniCPM-o 4.5", rope_axes=1, shape=MINICPM_O_4_5, framing=FRAMING,
                 system_tokens=SYSTEM_TOKENS, pick=dict(PICK_DEFAULTS), layout_kw={"audio_pool_step": 5},
                 aliases=("minicpm-o-4_5", "minicpmo45"),
                 notes="Qwen3-8B LLM; SigLIP + resampler (64 tokens per image or slice); Whisper + 5-frame pooling"),
    ModelProfile(name="minicpm-o-2.6", display="MiniCPM-o 2.6", rope_axes=1, shape=MINICPM_O_2_6, framing=FRAMING,
                 system_tokens=SYSTEM_TOKENS, pick=dict(PICK_DEFAULTS), layout_kw={"audio_pool_step": 2},
                 aliases=("minicpm-o-2_6", "minicpmo26"),
                 notes="Qwen2.5-7B LLM; 2-frame audio pooling (25 tokens a second); units as 4.5's (no 2.6 port)"),
)


def load(path: Path, config: dict, **kw):
    from . import load_model

    return load_model(Path(path), config, **kw)


def processor(path: Path):
    from .processor import MiniCPMOProcessor

    return MiniCPMOProcessor.from_pretrained(Path(path))


def stream_units(setting, **layout_kw):
    from .layout import stream_units as units

    return units(setting, **layout_kw)


def checkpoint_units(path: Path, config: dict, media, frame: bool = True, audio: bool = True):
    """The LLM's shape and the media unit at ``media``, from config.json and preprocessor_config.json."""
    from .config import ModelConfig
    from .layout import SCALE_RESOLUTION, STREAMING_MAX_SLICE_NUMS
    from .layout import stream_units as units

    cfg = ModelConfig.from_dict(config)
    t = cfg.text
    pre = Path(path) / "preprocessor_config.json"
    scale = json.loads(pre.read_text(encoding="utf-8")).get("scale_resolution", SCALE_RESOLUTION) \
        if pre.is_file() else SCALE_RESOLUTION
    shape = ModelShape(str(path), NAME, layers=t.num_hidden_layers, hidden=t.hidden_size,
                       intermediate=t.intermediate_size, q_heads=t.num_attention_heads,
                       kv_heads=t.num_key_value_heads, head_dim=t.head_dim, vocab=t.vocab_size,
                       rope_theta=t.rope_theta, source=f"{path}/config.json")
    return shape, units(replace(media, max_slice_nums=media.max_slice_nums or STREAMING_MAX_SLICE_NUMS),
                        query_num=cfg.query_num, audio_pool_step=cfg.audio_pool_step, scale_resolution=int(scale),
                        frame=frame, audio=audio)


def language_model(shape: ModelShape, layers: int, vocab: int):
    """The Qwen3 LLM at ``shape`` with ``layers`` layers and a ``vocab`` vocabulary (random weights)."""
    from .config import TextConfig
    from .language import LanguageModel

    cfg = TextConfig(hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_hidden_layers=layers,
                     num_attention_heads=shape.q_heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
                     vocab_size=vocab, rope_theta=shape.rope_theta)
    return LanguageModel(cfg), 1


def voicer(model, checkpoint):
    """The TTS (loaded with the model) + StepAudio2 token2wav + voices (loaded on the first spoken reply)."""
    from .speech import load_minicpm_speech

    return load_minicpm_speech(model, checkpoint)


def write_tiny(dst: Path, speech: bool = False) -> Path:
    """A tiny random checkpoint in the released layout with the real tokenizer (tests/data/tokenizers);
    ``speech``: with its TTS and assets/token2wav."""
    from .tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(dst, tts=True, seed=3) if speech else make_tiny_checkpoint(dst)


FAMILY = ModelFamily(
    name=NAME, display="MiniCPM-o", framing=FRAMING, load=load, processor=processor, model_types=("minicpmo",),
    hub_ids=("openbmb/MiniCPM-o-4_5",), profiles=PROFILES, stream_units=stream_units,
    checkpoint_units=checkpoint_units, language_model=language_model, voicer=voicer, write_tiny=write_tiny,
    model_classes=("omnitide_mlx.models.minicpmo.model:Model",))
