"""Trace-driven simulator: a retention policy and KV layouts over a unit stream, with no model.

The stream (profiles.StreamSpec) is one unit a second at the model's token counts, plus a question and a reply
every N seconds. Each update prefills one unit (its tokens get slots), the policy plans a trim when the history
is above the high watermark, every layout frees the deleted tokens' slots, and the layout's migration planner
may move entries. Retention does not depend on the layout, so one history drives all layouts side by side and
they see exactly the same plans.

Layouts (native / omnipage / eager) come from the one registry, core/layout.py.

Per update the simulator records the layout after maintenance (retained cells, physical span, active pages and
subblocks, holes, cells moved, bytes) and the span attention walked during the update's prefill (``peak_span`` is
its running maximum).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from .errors import OmniTideError
from .layout import LAYOUT_NAMES, layout_spec
from .page import AllocClass, LayoutError, LayoutStats, MigrationPlanner, PageTable
from .pick import RetentionPolicy, make_policy
from .retention_plan import apply_plan
from .profiles import ModelProfile, StreamSpec, build_unit, require_profile
from .units import History


class SimError(OmniTideError, ValueError):
    """A bad simulator request (unknown layout, impossible checkpoint, ...)."""


_STEADY_KEYS = ("retained_cells", "physical_span", "active_pages", "active_subblocks", "prefill_span",
                "prefill_active_pages")  # time-averaged and p95 once retention runs (from the first trim on)
_MEAN_KEYS = ("retained_cells", "physical_span", "active_pages", "active_subblocks", "holes", "prefill_span",
              "prefill_active_pages", "kv_bytes")


@dataclass
class LayoutTrace:
    """One layout's state and measurements over a run."""

    name: str
    table: PageTable
    planner: MigrationPlanner
    kv_bytes_per_token: int
    moved_entries_total: int = 0  # JSON: "moved_cells_total"
    migrations: int = 0
    peak_span: int = 0
    peak: dict = field(default_factory=dict)
    sums: dict = field(default_factory=dict)  # running sums over every update, for the time means
    series: list = field(default_factory=list)
    final: dict = field(default_factory=dict)
    steady: dict = field(default_factory=dict)  # per _STEADY_KEYS, every update's value from the first trim on

    def _bump_peak(self, s: LayoutStats) -> None:
        for k, v in (("retained_cells", s.retained_cells), ("physical_span", s.physical_span),
                     ("active_pages", s.active_pages), ("active_subblocks", s.active_subblocks),
                     ("holes", s.holes), ("capacity", s.capacity)):
            if v > self.peak.get(k, -1):
                self.peak[k] = v

    def record(self, s: LayoutStats, prefill: LayoutStats, moved: int, base: dict) -> dict:
        b = self.kv_bytes_per_token
        self.peak_span = max(self.peak_span, prefill.physical_span, s.physical_span)
        self._bump_peak(prefill)
        self._bump_peak(s)
        rec = {
            **base,
            "retained_cells": s.retained_cells,
            "physical_span": s.physical_span,
            "active_pages": s.active_pages,
            "active_subblocks": s.active_subblocks,
            "holes": s.holes,
            "capacity": s.capacity,
            "moved_cells": moved,
            "moved_cells_total": self.moved_entries_total,
            "prefill_span": prefill.physical_span,
            "prefill_active_pages": prefill.active_pages,
            "peak_span": self.peak_span,
            "kv_bytes": s.physical_span * b,
            "useful_bytes": s.retained_cells * b,
            "capacity_bytes": s.capacity * b,
        }
        if base.get("trimmed") or self.steady:
            for k in _STEADY_KEYS:
                self.steady.setdefault(k, []).append(rec[k])
        for k in _MEAN_KEYS:
            self.sums[k] = self.sums.get(k, 0) + rec[k]
        self.sums["_n"] = self.sums.get("_n", 0) + 1
        self.final = rec
        return rec

    def summary(self) -> dict:
        b = self.kv_bytes_per_token
        peak = dict(self.peak)
        peak["peak_span"] = self.peak_span
        peak["kv_bytes"] = peak.get("physical_span", 0) * b
        peak["useful_bytes"] = peak.get("retained_cells", 0) * b
        peak["capacity_bytes"] = peak.get("capacity", 0) * b
        n = max(1, self.sums.get("_n", 0))
        mean = {k: round(self.sums.get(k, 0) / n, 2) for k in _MEAN_KEYS}
        steady = {"updates": len(self.steady.get("physical_span", [])),
                  "mean": {k: round(float(np.mean(v)), 2) for k, v in self.steady.items()},
                  "p95": {k: float(np.percentile(v, 95)) for k, v in self.steady.items()}}
        return {"placement": self.table.placement, "migration": self.planner.mode, "tail_fill": self.planner.tail_fill,
                "final": dict(self.final), "peak": peak, "mean": mean, "after_first_trim": steady,
                "moved_cells_total": self.moved_entries_total,
                "moved_bytes_total": self.moved_entries_total * b, "migrations": self.migrations,
                "series": self.series}


class Simulator:
    """Drives one history through a policy and several layouts, one unit at a time."""

    def __init__(self, profile: ModelProfile | str, policy: RetentionPolicy | str, stream: StreamSpec,
                 layouts: Sequence[str] = LAYOUT_NAMES, migration: str = "class_aware",
                 page_size: int = 64, subblock_size: int = 32, min_gain_pages: int = 1, check: bool = False,
                 tail_fill: bool | None = None):
        self.profile = require_profile(profile)
        self.profile.stream_units  # noqa: B018  (a profile without its unit layout fails here, with the fix)
        self.policy = make_policy(policy, profile=self.profile) if isinstance(policy, str) else policy
        self.stream = stream
        if not layouts:
            raise SimError("no layout to simulate")
        self.layouts: dict[str, LayoutTrace] = {}
        for name in layouts:
            try:
                table, planner = layout_spec(name, migration, min_gain_pages, tail_fill).build(page_size,
                                                                                              subblock_size)
            except LayoutError as e:
                raise SimError(str(e)) from None
            self.layouts[name] = LayoutTrace(name, table, planner, self.profile.kv_bytes_per_token)
        self.check = check
        self.history = History([self.profile.system_unit(0)])
        for lt in self.layouts.values():
            lt.table.allocate(self.history[0].length, 0, AllocClass.MUST_KEEP)
        self.full_context_tokens = self.history.total_tokens
        self.updates = 0
        self.trims = 0
        self._uid = 1
        # H2O needs accumulated attention; without a model we use a seeded heavy-tailed proxy (layout only)
        self._scores = np.zeros(self.history.total_tokens) if self.policy.needs_scores else None
        self._score_rng = np.random.default_rng(stream.seed + 7919)

    def _accumulate_scores(self, new_tokens: int) -> None:
        total = self.history.total_tokens
        self._scores = np.concatenate([self._scores, np.zeros(new_tokens)])
        self._scores += self._score_rng.gamma(0.3, size=total) * (new_tokens / total)

    def step(self, event) -> dict[str, dict]:
        """Prefill one unit, trim, migrate; returns each layout's record of this update."""
        unit = build_unit(self.profile, event, self._uid, self.history.next_position())
        self._uid += 1
        self.history.append(unit)
        self.full_context_tokens += unit.length
        self.updates += 1
        prefill: dict[str, LayoutStats] = {}
        for name, lt in self.layouts.items():
            lt.table.allocate(unit.length, unit.uid, AllocClass.RECENT_CONTEXT)
            prefill[name] = lt.table.stats()
        if self._scores is not None:
            self._accumulate_scores(unit.length)
        plan = self.policy.plan(self.history, self._scores)
        moved: dict[str, int] = {name: 0 for name in self.layouts}
        if plan is not None:
            self.trims += 1
            if self._scores is not None:
                self._scores = self._scores[plan.keep_mask()]
            self.history = apply_plan(self.history, plan)
            for name, lt in self.layouts.items():
                lt.table.apply_retention(plan)
                mp = lt.planner.plan(lt.table)
                if mp.accepted:
                    lt.table.apply_migration(mp)
                    moved[name] = mp.moved
                    lt.moved_entries_total += mp.moved
                    lt.migrations += 1
        base = {"update": self.updates, "t": event.t, "kind": event.kind, "uid": unit.uid,
                "full_context_tokens": self.full_context_tokens, "trimmed": plan is not None}
        out = {}
        for name, lt in self.layouts.items():
            if self.check:
                lt.table.validate()
                lt.table.check_history(self.history)
            out[name] = lt.record(lt.table.stats(), prefill[name], moved[name], base)
        return out

    def run(self, progress: bool = False, series_every: int = 1, until_tokens: int | None = None) -> "SimResult":
        """Run the whole stream (or until the full-context history reaches ``until_tokens``)."""
        events: Iterable = self.stream.events()
        bar = None
        if progress:
            from tqdm import tqdm

            total = self.stream.seconds + (2 * (self.stream.seconds // self.stream.question_every)
                                           if self.stream.question_every else 0)
            bar = tqdm(total=total, unit="unit", desc=f"simulate {self.profile.name}", mininterval=0.5,
                       leave=False)
        try:
            for event in events:
                recs = self.step(event)
                if bar is not None:
                    bar.update(1)
                if series_every and (self.updates % series_every == 0 or self.updates == 1):
                    for name, rec in recs.items():
                        self.layouts[name].series.append(rec)
                if until_tokens is not None and self.full_context_tokens >= until_tokens:
                    break
        finally:
            if bar is not None:
                bar.close()
        for lt in self.layouts.values():  # the last update is always in the series
            if lt.final and (not lt.series or lt.series[-1] is not lt.final):
                lt.series.append(lt.final)
        return SimResult(self)


@dataclass
class SimResult:
    sim: Simulator

    def to_json(self) -> dict:
        s = self.sim
        return {
            "profile": s.profile.name,
            "policy": s.policy.name,
            "seconds": s.stream.seconds,
            "policy_config": s.policy.config(),
            "profile_info": s.profile.to_json(),
            "setting": s.profile.units.setting.to_json(),
            "tokens_per_unit": s.profile.units.tokens,
            "tokens_per_unit_by_kind": s.profile.tokens_by_kind(),
            "stream": s.stream.to_json(),
            "updates": s.updates,
            "trims": s.trims,
            "full_context_tokens": s.full_context_tokens,
            "page_size": next(iter(s.layouts.values())).table.page_size,
            "subblock_size": next(iter(s.layouts.values())).table.subblock_size,
            "layouts": {name: lt.summary() for name, lt in s.layouts.items()},
        }


def simulate(profile: ModelProfile | str, policy: RetentionPolicy | str = "omnitide", seconds: int = 240,
             *, question_every: int = 30, seed: int = 0, layouts: Sequence[str] = LAYOUT_NAMES,
             migration: str = "class_aware", page_size: int = 64, subblock_size: int = 32,
             min_gain_pages: int = 1, progress: bool = False, series_every: int = 1,
             check: bool = False, tail_fill: bool | None = None, **policy_kw: Any) -> dict:
    """Run a stream and return the JSON-able result (see ``omnitide simulate``)."""
    prof = require_profile(profile)
    pol = make_policy(policy, profile=prof, **policy_kw) if isinstance(policy, str) else policy
    sim = Simulator(prof, pol, StreamSpec(seconds, question_every=question_every, seed=seed), layouts,
                    migration, page_size, subblock_size, min_gain_pages, check, tail_fill)
    return sim.run(progress=progress, series_every=series_every).to_json()


@dataclass(frozen=True)
class LayoutSnapshot:
    """The layout a policy + layout produce once the full-context history reaches ``tokens``."""

    table: PageTable
    history: History
    full_context_tokens: int
    seconds: float
    updates: int


def snapshot_at(profile: ModelProfile | str, policy: RetentionPolicy | str, layout: str, tokens: int, *,
                question_every: int = 30, seed: int = 0, migration: str = "class_aware", page_size: int = 64,
                subblock_size: int = 32, min_gain_pages: int = 1, tail_fill: bool | None = None,
                **policy_kw: Any) -> LayoutSnapshot:
    """Stream until the no-slide history would hold ``tokens`` tokens (paper 7.1's no-slide checkpoints),
    finishing that update (prefill, trim, migration), and return the layout then."""
    prof = require_profile(profile)
    pol = make_policy(policy, profile=prof, **policy_kw) if isinstance(policy, str) else policy
    if tokens <= prof.system_tokens:
        raise SimError(f"checkpoint {tokens} is not past the {prof.system_tokens}-token system prompt")
    # enough seconds to get there, whatever the question rate
    seconds = int(tokens // prof.media_unit_tokens) + 2
    sim = Simulator(prof, pol, StreamSpec(seconds, question_every=question_every, seed=seed), (layout,),
                    migration, page_size, subblock_size, min_gain_pages, tail_fill=tail_fill)
    sim.run(series_every=0, until_tokens=tokens)
    if sim.full_context_tokens < tokens:  # pragma: no cover - seconds above always suffice
        raise SimError(f"stream ended at {sim.full_context_tokens} tokens before the {tokens} checkpoint")
    lt = sim.layouts[layout]
    return LayoutSnapshot(lt.table.copy(), sim.history, sim.full_context_tokens,
                          float(lt.final.get("t", 0.0)), sim.updates)


def page_table_at(profile: ModelProfile | str, policy: RetentionPolicy | str, layout: str, tokens: int,
                  **kw: Any) -> PageTable:
    """The PageTable (slot occupancy, serials, owners, classes) of :func:`snapshot_at`."""
    return snapshot_at(profile, policy, layout, tokens, **kw).table
