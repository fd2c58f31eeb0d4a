"""The llama-GGUF text family record (models/family.py): a text-only model (SmolLM2-135M-Instruct, the one real
model every machine has) registered like the omni ports: its chat framing and entry points. It has no media unit
(``stream_units`` None) and so no simulator profile; it loads from a GGUF file, not a config.json folder
(``model_types`` empty). No MLX import here: the functions import the folder's MLX code when called.
"""

from __future__ import annotations

from pathlib import Path

from ...core.profiles import ChatFraming
from ..family import ModelFamily

NAME = "llama_gguf"

# ChatML as adapter.py feeds it: a question closes the user turn and opens the assistant's; finish_reply closes the
# reply (<|im_end|>\n) and the next text unit reopens the user turn (<|im_start|>user\n). Tokens of SmolLM2's
# tokenizer, where "assistant" is two (ass, istant; tests/models/test_family.py checks them)
FRAMING = ChatFraming(question_open=(), question_close=("<|im_end|>", "\n", "<|im_start|>", "ass", "istant", "\n"),
                      reply_close=("<|im_end|>", "\n", "<|im_start|>", "user", "\n"),
                      turn_open=("<|im_start|>", "user", "\n"))


def load(path: Path, config: dict | None = None, **kw):
    from . import load_gguf

    return load_gguf(path, **kw)


def processor(path: Path):
    """The GGUF file's own tokenizer."""
    from .gguf_file import open_gguf, read_tokenizer_fields
    from .tokenizer import GGUFTokenizer

    return GGUFTokenizer(read_tokenizer_fields(open_gguf(path)))


def write_tiny(dst: Path) -> Path:
    """A tiny random llama GGUF (Q4_1 weights, a small trained BPE vocabulary with the ChatML markers)."""
    from .tiny import write_tiny_gguf

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    return write_tiny_gguf(dst / "tiny.gguf")


FAMILY = ModelFamily(
    name=NAME, display="Llama (GGUF, text)", framing=FRAMING, load=load, processor=processor,
    hub_ids=("HuggingFaceTB/SmolLM2-135M-Instruct",), write_tiny=write_tiny,
    model_classes=("omnitide_mlx.models.llama_gguf.model:Model",),
    notes="text streams only: transcripts, logs; the retention policies on real attention")
