"""The KV layouts at no-slide checkpoints (paper 7.1: 4K-64K history tokens), as both attention benchmarks time them.

``omnitide bench attention`` (bench/attention.py, MLX) and its ``--backend torch`` version (torch/bench.py) stream a
model profile's units through the simulator until the no-slide history reaches each checkpoint, and snapshot every
layout with its latest migration. That part is framework-free and lives here once, so the two benchmarks time the
same layouts and the torch one needs no MLX.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from .layout import LAYOUT_NAMES
from .page import MigrationPlan, MigrationPlanner, PageTable
from .pick import make_policy
from .profiles import ModelProfile, StreamSpec, require_profile
from .sim import Simulator

@dataclass
class RecordingPlanner(MigrationPlanner):
    """A migration planner that remembers the table and plan of its last accepted migration (to time it)."""

    last: Any = field(default=None, repr=False)

    def plan(self, table: PageTable) -> MigrationPlan:
        p = super().plan(table)
        if p.accepted:
            self.last = (table.copy(), p)
        return p


@dataclass
class Checkpoint:
    """The layouts at one no-slide checkpoint; per layout its latest migration (pre-migration table and plan, or
    None) and its migrations per update so far."""

    history: int
    full_context_tokens: int
    retained: int
    tables: dict[str, PageTable]
    migrations: dict[str, tuple[PageTable, MigrationPlan] | None]
    migration_rate: dict[str, float]


def checkpoint_simulator(profile: ModelProfile | str, histories: list[int], *, policy: str = "omnipick",
                         seed: int = 0, question_every: int = 30, layouts: Sequence[str] = LAYOUT_NAMES,
                         migration: str = "class_aware", **policy_kw) -> Simulator:
    """A simulator whose stream is long enough to reach the largest checkpoint. ``profile`` must carry its unit
    layout (``models.stream_units.resolve_profile``)."""
    prof = require_profile(profile)
    pol = make_policy(policy, profile=prof, **policy_kw)
    stream = StreamSpec(max(histories) // prof.media_unit_tokens + 4, question_every=question_every, seed=seed)
    return Simulator(prof, pol, stream, layouts, migration=migration)


def record_checkpoints(sim: Simulator, histories: list[int], layouts: Sequence[str] | None = None
                       ) -> list[Checkpoint]:
    """Stream ``sim`` once through every checkpoint (ascending) and snapshot ``layouts`` (default: all of the
    simulator's) at each; every layout's planner is replaced by a :class:`RecordingPlanner` of the same mode."""
    names = list(sim.layouts) if layouts is None else list(layouts)
    for lt in sim.layouts.values():
        lt.planner = RecordingPlanner(lt.planner.mode, min_gain_pages=lt.planner.min_gain_pages,
                                      tail_fill=lt.planner.tail_fill)
    todo = sorted(histories)
    out: list[Checkpoint] = []
    for event in sim.stream.events():
        sim.step(event)
        while todo and sim.full_context_tokens >= todo[0]:
            out.append(Checkpoint(todo.pop(0), sim.full_context_tokens, sim.history.total_tokens,
                                  {n: sim.layouts[n].table.copy() for n in names},
                                  {n: sim.layouts[n].planner.last for n in names},
                                  {n: sim.layouts[n].migrations / sim.updates for n in names}))
        if not todo:
            break
    if todo:
        raise RuntimeError(f"the stream ended before checkpoints {todo}")
    return out


def parse_histories(text) -> list[int]:
    """The ``--history`` flag: comma-separated positive token counts. A ValueError says what is wrong."""
    try:
        histories = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"bad --history {text!r}: want comma-separated integers") from None
    if not histories or min(histories) <= 0:
        raise ValueError("--history needs positive token counts")
    return histories
