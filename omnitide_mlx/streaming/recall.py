"""Recall: evicted units go to a bounded store, and a question brings the best of them back for its answer.

Retention hands every unit it drops whole to the store (``_recall_capture``, called before the cache frees the
slots). A question (``ask`` or ``probe_logits``) is first prefilled once to read its queries at a few layers (then
freed, like a probe), the stored units older than every retained one are scored against them, and the best that
fit ``recall_tokens`` (and the KV budget, with the question and its reply) are readmitted right after the system
prefix, in stream order, under their own uids and serials (core/recall.py: ``readmit_history``), in the
selected-history class of OmniPage; the retained units move up to make room (their keys re-rotate by one shift).
The question and its answer then run on the normal attention path. When the reply closes, one retention plan drops
the recalled units (``_recall_release``): the shift rule moves everything after them back, OmniPage may migrate,
and the units stay in the store. Retention waits while recalled units are in place. The tensors are the backend's
(omnitide_mlx/recall.py for MLX); this module imports no array framework.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from ..core.page import AllocClass
from ..core.recall import pick_units, readmit_history, release_mask
from ..core.retention_plan import RetentionPlan, apply_plan, plan_from_mask
from ..core.units import History, Span, SpanKind, Unit, UnitKind
from ..errors import RestoreError
from .budget import parse_bytes

RECALL_LOG = 256  # answers whose recall records stats() keeps


def recall_budget(value) -> int | None:
    """``recall=`` (bytes, or a size string like ``"1GiB"``; None / 0: off) as a positive int, checked before
    anything loads."""
    if value is None or value is False:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"recall must be a size in bytes (an int, or a string such as '1GiB'), got {value!r}")
    n = parse_bytes(value) if isinstance(value, str) else int(value)
    if n <= 0:
        raise ValueError(f"recall must be a positive size, got {value!r}")
    return n


class Recall:
    """The store of evicted units and readmission at question time.

    A part of StreamingSession (engine.py), which holds the state these methods use."""

    def _check_recall(self, recall, recall_tokens, recall_bits) -> dict | None:
        """The recall options, checked before the model loads (None: off)."""
        budget = recall_budget(recall)
        if budget is None:
            if recall_tokens is not None:
                raise ValueError("recall_tokens sets how many stored tokens an answer brings back: set recall "
                                 "(the store's size) too")
            return None
        if recall_tokens is not None and (isinstance(recall_tokens, bool) or not isinstance(recall_tokens, int)
                                          or recall_tokens <= 0):
            raise ValueError(f"recall_tokens must be a positive int, got {recall_tokens!r}")
        if recall_bits not in (None, 4, 8):
            raise ValueError(f"recall_bits must be 8, 4 or None, got {recall_bits!r}")
        if getattr(self.backend, "make_recall_store", None) is None:
            raise ValueError(f"the {self.backend.name} backend has no recall store (recall is MLX's)")
        return {"budget": budget, "tokens": recall_tokens, "bits": recall_bits}

    def _init_recall(self, options: dict | None, saved_meta: dict | None = None, saved_path: Path | None = None):
        self._recalled: tuple[int, ...] = ()
        self._recall_open: dict | None = None
        self.recall_log: list[dict] = []
        self.recall = None
        self.recall_tokens = None
        if saved_meta is not None:
            file = saved_path / "recall.safetensors"
            try:
                self.recall = self.backend.load_recall_store(self.cache, file, saved_meta)
            except Exception as e:  # safetensors, MLX and RecallError say it differently
                raise RestoreError(f"{file} or the recall state in session.json cannot be read: {e}") from e
            self.recall_tokens = saved_meta.get("tokens")
            return
        if options is not None:
            self.recall = self.backend.make_recall_store(self.cache, options["budget"], options["bits"])
            self.recall_tokens = options["tokens"]

    def _recall_limit(self) -> int:
        """Tokens an answer may bring back: ``recall_tokens``, else the room between the watermarks (what the
        cache held before its last trim), at least a page."""
        if self.recall_tokens is not None:
            return int(self.recall_tokens)
        return max(self.policy.high - self.policy.low, self.cache.table.page_size)

    # --- storing (retention hands dropped units over) ------------------------------------------------------------
    def _recall_capture(self, plan: RetentionPlan) -> None:
        """Store the units ``plan`` drops whole (what they still hold) before the cache frees their slots."""
        if self.recall is None:
            return
        for uid in plan.dropped_uids():
            unit = self.history.unit(uid)
            if unit.kind is UnitKind.SYSTEM or uid in self._recalled or uid in self.recall.index:
                continue
            self.recall.capture(self.cache, unit, self.cache.slots_of_unit(uid))

    # --- recalling (before a question's prefill) -----------------------------------------------------------------
    def _recall_admit(self, embeds, positions: np.ndarray, reserve: int, label: str = "") -> int:
        """Readmit the stored units that score best against the question (``embeds`` at ``positions``, prefilled
        once here to read its queries); returns how far the question's positions move (the span they take)."""
        if self.recall is None or self._recalled:
            return 0
        cands = self.recall.index.candidates(self.history)
        record = {"question": label, "uids": [], "t": [], "tokens": 0, "candidates": len(cands)}
        self._recall_open = record
        if not cands:
            return 0
        n = int(positions.shape[1])
        t0 = time.perf_counter()
        self._make_room(n + reserve)
        queries = self._question_queries(embeds, positions)
        tq = time.perf_counter()
        scores = self.recall.score(queries, int(positions.min()), cands)
        tokens = np.array([e.tokens for e in cands])
        chosen = [cands[i] for i in pick_units(scores, tokens, self._recall_limit())]
        chosen = self._fit_budget(chosen, scores, cands, n + reserve)
        t1 = time.perf_counter()
        if not chosen:
            record.update(probe_ms=(tq - t0) * 1000, score_ms=(t1 - tq) * 1000)
            return 0
        re = readmit_history(self.history, [e.unit for e in chosen])
        rest = [self.cache.slots_of_unit(u.uid) for u in self.history.stream_units]
        rest = np.concatenate(rest) if rest else np.zeros(0, dtype=np.int64)
        self.cache.shift_keys(rest, re.shift)
        t2 = time.perf_counter()
        written = []
        try:
            for e, delta in zip(chosen, re.deltas):
                keys, values = self.recall.rows(e, delta)
                written.append(self.cache.readmit(e.uid, e.serials, keys, values, AllocClass.SELECTED_HISTORY))
        except BaseException:  # put the cache back as the history has it, then let the error through
            for slots in written:
                self.cache.table.free(slots)
                self.cache.storage.release(slots)
            self.cache.shift_keys(rest, -re.shift)
            raise
        self.history = re.history
        self._recalled = tuple(e.uid for e in chosen)
        t3 = time.perf_counter()
        by_uid = dict(zip((e.uid for e in cands), scores))
        record.update(uids=list(self._recalled), t=[e.unit.t for e in chosen], tokens=re.tokens,
                      scores=[float(by_uid[e.uid]) for e in chosen], shift=re.shift,
                      probe_ms=(tq - t0) * 1000, score_ms=(t1 - tq) * 1000, rerotate_ms=(t2 - t1) * 1000,
                      copy_ms=(t3 - t2) * 1000)
        self.counters.maintenance_ms += (t3 - t0) * 1000
        return re.shift

    def _question_queries(self, embeds, positions: np.ndarray) -> dict:
        """The question's queries at the store's scoring layers: one prefill whose slots are freed again and whose
        attention does not count for H2O (as ``probe_logits``)."""
        cache, history = self.cache, self.history
        n, uid = int(positions.shape[1]), history.next_uid()
        collect = cache.collect_scores
        cache.collect_scores = False
        cache.capture_queries, cache.captured = frozenset(self.recall.layers), {}
        try:
            cache.set_owner(uid)
            logits, _ = self.backend.forward(self.model, cache, embeds, positions)
            queries = dict(cache.captured)
            self.backend.eval(logits, *queries.values())
        finally:
            cache.collect_scores = collect
            cache.capture_queries, cache.captured = None, {}
        probe = Unit(uid=uid, kind=UnitKind.USER, spans=(Span(SpanKind.TEXT, 0, n),), positions=positions)
        with_probe = History(list(history) + [probe])
        keep = np.ones(with_probe.total_tokens, dtype=bool)
        keep[-n:] = False
        cache.evict(plan_from_mask(with_probe, keep, "probe"), with_probe)
        return queries

    def _fit_budget(self, chosen: list, scores: np.ndarray, cands: list, need: int) -> list:
        """Under a KV budget, the chosen units minus the lowest-scored until they and ``need`` more tokens (the
        question and its reply) fit below the ceiling (placement tried on a copy of the page table)."""
        if self._max_slots is None or not chosen:
            return chosen
        rank = {e.uid: s for e, s in zip(cands, scores)}
        chosen = sorted(chosen, key=lambda e: -rank[e.uid])
        while chosen:
            table = self.cache.table.copy()
            ok = True
            for e in chosen:
                if table.free_slots_for(AllocClass.SELECTED_HISTORY, self._max_slots) < e.tokens:
                    ok = False
                    break
                table.allocate(e.tokens, e.uid, AllocClass.SELECTED_HISTORY, serials=e.serials)
            if ok and table.free_slots_for(AllocClass.RECENT_CONTEXT, self._max_slots) >= need:
                break
            chosen.pop()
        return sorted(chosen, key=lambda e: e.uid)

    # --- releasing (when the answer closes) ----------------------------------------------------------------------
    def _recall_release(self) -> None:
        """Drop the recalled units from the cache and the history (one retention plan: the shift rule moves the
        rest back), let OmniPage migrate, and log the answer's recall record."""
        record, self._recall_open = self._recall_open, None
        if self._recalled:
            t0 = time.perf_counter()
            plan = plan_from_mask(self.history, release_mask(self.history, self._recalled), "recall")
            self.cache.evict(plan, self.history)
            self.history = apply_plan(self.history, plan)
            self._recalled = ()
            mplan = self.planner.plan(self.cache.page_table)
            if mplan.accepted:
                self.counters.migrations += 1
                self.counters.migrated_cells += self.cache.migrate(mplan)
            ms = (time.perf_counter() - t0) * 1000
            self.counters.maintenance_ms += ms
            if record is not None:
                record["release_ms"] = ms
        if record is not None:
            self.recall_log.append(record)
            del self.recall_log[:-RECALL_LOG]

    def last_recall(self) -> dict | None:
        """The recall record of the last answer (or probe): the recalled uids, their stream times ``t``, tokens,
        scores and the milliseconds spent on the question's query prefill (``probe_ms``), scoring, re-rotating the
        retained keys, copying the recalled K/V in and releasing them; None before any."""
        return self.recall_log[-1] if self.recall_log else None

    def _recall_stats(self) -> dict | None:
        if self.recall is None:
            return None
        return {**self.recall.stats(), "recall_tokens": self._recall_limit(), "answers": list(self.recall_log)}

    def _recall_meta(self, path: Path) -> dict | None:
        """Save the store next to the session (``recall.safetensors``); its JSON side for session.json."""
        if self.recall is None:
            return None
        meta = self.recall.save(path / "recall.safetensors")
        meta["tokens"] = self.recall_tokens
        return meta
