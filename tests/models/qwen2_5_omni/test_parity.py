"""Parity with transformers' Qwen2_5OmniThinkerForConditionalGeneration on a tiny, fully random thinker.

Both load the same released-layout folder. For text, an image larger than one attention window, 3 s of audio
(two encoder chunks) and a 4-grid video with 4 s of interleaved audio: TMRoPE positions and rope deltas are
identical, encoder outputs and logits agree to about 1e-5 in float32 (a correct port differs by ~5e-6 here; the
porting mistakes of the reference's table move logits by 1e-3 to 5), and greedy continuations equal generate().
"""

import numpy as np
import pytest

from ._util import prompt, to_torch

torch = pytest.importorskip("torch")

LOGIT_TOL = 2e-5
ENCODER_TOL = 1e-5


def _inputs(proc, case):
    rng = np.random.default_rng(7)
    if case == "text":
        return proc(prompt("", "Tell me a story about a cat."))
    if case == "image":  # 84x112 px -> grid [1, 6, 8]: 12 tokens in 4 windows of 2x2 merged tokens
        img = rng.integers(0, 256, (84, 112, 3), dtype=np.uint8)
        return proc(prompt("<|vision_bos|><|IMAGE|><|vision_eos|>"), images=[img])
    if case == "audio":  # 3 s: encoder chunks of 200 + 100 mel frames, 75 tokens
        audio = (0.1 * rng.standard_normal(48000)).astype(np.float32)
        return proc(prompt("<|audio_bos|><|AUDIO|><|audio_eos|>"), audio=[audio])
    if case == "video_audio":  # 8 frames of 56x56 at 2 fps -> grid [4, 4, 4], 4 s audio: V8 A50 V8 A50
        frames = rng.integers(0, 256, (8, 56, 56, 3), dtype=np.uint8)
        audio = (0.1 * rng.standard_normal(64000)).astype(np.float32)
        return proc(prompt("<|vision_bos|><|VIDEO|><|vision_eos|>"), videos=[frames], audio=[audio],
                    use_audio_in_video=True, video_min_pixels=56 * 56, video_max_pixels=56 * 56)
    raise ValueError(case)


CASES = ["text", "image", "audio", "video_audio"]


@pytest.fixture(scope="module")
def runs(tiny, hf_thinker):
    """Per case: our inputs, our logits, transformers' logits / positions / deltas (computed once)."""
    model, proc = tiny
    out = {}
    for case in CASES:
        inputs = _inputs(proc, case)
        t = to_torch(inputs)
        with torch.no_grad():
            ref = hf_thinker(**t).logits.numpy()
            pos, deltas = hf_thinker.model.get_rope_index(
                t["input_ids"], t.get("image_grid_thw"), t.get("video_grid_thw"), t["attention_mask"],
                inputs.get("use_audio_in_video", False),
                t["feature_attention_mask"].sum(-1) if "feature_attention_mask" in t else None,
                t.get("video_second_per_grid"))
        out[case] = (inputs, np.array(model(**inputs)), ref, pos.numpy(), deltas.numpy())
    return out


@pytest.mark.parametrize("case", CASES)
def test_positions_exact(tiny, runs, case):
    model, _ = tiny
    inputs, _, _, pos, deltas = runs[case]
    ours, our_deltas = model.get_rope_index(
        inputs["input_ids"], inputs.get("image_grid_thw"), inputs.get("video_grid_thw"), inputs["attention_mask"],
        inputs.get("use_audio_in_video", False), inputs.get("feature_attention_mask"),
        inputs.get("video_second_per_grid"))
    np.testing.assert_array_equal(ours, pos)
    np.testing.assert_array_equal(our_deltas, deltas)


def test_rope_deltas_are_nontrivial(runs):
    """The media cases really exercise TMRoPE (compressed positions), as the reference's table says."""
    assert runs["text"][4].item() == 0
    assert runs["image"][4].item() == -8
    assert runs["video_audio"][4].item() == -18


@pytest.mark.parametrize("case", CASES)
def test_logits_match(runs, case):
    inputs, ours, ref, _, _ = runs[case]
    assert ours.shape == ref.shape
    assert np.abs(ref).max() > 1.0  # randomised weights give logits of a few units, not ~0.7
    np.testing.assert_allclose(ours, ref, rtol=0, atol=LOGIT_TOL)


def test_image_encoder_matches(tiny, hf_thinker, runs):
    model, _ = tiny
    inputs = runs["image"][0]
    with torch.no_grad():
        ref = hf_thinker.model.get_image_features(torch.tensor(inputs["pixel_values"]),
                                                  torch.tensor(inputs["image_grid_thw"])).pooler_output
    ref = torch.cat(list(ref)).numpy()
    ours = np.array(model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]))
    np.testing.assert_allclose(ours, ref, rtol=0, atol=ENCODER_TOL)


def test_video_encoder_matches(tiny, hf_thinker, runs):
    model, _ = tiny
    inputs = runs["video_audio"][0]
    with torch.no_grad():
        ref = hf_thinker.model.get_video_features(torch.tensor(inputs["pixel_values_videos"]),
                                                  torch.tensor(inputs["video_grid_thw"])).pooler_output
    ref = torch.cat(list(ref)).numpy()
    ours = np.array(model.get_image_features(inputs["pixel_values_videos"], inputs["video_grid_thw"]))
    np.testing.assert_allclose(ours, ref, rtol=0, atol=ENCODER_TOL)


@pytest.mark.parametrize("case", ["audio", "video_audio"])
def test_audio_encoder_matches(tiny, hf_thinker, runs, case):
    model, _ = tiny
    inputs = runs[case][0]
    with torch.no_grad():
        ref = hf_thinker.model.get_audio_features(torch.tensor(inputs["input_features"]),
                                                  torch.tensor(inputs["feature_attention_mask"])).last_hidden_state
    ours = np.array(model.get_audio_features(inputs["input_features"], inputs["feature_attention_mask"]))
    np.testing.assert_allclose(ours, ref.numpy(), rtol=0, atol=ENCODER_TOL)


def test_merged_input_embeddings_and_final_hidden_state(tiny, hf_thinker, runs):
    """The comparison points before the LM head: merged embeddings and the last RMSNorm's output."""
    model, _ = tiny
    inputs = runs["video_audio"][0]
    t = to_torch(inputs)
    with torch.no_grad():
        out = hf_thinker(**t, output_hidden_states=True)
    embeds, positions, _, _ = model.prepare(**inputs)
    np.testing.assert_allclose(np.array(embeds), out.hidden_states[0].numpy(), rtol=0, atol=ENCODER_TOL)
    hidden = model.language_model.hidden_states(embeds, None, positions[:, 0])
    np.testing.assert_allclose(np.array(hidden), out.hidden_states[-1].numpy(), rtol=0, atol=LOGIT_TOL)


@pytest.mark.parametrize("case", CASES)
def test_greedy_continuation_equals_generate(tiny, hf_thinker, runs, case):
    model, _ = tiny
    inputs = runs[case][0]
    t = to_torch(inputs)
    eos = hf_thinker.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    with torch.no_grad():
        ref = hf_thinker.generate(**t, max_new_tokens=8, do_sample=False)[0, t["input_ids"].shape[1]:].tolist()
    ours = model.generate(max_new_tokens=8, stop_token_ids=eos, **inputs)
    assert ours == ref


def test_left_padded_batch_matches(tiny, hf_thinker):
    model, proc = tiny
    inputs = proc([prompt("", "Hi."), prompt("", "A much longer question about many things at once?")])
    assert inputs["attention_mask"][0, 0] == 0  # left padding
    with torch.no_grad():
        ref = hf_thinker(**to_torch(inputs)).logits.numpy()
    ours = np.array(model(**inputs))
    valid = inputs["attention_mask"].astype(bool)
    np.testing.assert_allclose(ours[valid], ref[valid], rtol=0, atol=LOGIT_TOL)


def test_accepts_mlx_arrays(tiny, runs):
    import mlx.core as mx

    model, _ = tiny
    inputs, ours, _, _, _ = runs["image"]
    as_mx = {k: mx.array(v) if isinstance(v, np.ndarray) else v for k, v in inputs.items()}
    np.testing.assert_array_equal(np.array(model(**as_mx)), ours)
