"""A reply's decode steps, one bounded step per call (an open reply is a ``_Reply``, never a suspended
generator): the question's prefill, sampling, stop tokens and stop strings, and the closing tokens that put
the reply into the history.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from ..core.page import AllocClass
from ..core.units import SpanKind, Unit, UnitKind
from ..models.base import spans_from_runs, text_positions
from .records import _Reply, REPLY_CLOSING_RESERVE


def _partial_stop(text: str, stop) -> int:
    """Length of the longest end of ``text`` that begins a stop string: held back until the next token says
    whether the stop string follows, so a stop string is never printed in part."""
    longest = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


def _stop_index(text: str, stop) -> int | None:
    hits = [text.find(s) for s in stop if s and s in text]
    return min(hits) if hits else None


class Replies:
    """A reply's decode steps, one per call, with no state in a suspended generator.

    A part of StreamingSession (engine.py), which holds the state these methods use."""

    def _begin_reply(self, r: _Reply) -> None:
        """Prefill the question as a unit and open the reply (its tokens will belong to the next uid)."""
        start = self.history.next_position()
        prepared = (self.adapter.user_unit(r.question, start) if r.question is not None
                    else self.adapter.turn_unit(start))
        self._capture_hidden = r.on_forward is not None
        reserve = r.sampling.max_tokens + REPLY_CLOSING_RESERVE if self._max_slots is not None else 0
        if self.recall is not None:  # stored units the question needs come back first (streaming/recall.py)
            self._check_size(prepared, reserve, question=True)
            shift = self._recall_admit(prepared.inputs_embeds, prepared.positions, reserve, r.question[:40])
            if shift:
                prepared = dataclasses.replace(prepared, positions=prepared.positions + shift)
        try:
            self._unit(prepared, reserve=reserve, question=True)
        except BaseException:
            self._recall_release()
            raise
        if r.on_forward is not None:
            r.on_forward(prepared.input_ids, prepared.inputs_embeds, self._captured_hidden())
        r.logits = self._last_logits
        r.sample = self.backend.sampler(r.sampling)
        r.uid = self.history.next_uid()
        r.start = self.history.next_position()
        self.cache.set_owner(r.uid, AllocClass.RECENT_CONTEXT)
        self._open = r

    def _reply_step(self, r: _Reply) -> str:
        """Decode one token of the open reply; returns the new text (possibly empty). Ends the reply at a stop token,
        a stop string or ``max_tokens``; the text still held back (an incomplete character) comes with the end."""
        if len(r.generated) >= r.sampling.max_tokens:
            return self._finish_reply(r)
        t0 = time.perf_counter()
        try:
            token = r.sample(r.logits, r.generated)
            if token in self.adapter.stop_token_ids:
                r.stopped = True
                return self._finish_reply(r)
            r.generated.append(token)
            axes = self.adapter.kv_spec.position_axes
            embeds = self.adapter.embed_tokens([token])
            r.logits = self._forward(embeds, text_positions(r.start + len(r.generated) - 1, 1, axes))
            if r.on_forward is not None:
                r.on_forward(np.asarray([token]), embeds, self._captured_hidden())
        finally:
            self.counters.decode_ms += (time.perf_counter() - t0) * 1000
        text = self.adapter.decode(r.generated)
        cut = _stop_index(text, r.sampling.stop)
        if cut is not None:
            r.stopped = True
            return self._finish_reply(r)
        return self._emit(r, text[:len(text) - _partial_stop(text, r.sampling.stop)])

    def _emit(self, r: _Reply, text: str) -> str:
        if text.endswith("\ufffd") or len(text) <= len(r.emitted):
            return ""
        piece, r.emitted = text[len(r.emitted):], text
        return piece

    def _finish_reply(self, r: _Reply) -> str:
        """Close the reply: the adapter's closing tokens, the reply unit into the history, retention. Returns the
        text not yet emitted. Called at the reply's end, by a new question, or for an abandoned reply."""
        if r.done:
            return ""
        r.done = True
        self._capture_hidden = False
        if self._open is r:
            self._open = None
        t0 = time.perf_counter()
        axes = self.adapter.kv_spec.position_axes
        fed = len(r.generated)
        self.counters.decoded_tokens += fed
        closing = list(self.adapter.finish_reply(r.generated, r.stopped))
        logits = r.logits
        if closing:
            logits = self._forward(self.adapter.embed_tokens(closing), text_positions(r.start + fed, len(closing), axes))
        self.backend.eval(logits)
        self._last_logits = logits
        self.counters.decode_ms += (time.perf_counter() - t0) * 1000
        if fed + len(closing):
            spans = spans_from_runs([(SpanKind.RESPONSE, fed), (SpanKind.BOUNDARY, len(closing))])
            self.history.append(Unit(uid=r.uid, kind=UnitKind.REPLY, spans=tuple(spans),
                                     positions=text_positions(r.start, fed + len(closing), axes),
                                     label=(r.question or "(spoken)")[:40]))
            self.counters.units += 1
        self._recall_release()  # recalled units leave before retention runs again
        if fed + len(closing):
            self._maintain()
        text = self.adapter.decode(r.generated)
        cut = _stop_index(text, r.sampling.stop)
        if cut is not None:
            text = text[:cut]
        return self._emit(r, text)
