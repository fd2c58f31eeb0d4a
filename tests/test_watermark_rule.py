"""One rule for the high / low watermarks everywhere (issue 32 item 10): ``high`` alone gives low = 72 % of it,
``low`` alone keeps the default high (2500), both must have low <= high. Before, the CLI derived 72 % while
``OmniSession(high=1000)`` failed with "low=1800, high=1000" (the policy's default low) and the server, which
builds its sessions the same way, refused ``high`` alone."""

from argparse import Namespace

import pytest
from hypothesis import given, strategies as st

from omnitide_mlx.commands.options import UsageError, resolve_watermarks as cli_watermarks
from omnitide_mlx.core.watermarks import LOW_RATIO, WatermarkError, watermarks
from omnitide_mlx.streaming.budget import policy_from


def _cli(high=None, low=None):
    return cli_watermarks(Namespace(high=high, low=low, kv_budget=None, max_kv_size=None))


@given(st.one_of(st.none(), st.integers(1, 10**6)), st.one_of(st.none(), st.integers(1, 10**6)))
def test_the_cli_the_policies_and_the_core_rule_agree(high, low):
    try:
        want = watermarks(high, low)
    except WatermarkError:
        with pytest.raises(UsageError):
            _cli(high, low)
        with pytest.raises(ValueError):
            policy_from("omnitide", high, low)
        return
    assert _cli(high, low) == want
    p = policy_from("omnitide", high, low)
    if want != (None, None):
        assert (p.high, p.low) == want
    if high is not None and low is None:
        assert want == (high, max(1, int(high * LOW_RATIO)))


def test_the_rule():
    assert watermarks(None, None) == (None, None)
    assert watermarks(1000, None) == (1000, 720)
    assert watermarks(None, 1000) == (2500, 1000)
    with pytest.raises(WatermarkError, match="above"):
        watermarks(500, 600)
    with pytest.raises(WatermarkError, match="give high too"):
        watermarks(None, 3000)


def test_omnisession_with_high_alone(tiny_checkpoints):
    from omnitide_mlx import OmniSession

    s = OmniSession(tiny_checkpoints["qwen"], high=1000)
    assert (s.policy.high, s.policy.low) == (1000, 720)
    s = OmniSession(tiny_checkpoints["qwen"], low=300)
    assert (s.policy.high, s.policy.low) == (2500, 300)
