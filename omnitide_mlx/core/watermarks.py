"""The one rule for the high / low watermarks users give, used by the CLI, OmniSession and the server (pure
Python: the CLI's flag checks import it without NumPy)."""

from __future__ import annotations

from .errors import OmniTideError


class WatermarkError(OmniTideError, ValueError):
    """Watermarks that cannot work together (low above high, low alone above the default high)."""


DEFAULT_HIGH, DEFAULT_LOW = 2500, 1800  # the paper's watermarks (tokens)
LOW_RATIO = DEFAULT_LOW / DEFAULT_HIGH  # 0.72: low / high when only the high watermark is given


def watermarks(high: int | None = None, low: int | None = None, *, names: tuple[str, str] = ("high", "low"),
               default_high: int = DEFAULT_HIGH) -> tuple[int | None, int | None]:
    """The one rule for the watermarks users give (the CLI, OmniSession and the server all use it): ``high``
    alone gives ``low = LOW_RATIO * high`` (the paper's 1800 / 2500), ``low`` alone keeps ``default_high`` (and
    must lie under it), both must have ``low <= high``; neither is ``(None, None)``: the policy's or the model's
    own. ``names`` are how the caller spells them in messages (``--high`` / ``--low`` on the CLI)."""
    hn, ln = names
    if high is None and low is None:
        return None, None
    if high is not None and low is None:
        return int(high), max(1, int(high * LOW_RATIO))
    if high is None:
        if low > default_high:
            raise WatermarkError(f"{ln} {low} is above the default high watermark {default_high}: give {hn} too")
        return int(default_high), int(low)
    if low > high:
        raise WatermarkError(f"{ln} {low} is above {hn} {high}: the low watermark is a trim's target, below the high")
    return int(high), int(low)
