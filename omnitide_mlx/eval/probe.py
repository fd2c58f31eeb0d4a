"""Measuring what a streaming session still knows, without changing it.

``session.probe_logits(ids)`` (engine.py) feeds a few tokens (a question and the start of its answer) at the end of
the session's retained history, through the session's own bounded cache, under the session's lock, reads the
next-token logits, and takes the tokens back out with an ordinary retention plan that drops them. The session's
history, cache contents and H2O scores are as before, so many questions can be asked of one stream state and none
of them steers later retention. ``question_ids`` / ``context_unit_ids`` here give the ids to probe with.

``RetentionRecorder`` wraps a policy and records, for every unit, which of its original tokens are still retained:
it tells whether a fact's answer token survived in the KV cache when the question comes.
"""

from __future__ import annotations

import numpy as np

from ..core.pick import RetentionPolicy
from ..core.retention_plan import RetentionPlan
from ..core.units import History


class RetentionRecorder(RetentionPolicy):
    """A policy that behaves exactly like ``policy`` and remembers each unit's retained original token indices.
    (A RetentionPolicy itself, so a session takes it where it takes a policy instance; everything reads through.)"""

    def __init__(self, policy: RetentionPolicy):  # no super().__init__: every setting is the wrapped policy's
        self.policy = policy
        self.kept: dict[int, np.ndarray] = {}  # uid -> original token indices still in the cache
        self.plans = 0

    def __getattr__(self, name):  # knobs of the wrapped policy (recent_units, sink, ...)
        if name == "policy":
            raise AttributeError(name)
        return getattr(self.policy, name)

    name = property(lambda self: self.policy.name)
    high = property(lambda self: self.policy.high)
    low = property(lambda self: self.policy.low)
    layout = property(lambda self: self.policy.layout)
    needs_scores = property(lambda self: self.policy.needs_scores)
    positions = property(lambda self: self.policy.positions)

    def keep_mask(self, history: History, scores=None) -> np.ndarray:
        return self.policy.keep_mask(history, scores)

    def config(self) -> dict:
        return self.policy.config()

    def plan(self, history: History, scores=None, pinned=()) -> RetentionPlan | None:
        for u in history:
            if u.uid not in self.kept:
                self.kept[u.uid] = np.arange(u.length)
        plan = self.policy.plan(history, scores=scores, pinned=pinned) if pinned else \
            self.policy.plan(history, scores=scores)
        if plan is not None and plan.tokens_after < plan.tokens_before:
            self.plans += 1
            for up in plan.units:
                self.kept[up.uid] = self.kept[up.uid][up.keep_mask()]
        return plan

    def retained(self, uid: int, index: int) -> bool:
        """Is token ``index`` (of the unit as it was pushed) of unit ``uid`` still in the cache?"""
        kept = self.kept.get(uid)
        return kept is not None and bool(np.isin(index, kept))


def question_ids(session, question: str, answer_prefix: str = "") -> list[int]:
    """The token ids a question unit would have now (the adapter's protocol state is left as it was), followed by
    the start of the answer."""
    ids = _unit_ids(session, session.adapter.user_unit, question)
    if answer_prefix:
        ids += list(session.adapter.encode(answer_prefix))
    return ids


def _unit_ids(session, make_unit, text: str) -> list[int]:
    """The token ids of ``make_unit(text, next position)``, with the adapter's protocol state restored after."""
    adapter = session.adapter
    meta, arrays = adapter.state()
    try:
        prepared = make_unit(text, session.history.next_position())
    finally:
        adapter.load_state(meta, arrays)
    return [int(i) for i in prepared.input_ids]


def context_unit_ids(session, text: str) -> list[int]:
    """The token ids ``session.push(text=text)`` would prefill now (the adapter's state is left as it was)."""
    return _unit_ids(session, session.adapter.context_unit, text)
