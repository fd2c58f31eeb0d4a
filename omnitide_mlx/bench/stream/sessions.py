"""Whole sessions (paper table 3, figure 13) and attention under identical retention (figure 15): every variant
streams the same session, taking turns event by event."""

from __future__ import annotations

import gc
import time

import mlx.core as mx

from ...cache import DECODE_MAX_TOKENS
from ...core.profiles import StreamSpec
from ..shape_models import ShapeTrueModel, update_flops
from .names import LAYOUT_TRIO, real_kv_bytes_per_token
from .profiling import ProfiledOmniCache
from .rows import (AttentionEvent, AttentionSessionRow, EventAttention, SessionAttention, SessionEvent, SessionLimits,
                   SessionRow)
from .variants import Variant, _now


def session_events(stream: StreamSpec) -> list[tuple]:
    """("media", t) per second; ("ask", question tokens, reply tokens) for each question / reply pair."""
    out, pending = [], None
    for e in stream.events():
        if e.kind == "media":
            out.append(("media", e.t))
        elif e.kind == "question":
            pending = e.n_text
        else:
            out.append(("ask", pending, e.n_text))
    return out


def run_sessions(model: ShapeTrueModel, variants: dict[str, Variant], stream: StreamSpec, log
                 ) -> list[SessionRow | AttentionSessionRow]:
    """Every variant streams the same session, taking turns event by event; one row per variant, and for the
    OmniPick layouts (native, OmniPage, eager) one ``attention_session`` row (figure 15). Engine variants should be
    profiled (``make_variant(..., profiled=True)``) for the attention series."""
    for var in variants.values():  # the system prompt's prefill is not part of the session
        var.step_log().clear()
        if isinstance(getattr(getattr(var, "session", None), "cache", None), ProfiledOmniCache):
            var.session.cache.attention_s = {"prefill": 0.0, "decode": 0.0}
    events = session_events(stream)
    full_context = _full_context_series(model, events)
    series: dict[str, list[SessionEvent]] = {name: [] for name in variants}
    wall = {name: 0.0 for name in variants}
    cpu = {name: 0.0 for name in variants}
    order = list(variants)
    t_start = time.perf_counter()
    for i, ev in enumerate(events):
        gc.collect()
        for name in order[i % len(order):] + order[:i % len(order)]:
            var = variants[name]
            kv_before = var.kv_bytes
            active0 = mx.get_active_memory()
            mx.reset_peak_memory()
            t0, c0 = _now()
            if ev[0] == "media":
                var.media(ev[1])
            else:
                var.ask(ev[1], ev[2])
            t1, c1 = _now()
            peak = model.weights_bytes + max(kv_before, var.kv_bytes) + max(0, mx.get_peak_memory() - active0)
            wall[name] += t1 - t0
            cpu[name] += c1 - c0
            lay = var.layout()
            cache = getattr(getattr(var, "session", None), "cache", None)
            attention = None
            if isinstance(cache, ProfiledOmniCache):
                attention = EventAttention(prefill_attention_ms=round(cache.attention_s["prefill"] * 1000, 3),
                                           decode_attention_ms=round(cache.attention_s["decode"] * 1000, 3),
                                           migration_ms=round(cache.migration_s * 1000, 3))
            rec = SessionEvent(event=i, kind=ev[0], ms=round((t1 - t0) * 1000, 2), cpu_ms=round((c1 - c0) * 1000, 2),
                               retained_cells=lay["retained_cells"], physical_span=lay["physical_span"],
                               active_pages=lay["active_pages"], kv_bytes=lay["kv_bytes"],
                               peak_memory_bytes=int(peak), evictions=var.counters()["evictions"],
                               attention=attention, full_context_tokens=full_context[i])
            series[name].append(rec)
        if log:
            log(f"  session event {i + 1}/{len(events)} ({ev[0]}) done, {time.perf_counter() - t_start:.0f} s")
    rows: list[SessionRow | AttentionSessionRow] = []
    for name, var in variants.items():
        c = var.counters()
        lay = var.layout()
        ser = series[name]
        session_s = wall[name]
        maint = c["maintenance_ms"] / 1000
        s = model.shape
        steps = var.step_log()
        keys = {"prefill": sum(k for t, k in steps if t > DECODE_MAX_TOKENS),
                "decode": sum(k for t, k in steps if t <= DECODE_MAX_TOKENS)}
        cache = getattr(getattr(var, "session", None), "cache", None)
        profiled = isinstance(cache, ProfiledOmniCache)
        row = SessionRow(
            policy=name, retention=var.retention, kv_bits=var.kv_bits, kv_group_size=var.kv_group_size,
            session_s=round(session_s, 3), session_cpu_s=round(cpu[name], 3),
            prefill_s=round(c["prefill_ms"] / 1000, 3), decode_s=round(c["decode_ms"] / 1000, 3),
            maintenance_s=round(maint, 4), maintenance_share=round(maint / session_s, 5),
            flops=sum(update_flops(s, s.layers, s.vocab, t, k) for t, k in steps),
            prefill_keys_visited=keys["prefill"], decode_keys_visited=keys["decode"],
            other_s=round(session_s - (c["prefill_ms"] + c["decode_ms"] + c["maintenance_ms"]) / 1000, 3),
            units=sum(1 for e in events if e[0] == "media"), questions=sum(1 for e in events if e[0] == "ask"),
            decoded_tokens=c["decoded_tokens"], evictions=c["evictions"], migrations=c["migrations"],
            migrated_cells=c["migrated_cells"], full_context_tokens=ser[-1].full_context_tokens,
            retained_cells=lay["retained_cells"], physical_span=lay["physical_span"],
            active_pages=lay["active_pages"], active_subblocks=lay["active_subblocks"], peak_span=lay["peak_span"],
            kv_bytes=lay["kv_bytes"],
            kv_bytes_real_model=lay["retained_cells"] * real_kv_bytes_per_token(model.profile, var.kv_bits,
                                                                                var.kv_group_size or 64),
            peak_memory_bytes=max(r.peak_memory_bytes for r in ser),
            series=ser,
            attention=SessionAttention(prefill_attention_s=round(cache.attention_s["prefill"], 4),
                                       decode_attention_s=round(cache.attention_s["decode"], 4),
                                       migration_s=round(cache.migration_s, 4)) if profiled else None,
        )
        rows.append(row)
        if profiled and name in LAYOUT_TRIO:
            att = row.attention
            rows.append(AttentionSessionRow(
                policy=name, layout=var.policy.layout, prefill_attention_s=att.prefill_attention_s,
                decode_attention_s=att.decode_attention_s, migration_s=att.migration_s, migrations=row.migrations,
                migrated_cells=row.migrated_cells, maintenance_s=row.maintenance_s,
                prefill_keys_visited=row.prefill_keys_visited, decode_keys_visited=row.decode_keys_visited,
                series=[AttentionEvent(event=e.event, kind=e.kind,
                                       prefill_attention_ms=e.attention.prefill_attention_ms,
                                       decode_attention_ms=e.attention.decode_attention_ms,
                                       migration_ms=e.attention.migration_ms, active_pages=e.active_pages)
                        for e in ser]))
    full = next((r for r in rows if isinstance(r, SessionRow) and r.policy == "full"), None)
    for r in rows:
        if isinstance(r, SessionRow) and full is not None:
            flop_limit = round(full.flops / r.flops, 4)
            speedup = round(full.session_s / r.session_s, 4)
            r.limits = SessionLimits(flop_limit=flop_limit, speedup=speedup,
                                     cpu_speedup=round(full.session_cpu_s / r.session_cpu_s, 4),
                                     ratio_to_limit=round(speedup / flop_limit, 4))
    return rows


def _full_context_series(model: ShapeTrueModel, events: list[tuple]) -> list[int]:
    """The no-slide history length after each session event (system prompt included)."""
    prof = model.profile
    tokens = prof.system_tokens
    out = []
    for ev in events:
        if ev[0] == "media":
            tokens += prof.media_unit_tokens
        else:
            tokens += prof.framing.question_tokens(ev[1]) + ev[2] + len(prof.framing.reply_close)
        out.append(tokens)
    return out
