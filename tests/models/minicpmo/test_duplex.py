"""Full duplex (models/minicpmo/duplex.py) against the official ``MiniCPMODuplex`` on a tiny checkpoint in the released
layout (tests/data/minicpmo_duplex/, made by scripts/golden/minicpmo_duplex.py at commit 28b60cf): per unit the
mode, the decision, every generated id, the logits of every decode step, the LLM and Whisper cache lengths, the TTS
condition and audio tokens, and the token2wav windows; the sampled session replays the official draws and compares
the distributions they were drawn from."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from omnitide_mlx.models.base import MediaError
from omnitide_mlx.core.pick import make_policy
from omnitide_mlx.core.units import SpanKind
from omnitide_mlx.models.minicpmo.duplex import BasicWindow, DuplexDecoding, DuplexSession, top_k_top_p

from ._helpers import max_diff

DATA = Path(__file__).resolve().parents[2] / "data" / "minicpmo_duplex"
TOL = 1e-4
LISTEN, CHUNK_EOS, TURN_EOS, TTS_BOS, UNIT_END = 151705, 151718, 151717, 151703, 151684


def make_audio(u: int) -> np.ndarray:
    """scripts/golden/minicpmo_duplex.py's inputs."""
    rng = np.random.default_rng(100 + u)
    t = np.arange(16000) / 16000
    return (0.1 * np.sin(2 * np.pi * (200 + 50 * u) * t) + 0.02 * rng.standard_normal(16000)).astype(np.float32)


def make_frame(u: int) -> np.ndarray:
    return np.random.default_rng(200 + u).integers(0, 256, (60, 80, 3), dtype=np.uint8)


def make_big_frame(u: int) -> np.ndarray:
    return np.random.default_rng(300 + u).integers(0, 256, (480, 640, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def golden():
    return json.loads((DATA / "golden.json").read_text()), np.load(DATA / "golden.npz")


@pytest.fixture(scope="module")
def duplex_model(tmp_path_factory, golden):
    from omnitide_mlx.models import load
    from omnitide_mlx.models.minicpmo.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("minicpmo-duplex"), **golden[0]["checkpoint"])
    return load(ckpt, dtype=mx.float32)


def run(model, processor, spec: dict, generate: dict | None = None, **kw):
    s = DuplexSession(model, processor, record=True, **kw)
    ref = make_audio(spec["ref_audio"]) if spec["ref_audio"] is not None else None
    prompt = s.prepare(spec["prefix"], spec["suffix"], ref_audio=ref)
    units = []
    for unit in spec["units"]:
        inp = unit["inputs"]
        frames = [make_frame(inp["frame"])] if "frame" in inp else \
            [make_big_frame(inp["big_frame"])] if "big_frame" in inp else None
        mode = s.streaming_prefill(audio_waveform=make_audio(inp["audio"]) if "audio" in inp else None,
                                   frame_list=frames, text_list=inp.get("text"),
                                   max_slice_nums=spec.get("max_slice_nums", 1))
        windows_before = len(s.t2w_windows)
        r = s.streaming_generate(**(generate or {}))
        units.append((mode, r, s.audio_cache.length, s.t2w_windows[windows_before:]))
    return s, prompt, units


def check_logits(name, units, arrays):
    ours = np.stack([lg[arrays["logit_ids"]] for _, r, _, _ in units for lg in r.step_logits])
    assert ours.shape == arrays[f"{name}_logits"].shape
    assert max_diff(ours, arrays[f"{name}_logits"]) <= TOL
    top = np.stack([np.sort(lg)[::-1][:16] for _, r, _, _ in units for lg in r.step_logits])
    assert max_diff(top, arrays[f"{name}_top_values"]) <= TOL


def check_unit_protocol(name, spec, units, arrays):
    """Everything but the logits: decisions, ids, cache lengths, TTS tokens and token2wav windows."""
    for i, (ref, (mode, r, whisper, windows)) in enumerate(zip(spec["units"], units)):
        where = f"{name} unit {i}"
        assert mode == ref["mode"], where
        assert r.is_listen == ref["is_listen"], where
        assert r.ids == ref["ids"], where
        assert r.end_of_turn == ref["end_of_turn"], where
        assert r.text == ref["text"], where
        assert r.kv_length == ref["kv_length"], where
        assert whisper == ref["whisper_length"], where
        assert r.tts_tokens == ref["tts_tokens"], where
        assert r.to_dict()["n_tts_tokens"] == ref["n_tts_tokens"], where
        assert [[list(w), last] for w, last in windows] == ref["t2w_calls"], where


@pytest.mark.slow
def test_greedy_session_matches_official(duplex_model, golden):
    g, arrays = golden
    spec = g["sessions"]["greedy"]
    model, processor = duplex_model
    # the official call: the session's default (sampling) decoding, greedy asked for per unit
    s, prompt, units = run(model, processor, spec, generate={"decode_mode": "greedy"},
                           decoding=DuplexDecoding(tts_greedy=True))
    assert prompt == spec["prepare"]["prompt"]
    assert s.preserve_length == spec["prepare"]["preserve_length"] == spec["prepare"]["kv_length"]
    check_unit_protocol("greedy", spec, units, arrays)
    # the session covers every path the issue asks for
    refs = spec["units"]
    assert any(u["is_listen"] for u in refs) and any(not u["is_listen"] for u in refs)
    assert any(u["end_of_turn"] and u["ids"][-2] == CHUNK_EOS for u in refs)  # a turn ended by <|turn_eos|>
    assert any(len(u["ids"]) == 21 and u["ids"][-2] == CHUNK_EOS for u in refs)  # the forced <|chunk_eos|>
    assert any(TTS_BOS in u["ids"] for u in refs)  # <|listen|> refused mid-turn
    assert {u["mode"] for u in refs} >= {"AUDIO", "OMNI", "VISION"}
    assert any(a["whisper_length"] < b["whisper_length"] for a, b in zip(refs[1:], refs))  # Whisper cache reset
    # logits of every decode step (at the recorded ids) and the TTS conditions
    check_logits("greedy", units, arrays)
    conds = [r.tts_condition for _, r, _, _ in units if r.tts_condition is not None]
    assert len(conds) == sum(u["has_condition"] for u in refs) > 0
    for i, c in enumerate(conds):
        assert max_diff(c, arrays[f"greedy_condition_{i}"]) <= TOL


@pytest.mark.slow
def test_sampled_session_replays_official_draws(duplex_model, golden):
    """torch's RNG cannot be reproduced in MLX: the official draws are replayed (LLM and TTS, in order) and the
    distributions each was drawn from compared."""
    g, arrays = golden
    spec = g["sessions"]["sampled"]
    model, processor = duplex_model
    draws = iter(spec["draws"])
    seen = []

    def draw(probs):
        d = next(draws)
        seen.append((probs, d))
        return d["id"]

    _, _, units = run(model, processor, spec, decoding=DuplexDecoding(), draw=draw)
    check_unit_protocol("sampled", spec, units, arrays)
    assert len(seen) == len(spec["draws"])
    worst = 0.0
    for probs, d in seen:
        worst = max(worst, abs(float(probs[d["id"]]) - d["p"]), max_diff(probs[d["top_ids"]], d["top_p"]))
    assert worst <= 1e-5
    assert any(not u["is_listen"] for u in spec["units"])


@pytest.mark.slow
def test_basic_window_matches_official(duplex_model, golden):
    """The official "basic" window (watermarks 300 / 250 here): whole units dropped oldest first, the kept keys
    re-rotated; every later decision, id and logit still equal the official ones."""
    g, arrays = golden
    spec = g["sessions"]["basic_window"]
    model, processor = duplex_model
    s, _, units = run(model, processor, spec, decoding=DuplexDecoding(mode="greedy", tts_greedy=True),
                      window=BasicWindow(**spec["window"]))
    check_unit_protocol("basic_window", spec, units, arrays)
    check_logits("basic_window", units, arrays)
    dropped = np.cumsum([r.dropped_units for _, r, _, _ in units])
    assert dropped.tolist() == [u["dropped_units_total"] for u in spec["units"]]
    assert dropped[-1] > 0 and all(u["kv_length"] <= spec["window"]["high"] for u in spec["units"])
    assert s.history.total_tokens == s.kv_length


@pytest.mark.slow
def test_options_session_matches_official(duplex_model, golden):
    """The less common rules: force_listen_count, sliced frames (max_slice_nums 2 on 640x480: a source image and
    its slices), a text-only unit, text after audio, and per-unit listen_prob_scale / listen_top_k / a shorter
    max_new_speak_tokens_per_chunk."""
    g, arrays = golden
    spec = g["sessions"]["options"]
    model, processor = duplex_model
    _, _, units = run(model, processor, spec, generate={"decode_mode": "greedy", **spec["generate"]},
                      decoding=DuplexDecoding(tts_greedy=True, force_listen_count=spec["force_listen_count"]))
    check_unit_protocol("options", spec, units, arrays)
    check_logits("options", units, arrays)
    refs = spec["units"]
    assert [u["ids"][0] for u in refs[:2]] == [LISTEN, LISTEN] and {"TEXT", "OMNI"} <= {u["mode"] for u in refs}
    assert any(len(u["ids"]) == 9 and u["ids"][-2] == CHUNK_EOS for u in refs)  # forced at the 8th step


def rope_np(x: np.ndarray, pos: np.ndarray, base: float) -> np.ndarray:
    """NeoX RoPE in float64 NumPy: ``x`` [..., T, D] at positions ``pos`` [T] (independent of MLX's)."""
    d = x.shape[-1]
    inv = base ** (-np.arange(0, d // 2, dtype=np.float64) * 2 / d)
    ang = pos.astype(np.float64)[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
    return x * cos + rot * sin


def test_retention_policy_bounds_the_cache_and_keeps_unit_classes(tiny):
    """OmniPick instead of the window: the cache stays under the high watermark; the history matches the cache
    (length, next position = cache length); units keep their decision as label and their spans' kinds; each plan
    is applied as planned: the kept rows' values unchanged, their keys rotated back by their shift (checked with
    a NumPy RoPE)."""
    model, processor = tiny
    policy = make_policy("omnipick", high=200, low=150)
    s = DuplexSession(model, processor, DuplexDecoding(mode="greedy"), generate_audio=False, retention=policy)
    applied = []
    plan_fn = policy.plan

    def plan(history):
        p = plan_fn(history)
        if p is not None:
            applied.append((p, [(np.array(c.keys[:, :, :c.offset]), np.array(c.values[:, :, :c.offset]))
                                for c in s.cache]))
        return p

    policy.plan = plan
    s.prepare("<|im_start|>system\nYou are a helpful assistant.", "<|im_end|>")
    for u in range(10):
        s.streaming_prefill(audio_waveform=make_audio(u), frame_list=[make_frame(u)] if u % 3 == 0 else None)
        n_plans = len(applied)
        r = s.streaming_generate()
        assert s.history.total_tokens == s.kv_length == s.history.next_position() <= 200
        assert s.history[0].label == "system" and s.history[0].length == s.preserve_length
        assert s.history.stream_units[-1].label == r.decision
        if len(applied) > n_plans:
            p, before = applied[-1]
            assert r.evicted_tokens == p.deleted_tokens > 0
            keep, shifts = np.flatnonzero(p.keep_mask()), p.kept_token_shifts()
            for (k0, v0), c in zip(before, s.cache):
                np.testing.assert_array_equal(np.array(c.values[:, :, :c.offset]), v0[:, :, keep])
                want = rope_np(k0[:, :, keep].astype(np.float64), -shifts, model.config.text.rope_theta)
                assert max_diff(c.keys[:, :, :c.offset], want) < 1e-5
    assert applied and s.dropped_tokens == sum(p.deleted_tokens for p, _ in applied)
    kinds = {sp.kind for x in s.history.stream_units for sp in x.spans}
    assert {SpanKind.AUDIO, SpanKind.BOUNDARY} <= kinds
    with pytest.raises(ValueError, match="not both"):
        DuplexSession(model, processor, window=BasicWindow(), retention=policy, generate_audio=False)


@pytest.mark.slow
def test_long_session_state_stays_bounded(duplex_model):
    """40 units (the mel buffer slides at 30 s; the tiny Whisper table of 300 frames restarts every 5 units) with
    retention at 300 / 200: the LLM cache, the Whisper cache, the mel and audio buffers, the history and the
    decoder's repetition history all stay bounded (the history in tokens, as the cache)."""
    model, processor = duplex_model
    s = DuplexSession(model, processor, DuplexDecoding(mode="greedy"), generate_audio=False,
                      retention=make_policy("omnipick", high=300, low=200))
    s.prepare("<|im_start|>system\nYou are a helpful assistant.", "<|im_end|>")
    for u in range(40):
        s.streaming_prefill(audio_waveform=make_audio(u), frame_list=[make_frame(u)] if u % 4 == 0 else None)
        r = s.streaming_generate()
        assert r.kv_length <= 300 and s.history.total_tokens == s.kv_length
        assert s.audio_cache.length < 300 and len(s.audio_buffer) == 80
        assert len(s.mel.buffer) <= 31 * 16000  # slides 10 s once it holds 30 s
        assert len(s.decoder.history) <= 2 * s.cfg.repetition_window
    assert s.whisper_resets >= 6 and s.mel.base > 0 and s.dropped_tokens > 0


def test_top_k_top_p_keeps_the_first_token_past_p():
    x = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    out = top_k_top_p(x, top_k=0, top_p=0.7)
    assert np.isfinite(out[:2]).all() and np.isinf(out[2:]).all()
    out = top_k_top_p(x, top_k=1, top_p=0.0)
    assert np.isfinite(out[0]) and np.isinf(out[1:]).all()


def test_bad_units_are_refused_before_anything_is_fed(tiny):
    model, processor = tiny
    s = DuplexSession(model, processor, generate_audio=False)
    s.prepare("<|im_start|>system\nhi<|im_end|>\n")
    n = s.kv_length
    with pytest.raises(TypeError, match="unknown streaming_generate arguments: nope"):
        s.streaming_generate(nope=1)
    with pytest.raises(MediaError, match="needs audio, frames or text"):
        s.streaming_prefill()
    with pytest.raises(MediaError, match="NaN"):
        s.streaming_prefill(audio_waveform=np.full(16000, np.nan, np.float32))
    assert s.kv_length == n
    s.streaming_prefill(audio_waveform=make_audio(0))
    s.streaming_generate()
    n = s.kv_length
    with pytest.raises(MediaError, match="audio not enough"):
        s.streaming_prefill(audio_waveform=make_audio(1)[:8000])
    assert s.streaming_generate().is_listen and s.kv_length == n  # no unit pending: listen, nothing fed
    assert len(s.audio_buffer) == 80 + 8000  # the short audio is kept for the next unit
    s.streaming_prefill(audio_waveform=make_audio(1)[8000:])
    assert s.kv_length == n + 11 and len(s.audio_buffer) == 80  # <unit> + 10 audio embeddings
