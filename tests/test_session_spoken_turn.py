"""The engine's side of spoken turns: ``ask(None)`` answers the audio streamed since the last reply in the model's
chat format, ``hold_turn`` keeps a turn's units whole through retention, ``truncate_reply`` cuts a reply to what
was voiced."""

import numpy as np
import pytest

pytest.importorskip("mlx.core")

from omnitide_mlx.core.units import SpanKind, UnitKind  # noqa: E402
from omnitide_mlx.errors import MediaError  # noqa: E402
from omnitide_mlx.session import OmniSession  # noqa: E402

RNG = np.random.default_rng(0)


def _push(session, n, t0=None):
    for i in range(n):
        session.push(frame=RNG.integers(0, 255, (56, 56, 3), dtype=np.uint8),
                     audio=(RNG.standard_normal(16000) * 0.1).astype(np.float32),
                     t=None if t0 is None else t0 + i)


@pytest.mark.parametrize("family", ["qwen", "minicpmo"])
def test_spoken_question_closes_the_open_turn_in_the_chat_format(tiny_checkpoints, family):
    s = OmniSession(str(tiny_checkpoints[family]), policy="full")
    _push(s, 2)
    reply = s.answer(None, max_tokens=4)
    assert isinstance(reply, str)
    units = list(s.history)
    question, answer = units[-2], units[-1]
    assert question.kind is UnitKind.USER and answer.kind is UnitKind.REPLY
    assert [sp.kind for sp in question.spans] == [SpanKind.BOUNDARY]  # no text: the question is the audio
    assert units[-3].kind is UnitKind.MEDIA
    # the same boundary a typed question ends with: the turn close and the reply opener of the chat template
    typed = OmniSession(str(tiny_checkpoints[family]), policy="full")
    _push(typed, 2)
    typed.answer("Hi", max_tokens=1)
    tq = list(typed.history)[-2]
    assert tq.spans[-1].length == question.length
    # a second spoken question with nothing streamed since the reply has nothing to answer
    with pytest.raises(MediaError, match="no spoken turn"):
        s.answer(None)
    _push(s, 1)
    s.answer(None, max_tokens=2)  # a new turn after more audio


def test_a_text_only_model_cannot_hear_a_spoken_question(tmp_path):
    from omnitide_mlx.models.llama_gguf import load_gguf
    from omnitide_mlx.models.llama_gguf.tiny import write_tiny_gguf

    s = OmniSession(load_gguf(write_tiny_gguf(tmp_path / "tiny.gguf")), policy="full")
    with pytest.raises(ValueError, match="cannot hear"):
        s.ask(None)


def test_held_turn_units_stay_whole_until_released(tiny_checkpoints):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = OmniSession(str(tiny_checkpoints["qwen"]), policy="omnitide", high=320, low=240)
    _push(s, 4, t0=0)
    s.hold_turn(4.0)
    _push(s, 6, t0=4)
    held = [u for u in s.history if u.t is not None and u.t >= 4.0]
    assert len(held) == 6 and not any(u.trimmed for u in held)
    assert s.stats()["evictions"] > 0  # the older units were trimmed meanwhile
    assert s.cache.layout_stats().retained_cells == s.history.total_tokens
    s.answer(None, max_tokens=3)
    s.release_turn()
    _push(s, 3, t0=10)
    assert any(u.trimmed or u.t is None for u in s.history if u.t is not None and 4.0 <= u.t < 10) or \
        len([u for u in s.history if u.t is not None and 4.0 <= u.t < 10]) < 6
    with pytest.raises(ValueError):
        s.hold_turn(float("nan"))


def test_truncate_reply_keeps_the_voiced_tokens_and_the_closing(tiny_checkpoints):
    s = OmniSession(str(tiny_checkpoints["qwen"]), policy="full")
    _push(s, 2)
    s.answer(None, max_tokens=8, temp=1.0, seed=3)
    reply = list(s.history)[-1]
    resp = [sp for sp in reply.spans if sp.kind is SpanKind.RESPONSE][0]
    closing = [sp for sp in reply.spans if sp.kind is SpanKind.BOUNDARY][0].length
    before = s.history.total_tokens
    removed = s.truncate_reply(reply.uid, 3)
    assert removed == resp.length - 3
    cut = list(s.history)[-1]
    assert [(sp.kind, sp.length) for sp in cut.spans] == [(SpanKind.RESPONSE, 3), (SpanKind.BOUNDARY, closing)]
    assert s.history.total_tokens == before - removed
    assert s.cache.layout_stats().retained_cells == s.history.total_tokens
    # positions stay contiguous: the closing tokens moved down to follow the kept reply tokens
    pos = cut.positions[0]
    assert np.array_equal(pos, np.arange(pos[0], pos[0] + cut.length))
    assert s.truncate_reply(cut.uid, 10) == 0  # nothing past the end to cut
    with pytest.raises(ValueError, match="not a reply"):
        s.truncate_reply(list(s.history)[-2].uid, 0)
    _push(s, 1)
    assert isinstance(s.answer(None, max_tokens=2), str)  # the session goes on
