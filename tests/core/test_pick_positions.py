"""positions="keep": a policy that leaves the gaps instead of shifting kept tokens (measured in docs/quality.md)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from unit_streams import histories

from omnitide_mlx.core.pick import (
    POLICIES,
    RetentionError,
    RetentionPlan,
    apply_plan,
    make_policy,
    plan_from_mask,
)
from omnitide_mlx.eval.policies import parse_policy_spec


@settings(max_examples=40, deadline=None)
@given(histories(), st.sampled_from(sorted(set(POLICIES) - {"full"})), st.integers(0, 2 ** 16))
def test_keep_plans_select_the_same_tokens_and_shift_nothing(h, name, seed):
    low = max(h.system_tokens + 1, h.total_tokens // 3)
    shift = make_policy(name, high=low, low=low)
    keep = make_policy(name, high=low, low=low, positions="keep")
    scores = np.random.default_rng(seed).random(h.total_tokens)
    ps, pk = shift.plan(h, scores=scores), keep.plan(h, scores=scores)
    if ps is None:
        assert pk is None
        return
    assert np.array_equal(ps.keep_mask(), pk.keep_mask())
    assert pk.positions == "keep" and not pk.kept_token_shifts().any()
    new = apply_plan(h, pk)
    # every kept token keeps its position; new tokens continue after the largest of them
    assert np.array_equal(new.positions(), h.positions()[:, pk.keep_mask()])
    assert new.next_position() == int(h.positions()[:, pk.keep_mask()].max()) + 1


def test_keep_is_validated_and_configured_explicitly():
    from omnitide_mlx.core.units import History, Span, SpanKind, Unit, UnitKind

    units = [Unit(uid=0, kind=UnitKind.SYSTEM, spans=(Span(SpanKind.SYSTEM, 0, 2),), positions=np.arange(2)[None]),
             Unit(uid=1, kind=UnitKind.USER, spans=(Span(SpanKind.TEXT, 0, 3),), positions=np.arange(2, 5)[None]),
             Unit(uid=2, kind=UnitKind.USER, spans=(Span(SpanKind.TEXT, 0, 3),), positions=np.arange(5, 8)[None])]
    h = History(units)
    mask = np.array([1, 1, 0, 0, 0, 1, 1, 1], dtype=bool)
    shifted, kept = plan_from_mask(h, mask), plan_from_mask(h, mask, positions="keep")
    assert list(shifted.kept_token_shifts()) == [0, 0, 3, 3, 3] and not kept.kept_token_shifts().any()
    kept.validate(h)
    shifted.validate(h)
    # a plan that claims one mode but carries the other's shifts is refused
    with pytest.raises(RetentionError, match="must not shift"):
        RetentionPlan(kept.policy, kept.tokens_before, kept.tokens_after, shifted.units, "keep").validate(h)
    with pytest.raises(RetentionError, match="shift rule"):
        RetentionPlan(kept.policy, kept.tokens_before, kept.tokens_after, kept.units, "shift").validate(h)
    with pytest.raises(RetentionError, match="positions must be one of"):
        plan_from_mask(h, mask, positions="gap")
    with pytest.raises(RetentionError, match="positions must be one of"):
        make_policy("token", positions="gaps")
    p = make_policy("omnipick", high=10, low=8, positions="keep")
    assert p.config()["positions"] == "keep" and "positions" not in make_policy("omnipick").config()
    assert make_policy(**p.config()).positions == "keep"  # a saved session's policy comes back the same
    assert parse_policy_spec("h2o:positions=keep,recent=4") == ("h2o", (("positions", "keep"), ("recent", 4)))
    with pytest.raises(ValueError, match="positions is one of"):
        parse_policy_spec("h2o:positions=gaps")
