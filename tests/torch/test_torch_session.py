"""TorchSession end to end on the tiny Qwen2.5-Omni checkpoint and the bundled clip: retention under the watermark
for every policy, layout invariance (native / ordered-suffix / class-aware / eager) and kernel invariance at the
session level, save / restore, bad input, sampling."""

import numpy as np
import pytest
import torch

from omnitide_mlx.errors import MediaError
from omnitide_mlx.torch.session import TorchSession

HIGH, LOW = 300, 200


def _run(model, chunks, question="What colour is the square?", max_tokens=5, **kw):
    s = TorchSession(model, high=HIGH, low=LOW, **kw)
    logits = []
    for frame, audio, t in chunks:
        s.push(frame=frame, audio=audio, t=t)
        logits.append(s._last_logits.float().cpu().numpy())
    answer = s.answer(question, max_tokens=max_tokens)
    logits.append(s._last_logits.float().cpu().numpy())
    return s, np.stack(logits), answer


@pytest.mark.parametrize("policy", ["omnitide", "omnipick", "full", "fifo", "token", "streamingllm", "h2o", "eager"])
def test_stream_then_ask_keeps_kv_under_the_high_watermark(torch_qwen, clip_chunks, policy):
    s = TorchSession(torch_qwen, policy=policy, high=HIGH, low=LOW)
    for frame, audio, t in clip_chunks:
        rec = s.push(frame=frame, audio=audio, t=t)[0]
        assert rec.kind == "media" and rec.t == t
        if policy != "full":
            assert rec.retained_cells <= HIGH or len(s.history) <= 2
        s.cache.page_table.check_history(s.history)
    assert isinstance(s.answer("What colour is the square?", max_tokens=4), str)
    st = s.stats()
    assert st["backend"] == "torch" and st["retained_cells"] == s.history.total_tokens == s.cache.retained
    assert [u.kind.value for u in s.history][-2:] == ["user", "reply"]
    assert (st["evictions"] == 0) == (policy == "full")
    if policy == "h2o":
        assert s.cache.kernel == "reference" and s.cache.collect_scores


def test_layouts_and_kernels_give_the_same_logits(torch_qwen, clip_chunks):
    """One retention sequence (OmniPick's), five physical layouts / kernels: per-update logits and the answer agree."""
    runs = {
        "native": dict(policy="omnipick"),
        "ordered_suffix": dict(policy="omnitide"),
        "class_aware": dict(policy="omnitide", migration="class_aware"),
        "eager": dict(policy="eager"),
        "flex": dict(policy="omnitide", kernel="flex"),
        "reference": dict(policy="omnitide", kernel="reference"),
    }
    out = {name: _run(torch_qwen, clip_chunks, **kw) for name, kw in runs.items()}
    for name in ("ordered_suffix", "class_aware", "eager"):
        assert out[name][0].stats()["migrations"] >= 1, name
    assert out["native"][0].stats()["migrations"] == 0
    assert out["ordered_suffix"][0].planner.mode == "ordered_suffix"
    assert out["class_aware"][0].cache.page_table.placement == "class_aware"
    assert out["flex"][0].cache.kernel == "flex" and out["native"][0].cache.kernel == "sdpa"
    ref_logits, ref_answer = out["native"][1], out["native"][2]
    for name, (s, logits, answer) in out.items():
        assert s.stats()["evictions"] >= 1
        np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=1e-5, err_msg=name)
        assert answer == ref_answer, name


def test_save_restore_continues_with_identical_logits_and_answers(torch_qwen, clip_chunks, tmp_path):
    s = TorchSession(torch_qwen, policy="omnitide", high=HIGH, low=LOW)
    for frame, audio, t in clip_chunks[:4]:
        s.push(frame=frame, audio=audio, t=t)
    s.answer("Hello?", max_tokens=3)
    s.push(audio=clip_chunks[4][1][:7000])  # less than a second: stays buffered across the save
    path = s.save(tmp_path / "sess")
    r = TorchSession.restore(path, model=torch_qwen)
    assert r.history.to_json() == s.history.to_json() and r.planner.mode == "ordered_suffix"
    assert r.stats()["retained_cells"] == s.stats()["retained_cells"]
    for sess in (s, r):
        sess.push(frame=clip_chunks[5][0], audio=clip_chunks[4][1][7000:], t=5.0)
    assert torch.equal(s._last_logits, r._last_logits)
    assert s.answer("What now?", max_tokens=6) == r.answer("What now?", max_tokens=6)
    again = TorchSession.restore(path, model=torch_qwen, kernel="reference")
    assert again.cache.kernel == "reference"


def test_a_session_loaded_from_a_path_restores_from_its_path(tiny_qwen, clip_chunks, tmp_path, device):
    s = TorchSession(str(tiny_qwen), device=device, dtype=torch.float32, policy="fifo", high=HIGH, low=LOW)
    s.push(frame=clip_chunks[0][0], audio=clip_chunks[0][1], t=0.0)
    r = TorchSession.restore(s.save(tmp_path / "sess"), device=device, dtype=torch.float32)
    assert r.model_path == str(tiny_qwen) and r.model.device.type == torch.device(device).type
    for sess in (s, r):
        sess.push(frame=clip_chunks[1][0], audio=clip_chunks[1][1], t=1.0)
    assert torch.equal(s._last_logits, r._last_logits)


def test_bad_chunks_are_rejected_before_the_cache_and_the_session_goes_on(torch_qwen, clip_chunks):
    s = TorchSession(torch_qwen, policy="omnitide", high=HIGH, low=LOW)
    s.push(frame=clip_chunks[0][0], audio=clip_chunks[0][1], t=0.0)
    before = (s.history.to_json(), s.cache.page_table.state(), s._last_logits.clone())
    bad = [dict(frame=np.zeros((8, 8, 2), np.uint8), audio=clip_chunks[1][1]),
           dict(frame=clip_chunks[1][0], audio=np.full(16000, np.nan, np.float32)),
           dict(audio=clip_chunks[1][1], sample_rate=0), dict(text=""), dict()]
    for kw in bad:
        with pytest.raises(MediaError):
            s.push(**kw)
    assert (s.history.to_json(), s.cache.page_table.state()) == before[:2]
    assert torch.equal(s._last_logits, before[2])
    s.push(frame=clip_chunks[1][0], audio=clip_chunks[1][1], t=1.0)
    assert len(s.history) == 3


def test_a_failed_forward_gives_its_slots_back(torch_qwen, clip_chunks):
    s = TorchSession(torch_qwen, policy="omnitide", high=HIGH, low=LOW)
    state = s.cache.page_table.state()
    with pytest.raises(ValueError, match="positions must be"):
        s._forward(s.adapter.embed_tokens([1, 2, 3]), np.zeros((3, 2), np.int64))
    bad_positions = np.zeros((3, 3), np.int64)
    with pytest.raises(RuntimeError):  # wrong hidden size: fails inside the first layer, after the step opened
        s._forward(torch.zeros(3, 7, device=s.model.device), bad_positions)
    assert not s.cache.in_step and s.cache.page_table.state() == state
    s.push(frame=clip_chunks[0][0], audio=clip_chunks[0][1], t=0.0)


def test_sampling_is_seeded_and_filters_apply(torch_qwen, clip_chunks):
    s = TorchSession(torch_qwen, policy="omnitide", high=HIGH, low=LOW)
    s.push(frame=clip_chunks[0][0], audio=clip_chunks[0][1], t=0.0)
    path_a = s.answer("Say something.", max_tokens=4, temp=0.8, top_p=0.9, top_k=50, min_p=0.01, seed=3)
    assert isinstance(path_a, str)
    from omnitide_mlx.engine import Sampling
    from omnitide_mlx.torch.session import make_sampler

    logits = torch.tensor([0.0, 5.0, 4.0, -3.0])
    draws = {make_sampler(Sampling(temp=1.0, top_k=2, seed=i))(logits, []) for i in range(40)}
    assert draws == {1, 2}
    assert make_sampler(Sampling(temp=0.0))(logits, []) == 1
    assert make_sampler(Sampling(temp=0.0, repetition_penalty=10.0))(logits, [1]) == 2
    a = [make_sampler(Sampling(temp=1.0, seed=7))(logits, []) for _ in range(5)]
    b = [make_sampler(Sampling(temp=1.0, seed=7))(logits, []) for _ in range(5)]
    assert a == b


def test_a_probe_leaves_the_torch_session_as_it_was(torch_qwen, clip_chunks):
    """The session's probe (the retention study's) goes through the backend, so it runs on torch too: float32 logits
    on the host, and the history, page table and H2O scores as before."""
    from omnitide_mlx.eval.probe import question_ids

    s = TorchSession(torch_qwen, policy="h2o", high=HIGH, low=LOW)
    for frame, audio, t in clip_chunks[:2]:
        s.push(frame=frame, audio=audio, t=t)
    ids = question_ids(s, "What colour is the square?")
    def table():  # the probe's tokens take sequence numbers (next_seq) and leave every slot as it was
        return {k: v for k, v in s.cache.page_table.state().items() if k != "next_seq"}

    before = (s.history.to_json(), table(), s.cache.token_scores(s.history).copy())
    a, b = s.probe_logits(ids), s.probe_logits(ids)
    assert isinstance(a, np.ndarray) and a.dtype == np.float32 and a.ndim == 1 and np.isfinite(a).all()
    np.testing.assert_array_equal(a, b)
    assert (s.history.to_json(), table()) == before[:2]
    np.testing.assert_array_equal(s.cache.token_scores(s.history), before[2])
