"""The streaming adapter: unit layouts, spans and positions, streaming parity with the offline forward (ours and
transformers'), greedy decoding after a streamed prefill, bad media, and re-rotation after an OmniPick eviction;
through mlx-lm KVCaches and through OmniCache (paged, tile-skip attention, float32 re-rotation on eviction).
The steps and the offline reference's inputs are tests/qwen_omni_steps.py's (shared with the torch path's test).
"""

import mlx.core as mx
import numpy as np
import pytest
from qwen_omni_steps import SR, TOL, av_steps, offline_inputs, prepare_unit, random_audio, random_frame

from omnitide_mlx.core.units import History, SpanKind, UnitKind
from omnitide_mlx.models.base import MediaError
from omnitide_mlx.models.qwen2_5_omni.adapter import FRAME_MAX_PIXELS, FRAME_MIN_PIXELS
from omnitide_mlx.models.qwen2_5_omni.language import mrope_cos_sin, rotate_half

from ._util import to_torch


def _make_cache(model, kind):
    """``"mlx_lm"``: mlx-lm KVCaches; ``"omni"``: an OmniCache (float32, paged, tile-skip attention)."""
    if kind == "mlx_lm":
        return model.make_cache()
    from omnitide_mlx.cache import OmniCache

    return OmniCache.for_spec(model.kv_spec(), dtype=mx.float32)


def _set_owner(cache, uid, system=False):
    from omnitide_mlx.cache import OmniCache
    from omnitide_mlx.core.page import AllocClass

    if isinstance(cache, OmniCache):
        cache.set_owner(uid, AllocClass.MUST_KEEP if system else AllocClass.RECENT_CONTEXT)


def _stream(model, adapter, steps, cache=None):
    """Prepare and prefill ``steps`` one unit at a time; returns (units, logits per unit, history, cache)."""
    history, units, logits = History(), [], []
    cache = model.make_cache() if cache is None else cache
    for i, (kind, args) in enumerate(steps):
        start = history.next_position()
        _set_owner(cache, i, system=kind == "system")
        u = prepare_unit(adapter, kind, args, i, start)
        logits.append(model.language_model(u.inputs_embeds, cache, u.positions)[0])
        history.append(u.to_unit(i))
        units.append(u)
    return units, logits, history, cache


@pytest.fixture(scope="module")
def av_stream(tiny):
    model, proc = tiny
    steps = av_steps()
    units, logits, history, cache = _stream(model, model.stream_adapter(proc), steps)
    return steps, units, logits, history, cache, offline_inputs(proc, units, steps)


def test_unit_layouts_and_spans(tiny, av_stream):
    model, proc = tiny
    _, units, _, history, _, _ = av_stream
    ids = proc.token_ids
    system, first, second, audio_only, last, user = units
    assert system.kind is UnitKind.SYSTEM and [s.kind for s in system.spans] == [SpanKind.SYSTEM]
    assert proc.decode(system.input_ids, skip_special_tokens=False).startswith("<|im_start|>system\nYou are Qwen")
    text = proc.decode(first.input_ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>user\n<|vision_bos|><|audio_bos|><|VIDEO|>")
    assert text.endswith("<|AUDIO|><|audio_eos|><|vision_eos|>")
    assert [s.kind for s in first.spans] == [SpanKind.BOUNDARY, SpanKind.IMAGE, SpanKind.AUDIO, SpanKind.BOUNDARY]
    assert first.spans[1].length == 16 and first.spans[2].length == 25  # 112x112 px frame, 1 s of audio
    assert second.input_ids[0] == ids["<|vision_bos|>"]  # the turn is already open
    assert [s.kind for s in audio_only.spans] == [SpanKind.BOUNDARY, SpanKind.AUDIO, SpanKind.BOUNDARY]
    assert [s.kind for s in last.spans] == [SpanKind.BOUNDARY, SpanKind.IMAGE, SpanKind.AUDIO, SpanKind.BOUNDARY]
    assert last.spans[2].length == 60  # 2.4 s: two interleave chunks, 50 + 10 audio tokens
    assert proc.decode(user.input_ids, skip_special_tokens=False) == \
        "What happened in these seconds?<|im_end|>\n<|im_start|>assistant\n"
    assert [s.kind for s in user.spans] == [SpanKind.TEXT, SpanKind.BOUNDARY]
    for u, unit in zip(units, history):
        assert unit.positions.shape == (3, u.length) and u.inputs_embeds.shape == (u.length, 64)
    # each unit starts one past the previous unit's largest position
    for prev, nxt in zip(history.units, history.units[1:]):
        assert nxt.positions.min() == prev.positions.max() + 1
    # the frame+audio block: shared bos position, video at t = p, audio p..p+24, shared eos one past the audio
    p = first.positions
    bos = p[0, 3]
    assert (p[:, 3:5] == bos).all() and (p[0, 5:21] == bos + 1).all()
    np.testing.assert_array_equal(p[0, 21:46], bos + 1 + np.arange(25))
    assert (p[:, 46:] == bos + 26).all()
    assert first.extras["vision_tokens"] == 16 and first.extras["audio_tokens"] == 25


@pytest.mark.parametrize("cache_kind", ["mlx_lm", "omni"])
def test_streaming_equals_transformers_offline(tiny, hf_thinker, av_stream, cache_kind):
    torch = pytest.importorskip("torch")
    model, proc = tiny
    steps, units, logits, history, _, inputs = av_stream
    if cache_kind == "omni":
        units, logits, history, _ = _stream(model, model.stream_adapter(proc), steps, _make_cache(model, "omni"))
    t = to_torch(inputs)
    with torch.no_grad():
        ref = hf_thinker(**t).logits[0].numpy()
        pos, _ = hf_thinker.model.get_rope_index(t["input_ids"], None, t["video_grid_thw"], t["attention_mask"], True,
                                                 t["feature_attention_mask"].sum(-1), t["video_second_per_grid"])
    np.testing.assert_array_equal(history.positions(), pos[:, 0].numpy())
    streamed = np.concatenate([np.array(x) for x in logits])
    np.testing.assert_allclose(streamed, ref, rtol=0, atol=TOL)
    np.testing.assert_allclose(np.array(model(**inputs))[0], ref, rtol=0, atol=TOL)


@pytest.mark.parametrize("cache_kind", ["mlx_lm", "omni"])
def test_greedy_after_streamed_prefill_equals_generate(tiny, hf_thinker, av_stream, cache_kind):
    torch = pytest.importorskip("torch")
    model, proc = tiny
    steps, _, _, _, _, inputs = av_stream
    adapter = model.stream_adapter(proc)
    _, logits, history, cache = _stream(model, adapter, steps, _make_cache(model, cache_kind))
    _set_owner(cache, len(steps))  # the reply unit
    out, nxt, last = [], history.next_position(), logits[-1][-1]
    for _ in range(6):
        token = int(mx.argmax(last).item())
        out.append(token)
        if token in adapter.stop_token_ids:
            break
        last = model.language_model(adapter.embed_tokens([token]), cache, np.full((3, 1), nxt))[0, -1]
        nxt += 1
    with torch.no_grad():
        ref = hf_thinker.generate(**to_torch(inputs), max_new_tokens=6, do_sample=False,
                                  eos_token_id=sorted(adapter.stop_token_ids))
    assert out == ref[0, inputs["input_ids"].shape[1]:].tolist()


def test_frame_only_audio_only_and_context_units(tiny, hf_thinker):
    """Units of every kind, streamed, equal one offline pass over the concatenation; frame-only positions equal
    transformers' for videos without audio."""
    torch = pytest.importorskip("torch")
    model, proc = tiny
    rng = np.random.default_rng(5)
    steps = [("system", "Be brief."), ("media", (random_frame(rng, 112, 140), None)),
             ("media", (None, random_audio(rng, 1))), ("context", "a caption"),
             ("media", (random_frame(rng, 84, 84), random_audio(rng, 1))), ("user", "Why?"),
             ("media", (random_frame(rng, 56, 56), None)), ("user", "And now?")]
    units, logits, history, _ = _stream(model, model.stream_adapter(proc), steps)
    embeds = mx.concatenate([u.inputs_embeds for u in units])
    offline = model.language_model(embeds, None, history.positions())[0]
    np.testing.assert_allclose(np.concatenate([np.array(x) for x in logits]), np.array(offline), rtol=0, atol=TOL)
    assert proc.decode(units[5].input_ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    assert proc.decode(units[6].input_ids, skip_special_tokens=False).startswith("<|im_start|>user\n")
    # frame-only and audio-only units as transformers places a video without audio and an audio
    ids = np.concatenate([u.input_ids for u in units[:3]]).astype(np.int64)[None]
    _, grid = proc.vision.image(steps[1][1][0], FRAME_MIN_PIXELS, FRAME_MAX_PIXELS)
    with torch.no_grad():
        ref, _ = hf_thinker.model.get_rope_index(torch.tensor(ids), None, torch.tensor([grid]),
                                                 torch.ones_like(torch.tensor(ids)), False, torch.tensor([100]),
                                                 torch.tensor([1.0]))
    np.testing.assert_array_equal(np.concatenate([u.positions for u in history.units[:3]], axis=1), ref[:, 0].numpy())


def test_finish_reply_and_stop_tokens(tiny):
    model, proc = tiny
    adapter = model.stream_adapter(proc)
    assert adapter.stop_token_ids == {proc.token_ids["<|im_end|>"], proc.token_ids["<|endoftext|>"]}
    adapter.media_unit(None, np.zeros(SR, np.float32), 0.0, 0)
    assert adapter.turn_open
    assert proc.decode(adapter.finish_reply([5, 6], stopped=True), skip_special_tokens=False) == "<|im_end|>\n"
    assert not adapter.turn_open
    assert adapter.decode([proc.token_ids["<|im_start|>"]] + proc.encode("hello")) == "hello"
    meta, arrays = adapter.state()
    fresh = model.stream_adapter(proc)
    fresh.load_state(meta, arrays)
    assert fresh.turn_open == adapter.turn_open
    assert adapter.kv_spec.position_axes == 3 and adapter.kv_spec.rope.traditional is False


@pytest.mark.parametrize("frame, audio, match", [
    (np.zeros((32, 32), np.uint8), None, "shape"),
    (np.zeros((32, 32, 4), np.uint8), None, "shape"),
    (np.zeros((32, 32, 3), np.float32), None, "dtype"),
    (np.zeros((1, 32, 3), np.uint8), None, "too small"),
    (None, np.zeros((SR, 2), np.float32), "shape"),
    (None, np.array([0.0, np.inf] * 800, np.float32), "NaN or infinite"),
    (None, np.zeros(0, np.float32), "empty"),
    (None, np.zeros(SR, np.int16), "dtype"),
    (None, np.zeros(100, np.float32), "too short"),
    (None, None, "needs a frame"),
])
def test_bad_media_raises_before_anything_changes(tiny, frame, audio, match):
    model, proc = tiny
    adapter = model.stream_adapter(proc)
    with pytest.raises(MediaError, match=match):
        adapter.media_unit(frame, audio, 0.0, 0)
    assert not adapter.turn_open


def test_kv_spec_rerotation_is_exact_for_mrope(tiny, av_stream):
    """A uniform shift of t, h and w is one plain NeoX rotation with kv_spec().rope: keys written at TMRoPE
    positions P and re-rotated by -s equal keys written at P - s."""
    model, _ = tiny
    _, units, _, history, _, _ = av_stream
    spec = model.kv_spec()
    lm = model.language_model
    attn = lm.layers[0].self_attn
    x = lm.layers[0].input_layernorm(mx.concatenate([u.inputs_embeds for u in units])[None])
    k = attn.k_proj(x).reshape(1, -1, attn.n_kv_heads, attn.head_dim).transpose(0, 2, 1, 3)
    pos = mx.array(history.positions())

    def rope(p):
        cos, sin = mrope_cos_sin(p, lm._inv_freq, lm.args.mrope_section, mx.float32)
        return k * cos + rotate_half(k) * sin

    shift = 37
    moved = spec.rope.rotate_sequence(rope(pos), np.full(pos.shape[1], -shift))
    np.testing.assert_allclose(np.array(moved), np.array(rope(pos - shift)), rtol=0, atol=2e-5)
    assert spec.rope.dims == attn.head_dim and spec.rope.base == lm.args.rope_theta


# --- eviction -------------------------------------------------------------------------------------------------
def _qkv(attn, x, cos, sin):
    b, t, _ = x.shape

    def heads(y, n):
        return y.reshape(b, t, n, attn.head_dim).transpose(0, 2, 1, 3)

    q, k = heads(attn.q_proj(x), attn.n_heads), heads(attn.k_proj(x), attn.n_kv_heads)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, heads(attn.v_proj(x), attn.n_kv_heads)


def recompute_reference(lm, prefix_embeds, prefix_pos, keep, kept_pos, new_embeds, new_pos):
    """Logits of new tokens after an eviction, recomputed without any cache or re-rotation: the prefix runs in
    full (its kept tokens' layer inputs are what they were when written), the kept tokens' keys are computed
    afresh at their shifted positions, and the new tokens attend to the kept tokens and causally to themselves."""
    def cs(p):
        return mrope_cos_sin(mx.array(p), lm._inv_freq, lm.args.mrope_section, mx.float32)

    (cp, sp), (ck, sk), (cn, sn) = cs(prefix_pos), cs(kept_pos), cs(new_pos)
    idx = mx.array(np.nonzero(keep)[0].astype(np.int32))
    n_new = new_embeds.shape[0]
    mask = mx.array(np.concatenate([np.ones((n_new, int(keep.sum())), bool), np.tril(np.ones((n_new, n_new), bool))],
                                   axis=1))
    h, hn = prefix_embeds[None], new_embeds[None]
    for layer in lm.layers:
        a = layer.self_attn
        x, xn = layer.input_layernorm(h), layer.input_layernorm(hn)
        q, k, v = _qkv(a, x, cp, sp)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=a.scale, mask="causal")
        _, kk, vv = _qkv(a, x[:, idx], ck, sk)
        qn, kn, vn = _qkv(a, xn, cn, sn)
        outn = mx.fast.scaled_dot_product_attention(qn, mx.concatenate([kk, kn], 2), mx.concatenate([vv, vn], 2),
                                                    scale=a.scale, mask=mask)
        h = h + a.o_proj(out.transpose(0, 2, 1, 3).reshape(1, h.shape[1], -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        hn = hn + a.o_proj(outn.transpose(0, 2, 1, 3).reshape(1, n_new, -1))
        hn = hn + layer.mlp(layer.post_attention_layernorm(hn))
    return lm.logits(lm.model.norm(hn))[0]


def _evict_kv_caches(caches, keep, shifts, rope):
    """What the cache does on eviction, on mlx-lm KVCaches: drop the deleted tokens, re-rotate kept keys by
    ``-shift`` once, in float32, with the model's RopeSpec."""
    idx = mx.array(np.nonzero(keep)[0].astype(np.int32))
    for c in caches:
        k, v = c.keys[..., :c.offset, :][:, :, idx], c.values[..., :c.offset, :][:, :, idx]
        k = rope.rotate_sequence(k, -np.asarray(shifts))
        c.state = (k, v, int(keep.sum()))


@pytest.mark.parametrize("cache_kind", ["mlx_lm", "omni"])
@pytest.mark.parametrize("high, low, n_shifts", [(230, 200, 4),  # older units trimmed to boundaries + sinks
                                                  (150, 120, 2)])  # older units dropped whole
def test_omnipick_eviction_matches_recompute_with_shifted_positions(tiny, high, low, n_shifts, cache_kind):
    from omnitide_mlx.core.pick import OmniPick, apply_plan

    model, proc = tiny
    rng = np.random.default_rng(9)
    steps = [("system", None)] + [("media", (random_frame(rng, 56, 84), random_audio(rng, 1.0))) for _ in range(5)]
    adapter = model.stream_adapter(proc)
    units, _, history, cache = _stream(model, adapter, steps, _make_cache(model, cache_kind))
    policy = OmniPick(high=high, low=low, recent_units=2, image_sink=2, audio_sink=2, text_budget=8)
    plan = policy.plan(history)
    assert plan is not None and 0 < plan.deleted_tokens < history.total_tokens
    keep, shifts = plan.keep_mask(), plan.kept_token_shifts()
    assert len(np.unique(shifts)) == n_shifts and shifts.max() > 0  # kept ranges really move
    new_history = apply_plan(history, plan)
    np.testing.assert_array_equal(new_history.positions(), history.positions()[:, keep] - shifts)

    if cache_kind == "omni":
        freed = cache.evict(plan, history)
        assert freed.size == plan.deleted_tokens and cache.rotated_rows == int((shifts != 0).sum())
    else:
        _evict_kv_caches(cache, keep, shifts, model.kv_spec().rope)
    start = new_history.next_position()
    nxt_media = adapter.media_unit(random_frame(rng, 84, 56), random_audio(rng, 1.0), 5.0, start)
    question = adapter.user_unit("What changed?", int(nxt_media.positions.max()) + 1)
    streamed = []
    for uid, u in ((len(steps), nxt_media), (len(steps) + 1, question)):
        _set_owner(cache, uid)
        streamed.append(model.language_model(u.inputs_embeds, cache, u.positions)[0])

    ref = recompute_reference(model.language_model, mx.concatenate([u.inputs_embeds for u in units]),
                              history.positions(), keep, new_history.positions(),
                              mx.concatenate([nxt_media.inputs_embeds, question.inputs_embeds]),
                              np.concatenate([nxt_media.positions, question.positions], axis=1))
    np.testing.assert_allclose(np.concatenate([np.array(x) for x in streamed]), np.array(ref), rtol=0, atol=TOL)
    # and the shift is not a no-op: at the unshifted positions the logits differ
    unshifted = recompute_reference(model.language_model, mx.concatenate([u.inputs_embeds for u in units]),
                                    history.positions(), keep, history.positions()[:, keep],
                                    mx.concatenate([nxt_media.inputs_embeds, question.inputs_embeds]),
                                    np.concatenate([nxt_media.positions, question.positions], axis=1))
    assert np.abs(np.array(unshifted) - np.array(ref)).max() > 1e-2
