"""One unit's prefill and the retention step after it: the size check (InputTooLargeError), early room under
a KV budget, the policy's plan, the cache's eviction, the layout's migration and the buffers' capacity.
"""

from __future__ import annotations

import copy
import time

import numpy as np

from ..core.page import AllocClass, MigrationPlanner
from ..core.retention_plan import RetentionPlan, apply_plan, plan_from_mask
from ..core.units import UnitKind
from ..errors import InputTooLargeError, SessionError
from ..models.base import PreparedUnit
from .records import UpdateRecord
from .budget import RESERVE_PAGES


class Retention:
    """One unit's prefill and the retention step after it (policy plan, eviction, migration, capacity).

    A part of StreamingSession (engine.py), which holds the state these methods use."""

    def _unit(self, prepared: PreparedUnit, alloc_class: AllocClass = AllocClass.RECENT_CONTEXT,
              reserve: int = 0, question: bool = False) -> UpdateRecord:
        """Prefill one unit and run retention. ``reserve``: slots that must stay free after it (a reply's)."""
        self._check_size(prepared, reserve, question)
        t0 = time.perf_counter()
        self._make_room(prepared.length + reserve)
        uid = self._prefill(prepared, alloc_class)
        t1 = time.perf_counter()
        evicted, migrated = self._maintain()
        t2 = time.perf_counter()
        layout = self.cache.layout_stats()
        rec = UpdateRecord(
            t=prepared.t, uid=uid, kind=prepared.kind.value, tokens=prepared.length,
            retained_cells=layout.retained_cells, physical_span=layout.physical_span,
            active_pages=layout.active_pages, active_subblocks=layout.active_subblocks, kv_bytes=self.cache.nbytes,
            prefill_ms=(t1 - t0) * 1000, maintenance_ms=(t2 - t1) * 1000, update_ms=(t2 - t0) * 1000,
            evicted_tokens=evicted, migrated_cells=migrated,
            kv_retained_bytes=layout.retained_cells * self.cache.bytes_per_token)
        self.records.append(rec)
        if self.on_update is not None:
            self.on_update(rec)
        return rec

    def _check_size(self, prepared: PreparedUnit, reserve: int = 0, question: bool = False) -> None:
        """Reject (InputTooLargeError, nothing touched) a unit the session could not keep: under a KV budget, one
        that does not fit next to the system prefix (with ``reserve``: a question and its reply); without one,
        text longer than the high watermark leaves room for (it would be computed only to be evicted)."""
        n = prepared.length
        what = {UnitKind.USER: "the question" if question else "the text", UnitKind.MEDIA: "the media unit",
                UnitKind.SYSTEM: "the system prompt"}.get(prepared.kind, f"the {prepared.kind.value} unit")
        page = self.cache.table.page_size
        if self._max_slots is not None:
            room = self._max_slots - (-(-self.history.system_tokens // page) * page if len(self.history) else 0)
            if n + reserve > room:
                extra = f" plus {reserve} slots for its reply (max_tokens)" if reserve else ""
                raise InputTooLargeError(
                    f"{what} is {n} tokens{extra}; the KV budget of {self.kv_budget} bytes holds {self._max_slots} "
                    f"tokens, {room} of them for one input next to the system prompt: shorten it"
                    f"{', lower max_tokens' if reserve else ''} or raise kv_budget")
        elif (prepared.kind is UnitKind.USER and self.policy.name != "full"
              and n > self.policy.high - self.history.system_tokens):
            raise InputTooLargeError(
                f"{what} is {n} tokens; the high watermark {self.policy.high} leaves "
                f"{self.policy.high - self.history.system_tokens} next to the system prompt, so it would be evicted "
                "as soon as it was computed: shorten it or raise high")

    def _pinned_uids(self) -> frozenset[int]:
        """The units ``hold_turn`` keeps whole: from the first unit at or after its stream time on (the spoken
        turn's media, its text and its question)."""
        since = self._turn_since
        if since is None:
            return frozenset()
        out, held = set(), False
        for u in self.history:
            if u.kind is UnitKind.SYSTEM:
                continue
            held = held or (u.t is not None and u.t >= since)
            if held:
                out.add(u.uid)
        return frozenset(out)

    def _room(self) -> int:
        return self.cache.table.free_slots_for(AllocClass.RECENT_CONTEXT, self._max_slots)

    def _make_room(self, n: int) -> None:
        """Under a KV budget, make sure ``n`` new tokens fit below the ceiling before they are computed: trim early
        (the policy's own choice toward a lower target, then whole units oldest first), then compact the layout.
        Without a budget the cache grows as it needs (and gives the room back in ``_trim_capacity``)."""
        if self._max_slots is None or self._room() >= n:
            return
        t0 = time.perf_counter()
        target = max(0, self._max_slots - RESERVE_PAGES * self.cache.table.page_size - n)
        keep = self._trim_mask(target)
        plan = plan_from_mask(self.history, keep, self.policy.name)
        if plan.deleted_tokens:
            self._apply_retention(plan)
        if self._room() < n:
            mplan = MigrationPlanner("eager").plan(self.cache.page_table)
            if mplan.accepted:
                self.counters.migrations += 1
                self.counters.migrated_cells += self.cache.migrate(mplan)
        self.counters.maintenance_ms += (time.perf_counter() - t0) * 1000
        if self._room() < n:  # _check_size admitted it, so this is a bug, not bad input
            raise SessionError(f"could not make room for {n} tokens under the KV ceiling of {self._max_slots} slots "
                               f"({self.cache.table!r})")

    def _trim_mask(self, target: int) -> np.ndarray:
        """Which tokens to keep so that at most ``target`` remain (the system prefix always stays)."""
        h = self.history
        if h.stream_units:
            policy = copy.copy(self.policy)
            policy.low = max(1, min(policy.low, target))
            scores = self.cache.token_scores(h) if policy.needs_scores else None
            keep = np.asarray(policy.keep_mask(h, scores), dtype=bool).copy()
        else:
            keep = np.ones(h.total_tokens, dtype=bool)
        pinned = self._pinned_uids()
        offsets = h.offsets()
        for held in (False, True):  # whole units oldest first, held units (a spoken turn) only if still over
            for i, u in enumerate(h):
                if keep.sum() <= target:
                    return keep
                if u.kind is not UnitKind.SYSTEM and (u.uid in pinned) == held:
                    keep[offsets[i]:offsets[i] + u.length] = False
        return keep

    def _prefill(self, prepared: PreparedUnit, alloc_class: AllocClass = AllocClass.RECENT_CONTEXT) -> int:
        uid = self.history.next_uid()
        unit = prepared.to_unit(uid)  # validates spans / positions before the cache is touched
        t0 = time.perf_counter()
        self.cache.set_owner(uid, alloc_class)
        logits = self._forward(prepared.inputs_embeds, prepared.positions, prepared.extras)
        self.backend.eval(logits)
        self.counters.prefill_ms += (time.perf_counter() - t0) * 1000
        self.history.append(unit)
        self.counters.units += 1
        self._last_logits = logits
        return uid

    def _apply_retention(self, plan: RetentionPlan) -> tuple[int, int]:
        """Evict what ``plan`` deletes (cache and history), then let the layout migrate; returns (evicted, moved).
        With recall on, the units it drops whole go to the store first."""
        self._recall_capture(plan)
        self.cache.evict(plan, self.history)
        self.history = apply_plan(self.history, plan)
        evicted = plan.tokens_before - plan.tokens_after
        self.counters.evictions += 1
        self.counters.evicted_tokens += evicted
        migrated = 0
        mplan = self.planner.plan(self.cache.page_table)
        if mplan.accepted:
            migrated = self.cache.migrate(mplan)
            self.counters.migrations += 1
            self.counters.migrated_cells += migrated
        return evicted, migrated

    def _maintain(self) -> tuple[int, int]:
        """Retention after a prefill: the policy's plan, the cache's eviction, and the layout's migration."""
        t0 = time.perf_counter()
        evicted = migrated = 0
        scores = self.cache.token_scores(self.history) if self.policy.needs_scores else None
        pinned = self._pinned_uids()  # passed only when a turn is held: a user's own policy may not take it
        plan = None if self._recalled else (  # waits for release
            self.policy.plan(self.history, scores=scores, pinned=pinned) if pinned
            else self.policy.plan(self.history, scores=scores))
        if plan is not None and plan.tokens_after < plan.tokens_before:
            evicted, migrated = self._apply_retention(plan)
        span = self.cache.layout_stats().physical_span
        self.counters.peak_physical_span = max(self.counters.peak_physical_span, span)
        self._trim_capacity()
        self.counters.maintenance_ms += (time.perf_counter() - t0) * 1000
        return evicted, migrated

    def capacity_bound(self) -> int | None:
        """The slots the cache's buffers return to after a large input has gone: the budget's ceiling, or the high
        watermark plus the cache's growth step (None for a policy that never evicts)."""
        if self._max_slots is not None:
            return self._max_slots
        if self.policy.name == "full":
            return None
        page = self.cache.table.page_size
        return (-(-self.policy.high // page) + self.cache.grow_pages) * page

    def _trim_capacity(self) -> None:
        bound = self.capacity_bound()
        if bound is None or self.cache.capacity <= bound:
            return
        target = max(bound, self.cache.layout_stats().physical_span)
        if self.cache.capacity > target:
            self.cache.shrink(target)
