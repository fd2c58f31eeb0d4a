"""Text units in ChatML for a text-only model: a transcript or a log streamed a segment at a time.

Layouts (``[S]`` system, ``[B]`` boundary, ``[T]`` text)::

    system   [S] <|im_start|>system\\n{prompt}<|im_end|>\\n
    context  [B] (<|im_start|>user\\n) [B] [tag] [T] text [B] \\n
    user     [B] (<|im_start|>user\\n) [T] question [B] <|im_end|>\\n<|im_start|>assistant\\n
    reply    generated text; finish_reply closes it with <|im_end|>\\n

A context unit is one stream segment inside an open user turn, like a media unit of an omni model. Its leading
bracketed tag (a time stamp or a speaker: ``[08:14]``, ``[alice]``) and the newline that ends it are its boundary
tokens, the structural markers OmniPick keeps from older units; the rest is text under OmniPick's text budget.
A question closes the turn and opens the assistant's. Positions are ``start + arange(T)`` (1-D RoPE).
"""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np

from ...core.units import SpanKind, UnitKind
from ..base import MediaError, PreparedUnit, StreamAdapter, spans_from_runs, text_positions

GENERIC_SYSTEM_PROMPT = "You are a helpful assistant."
UNIT_TAG = re.compile(r"^\[[^\]\n]{1,40}\]")


def template_system_prompt(chat_template: str | None) -> str:
    """The default system prompt a ChatML template inserts (SmolLM2's names itself), else a generic one."""
    if chat_template:
        m = re.search(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", chat_template, re.S)
        if m and "{" not in m.group(1):
            return m.group(1)
    return GENERIC_SYSTEM_PROMPT


class TextStreamAdapter(StreamAdapter):
    def __init__(self, model, tokenizer):
        from .gguf_file import GGUFError

        self.model = model
        self.tokenizer = tokenizer
        self.kv_spec = model.kv_spec()
        try:
            self.im_start, self.im_end = tokenizer.token_id("<|im_start|>"), tokenizer.token_id("<|im_end|>")
        except GGUFError as e:
            raise GGUFError(f"this tokenizer has no ChatML markers: {e}") from None
        self.newline = tokenizer.encode("\n")
        self.user_open = [self.im_start] + tokenizer.encode("user\n")
        self.turn_close = [self.im_end] + self.newline + [self.im_start] + tokenizer.encode("assistant\n")
        stops = {self.im_end}
        if tokenizer.eos_id is not None:
            stops.add(tokenizer.eos_id)
        self.stop_token_ids = frozenset(stops)
        self.default_system_prompt = template_system_prompt(tokenizer.chat_template)
        self.turn_open = False

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def embed_tokens(self, ids) -> mx.array:
        return self.model.language_model.embed_tokens(mx.array(np.asarray(ids, dtype=np.int32).reshape(-1)))

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _unit(self, kind: UnitKind, runs: list[tuple[SpanKind, list[int]]], start: int, label: str) -> PreparedUnit:
        ids = [i for _, part in runs for i in part]
        return PreparedUnit(kind=kind, input_ids=np.asarray(ids, dtype=np.int32), inputs_embeds=self.embed_tokens(ids),
                            spans=spans_from_runs([(k, len(p)) for k, p in runs]),
                            positions=text_positions(start, len(ids), 1), label=label)

    def system_unit(self, prompt: str | None, start: int) -> PreparedUnit:
        prompt = self.default_system_prompt if prompt is None else prompt
        ids = [self.im_start] + self.encode(f"system\n{prompt}") + [self.im_end] + self.newline
        self.turn_open = False
        return self._unit(UnitKind.SYSTEM, [(SpanKind.SYSTEM, ids)], start, "system")

    def context_unit(self, text: str, start: int) -> PreparedUnit:
        if not isinstance(text, str) or not text.strip():
            raise MediaError("a text unit needs non-empty text")
        runs: list[tuple[SpanKind, list[int]]] = []
        if not self.turn_open:
            runs.append((SpanKind.BOUNDARY, self.user_open))
        m = UNIT_TAG.match(text)
        if m:
            runs.append((SpanKind.BOUNDARY, self.encode(m.group(0))))
            text = text[m.end():]
        if text.strip():
            runs.append((SpanKind.TEXT, self.encode(text.rstrip("\n"))))
        runs.append((SpanKind.BOUNDARY, self.newline))
        unit = self._unit(UnitKind.USER, runs, start, (m.group(0) if m else text)[:40])
        self.turn_open = True
        return unit

    def user_unit(self, text: str, start: int) -> PreparedUnit:
        if not isinstance(text, str) or not text.strip():
            raise MediaError("a question needs non-empty text")
        runs: list[tuple[SpanKind, list[int]]] = []
        if not self.turn_open:
            runs.append((SpanKind.BOUNDARY, self.user_open))
        runs += [(SpanKind.TEXT, self.encode(text)), (SpanKind.BOUNDARY, self.turn_close)]
        unit = self._unit(UnitKind.USER, runs, start, text[:40])
        self.turn_open = False
        return unit

    def media_unit(self, frame, audio, t, start: int) -> PreparedUnit:
        raise MediaError("this is a text-only model: push text (a transcript or log segment), not frames or audio")

    def finish_reply(self, generated: list[int], stopped: bool) -> list[int]:
        self.turn_open = False
        return [self.im_end] + self.newline

    def state(self) -> tuple[dict, dict]:
        return {"turn_open": self.turn_open}, {}

    def load_state(self, meta: dict, arrays: dict) -> None:
        self.turn_open = bool(meta.get("turn_open", False))
