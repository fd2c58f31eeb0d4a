"""The streaming adapter: unit layouts, spans and positions, and streaming parity with transformers' offline
forward over the concatenated units (every frame a one-patch video, every unit's audio a separate clip), through
mlx-lm KVCaches and through OmniCache, with DeepStack passed at each unit's prefill; greedy decoding after a
streamed prefill; bad media."""

import mlx.core as mx
import numpy as np
import pytest

from omnitide_mlx.core.units import History, SpanKind, UnitKind
from omnitide_mlx.models.base import MediaError
from omnitide_mlx.models.qwen3_omni.adapter import FRAME_MAX_PIXELS, FRAME_MIN_PIXELS

TOL = 5e-5
SR = 16000


def frame(seed, w=96, h=64):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def audio(seed, seconds=1.0):
    return (0.1 * np.random.default_rng(100 + seed).standard_normal(int(seconds * SR))).astype(np.float32)


AV_STEPS = [("system", "You are a careful observer."), ("media", (frame(1), audio(1))),
            ("media", (frame(2), audio(2, 1.5))), ("media", (None, audio(3))), ("context", "Look closely."),
            ("media", (frame(4), audio(4, 2.4))), ("user", "What happened in these seconds?")]


def make_cache(model, kind):
    if kind == "mlx_lm":
        return model.make_cache()
    from omnitide_mlx.cache import OmniCache

    return OmniCache.for_spec(model.kv_spec(), dtype=mx.float32)


def set_owner(cache, uid, system=False):
    from omnitide_mlx.cache import OmniCache
    from omnitide_mlx.core.page import AllocClass

    if isinstance(cache, OmniCache):
        cache.set_owner(uid, AllocClass.MUST_KEEP if system else AllocClass.RECENT_CONTEXT)


def prepare(adapter, kind, args, i, start):
    if kind == "system":
        return adapter.system_unit(args, start)
    if kind == "user":
        return adapter.user_unit(args, start)
    if kind == "context":
        return adapter.context_unit(args, start)
    return adapter.media_unit(args[0], args[1], float(i), start)


def stream(model, adapter, steps, cache):
    history, units, logits = History(), [], []
    for i, (kind, args) in enumerate(steps):
        start = history.next_position()
        set_owner(cache, i, system=kind == "system")
        u = prepare(adapter, kind, args, i, start)
        logits.append(model.language_model(u.inputs_embeds, cache, u.positions,
                                           deepstack=u.extras.get("deepstack"))[0])
        history.append(u.to_unit(i))
        units.append(u)
    return units, logits, history


def offline_inputs(proc, units, steps, use_audio_in_video=True):
    rows, grids, mels = [], [], []
    for kind, args in steps:
        if kind != "media":
            continue
        if args[0] is not None:
            r, g = proc.vision.image(args[0], FRAME_MIN_PIXELS, FRAME_MAX_PIXELS)
            rows.append(r)
            grids.append(g)
        if args[1] is not None:
            mels.append(proc.audio_features(args[1]))
    ids = np.concatenate([u.input_ids for u in units]).astype(np.int64)[None]
    out = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    if rows:
        out.update(pixel_values_videos=np.concatenate(rows), video_grid_thw=np.asarray(grids, np.int64),
                   video_second_per_grid=np.ones(len(grids), np.float32))
    if mels:
        width = max(m.shape[1] for m in mels)
        feats = np.zeros((len(mels), 128, width), np.float32)
        mask = np.zeros((len(mels), width), np.int64)
        for i, m in enumerate(mels):
            feats[i, :, :m.shape[1]], mask[i, :m.shape[1]] = m, 1
        out.update(input_features=feats, feature_attention_mask=mask)
    if use_audio_in_video:
        out["use_audio_in_video"] = True
    return out


def to_torch(inputs):
    import torch

    return {k: torch.tensor(v) if isinstance(v, np.ndarray) else v for k, v in inputs.items()}


@pytest.fixture(scope="module")
def av(q3):
    model, proc = q3
    units, logits, history = stream(model, model.stream_adapter(proc), AV_STEPS, model.make_cache())
    return units, logits, history, offline_inputs(proc, units, AV_STEPS)


def test_unit_layouts_and_spans(q3, av):
    _, proc = q3
    units, _, history, _ = av
    system, first, second, audio_only, context, third, user = units
    assert proc.decode(system.input_ids, skip_special_tokens=False) == \
        "<|im_start|>system\nYou are a careful observer.<|im_end|>\n"
    text = proc.decode(first.input_ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>user\n<|vision_start|><|audio_start|><|video_pad|>")
    assert text.endswith("<|audio_pad|><|audio_end|><|vision_end|>")
    assert [s.kind for s in first.spans] == [SpanKind.BOUNDARY, SpanKind.IMAGE, SpanKind.AUDIO, SpanKind.BOUNDARY]
    assert first.spans[1].length == 6 and first.spans[2].length == 13  # 96x64 px: 2x3 merged; 1 s: 13 tokens
    assert second.spans[2].length == 20 and third.spans[2].length == 31  # 1.5 s, 2.4 s
    assert second.input_ids[0] == proc.token_ids["<|vision_start|>"]  # the turn is already open
    assert [s.kind for s in audio_only.spans] == [SpanKind.BOUNDARY, SpanKind.AUDIO, SpanKind.BOUNDARY]
    assert proc.decode(user.input_ids, skip_special_tokens=False) == \
        "What happened in these seconds?<|im_end|>\n<|im_start|>assistant\n"
    p = first.positions
    start = int(p[0, 0]) + 3  # after <|im_start|>user\n (3 tokens)
    assert p[:, 3].tolist() == [start] * 3 and p[:, 4].tolist() == [start + 1] * 3  # the bos pair: consecutive
    assert p[0, 5:11].tolist() == [start + 2] * 6  # the frame at t = p + 2
    for u, unit in zip(units, history):
        assert unit.positions.shape == (3, u.length) and u.positions.dtype == np.int64
    assert "deepstack" in first.extras and len(first.extras["deepstack"][1]) == 2
    assert "deepstack" not in audio_only.extras


@pytest.mark.parametrize("cache_kind", ["mlx_lm", "omni"])
def test_streaming_equals_transformers_offline(q3, q3_hf, av, cache_kind):
    torch = pytest.importorskip("torch")
    model, proc = q3
    units, logits, history, inputs = av
    if cache_kind == "omni":
        units, logits, history = stream(model, model.stream_adapter(proc), AV_STEPS, make_cache(model, "omni"))
    t = to_torch(inputs)
    t["video_second_per_grid"] = t["video_second_per_grid"].float()
    with torch.no_grad():
        ref = q3_hf(**t).logits[0].numpy()
        pos, _ = q3_hf.model.get_rope_index(t["input_ids"], None, t["video_grid_thw"], t["attention_mask"], True,
                                            t["feature_attention_mask"].sum(-1), t["video_second_per_grid"])
    np.testing.assert_array_equal(history.positions(), pos[:, 0].numpy())
    streamed = np.concatenate([np.array(x) for x in logits])
    np.testing.assert_allclose(streamed, ref, rtol=0, atol=TOL)
    np.testing.assert_allclose(np.array(model(**inputs))[0], ref, rtol=0, atol=TOL)


@pytest.mark.parametrize("cache_kind", ["mlx_lm", "omni"])
def test_greedy_after_streamed_prefill_equals_generate(q3, q3_hf, av, cache_kind):
    torch = pytest.importorskip("torch")
    model, proc = q3
    inputs = av[3]
    adapter = model.stream_adapter(proc)
    cache = make_cache(model, cache_kind)
    _, logits, history = stream(model, adapter, AV_STEPS, cache)
    set_owner(cache, len(AV_STEPS))
    out, nxt, last = [], history.next_position(), logits[-1][-1]
    for _ in range(6):
        token = int(mx.argmax(last).item())
        out.append(token)
        if token in adapter.stop_token_ids:
            break
        last = model.language_model(adapter.embed_tokens([token]), cache, np.full((3, 1), nxt))[0, -1]
        nxt += 1
    t = to_torch(inputs)
    t["video_second_per_grid"] = t["video_second_per_grid"].float()
    with torch.no_grad():
        ref = q3_hf.generate(**t, max_new_tokens=6, do_sample=False, eos_token_id=sorted(adapter.stop_token_ids))
    assert out == ref[0, inputs["input_ids"].shape[1]:].tolist()


def test_frame_only_and_audio_only_units_equal_offline(q3, q3_hf):
    """Frame-only units are one-patch videos without audio (use_audio_in_video off), audio-only units clips."""
    torch = pytest.importorskip("torch")
    model, proc = q3
    steps = [("system", "Watch."), ("media", (frame(7), None)), ("media", (None, audio(8))),
             ("media", (frame(9, 64, 96), None)), ("user", "And now?")]
    units, logits, history = stream(model, model.stream_adapter(proc), steps, model.make_cache())
    assert [s.kind for s in units[1].spans] == [SpanKind.BOUNDARY, SpanKind.IMAGE, SpanKind.BOUNDARY]
    inputs = offline_inputs(proc, units, steps, use_audio_in_video=False)
    t = to_torch(inputs)
    t["video_second_per_grid"] = t["video_second_per_grid"].float()
    with torch.no_grad():
        ref = q3_hf(**t).logits[0].numpy()
        pos, _ = q3_hf.model.get_rope_index(t["input_ids"], None, t["video_grid_thw"], t["attention_mask"], False,
                                            t["feature_attention_mask"].sum(-1), t["video_second_per_grid"])
    np.testing.assert_array_equal(history.positions(), pos[:, 0].numpy())
    np.testing.assert_allclose(np.concatenate([np.array(x) for x in logits]), ref, rtol=0, atol=TOL)


def test_finish_reply_and_stop_tokens(q3):
    model, proc = q3
    adapter = model.stream_adapter(proc)
    assert adapter.stop_token_ids == {proc.token_ids["<|im_end|>"], proc.token_ids["<|endoftext|>"]}
    assert adapter.finish_reply([5, 6], stopped=False) == [proc.token_ids["<|im_end|>"]] + proc.encode("\n")
    assert model.kv_spec().position_axes == 3 and model.kv_spec().num_layers == 3
    assert model.kv_spec().bytes_per_token() == 2 * 3 * 2 * 16 * 2


@pytest.mark.parametrize("frame_,audio_,match", [
    (None, None, "needs a frame, audio or both"),
    (np.zeros((8, 8), np.uint8), None, "HxWx3"),
    (None, np.zeros(100, np.float32), "too short"),
    (None, np.full(16000, np.nan, np.float32), "NaN"),
])
def test_bad_media_raises_before_anything_changes(q3, frame_, audio_, match):
    model, proc = q3
    adapter = model.stream_adapter(proc)
    with pytest.raises(MediaError, match=match):
        adapter.media_unit(frame_, audio_, 0.0, 0)
    assert adapter.turn_open is False
    assert adapter.media_unit(None, audio(1), 0.0, 0).kind is UnitKind.MEDIA


def test_kv_spec_rerotation_is_exact_for_interleaved_mrope(q3, av):
    """A uniform shift of t, h and w is one plain NeoX rotation with kv_spec().rope: keys (after k_norm) written at
    interleaved M-RoPE positions P and re-rotated by -s equal keys written at P - s (what OmniPick's eviction
    relies on)."""
    from omnitide_mlx.models.qwen3_omni.language import mrope_cos_sin, rotate_half

    model, _ = q3
    units, _, history, _ = av
    spec, lm = model.kv_spec(), model.language_model
    attn = lm.layers[0].self_attn
    x = lm.layers[0].input_layernorm(mx.concatenate([u.inputs_embeds for u in units])[None])
    k = attn.k_norm(attn.k_proj(x).reshape(1, -1, attn.n_kv_heads, attn.head_dim)).transpose(0, 2, 1, 3)
    pos = mx.array(history.positions())

    def rope(p):
        cos, sin = mrope_cos_sin(p, lm._inv_freq, lm._axis_of_freq, mx.float32)
        return k * cos + rotate_half(k) * sin

    assert len(set(lm._axis_of_freq.tolist())) == 3  # the tiny layout really mixes t, h and w
    shift = 37
    moved = spec.rope.rotate_sequence(rope(pos), np.full(pos.shape[1], -shift))
    np.testing.assert_allclose(np.array(moved), np.array(rope(pos - shift)), rtol=0, atol=2e-5)


def test_stream_units_describe_the_units_the_adapter_builds(q3):
    """The simulator's view of a unit (spans and relative positions) is the adapter's own unit at the same
    setting; at the released defaults a VGA second is 117 frame tokens + 13 audio tokens + 4 markers."""
    from omnitide_mlx.core.stream_units import MediaSetting
    from omnitide_mlx.models.qwen3_omni.adapter import stream_units

    model, proc = q3
    adapter = model.stream_adapter(proc, media=MediaSetting(frame_size=(96, 64)))
    adapter.turn_open = True
    unit = adapter.media_unit(frame(3, 200, 120), audio(3), 0.0, 50)
    su = adapter.stream_units()
    assert [(s.kind, s.length) for s in unit.spans] == list(su.runs)
    np.testing.assert_array_equal(unit.positions - 50, su.positions)
    vga = stream_units(MediaSetting())
    assert vga.tokens == 134 and dict(vga.detail)["merged_grid"] == [9, 13]
    paper = stream_units(MediaSetting(max_pixels=768 * 32 * 32))
    assert paper.tokens == 317
