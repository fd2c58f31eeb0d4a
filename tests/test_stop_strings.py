"""``stop`` strings (CLI ``--stop``): never printed in part, and one string is one stop string (issue 15)."""

import pytest

from omnitide_mlx import OmniSession
from omnitide_mlx.models import load


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    return load(tiny_checkpoints["qwen"])


def pieces(model, **kw):
    session = OmniSession(model, policy="full")
    return list(session.ask("Say something.", max_tokens=16, **kw))


def test_a_stop_string_across_two_pieces_is_never_printed_in_part(model):
    free = pieces(model)
    text = "".join(free)
    # a stop string made of the last character of one piece and the first of the next: the first character was
    # printed before the engine could know the stop string follows
    i = next(i for i in range(len(free) - 1) if free[i] and free[i + 1])
    stop = free[i][-1] + free[i + 1][0]
    got = pieces(model, stop=[stop])
    assert "".join(got) == text[:text.find(stop)]
    # a held-back prefix that the next piece does not complete is printed after all
    assert "".join(pieces(model, stop=[free[i][-1] + "\x00"])) == text


def test_one_stop_string_is_not_its_characters(model):
    text = "".join(pieces(model))
    absent = next(c for c in "QXZ#@~^" if c not in text)
    assert "".join(pieces(model, stop=absent + text[0])) == text  # was cut at text[0]: empty answer
