"""Qwen3-Omni through the engine: a unit with a frame reaches the thinker with its DeepStack features (the
adapter's ``extras["deepstack"]``, passed on by the MLX backend because the language model names it), so the
session's logits are the port's own streamed forward's."""

import mlx.core as mx
import numpy as np

from omnitide_mlx.session import OmniSession

from .test_streaming import audio, frame

TOL = 1e-4


def reference(model, proc, steps, deepstack=True):
    """The last logits of the units streamed by hand through an mlx-lm cache (test_streaming.py checks this path
    against transformers)."""
    adapter, cache, start, out = model.stream_adapter(proc), model.make_cache(), 0, None
    for kind, args in steps:
        u = adapter.system_unit(args, start) if kind == "system" else adapter.media_unit(*args, start)
        out = model.language_model(u.inputs_embeds, cache, u.positions,
                                   deepstack=u.extras.get("deepstack") if deepstack else None)[0, -1]
        start += u.length
    return np.array(out.astype(mx.float32))


def test_the_engine_passes_deepstack_to_the_thinker(q3):
    model, proc = q3
    prompt = "You are a careful observer."
    s = OmniSession((model, proc), policy="full", system_prompt=prompt)
    s.push(frame=frame(1), audio=audio(1), t=0.0)
    assert [u.kind.name for u in s.history.units] == ["SYSTEM", "MEDIA"]
    got = np.array(s._last_logits.astype(mx.float32))
    steps = [("system", prompt), ("media", (frame(1), audio(1), 0.0))]
    want = reference(model, proc, steps)
    assert np.abs(got - want).max() <= TOL
    # DeepStack matters at this checkpoint: without it the logits are far off (the test can fail)
    assert np.abs(got - reference(model, proc, steps, deepstack=False)).max() > 100 * TOL


def test_save_restore_after_evictions_continues_with_identical_logits_and_answers(q3, tmp_path):
    """OmniPick evicts (fourteen small units over the high watermark), the session is saved and restored, and both continue with
    the same DeepStack-fed logits and the same greedy answer."""
    model, proc = q3
    s = OmniSession((model, proc), policy="omnitide", high=300, low=280)
    for i in range(14):
        s.push(frame=frame(i), audio=audio(i), t=float(i))
    s.answer("Hello?", max_tokens=3)
    assert s.stats()["evictions"] > 0
    r = OmniSession.restore(s.save(tmp_path / "sess"), model=(model, proc))
    assert r.history.to_json() == s.history.to_json()
    for sess in (s, r):
        sess.push(frame=frame(9), audio=audio(9), t=14.0)
    np.testing.assert_array_equal(np.array(s._last_logits), np.array(r._last_logits))
    assert s.answer("What now?", max_tokens=4) == r.answer("What now?", max_tokens=4)
