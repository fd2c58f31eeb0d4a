"""The rows of ``omnitide bench stream``, typed: one dataclass per row kind, turned into the JSON dicts of the
result file only by :func:`row_json` (the runner calls it once, on the finished rows).

The JSON keys and their order are those of the result files committed under docs/img (the report, goals and plot
code read those dicts, old files included). A field's place in its class is its place in the JSON; a field holding
a part that only some rows have (limits computed against ``full``, the profiled attention times) is flattened in
place when set and left out when None. Imports no array framework.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, ClassVar

from ..common import Timing

FLAT = {"flat": True}  # field metadata: merge this part's keys into the row (left out when None)


def row_json(row: Any) -> Any:
    """A row (or a part, a list of them, a Timing) as the JSON value the result file holds."""
    if isinstance(row, Timing):
        return row.to_json()
    if isinstance(row, list):
        return [row_json(x) for x in row]
    if not is_dataclass(row):
        return row
    out: dict[str, Any] = {}
    kind = getattr(type(row), "KIND", None)
    if kind is not None:
        out["kind"] = kind
    for f in fields(row):
        value = getattr(row, f.name)
        if f.metadata.get("flat"):
            if value is not None:
                out.update(row_json(value))
        else:
            out[f.name] = row_json(value)
    return out


@dataclass(kw_only=True)
class UpdateLimits:
    """An update row against ``full`` at its checkpoint (limits.py): speedups, the FLOP, key and cost-weighted
    limits, and the ratios of the speedups to them. The cost-weighted ones are None when no estimate exists."""

    cpu_cost_limit: float | None
    flop_limit: float
    flop_limit_real_model: float
    flop_limit_no_chunk_skip: float
    speedup: float
    cpu_speedup: float
    key_limit: float
    attention_speedup: float
    attention_cpu_speedup: float
    ratio_to_limit: float
    cpu_ratio_to_limit: float
    attention_ratio_to_limit: float
    attention_cpu_ratio_to_limit: float
    cpu_ratio_to_cost_limit: float | None


@dataclass(kw_only=True)
class UpdateRow:
    """One variant's update at one no-slide checkpoint (medians over the repetitions; checkpoints.py)."""

    KIND: ClassVar[str] = "update"
    policy: str  # the variant name (``omnitide_kv4``: a quantised twin)
    checkpoint: int
    full_context_tokens: int
    chunk_tokens: int
    synthetic_kv: bool = True
    retention: str
    kv_bits: int | None
    kv_group_size: int | None
    retained_before: int
    active_slots: int
    keys_visited: int
    flops: int
    flops_all_active: int
    update_ms: float
    update_cpu_ms: float
    prefill_ms: float
    attention_ms: float
    attention_cpu_ms: float
    maintenance_ms: float
    migrated_cells: int
    timing: Timing
    attention_timing: Timing
    retained_cells: int
    physical_span: int
    active_pages: int
    active_subblocks: int
    prefill_span: int
    peak_span: int
    kv_bytes: int
    kv_bytes_real_model: int
    peak_memory_bytes: int
    limits: UpdateLimits | None = field(default=None, metadata=FLAT)


@dataclass(kw_only=True)
class EventAttention:
    """Attention and migration time up to an event, from a profiled engine cache (ms)."""

    prefill_attention_ms: float
    decode_attention_ms: float
    migration_ms: float


@dataclass(kw_only=True)
class SessionEvent:
    """One event (a second of media, or a question and its reply) of one variant's session."""

    event: int
    kind: str  # "media" or "ask"
    ms: float
    cpu_ms: float
    retained_cells: int
    physical_span: int
    active_pages: int
    kv_bytes: int
    peak_memory_bytes: int
    evictions: int
    attention: EventAttention | None = field(default=None, metadata=FLAT)
    full_context_tokens: int  # the no-slide history after the event


@dataclass(kw_only=True)
class SessionAttention:
    """A profiled engine session's attention and migration time (s)."""

    prefill_attention_s: float
    decode_attention_s: float
    migration_s: float


@dataclass(kw_only=True)
class SessionLimits:
    """A session row against ``full``'s session: speedups, the FLOP limit and the ratio to it."""

    flop_limit: float
    speedup: float
    cpu_speedup: float
    ratio_to_limit: float


@dataclass(kw_only=True)
class SessionRow:
    """One variant's whole session (paper table 3; sessions.py)."""

    KIND: ClassVar[str] = "session"
    policy: str
    synthetic_kv: bool = False
    retention: str
    kv_bits: int | None
    kv_group_size: int | None
    session_s: float
    session_cpu_s: float
    prefill_s: float
    decode_s: float
    maintenance_s: float
    maintenance_share: float
    flops: int
    prefill_keys_visited: int
    decode_keys_visited: int
    other_s: float
    units: int
    questions: int
    decoded_tokens: int
    evictions: int
    migrations: int
    migrated_cells: int
    full_context_tokens: int
    retained_cells: int
    physical_span: int
    active_pages: int
    active_subblocks: int
    peak_span: int
    kv_bytes: int
    kv_bytes_real_model: int
    peak_memory_bytes: int
    series: list[SessionEvent]
    attention: SessionAttention | None = field(default=None, metadata=FLAT)
    limits: SessionLimits | None = field(default=None, metadata=FLAT)


@dataclass(kw_only=True)
class AttentionEvent:
    """One event of an ``attention_session`` row: the profiled times so far and the active pages."""

    event: int
    kind: str
    prefill_attention_ms: float
    decode_attention_ms: float
    migration_ms: float
    active_pages: int


@dataclass(kw_only=True)
class AttentionSessionRow:
    """Attention under identical retention (figure 15): one of the OmniPick layouts' profiled session."""

    KIND: ClassVar[str] = "attention_session"
    policy: str
    layout: str
    prefill_attention_s: float
    decode_attention_s: float
    migration_s: float
    migrations: int
    migrated_cells: int
    maintenance_s: float
    prefill_keys_visited: int
    decode_keys_visited: int
    series: list[AttentionEvent]


Row = UpdateRow | SessionRow | AttentionSessionRow
