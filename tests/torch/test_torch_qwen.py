"""transformers' Qwen2.5-Omni thinker streamed unit by unit through OmniTorchCache: equal to the offline forward over
the concatenated sequence; after an OmniPick eviction equal to a reference that keeps the full prefix, masks the
deleted tokens and computes the kept keys at their shifted positions; ``generate()`` through the cache equal to
greedy decoding on that reference."""

import numpy as np
import pytest
import torch
from qwen_omni_steps import TOL, av_steps, offline_inputs, prepare_unit, random_audio, random_frame
from torch_stream import DEVICE
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import apply_rotary_pos_emb

from omnitide_mlx.core.page import AllocClass
from omnitide_mlx.core.pick import OmniPick, apply_plan
from omnitide_mlx.core.units import History
from omnitide_mlx.torch.cache import OmniTorchCache


def _stream(model, adapter, steps, cache):
    """Prepare and prefill ``steps`` one unit at a time; returns (units, logits per unit [T, vocab], history)."""
    history, units, logits = History(), [], []
    lm = model.hf.model.language_model
    for i, (kind, args) in enumerate(steps):
        start = history.next_position()
        cache.set_owner(i, AllocClass.MUST_KEEP if kind == "system" else AllocClass.RECENT_CONTEXT)
        u = prepare_unit(adapter, kind, args, i, start)
        pos = torch.as_tensor(u.positions, device=DEVICE)[:, None, :]
        with torch.no_grad():
            h = lm(inputs_embeds=u.inputs_embeds[None], position_ids=pos, cache=cache, use_cache=True)
            logits.append(model.hf.lm_head(h.last_hidden_state)[0])
        history.append(u.to_unit(i))
        units.append(u)
    return units, logits, history


def _cache(model, **kw):
    return OmniTorchCache.for_spec(model.kv_spec(), dtype=torch.float32, device=DEVICE, **kw)


def _offline_inputs(proc, units, steps):
    """The offline inputs (tests/qwen_omni_steps.py) as tensors on the test device, in the dtypes transformers'
    processor gives: an int64 feature mask, float32 seconds per grid."""
    dtypes = {"feature_attention_mask": np.int64, "video_second_per_grid": np.float32}
    out = {k: torch.as_tensor(np.asarray(v, dtypes.get(k)), device=DEVICE)
           for k, v in offline_inputs(proc, units, steps).items() if k != "use_audio_in_video"}
    out["use_audio_in_video"] = True
    return out


@pytest.mark.parametrize("kernel", ["sdpa", "flex", "reference"])
def test_streaming_equals_transformers_offline(torch_qwen, kernel):
    model, proc = torch_qwen
    steps = av_steps()
    units, logits, history = _stream(model, model.stream_adapter(proc), steps, _cache(model, kernel=kernel))
    inputs = _offline_inputs(proc, units, steps)
    with torch.no_grad():
        ref = model.hf(**inputs).logits[0]
        pos, _ = model.hf.model.get_rope_index(inputs["input_ids"], None, inputs["video_grid_thw"],
                                               inputs["attention_mask"], True, inputs["feature_attention_mask"].sum(-1),
                                               inputs["video_second_per_grid"])
    np.testing.assert_array_equal(history.positions(), pos[:, 0].cpu().numpy())
    streamed = torch.cat(logits).cpu().numpy()
    assert np.abs(ref.cpu().numpy()).max() > 1.0  # a randomised model: logits of magnitude ~4
    np.testing.assert_allclose(streamed, ref.cpu().numpy(), rtol=0, atol=TOL)


def recompute_reference(hf, prefix_embeds, prefix_pos, keep, kept_pos, new_embeds, new_pos):
    """Logits of new tokens after an eviction, recomputed without any cache or re-rotation: the prefix runs in full
    (its kept tokens' layer inputs are what they were when written), the kept tokens' keys are computed afresh at
    their shifted positions, and the new tokens attend to the kept tokens and causally to themselves."""
    lm = hf.model.language_model

    def cs(p, x):
        return lm.rotary_emb(x, torch.as_tensor(np.asarray(p), device=DEVICE)[:, None, :])

    def qkv(a, x, cos, sin):
        b, t, _ = x.shape
        heads = a.head_dim

        def split(y):
            return y.view(b, t, -1, heads).transpose(1, 2)

        q, k = apply_rotary_pos_emb(split(a.q_proj(x)), split(a.k_proj(x)), cos, sin)
        return q, k, split(a.v_proj(x))

    idx = torch.as_tensor(np.nonzero(keep)[0], device=DEVICE)
    n_new, n_kept = new_embeds.shape[0], int(keep.sum())
    mask = torch.cat([torch.ones(n_new, n_kept, dtype=torch.bool), torch.ones(n_new, n_new).tril().bool()], 1)
    mask = mask.to(DEVICE)
    h, hn = prefix_embeds[None], new_embeds[None]
    (cp, sp), (ck, sk), (cn, sn) = cs(prefix_pos, h), cs(kept_pos, h), cs(new_pos, h)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for layer in lm.layers:
        a = layer.self_attn
        x, xn = layer.input_layernorm(h), layer.input_layernorm(hn)
        q, k, v = qkv(a, x, cp, sp)
        out = sdpa(q, k, v, is_causal=True, scale=a.scaling, enable_gqa=True)
        _, kk, vv = qkv(a, x[:, idx], ck, sk)
        qn, kn, vn = qkv(a, xn, cn, sn)
        outn = sdpa(qn, torch.cat([kk, kn], 2), torch.cat([vv, vn], 2), attn_mask=mask, scale=a.scaling,
                    enable_gqa=True)
        h = h + a.o_proj(out.transpose(1, 2).reshape(1, h.shape[1], -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        hn = hn + a.o_proj(outn.transpose(1, 2).reshape(1, n_new, -1))
        hn = hn + layer.mlp(layer.post_attention_layernorm(hn))
    return hf.lm_head(lm.norm(hn))[0]


@pytest.fixture(scope="module")
def evicted(torch_qwen):
    """Five frame+audio seconds through the cache, then one OmniPick plan (older units trimmed to sinks)."""
    model, proc = torch_qwen
    rng = np.random.default_rng(9)
    steps = [("system", None)] + [("media", (random_frame(rng, 56, 84), random_audio(rng, 1.0))) for _ in range(5)]
    adapter = model.stream_adapter(proc)
    cache = _cache(model, placement="first_fit")
    units, _, history = _stream(model, adapter, steps, cache)
    plan = OmniPick(high=230, low=200, recent_units=2, image_sink=2, audio_sink=2, text_budget=8).plan(history)
    return model, proc, adapter, cache, units, history, plan, rng


def test_omnipick_eviction_matches_recompute_with_shifted_positions(evicted):
    model, proc, adapter, cache, units, history, plan, rng = evicted
    keep, shifts = plan.keep_mask(), plan.kept_token_shifts()
    assert 0 < plan.deleted_tokens and len(np.unique(shifts)) >= 3 and shifts.max() > 0
    new_history = apply_plan(history, plan)
    np.testing.assert_array_equal(new_history.positions(), history.positions()[:, keep] - shifts)
    cache.evict(plan, history)
    assert cache.rotated_rows == int((shifts != 0).sum())
    nxt = adapter.media_unit(random_frame(rng, 84, 56), random_audio(rng, 1.0), 5.0, new_history.next_position())
    question = adapter.user_unit("What changed?", int(nxt.positions.max()) + 1)
    streamed = []
    lm = model.hf.model.language_model
    for uid, u in ((6, nxt), (7, question)):
        cache.set_owner(uid)
        with torch.no_grad():
            pos = torch.as_tensor(u.positions, device=DEVICE)[:, None]
            h = lm(inputs_embeds=u.inputs_embeds[None], position_ids=pos, cache=cache, use_cache=True)
            streamed.append(model.hf.lm_head(h.last_hidden_state)[0])
    prefix = torch.cat([u.inputs_embeds for u in units])
    new = torch.cat([nxt.inputs_embeds, question.inputs_embeds])
    new_pos = np.concatenate([nxt.positions, question.positions], axis=1)
    with torch.no_grad():
        ref = recompute_reference(model.hf, prefix, history.positions(), keep, new_history.positions(), new, new_pos)
        unshifted = recompute_reference(model.hf, prefix, history.positions(), keep, history.positions()[:, keep], new,
                                        new_pos)
    np.testing.assert_allclose(torch.cat(streamed).cpu().numpy(), ref.cpu().numpy(), rtol=0, atol=TOL)
    assert (unshifted - ref).abs().max() > 1e-2  # the shift is not a no-op


def test_generate_through_the_cache_equals_greedy_on_the_reference(torch_qwen):
    """``thinker.generate(cache=OmniTorchCache)`` after an eviction (explicit TMRoPE position ids from the units,
    a 2-D attention mask as long as the logical sequence) decodes what greedy decoding on the recompute reference
    decodes, with the same logits."""
    model, proc = torch_qwen
    rng = np.random.default_rng(11)
    steps = [("system", None)] + [("media", (random_frame(rng, 56, 56), random_audio(rng, 1.0))) for _ in range(4)]
    adapter = model.stream_adapter(proc)
    cache = _cache(model)
    units, _, history = _stream(model, adapter, steps, cache)
    plan = OmniPick(high=150, low=130, recent_units=2, image_sink=2, audio_sink=2, text_budget=8).plan(history)
    assert plan is not None and plan.kept_token_shifts().max() > 0
    cache.evict(plan, history)
    new_history = apply_plan(history, plan)
    question = adapter.user_unit("Describe it.", new_history.next_position())
    ids = torch.as_tensor(question.input_ids, dtype=torch.long, device=DEVICE)[None]
    cache.set_owner(len(steps))
    n_new = 6
    with torch.no_grad():
        out = model.hf.generate(input_ids=ids, attention_mask=torch.ones(1, cache.seen_tokens + ids.shape[1],
                                                                         dtype=torch.long, device=DEVICE),
                                position_ids=torch.as_tensor(question.positions, device=DEVICE)[:, None, :],
                                cache=cache, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                                output_logits=True, return_dict_in_generate=True)
    got = out.sequences[0, ids.shape[1]:].tolist()
    assert len(got) == n_new and cache.retained == new_history.total_tokens + question.length + n_new - 1
    assert cache.seen_tokens == history.total_tokens + question.length + n_new - 1  # the logical length
    prefix = torch.cat([u.inputs_embeds for u in units])
    tokens, embeds, pos = [], question.inputs_embeds, question.positions
    for step in range(n_new):
        with torch.no_grad():
            logits = recompute_reference(model.hf, prefix, history.positions(), plan.keep_mask(),
                                         new_history.positions(), embeds, pos)[-1]
        np.testing.assert_allclose(out.logits[step][0].cpu().numpy(), logits.cpu().numpy(), rtol=0, atol=TOL)
        tokens.append(int(logits.argmax()))
        embeds = torch.cat([embeds, adapter.embed_tokens([tokens[-1]])])
        pos = np.concatenate([pos, pos[:, -1:] + 1], axis=1)
    assert got == tokens
