"""Which retention settings an evaluation compares: policy names with optional overrides, times watermarks.

A policy spec is a CLI policy name, optionally with keyword overrides: ``omnipick``, ``h2o``,
``omnipick:text_budget=64,recent_units=3``, ``token:positions=keep`` (old positions kept, gaps left: core/pick.py).
A watermark spec is ``HIGH/LOW`` in tokens (``2500/1800``). Every spec runs at every watermark, except ``full``,
which never evicts and runs once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..core.pick import POLICIES, POSITION_MODES, RECENT_COUNTS, RetentionError, RetentionPolicy, make_policy, parse_leftover

# the rows of the paper's table 2, in its order, with its names
PAPER_POLICIES = ("full", "fifo", "token", "streamingllm", "h2o", "omnipick")
PAPER_LABELS = {"full": "No-slide", "fifo": "FIFO / basic", "token": "Token-basic", "streamingllm": "StreamingLLM",
                "h2o": "H2O", "omnipick": "OmniPick (ours)", "omnitide": "OmniTide (OmniPick + OmniPage)",
                "eager": "OmniPick + eager compaction"}
DEFAULT_WATERMARKS = (2500, 1800)  # the paper's default


@dataclass(frozen=True)
class PolicySetting:
    """One policy at one pair of watermarks: what a single evaluation run uses."""

    name: str
    overrides: tuple[tuple[str, int | str], ...] = ()
    high: int = DEFAULT_WATERMARKS[0]
    low: int = DEFAULT_WATERMARKS[1]
    recall: int | None = None  # the session's evicted-unit store in bytes (streaming/recall.py); None: off

    @property
    def spec(self) -> str:
        """The policy spec as written on the command line (no watermarks)."""
        if not self.overrides:
            return self.name
        return self.name + ":" + ",".join(f"{k}={v}" for k, v in self.overrides)

    @property
    def key(self) -> str:
        """A file-name-safe id: ``omnipick@2500-1800``, ``full``, ``omnipick+text_budget=64@512-368``."""
        if self.name == "full":
            return "full"
        spec = self.spec.replace(":", "+").replace(",", "+")
        return f"{spec}{f'+recall={self.recall}' if self.recall else ''}@{self.high}-{self.low}"

    @property
    def label(self) -> str:
        base = PAPER_LABELS.get(self.name, self.name)
        if self.overrides:
            base += " (" + ", ".join(f"{k}={v}" for k, v in self.overrides) + ")"
        return base + (" + recall" if self.recall else "")

    @property
    def watermarks(self) -> str:
        return "-" if self.name == "full" else f"{self.high}/{self.low}"

    def build(self) -> RetentionPolicy:
        return make_policy(self.name, high=self.high, low=self.low, **dict(self.overrides))

    def session_kwargs(self) -> dict:
        """OmniSession keywords besides the policy (the recall store)."""
        return {"recall": self.recall} if self.recall else {}

    def to_json(self) -> dict:
        d = {"name": self.name, "overrides": dict(self.overrides), "high": self.high, "low": self.low,
             "key": self.key}
        if self.recall:  # run folders made before recall stay valid
            d["recall"] = self.recall
        return d


def parse_policy_spec(text: str) -> tuple[str, tuple[tuple[str, int | str], ...]]:
    """``omnipick:text_budget=64,recent_units=3`` -> ("omnipick", (("recent_units", 3), ("text_budget", 64))).
    Values are integers, except ``positions`` (``shift`` or ``keep``), ``recent_count`` (``media`` or ``all``) and
    ``leftover`` (``audio+text``, ...)."""
    name, _, rest = text.strip().partition(":")
    name = name.strip().lower()
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r} in {text!r}; choose from {', '.join(sorted(POLICIES))}")
    overrides: dict[str, int | str] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        m = re.fullmatch(r"positions=([a-z]+)", part)
        if m:
            if m.group(1) not in POSITION_MODES:
                raise ValueError(f"policy option {part!r} in {text!r}: positions is one of {', '.join(POSITION_MODES)}")
            overrides["positions"] = m.group(1)
            continue
        m = re.fullmatch(r"recent_count=([a-z]+)", part)
        if m:
            if m.group(1) not in RECENT_COUNTS:
                raise ValueError(f"policy option {part!r} in {text!r}: recent_count is one of "
                                 f"{', '.join(RECENT_COUNTS)}")
            overrides["recent_count"] = m.group(1)
            continue
        m = re.fullmatch(r"leftover=([a-z+]+)", part)
        if m:
            try:
                overrides["leftover"] = "+".join(parse_leftover(m.group(1))) or "off"
            except RetentionError as e:
                raise ValueError(f"policy option {part!r} in {text!r}: {e}") from None
            continue
        m = re.fullmatch(r"([a-z_]+)=(-?\d+)", part)
        if not m:
            raise ValueError(f"policy option {part!r} in {text!r} is not NAME=INTEGER (e.g. text_budget=64)")
        overrides[m.group(1)] = int(m.group(2))
    return name, tuple(sorted(overrides.items()))


def parse_watermarks(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m:
        raise ValueError(f"watermarks {text!r} are not HIGH/LOW in tokens (e.g. 2500/1800)")
    high, low = int(m.group(1)), int(m.group(2))
    if not 0 < low <= high:
        raise ValueError(f"watermarks {text!r}: need 0 < LOW <= HIGH")
    return high, low


def expand_settings(policies: list[str] | None, watermarks: list[str] | None,
                    recall: int | None = None) -> list[PolicySetting]:
    """Every policy spec at every watermark pair (``full`` once), in the order given; each is built once here
    so that a bad option fails before any model is loaded. ``recall`` (bytes): each evicting setting also runs
    with a recall store of that size, right after itself (paired in the study's tests)."""
    specs = [parse_policy_spec(p) for p in (policies or PAPER_POLICIES)]
    marks = [parse_watermarks(w) for w in watermarks] if watermarks else [DEFAULT_WATERMARKS]
    out: list[PolicySetting] = []
    seen: set[str] = set()
    for high, low in marks:
        for name, overrides in specs:
            s = PolicySetting(name, overrides, high, low)
            if s.key in seen:
                continue
            try:
                s.build()
            except (RetentionError, TypeError) as e:
                raise ValueError(f"policy {s.spec} at {high}/{low}: {e}") from None
            seen.add(s.key)
            out.append(s)
            if recall and name != "full":
                out.append(PolicySetting(name, overrides, high, low, recall=int(recall)))
    return out
