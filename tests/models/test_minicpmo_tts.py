"""MiniCPM-o 4.5 TTS (models/minicpmo/tts.py) against the official MiniCPMTTS on a tiny random config.

Golden data: tests/data/minicpmo_tts/, written by scripts/golden/minicpmo_tts.py (official code at 28b60cf, torch
2.13.0+cpu, transformers 4.51.0, float32). The official streaming path is ``TTSStreamingGenerator.generate_with_buffer``
once per text chunk, then the buffer flush of ``streaming_generate``.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from omnitide_mlx.models.minicpmo.tts import (MiniCPMTTS, TTSArgs, TTSSampling, materialize_weight_norm,
                                              process_logits)

DATA = Path(__file__).resolve().parents[1] / "data" / "minicpmo_tts"
LOGIT_TOL = 1e-4  # float32, logit scale ~ 3
PROB_TOL = 1e-5
KINDS = ("full_attention", "sliding_window", "sliding_recompute", "reindex")


@pytest.fixture(scope="module")
def golden():
    meta = json.loads((DATA / "golden.json").read_text())
    arrays = dict(np.load(DATA / "golden.npz"))
    return meta, arrays


@pytest.fixture(scope="module")
def official_weights():
    return mx.load(str(DATA / "tts_weights.safetensors"))


def build(golden, official_weights, attention_type="full_attention", cls=MiniCPMTTS) -> MiniCPMTTS:
    meta, _ = golden
    tts = cls(TTSArgs.from_dict({**meta["tts_config"], "attention_type": attention_type}))
    weights = MiniCPMTTS.sanitize({k[4:]: v for k, v in official_weights.items()})
    tts.load_weights(list(weights.items()), strict=True)
    mx.eval(tts.parameters())
    return tts


def chunks(golden):
    meta, arrays = golden
    return [(arrays[f"ids_{i}"], arrays[f"hidden_{i}"]) for i in range(len(meta["chunk_sizes"]))]


def expected_yields(run: dict, terminated: bool = True) -> list[list[list[int]]]:
    """Per text chunk, the official yields (the flush belongs to the last feed when the LLM terminated). Checks
    the official is_last flags follow the rule feed() relies on: only the reply's final yield is marked."""
    feeds = [[t for t, _ in f] for f in run["feeds"]]
    flags = [flag for f in run["feeds"] for _, flag in f] + [flag for _, flag in run["flush"]]
    if flags:
        assert not any(flags[:-1]) and (flags[-1] or not terminated)
    if terminated:
        feeds[-1] = feeds[-1] + [t for t, _ in run["flush"]]
    return feeds


class RecordingTTS(MiniCPMTTS):
    """Keeps the head_code logits of every step."""

    def __init__(self, args):
        super().__init__(args)
        self.seen = []

    def logits(self, embeds, position, cache):
        out = super().logits(embeds, position, cache)
        self.seen.append(np.array(out))
        return out


def test_weight_norm_materialised_like_torch(golden, official_weights):
    _, arrays = golden
    g = official_weights["tts.head_code.0.parametrizations.weight.original0"]
    v = official_weights["tts.head_code.0.parametrizations.weight.original1"]
    w = np.array(materialize_weight_norm(g, v))
    np.testing.assert_allclose(w, arrays["head_code_weight"], atol=1e-6, rtol=0)
    assert np.abs(w - np.array(v)).max() > 0.1  # g is not ||v||: the materialisation matters
    tts = build(golden, official_weights)
    np.testing.assert_allclose(np.array(tts.head_code[0].weight), arrays["head_code_weight"], atol=1e-6, rtol=0)


def test_condition_matches_official(golden, official_weights):
    _, arrays = golden
    tts = build(golden, official_weights)
    for i, (ids, h) in enumerate(chunks(golden)):
        cond = np.array(tts.condition(ids, h))[0]
        np.testing.assert_allclose(cond, arrays[f"condition_{i}"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_streaming_matches_official(golden, official_weights, kind):
    """Logits of the first steps within LOGIT_TOL, audio tokens identical and chunked as the official yields."""
    meta, arrays = golden
    tts = build(golden, official_weights, kind, cls=RecordingTTS)
    reply = tts.start_reply(TTSSampling(greedy=True))
    cs = chunks(golden)
    got = [reply.feed(ids, h, last=i == len(cs) - 1) for i, (ids, h) in enumerate(cs)]
    assert reply.done
    ref = arrays[f"logits_greedy_{kind}"]
    mine = np.stack(tts.seen[: len(ref)])
    assert np.abs(mine - ref).max() < LOGIT_TOL, np.abs(mine - ref).max()
    assert got == expected_yields(meta["runs"][f"greedy_{kind}"])


def test_no_terminator_flushes_buffer(golden, official_weights):
    """The LLM stopped at its limit: every chunk fed with last=False, then finish() hands out the buffer."""
    meta, _ = golden
    run = meta["runs"]["greedy_full_attention_no_terminator"]
    tts = build(golden, official_weights)
    reply = tts.start_reply(TTSSampling(greedy=True))
    got = [reply.feed(ids, h, last=False) for ids, h in chunks(golden)]
    assert got == expected_yields(run, terminated=False)
    assert reply.finish() == [t for t, _ in run["flush"]]
    assert reply.done
    with pytest.raises(RuntimeError, match="finished"):
        reply.feed(*chunks(golden)[0])


@pytest.mark.parametrize("kind", ("full_attention", "sliding_recompute"))
def test_sampling_distribution_matches_official(golden, official_weights, kind):
    """Replays the official draws: at every step the distribution we would draw from (temperature, repetition
    penalty, top-p, top-k) equals the one torch.multinomial drew from, and the chunking follows."""
    meta, arrays = golden
    run = meta["runs"][f"sampled_{kind}"]
    probs, draws = arrays[f"probs_sampled_{kind}"], run["draws"]
    step = iter(range(len(draws)))

    def draw(p):
        i = next(step)
        ref = probs[i]
        assert np.array_equal(p > 0, ref > 0), f"step {i}: different tokens kept"
        assert np.abs(p - ref).max() < PROB_TOL, (i, np.abs(p - ref).max())
        return draws[i]

    tts = build(golden, official_weights, kind)
    reply = tts.start_reply(TTSSampling(), draw=draw)
    cs = chunks(golden)
    got = [reply.feed(ids, h, last=i == len(cs) - 1) for i, (ids, h) in enumerate(cs)]
    assert next(step, None) is None  # every official draw replayed
    assert got == expected_yields(run)
    # top-k / top-p really cut: some steps keep fewer tokens than the vocabulary
    assert min(int((probs[i] > 0).sum()) for i in range(1, len(probs))) <= 25


def test_seeded_sampling_is_reproducible(golden, official_weights):
    tts = build(golden, official_weights)
    cs = chunks(golden)

    def one(seed):
        reply = tts.start_reply(TTSSampling(), seed=seed)
        return [reply.feed(ids, h, last=i == len(cs) - 1) for i, (ids, h) in enumerate(cs)]

    a, b = one(3), one(3)
    assert a == b and sum(len(t) for f in a for t in f) > 0
    n_audio = tts.args.num_audio_tokens
    assert all(0 <= t < n_audio - 1 for f in a for c in f for t in c)  # never the eos


def test_process_logits_rules():
    s = TTSSampling(temperature=0.5, top_p=1.0, top_k=None, repetition_penalty=2.0)
    x = np.array([1.0, -1.0, 2.0, 0.5], np.float32)
    first = process_logits(x, [0, 1], s, first=True)
    np.testing.assert_allclose(first, x / 0.5)  # no penalty before the first audio token
    later = process_logits(x, [0, 1, 1], s, first=False)
    np.testing.assert_allclose(later, [2.0 / 2, -2.0 * 4, 4.0, 1.0])
    k = process_logits(x, [], TTSSampling(top_k=1, top_p=1.0, repetition_penalty=1.0), first=False)
    assert np.isfinite(k).sum() == 3  # top-k keeps at least 3 (min_tokens_to_keep)


def test_bad_inputs_raise_clear_errors(golden, official_weights):
    tts = build(golden, official_weights)
    ids, h = chunks(golden)[0]
    reply = tts.start_reply(TTSSampling(greedy=True))
    with pytest.raises(ValueError, match="empty text chunk"):
        reply.feed([], np.zeros((0, h.shape[1]), np.float32))
    with pytest.raises(ValueError, match=r"hidden states must be \[n, 64\]"):
        reply.feed(ids, h[:, :32])
    with pytest.raises(ValueError, match="one hidden state per token"):
        reply.feed(ids[:3], h)
    with pytest.raises(ValueError, match="token ids must be in"):
        reply.feed(np.full_like(ids, 10_000), h)
    with pytest.raises(ValueError, match="temperature"):
        TTSSampling(temperature=0)
    from omnitide_mlx.models.minicpmo.config import ConfigError

    with pytest.raises(ConfigError, match="attention_type"):
        TTSArgs.from_dict({"attention_type": "sliding"})
    # the bad feeds left the reply untouched; an empty *last* chunk is fine (text eos + audio bos only) and ends it
    out = reply.feed([], np.zeros((0, 64), np.float32), last=True)
    assert reply.done and out and all(len(c) == 25 for c in out[:-1]) and len(out[-1]) <= 25


# --- checkpoints --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tts_checkpoint(tmp_path_factory):
    from omnitide_mlx.models.minicpmo.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tts") / "ckpt", tts=True, init_vision=False,
                                init_audio=False)


def test_checkpoint_with_tts_loads_it(tts_checkpoint):
    from omnitide_mlx import load
    from safetensors.numpy import load_file

    model, proc = load(tts_checkpoint, dtype=mx.float32)
    tts = model.require_tts()
    assert isinstance(tts, MiniCPMTTS) and tts.args.num_audio_tokens == 6562 and tts.args.llm_dim == 128
    raw = load_file(str(tts_checkpoint / "model.safetensors"))
    assert "tts.model.embed_tokens.weight" in raw and "tts.projector_spk.linear1.weight" in raw  # official layout
    g = raw["tts.head_code.0.parametrizations.weight.original0"]
    v = raw["tts.head_code.0.parametrizations.weight.original1"]
    want = g * v / np.linalg.norm(v, axis=1, keepdims=True)
    np.testing.assert_allclose(np.array(tts.head_code[0].weight), want, atol=1e-6, rtol=0)
    # end to end on the LLM's own hidden states (final norm, one per token as input), real token ids
    ids = proc.tokenizer.encode("Hello there, how are you today?")
    hidden = model.language_model.hidden_states(model.language_model.embed_tokens(mx.array(ids))[None])[0]
    reply = tts.start_reply(TTSSampling(greedy=True, max_new_tokens_per_chunk=30))
    out = reply.feed(ids[:5], hidden[:5]) + reply.feed(ids[5:], hidden[5:], last=True)
    assert reply.done and all(len(c) == 25 for c in out[:-1]) and len(out[-1]) <= 25
    assert all(0 <= t < 6561 for c in out for t in c)


def test_checkpoint_without_tts_raises_speech_unavailable(tmp_path):
    from omnitide_mlx import load
    from omnitide_mlx.models.minicpmo.tiny import make_tiny_checkpoint
    from omnitide_mlx.models.qwen2_5_omni.speech import SpeechUnavailable

    ckpt = make_tiny_checkpoint(tmp_path / "plain", init_vision=False, init_audio=False)
    model, _ = load(ckpt, dtype=mx.float32)
    assert model.tts is None
    with pytest.raises(SpeechUnavailable, match="init_tts=false.*text only"):
        model.require_tts()
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["init_tts"] = True  # asked for, but no tts.* weights stored
    (ckpt / "config.json").write_text(json.dumps(cfg))
    model, _ = load(ckpt, dtype=mx.float32)
    with pytest.raises(SpeechUnavailable, match="no tts.* weights"):
        model.require_tts()
