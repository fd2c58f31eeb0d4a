"""The Qwen2.5-Omni family record (models/family.py): shapes, profiles, chat framing and the folder's entry points.

Shapes are the released checkpoints' thinker ``text_config`` (Qwen2.5-7B / 3B LLMs), as written down with their
sources in ``shared/reference/qwen2_5_omni.md`` ("Sub-config defaults", "3B") and docs/models/qwen2_5_omni.md.
Watermarks: the best setting of the paper's figure 14 (7.4.1, StreamingBench accuracy): Qwen2.5-Omni-3B 68.1 % at
5000/3500 (62.8 % at the 2500/1800 default), Qwen2.5-Omni-7B 61.0 % at 8000/6000 (52.4 %).
No MLX import here: the functions import the folder's MLX code when called.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ...core.profiles import PICK_DEFAULTS, ChatFraming, ModelProfile
from ...core.shapes import ModelShape
from ..family import ModelFamily

NAME = "qwen2_5_omni"

# <|im_start|>system\n + the default Qwen system prompt (37 BPE tokens) + <|im_end|>\n, then <|im_start|>user\n
SYSTEM_TOKENS = 43

# layout.py's user unit closes the turn and opens the reply; finish_reply closes the reply (<|im_end|>\n) and the
# next unit reopens the user turn (<|im_start|>user\n): the reply owns both
FRAMING = ChatFraming(question_open=(), question_close=("<|im_end|>", "\n", "<|im_start|>", "assistant", "\n"),
                      reply_close=("<|im_end|>", "\n", "<|im_start|>", "user", "\n"),
                      turn_open=("<|im_start|>", "user", "\n"))

QWEN2_5_OMNI_7B = ModelShape(
    "qwen2.5-omni-7b", NAME, layers=28, hidden=3584, intermediate=18944, q_heads=28, kv_heads=4,
    head_dim=128, vocab=152064, rope_theta=1e6,
    source="Qwen/Qwen2.5-Omni-7B thinker text_config (= transformers' Qwen2_5OmniTextConfig defaults; a Qwen2.5-7B "
           "LLM): shared/reference/qwen2_5_omni.md, 'Sub-config defaults'")
QWEN2_5_OMNI_3B = ModelShape(
    "qwen2.5-omni-3b", NAME, layers=36, hidden=2048, intermediate=11008, q_heads=16, kv_heads=2,
    head_dim=128, vocab=151936, rope_theta=1e6,
    source="Qwen/Qwen2.5-Omni-3B thinker text_config (a Qwen2.5-3B LLM): shared/reference/qwen2_5_omni.md, '3B'")

PROFILES = (
    ModelProfile(name="qwen2.5-omni-7b", display="Qwen2.5-Omni-7B", rope_axes=3, shape=QWEN2_5_OMNI_7B,
                 framing=FRAMING, system_tokens=SYSTEM_TOKENS, high=8000, low=6000, pick=dict(PICK_DEFAULTS),
                 aliases=("qwen7b",), notes="Qwen2.5-7B LLM"),
    ModelProfile(name="qwen2.5-omni-3b", display="Qwen2.5-Omni-3B", rope_axes=3, shape=QWEN2_5_OMNI_3B,
                 framing=FRAMING, system_tokens=SYSTEM_TOKENS, high=5000, low=3500, pick=dict(PICK_DEFAULTS),
                 aliases=("qwen3b",), notes="Qwen2.5-3B LLM"),
)


def load(path: Path, config: dict, **kw):
    from . import load_model

    return load_model(Path(path), config, **kw)


def processor(path: Path):
    from .processor import Processor

    return Processor.from_pretrained(Path(path))


def stream_units(setting, **layout_kw):
    from .layout import stream_units as units

    return units(setting, **layout_kw)


def checkpoint_units(path: Path, config: dict, media, frame: bool = True, audio: bool = True):
    """The thinker's shape and its media unit at ``media``, from config.json and preprocessor_config.json."""
    from .config import ModelConfig
    from .layout import FRAME_MAX_PIXELS
    from .layout import stream_units as units
    from .processor import read_preprocessor_config

    cfg = ModelConfig.from_dict(config)
    t = cfg.text_config
    vision, _ = read_preprocessor_config(path)
    shape = ModelShape(str(path), NAME, layers=t.num_hidden_layers, hidden=t.hidden_size,
                       intermediate=t.intermediate_size, q_heads=t.num_attention_heads,
                       kv_heads=t.num_key_value_heads, head_dim=t.head_dim, vocab=t.vocab_size,
                       rope_theta=t.rope_theta, source=f"{path}/config.json")
    return shape, units(replace(media, max_pixels=media.max_pixels or FRAME_MAX_PIXELS), vision=vision,
                        position_id_per_seconds=cfg.position_id_per_seconds,
                        seconds_per_chunk=cfg.seconds_per_chunk, frame=frame, audio=audio)


def language_model(shape: ModelShape, layers: int, vocab: int):
    """The thinker's decoder at ``shape`` with ``layers`` layers and a ``vocab`` vocabulary (random weights)."""
    from .config import TextConfig
    from .language import LanguageModel

    cfg = TextConfig(vocab_size=vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                     num_hidden_layers=layers, num_attention_heads=shape.q_heads, num_key_value_heads=shape.kv_heads,
                     head_dim=shape.head_dim, rope_theta=shape.rope_theta)
    return LanguageModel(cfg, tie_word_embeddings=False), 3


def voicer(model, checkpoint):
    """The talker + token2wav + voices of the checkpoint (loaded on the first spoken reply)."""
    from .speech import load_speech

    return load_speech(checkpoint)


def convert_extra(src: Path, config: dict):
    """The talker, token2wav and voices of a full checkpoint, for ``omnitide convert`` (None: a thinker-only one)."""
    from .speech import has_speech, load_speech, save_speech

    if config.get("model_type") != "qwen2_5_omni" or not has_speech(src, config):
        return None
    speech = load_speech(src, config)

    def write(dst: Path) -> str:
        save_speech(speech, dst)  # float, MLX layout; spk_dict.pt becomes speech/speakers.safetensors
        return f"wrote the talker, token2wav and {len(speech.speakers)} voices to {Path(dst) / 'speech'}"

    return write


def write_tiny(dst: Path, speech: bool = False) -> Path:
    """A tiny random checkpoint in the released layout with the real Qwen2 tokenizer (tests/data/tokenizers);
    ``speech``: with a talker, token2wav and voices (seed 1: its talker speaks to a first question)."""
    from .tiny import make_tiny_checkpoint

    repo = Path(__file__).resolve().parents[3]
    tokenizers = repo / "tests" / "data" / "tokenizers" / "qwen2"
    if speech:
        return make_tiny_checkpoint(dst, tokenizer_dir=tokenizers, speech=True, seed=1)
    return make_tiny_checkpoint(dst, tokenizer_dir=tokenizers, vocab="real")


FAMILY = ModelFamily(
    name=NAME, display="Qwen2.5-Omni", framing=FRAMING, load=load, processor=processor,
    model_types=("qwen2_5_omni", "qwen2_5_omni_thinker"),
    hub_ids=("Qwen/Qwen2.5-Omni-7B", "Qwen/Qwen2.5-Omni-3B"),
    profiles=PROFILES, stream_units=stream_units, checkpoint_units=checkpoint_units,
    language_model=language_model, voicer=voicer, write_tiny=write_tiny, convert_extra=convert_extra,
    model_classes=("omnitide_mlx.models.qwen2_5_omni.model:Model", "omnitide_mlx.torch.qwen2_5_omni:TorchQwenOmni"))
