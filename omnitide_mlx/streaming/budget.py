"""Retention settings from what users give: a policy by name or instance, watermarks, and a KV budget in bytes
(``512MiB``) with the watermarks it pays for. Checked before any model loads.
"""

from __future__ import annotations

import math
import os

import numpy as np

from ..core.pick import DEFAULT_HIGH, DEFAULT_LOW, RetentionPolicy, make_policy


RESERVE_PAGES = 2  # a KV budget's high watermark sits this many pages under its ceiling (see watermarks_for_budget)


def policy_from(policy: RetentionPolicy | str | None, high: int | None = None, low: int | None = None) -> RetentionPolicy:
    """A policy from a name (``omnitide``, ``omnipick``, ``full``, ``fifo``, ``token``, ``streamingllm``, ``h2o``,
    ``eager``) or an instance (returned as is; ``high`` / ``low`` with an instance are an error, not ignored)."""
    if policy is None:
        policy = "omnitide"
    if isinstance(policy, str):
        kw = {}
        if high is not None:
            kw["high"] = _watermark("high", high)
        if low is not None:
            kw["low"] = _watermark("low", low)
        return make_policy(policy, **kw)
    if not isinstance(policy, RetentionPolicy):
        raise ValueError(f"policy must be a policy name or a RetentionPolicy, got {type(policy).__name__}")
    if high is not None or low is not None:
        raise ValueError(f"high= / low= go with a policy name; {policy!r} is an instance: set its watermarks there "
                         f"({type(policy).__name__}(high=..., low=...))")
    return policy


def _watermark(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} watermark must be a positive int (tokens), got {value!r}")
    return int(value)


def budget_slots(budget_bytes: int, bytes_per_token: int, page_size: int = 64) -> int:
    """The KV slots a budget pays for, in whole pages: the cache's buffers never hold more."""
    return budget_bytes // bytes_per_token // page_size * page_size


def watermarks_for_budget(budget_bytes: int, bytes_per_token: int, low_ratio: float = DEFAULT_LOW / DEFAULT_HIGH,
                          *, page_size: int = 64, low: int | None = None) -> tuple[int, int]:
    """High / low watermarks (tokens) under a KV budget: users think in memory.

    The budget pays for ``budget_slots`` slots (whole pages); the cache never grows past them. ``high`` sits
    ``RESERVE_PAGES`` pages under that ceiling (the room class-aware placement may leave in pages of another class)
    and ``low`` keeps the paper's 1800 / 2500 ratio unless given. A unit that would not fit the free room is
    preceded by an early trim (the session's ``_make_room``), so the ceiling holds whatever the unit sizes.
    """
    budget_bytes = kv_budget_bytes(budget_bytes, check_memory=False)
    slots = budget_slots(budget_bytes, bytes_per_token, page_size)
    high = slots - RESERVE_PAGES * page_size
    if high < 64:
        raise ValueError(f"a KV budget of {budget_bytes} bytes holds only {slots} tokens ({bytes_per_token} bytes per "
                         f"token, whole pages of {page_size}); raise it to at least "
                         f"{(64 + RESERVE_PAGES * page_size) * bytes_per_token} bytes")
    if low is None:
        low = max(1, int(high * low_ratio))
    elif _watermark("low", low) > high:
        raise ValueError(f"low watermark {low} is above the KV budget's high watermark {high}")
    return int(high), int(low)


def parse_bytes(text: str) -> int:
    """``512MiB``, ``2GB``, ``1.5GiB``, ``100000`` -> bytes."""
    units = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
             "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}
    s = str(text).strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    try:
        value = float(num) * units[unit]
    except (KeyError, ValueError):
        raise ValueError(f"cannot read {text!r} as a size (examples: 512MiB, 2GB)") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"a size must be positive and finite, got {text!r}")
    return int(value)


def machine_memory_bytes() -> int | None:
    """Physical memory of this machine (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def kv_budget_bytes(value, check_memory: bool = True) -> int:
    """A KV budget (bytes, or a size string like ``"512MiB"``) as a positive int, checked before anything loads:
    not a bool, NaN, negative, or (``check_memory``) more than the machine's memory."""
    if isinstance(value, str):
        budget = parse_bytes(value)
    elif isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"kv_budget must be bytes or a size like '512MiB', got {value!r}")
    else:
        if not math.isfinite(float(value)) or value <= 0:
            raise ValueError(f"kv_budget must be a positive, finite number of bytes, got {value!r}")
        budget = int(value)
    total = machine_memory_bytes() if check_memory else None
    if total and budget > total:
        raise ValueError(f"a KV budget of {value!r} ({budget / 2**30:.3g} GiB) is more than this machine's memory "
                         f"({total / 2**30:.1f} GiB)")
    return budget


def _check_budget_args(policy, high, low, kv_budget) -> int | None:
    """The KV budget in bytes (None without one), its combination with the policy arguments checked."""
    budget = kv_budget_bytes(kv_budget) if kv_budget is not None else None
    if budget is not None:
        if high is not None:
            raise ValueError("kv_budget sets the high watermark: give kv_budget (and optionally low) or high / low")
        name = policy if isinstance(policy, str) or policy is None else policy_from(policy).name
        if policy_from(name).name == "full":
            raise ValueError("policy 'full' never evicts, so it cannot stay under a kv_budget; give it high / low "
                             "or choose an evicting policy")
        if low is not None and not isinstance(policy, (str, type(None))):
            raise ValueError("low= goes with a policy name; with a policy instance, kv_budget sets both watermarks")
        if low is not None:
            _watermark("low", low)
    return budget
