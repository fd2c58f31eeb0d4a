"""Save / restore that survives moving folders and bad files (issue 15, item 6): the model is recorded by absolute
path, the model's family and KV shape are checked, every malformed file raises one RestoreError naming it, and
saves are atomic."""

import json
import os

import numpy as np
import pytest

from omnitide_mlx.errors import RestoreError, SessionError
from omnitide_mlx.media import iter_chunks
from omnitide_mlx.session import OmniSession


@pytest.fixture(scope="module")
def models(tiny_checkpoints):
    from omnitide_mlx.models import load

    return {name: load(path) for name, path in tiny_checkpoints.items()}


@pytest.fixture(scope="module")
def chunks(media_dir):
    return [(c.frame[::4, ::4].copy(), c.audio, c.t) for c in iter_chunks(media_dir / "video_10s_av.mp4", seconds=3)]


@pytest.fixture(scope="module")
def saved(models, chunks, tmp_path_factory):
    s = OmniSession(models["qwen"], policy="omnitide", high=300, low=200)
    for frame, audio, t in chunks:
        s.push(frame=frame, audio=audio, t=t)
    s.answer("Hello?", max_tokens=3)
    return s, s.save(tmp_path_factory.mktemp("saved") / "sess")


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_a_relative_model_path_is_saved_absolute(tiny_checkpoints, chunks, tmp_path, monkeypatch):
    """Before: the relative path was saved as given, so restoring from another folder looked it up on the Hub."""
    ckpt = tiny_checkpoints["qwen"]
    monkeypatch.chdir(ckpt.parent)
    s = OmniSession(ckpt.name, policy="fifo", high=300, low=200)
    s.push(frame=chunks[0][0], audio=chunks[0][1], t=0)
    path = s.save(tmp_path / "sess")
    assert json.loads((path / "session.json").read_text())["model_path"] == str(ckpt.resolve())
    monkeypatch.chdir(tmp_path)
    r = OmniSession.restore(path)
    assert r.history.to_json() == s.history.to_json()


def test_restoring_into_another_model_family_names_the_file(models, saved):
    """Before: a bare KeyError from the adapter state."""
    _, path = saved
    with pytest.raises(RestoreError, match=r"session\.json was saved from a qwen2_5_omni model; this one is minicpmo"):
        OmniSession.restore(path, model=models["minicpmo"])


def _truncate(p, keep=0.5):
    data = p.read_bytes()
    p.write_bytes(data[: int(len(data) * keep)])


BREAKS = {
    "truncated session.json": ("session.json", lambda d: _truncate(d / "session.json"), "not valid JSON"),
    "empty session.json": ("session.json", lambda d: (d / "session.json").write_text(""), "not valid JSON"),
    "session.json a list": ("session.json", lambda d: (d / "session.json").write_text("[]"), "does not hold"),
    "future format": ("session.json", lambda d: _edit(d, format=99), "format 99"),
    "missing history": ("session.json", lambda d: _edit(d, history=None, drop="history"), "missing history"),
    "bad history": ("session.json", lambda d: _edit(d, history=[{"uid": "x"}]), "malformed"),
    "no kv file": ("kv.safetensors", lambda d: (d / "kv.safetensors").unlink(), "missing"),
    "truncated kv": ("kv.safetensors", lambda d: _truncate(d / "kv.safetensors"), "cannot be read"),
    "no arrays file": ("session.safetensors", lambda d: (d / "session.safetensors").unlink(), "missing"),
    "truncated arrays": ("session.safetensors", lambda d: _truncate(d / "session.safetensors"), "cannot be read"),
    "no session.json": ("session.json", lambda d: (d / "session.json").unlink(), "no saved session"),
}


def _edit(d, drop=None, **kw):
    meta = json.loads((d / "session.json").read_text())
    meta.update(kw)
    if drop:
        del meta[drop]
    (d / "session.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("case", list(BREAKS))
def test_every_malformed_file_is_one_clear_error_naming_it(models, saved, tmp_path, case):
    _, path = saved
    name, breaker, message = BREAKS[case]
    d = _copy(path, tmp_path / "broken")
    breaker(d)
    with pytest.raises(RestoreError, match=message) as e:
        OmniSession.restore(d, model=models["qwen"])
    assert name in str(e.value) or str(d) in str(e.value)


def test_save_is_atomic_and_replaces_an_older_save_whole(models, saved, chunks, tmp_path):
    s, _ = saved
    path = s.save(tmp_path / "sess")
    before = {f.name: f.read_bytes() for f in path.iterdir()}
    s2 = OmniSession(models["qwen"], policy="omnitide", high=300, low=200)
    s2.push(frame=chunks[0][0], audio=chunks[0][1], t=0)

    def disk_full(*a, **k):  # a write that fails half way through the save
        raise OSError(28, "No space left on device")

    s2.backend.save_arrays = disk_full  # this session's backend object only
    with pytest.raises(OSError, match="No space"):
        s2.save(path)
    assert {f.name: f.read_bytes() for f in path.iterdir()} == before  # the older save is untouched
    assert sorted(os.listdir(tmp_path)) == ["sess"]  # no temporary folder left behind
    del s2.backend.save_arrays
    s2.save(path)  # a good save replaces it whole
    r = OmniSession.restore(path, model=models["qwen"])
    assert r.history.to_json() == s2.history.to_json()
    np.testing.assert_array_equal(np.array(r._last_logits), np.array(s2._last_logits))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(SessionError, match="not a saved session"):
        s2.save(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_a_restored_session_keeps_its_media_setting_and_reports_stats(models, chunks, tmp_path):
    """Before: restore built the adapter at the default setting and set no profile, so stats() raised
    AttributeError on any restored session and a session streamed at another frame size came back at the default."""
    from omnitide_mlx.core.stream_units import MediaSetting

    media = MediaSetting(frame_size=(224, 224), name="small")
    s = OmniSession(models["qwen"], policy="omnitide", high=600, low=400, media=media)
    s.push(frame=chunks[0][0], audio=chunks[0][1], t=0)
    r = OmniSession.restore(s.save(tmp_path / "sess"), model=models["qwen"])
    assert r.media == media
    assert r.stats()["tokens_per_unit"] == s.stats()["tokens_per_unit"]
    assert r.stats()["retained_cells"] == s.stats()["retained_cells"]
    r.push(frame=chunks[1][0], audio=chunks[1][1], t=1)
    s.push(frame=chunks[1][0], audio=chunks[1][1], t=1)
    assert r.stats()["retained_cells"] == s.stats()["retained_cells"]


def test_the_session_takes_a_layout_spec_and_restores_it(models, chunks, tmp_path):
    """A frozen LayoutSpec (or a layout name) chooses the KV layout apart from the policy; stats() reports it and a
    saved session comes back with it. A layout no spec can be is refused before anything is built."""
    from omnitide_mlx.core.layout import LayoutSpec, layout_spec
    from omnitide_mlx.core.page import LayoutError

    paper = layout_spec("omnipage", tail_fill=False)  # OmniPage as the paper words it
    s = OmniSession(models["qwen"], policy="omnitide", high=300, low=200, layout=paper)
    assert s.layout == paper and s.planner.tail_fill is False
    for frame, audio, t in chunks:
        s.push(frame=frame, audio=audio, t=t)
    assert s.stats()["layout_spec"] == paper.to_json()
    r = OmniSession.restore(s.save(tmp_path / "sess"), model=models["qwen"])
    assert r.layout == paper and r.planner.tail_fill is False
    assert OmniSession(models["qwen"], policy="omnitide", high=300, low=200).planner.tail_fill is True
    eager = OmniSession(models["qwen"], policy="omnipick", high=300, low=200, layout="eager")
    assert eager.stats()["layout"] == "eager" and eager.stats()["policy"] == "omnipick"
    bad = LayoutSpec("omnipage", "first_fit", "ordered_suffix", tail_fill=True)
    with pytest.raises(LayoutError, match="not a layout"):
        OmniSession("/nonexistent/model", layout=bad)
    with pytest.raises(LayoutError, match="unknown layout"):
        OmniSession("/nonexistent/model", layout="compact")
    # a save from before the layout was recorded restores with the policy's layout
    d = tmp_path / "old"
    d.mkdir()
    for f in (tmp_path / "sess").iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    _edit(d, drop="layout")
    assert OmniSession.restore(d, model=models["qwen"]).layout == layout_spec("omnipage")
