"""Quantised KV figures for ``omnitide bench attention --kv-bits``: bytes per token with scales and biases, and the
KV a long simulated stream holds at each precision (issue 16).

The stream is the core simulator's (no model): the profile's units a second, OmniPick retention with the OmniPage
layout, until the no-slide history reaches ``tokens``; the KV held is then read off the page table three ways:
retained cells (what the history keeps), active pages (what tile-skip attention reads) and the allocated capacity
(what the buffers hold, pages kept for the next unit included), each times the bytes per token of a precision.
"""

from __future__ import annotations

GIB = 1 << 30


def kv_bytes_per_token(profile, bits: int | None, group_size: int = 64) -> int:
    """K and V of every layer for one token of ``profile``'s model in its KV dtype (``profile.kv_dtype_bytes``):
    float, or packed values plus a scale and a bias per group in that dtype (``core.shapes.kv_bytes_per_token``)."""
    return profile.shape.kv_bytes_per_token(profile.kv_dtype_bytes, bits, group_size)


def kv_held(profile, tokens: int, precisions, *, policy: str = "omnitide", seed: int = 0, **policy_kw) -> dict:
    """The KV a ``tokens``-token simulated stream holds at each of ``precisions`` ((bits or None, group) pairs)."""
    from ..core.sim import snapshot_at

    snap = snapshot_at(profile, policy, "omnipage", tokens, seed=seed, **policy_kw)
    st = snap.table.stats()
    slots = {"retained": st.retained_cells, "active_pages": st.active_pages * snap.table.page_size,
             "capacity": st.capacity}
    rows = []
    for bits, group in precisions:
        bpt = kv_bytes_per_token(profile, bits, group)
        rows.append({"kv_bits": bits, "kv_group_size": group if bits else None, "bytes_per_token": bpt,
                     **{f"{k}_gib": round(n * bpt / GIB, 6) for k, n in slots.items()}})
    return {"profile": profile.name, "tokens": snap.full_context_tokens, "seconds": snap.seconds,
            "policy": policy, "policy_kw": policy_kw, "slots": slots, "rows": rows}


def markdown(held: dict) -> str:
    lines = [f"KV held after {held['tokens']} tokens ({held['profile']}, {held['policy']} "
             f"{held['policy_kw'] or ''}): {held['slots']['retained']} retained cells, "
             f"{held['slots']['active_pages']} slots in active pages, {held['slots']['capacity']} allocated",
             "", "| KV | bytes / token | retained GiB | active pages GiB | allocated GiB |", "|---|---|---|---|---|"]
    for r in held["rows"]:
        name = "float16" if r["kv_bits"] is None else f"{r['kv_bits']}-bit, group {r['kv_group_size']}"
        lines.append(f"| {name} | {r['bytes_per_token']} | {r['retained_gib']:.4f} | {r['active_pages_gib']:.4f} | "
                     f"{r['capacity_gib']:.4f} |")
    return "\n".join(lines)
