"""Streaming: the official simplex protocol's KV lengths, units fed one at a time equal the offline forward, the
streamed audio equals the offline chunked encoder, and logits after an OmniPick eviction equal the masked,
shifted reference."""

import json

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from omnitide_mlx.core.pick import OmniPick, apply_plan
from omnitide_mlx.core.units import History, SpanKind
from omnitide_mlx.models.audio_features import log_mel
from omnitide_mlx.models.minicpmo.simplex import SimplexSession
from omnitide_mlx.models.minicpmo.audio import WhisperStreamCache
from omnitide_mlx.models.attention import rope_at

from ._helpers import max_diff


def stream_ref_inputs():
    rng = np.random.default_rng(0)
    frames = [Image.fromarray((rng.random((300, 500, 3)) * 255).astype(np.uint8)) for _ in range(2)]
    t = np.arange(16000) / 16000
    audios = [(0.1 * np.sin(2 * np.pi * f * t)).astype(np.float32) for f in (300, 500)]
    return [frames[0], audios[0], frames[1], audios[1]]


def test_simplex_session_reproduces_the_official_kv_lengths(tiny, fixture_dir):
    ref = json.loads((fixture_dir / "stream_ref.json").read_text())
    model, proc = tiny
    s = SimplexSession(model, proc)
    items = stream_ref_inputs()
    for i, (item, expected) in enumerate(zip(items, ref["prefill"])):
        prompt = s.streaming_prefill(item, is_last_chunk=i == len(items) - 1)
        assert prompt == expected["prompt"]
        assert len(proc.tokenizer.encode(prompt)) == expected["prompt_tokens"]
        assert s.kv_length == expected["kv_len_after"]
    chunks = list(s.streaming_generate(max_new_tokens=12, do_sample=False))
    assert [finished for _, finished in chunks] == [False, False]  # two chunks, no terminator on these weights
    assert all(isinstance(text, str) for text, _ in chunks)
    assert s.kv_length == ref["kv_len_after_generate"]
    # the next user turn closes the reply the official way
    assert s.streaming_prefill("next") == "<|tts_eos|><|im_end|>\n<|im_start|>user\nnext"


def test_simplex_audio_is_the_streaming_encoder(tiny):
    """Two audio calls: the slots hold the streamed Whisper tokens of the streaming mel (fixed -10 floor, no extra
    context), and the first call's Whisper cache is dropped as in the official session."""
    model, proc = tiny
    s = SimplexSession(model, proc)
    items = stream_ref_inputs()
    s.streaming_prefill(items[1])
    s.streaming_prefill(items[3])
    padded = np.concatenate([np.zeros(560, np.float32), items[1]])  # first chunk left-padded to 1035 ms
    mel = log_mel(np.concatenate([padded, items[3]]), 80, floor=-10.0)
    lm = model.language_model
    cache = lm.make_cache()
    logits = None
    for prompt, audio, frames in [("<|im_start|>user\n<audio>./</audio>", padded, (0, 100)),
                                  ("<audio>./</audio>", items[3], (100, 200))]:
        inputs = proc(prompt, audios=[audio])
        tokens, _ = model.audio_embeddings_streaming(mel[None, :, frames[0]:frames[1]], WhisperStreamCache())
        embeds = lm.embed_tokens(mx.array(inputs["input_ids"][0]))
        (a, b), = inputs["audio_bounds"][0]
        embeds[int(a):int(b)] = tokens
        logits = lm(embeds[None], cache=cache, positions=cache[0].offset)
    assert s.kv_length == 15 + 12
    assert max_diff(s.pending_logits, logits[:, -1]) < 1e-5


def _prefill_units(model, units, cache):
    out = []
    for u in units:
        logits = model.language_model(u.inputs_embeds[None], cache=cache, positions=u.positions[0])
        out.append(logits[0])
    return mx.concatenate(out)


def _session_units(model, proc, n_media=3, seed=5, mode="streaming"):
    rng = np.random.default_rng(seed)
    ad = model.stream_adapter(proc, mode=mode)
    units = [ad.system_unit("You are terse.", 0)]
    pos = units[0].length
    audios = []
    for k in range(n_media):
        frame = (rng.random((240, 320, 3)) * 255).astype(np.uint8) if k % 2 == 0 else None
        audio = (0.1 * rng.standard_normal(16000)).astype(np.float32)
        audios.append(audio)
        units.append(ad.media_unit(frame, audio, float(k), pos))
        pos += units[-1].length
    units.append(ad.user_unit("What happened?", pos))
    return ad, units, audios


def test_units_one_at_a_time_equal_the_offline_forward(tiny):
    model, proc = tiny
    _, units, _ = _session_units(model, proc)
    streamed = _prefill_units(model, units, model.language_model.make_cache())
    embeds = mx.concatenate([u.inputs_embeds for u in units])
    positions = np.concatenate([u.positions[0] for u in units])
    np.testing.assert_array_equal(positions, np.arange(len(positions)))
    offline = model.language_model(embeds[None])[0]
    assert max_diff(streamed, offline) < 1e-5


def test_units_one_at_a_time_through_omnicache_equal_the_offline_forward(tiny):
    cache_mod = pytest.importorskip("omnitide_mlx.cache", reason="OmniCache (omnitide_mlx/cache.py) not merged yet")
    from omnitide_mlx.core.page import AllocClass

    model, proc = tiny
    _, units, _ = _session_units(model, proc)
    cache = cache_mod.OmniCache.for_spec(model.kv_spec(), dtype=mx.float32)
    out = []
    for i, u in enumerate(units):
        cache.set_owner(i, AllocClass.MUST_KEEP if i == 0 else AllocClass.RECENT_CONTEXT)
        out.append(model.language_model(u.inputs_embeds[None], cache=cache, positions=u.positions[0])[0])
    offline = model.language_model(mx.concatenate([u.inputs_embeds for u in units])[None])[0]
    assert max_diff(mx.concatenate(out), offline) < 1e-5


def test_streamed_unit_audio_equals_offline_chunked_encoder(tiny):
    model, proc = tiny
    _, units, audios = _session_units(model, proc, n_media=3)
    got = mx.concatenate([u.inputs_embeds[s.start:s.end] for u in units[1:-1] for s in u.spans
                          if s.kind is SpanKind.AUDIO])
    assert got.shape[0] == 30
    # what the duplex session's mel saw: 560 zeros of first-chunk padding, then the audio (under 5 s: -10 floor)
    full = np.concatenate([np.zeros(560, np.float32)] + audios)
    mel = log_mel(full, 80, floor=-10.0)[:, :302]
    ref = model.audio_embeddings(mel[None], [[302]], chunk_length=1.0)[0][:30]
    assert max_diff(got, ref) < 1e-5


# --- eviction ----------------------------------------------------------------------------------------------------

def _layer_kv(model, embeds, positions):
    """Reference forward that keeps every layer's pre-RoPE keys and values."""
    lm = model.language_model
    x = embeds[None]
    kv = []
    for layer in lm.layers:
        a = layer.self_attn
        h = layer.input_layernorm(x)
        b, t, _ = h.shape
        q = a.q_norm(a.q_proj(h).reshape(b, t, a.n_heads, -1)).transpose(0, 2, 1, 3)
        k = a.k_norm(a.k_proj(h).reshape(b, t, a.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = a.v_proj(h).reshape(b, t, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
        kv.append((k, v))
        p = mx.array(positions.astype(np.int32))
        o = mx.fast.scaled_dot_product_attention(rope_at(q, p, a.head_dim, a.rope_base),
                                                 rope_at(k, p, a.head_dim, a.rope_base), v, scale=a.scale,
                                                 mask="causal")
        x = x + a.o_proj(o.transpose(0, 2, 1, 3).reshape(b, t, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return kv


def _masked_shifted_reference(model, old_embeds, old_positions, keep, new_old_positions, new_embeds, new_positions):
    """Logits of the new tokens when they see only the kept old tokens, whose keys sit at their shifted
    positions (rotated once from the pre-RoPE keys: no un-rotate / re-rotate, no compaction)."""
    lm = model.language_model
    old_kv = _layer_kv(model, old_embeds, old_positions)
    x = new_embeds[None]
    idx = mx.array(np.flatnonzero(keep).astype(np.int32))
    kpos = mx.array(new_old_positions.astype(np.int32))
    npos = mx.array(new_positions.astype(np.int32))
    t = new_embeds.shape[0]
    n_old = int(keep.sum())
    mask = mx.array(np.concatenate([np.ones((t, n_old), bool), np.tril(np.ones((t, t), bool))], axis=1))
    for layer, (k_old, v_old) in zip(lm.layers, old_kv):
        a = layer.self_attn
        h = layer.input_layernorm(x)
        q = a.q_norm(a.q_proj(h).reshape(1, t, a.n_heads, -1)).transpose(0, 2, 1, 3)
        k = a.k_norm(a.k_proj(h).reshape(1, t, a.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = a.v_proj(h).reshape(1, t, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
        keys = mx.concatenate([rope_at(k_old[:, :, idx], kpos, a.head_dim, a.rope_base),
                               rope_at(k, npos, a.head_dim, a.rope_base)], axis=2)
        values = mx.concatenate([v_old[:, :, idx], v], axis=2)
        o = mx.fast.scaled_dot_product_attention(rope_at(q, npos, a.head_dim, a.rope_base), keys, values,
                                                 scale=a.scale, mask=mask)
        x = x + a.o_proj(o.transpose(0, 2, 1, 3).reshape(1, t, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return lm.lm_head(lm.model.norm(x))[0]


def _evicted_scenario(model, proc):
    ad, units, _ = _session_units(model, proc, n_media=5, seed=9)
    media = units[:-1]  # system + 5 media units, then an eviction, then the question
    history = History([u.to_unit(i) for i, u in enumerate(media)])
    total = history.total_tokens
    policy = OmniPick(high=total - 1, low=total - 150, recent_units=2)
    plan = policy.plan(history)
    assert plan is not None and plan.deleted_tokens > 0
    new_history = apply_plan(history, plan)
    question = ad.user_unit("What happened?", new_history.next_position())
    return media, history, plan, new_history, question


def test_logits_after_omnipick_eviction_equal_the_masked_shifted_reference_kvcache(tiny):
    """Eviction on a plain mlx-lm KVCache: delete the planned rows, re-rotate kept keys by -shift (RopeSpec)."""
    model, proc = tiny
    media, history, plan, new_history, question = _evicted_scenario(model, proc)
    cache = model.language_model.make_cache()
    _prefill_units(model, media, cache)
    keep = plan.keep_mask()
    shifts = plan.kept_token_shifts()
    old_pos = history.positions()[0]
    spec = model.kv_spec().rope
    idx = mx.array(np.flatnonzero(keep).astype(np.int32))
    for c in cache:
        k, v, offset = c.state  # buffers may be preallocated past offset
        k, v = k[:, :, :offset][:, :, idx], v[:, :, :offset][:, :, idx]
        k = spec.rotate_sequence(k, -shifts).astype(k.dtype)
        c.state = (k, v, k.shape[2])
    np.testing.assert_array_equal(new_history.positions()[0], old_pos[keep] - shifts)
    got = model.language_model(question.inputs_embeds[None], cache=cache, positions=question.positions[0])[0]
    old_embeds = mx.concatenate([u.inputs_embeds for u in media])
    ref = _masked_shifted_reference(model, old_embeds, old_pos, keep, new_history.positions()[0],
                                    question.inputs_embeds, question.positions[0])
    assert max_diff(got, ref) < 2e-5
    # and the eviction mattered: the un-evicted cache gives other logits
    full = model.language_model.make_cache()
    _prefill_units(model, media, full)
    other = model.language_model(question.inputs_embeds[None], cache=full,
                                 positions=history.next_position() + np.arange(question.length))[0]
    assert max_diff(other, ref) > 1e-2


def test_logits_after_omnipick_eviction_through_omnicache(tiny):
    cache_mod = pytest.importorskip("omnitide_mlx.cache", reason="OmniCache (omnitide_mlx/cache.py) not merged yet")
    from omnitide_mlx.core.page import AllocClass

    model, proc = tiny
    media, history, plan, new_history, question = _evicted_scenario(model, proc)
    cache = cache_mod.OmniCache.for_spec(model.kv_spec(), dtype=mx.float32)
    for i, u in enumerate(media):
        cache.set_owner(i, AllocClass.MUST_KEEP if i == 0 else AllocClass.RECENT_CONTEXT)
        model.language_model(u.inputs_embeds[None], cache=cache, positions=u.positions[0])
    cache.evict(plan, history)
    cache.set_owner(len(media), AllocClass.RECENT_CONTEXT)
    got = model.language_model(question.inputs_embeds[None], cache=cache, positions=question.positions[0])[0]
    old_embeds = mx.concatenate([u.inputs_embeds for u in media])
    ref = _masked_shifted_reference(model, old_embeds, history.positions()[0], plan.keep_mask(),
                                    new_history.positions()[0], question.inputs_embeds, question.positions[0])
    assert max_diff(got, ref) < 2e-5


def test_simplex_system_prompt_then_user_turns(tiny):
    model, proc = tiny
    s = model.simplex_session(proc)
    p0 = s.streaming_prefill("Be brief.", role="system")
    assert p0 == "<|im_start|>system\nBe brief.<|im_end|>\n"
    n0 = len(proc.tokenizer.encode(p0))
    assert s.kv_length == n0
    assert s.streaming_prefill("Hi") == "<|im_start|>user\nHi"
    assert s.streaming_prefill(["there", stream_ref_inputs()[0]]) == "there<image>./</image>"
    assert s.kv_length == n0 + 4 + 1 + 66
    list(s.streaming_generate(max_new_tokens=1, do_sample=True, temperature=0.7, top_k=20, top_p=0.8))
    assert s.streaming_prefill("more").startswith("<|tts_eos|><|im_end|>\n<|im_start|>user\n")
