"""Parity with transformers' Qwen3OmniMoeThinkerForConditionalGeneration on a tiny, fully random thinker.

Both load the same released-layout folder (8 experts, 2 active, one dense ``mlp_only_layers`` layer, interleaved
M-RoPE with a t-only tail, DeepStack after vision blocks 0 and 1, AuT windows of 4 chunks). For text, an image of
3x4 merged tokens, 5.3 s of audio (two attention windows, a short last chunk), a 4-frame video with its audio
interleaved and a left-padded batch: positions and rope deltas are identical, encoder outputs and logits agree to
~1e-5 in float32, and greedy continuations equal generate().
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

LOGIT_TOL = 5e-5
ENCODER_TOL = 2e-5
CASES = ["text", "image", "audio", "video_audio"]


def prompt(media: str, question: str = "What do you see and hear?") -> str:
    return f"<|im_start|>user\n{media}{question}<|im_end|>\n<|im_start|>assistant\n"


def to_torch(inputs: dict) -> dict:
    out = {}
    for k, v in inputs.items():
        if isinstance(v, np.ndarray):
            v = torch.tensor(v)
            if k == "video_second_per_grid":
                v = v.float()
        out[k] = v
    return out


def make_inputs(proc, case):
    rng = np.random.default_rng(7)
    if case == "text":
        return proc(prompt("", "Tell me a story about a cat."))
    if case == "image":  # 96x128 px -> grid [1, 6, 8]: 12 tokens
        img = rng.integers(0, 256, (96, 128, 3), dtype=np.uint8)
        return proc(prompt("<|vision_start|><|image_pad|><|vision_end|>"), images=[img])
    if case == "audio":  # 5.3 s: 530 mel frames, chunks 5 x 100 + 30, 69 tokens in windows of 52 + 17
        audio = (0.1 * rng.standard_normal(84800)).astype(np.float32)
        return proc(prompt("<|audio_start|><|audio_pad|><|audio_end|>"), audio=[audio])
    if case == "video_audio":  # 4 frames of 64x64 at 2 fps -> grid [2, 4, 4], 2 s of audio (26 tokens)
        frames = rng.integers(0, 256, (4, 64, 64, 3), dtype=np.uint8)
        audio = (0.1 * rng.standard_normal(32000)).astype(np.float32)
        return proc(prompt("<|vision_start|><|video_pad|><|vision_end|>"), videos=[frames], audio=[audio],
                    use_audio_in_video=True, video_min_pixels=64 * 64, video_max_pixels=64 * 64)
    raise ValueError(case)


@pytest.fixture(scope="module")
def runs(q3, q3_hf):
    model, proc = q3
    out = {}
    for case in CASES:
        inputs = make_inputs(proc, case)
        t = to_torch(inputs)
        with torch.no_grad():
            ref = q3_hf(**t).logits.numpy()
            pos, deltas = q3_hf.model.get_rope_index(
                t["input_ids"], t.get("image_grid_thw"), t.get("video_grid_thw"), t["attention_mask"],
                inputs.get("use_audio_in_video", False),
                t["feature_attention_mask"].sum(-1) if "feature_attention_mask" in t else None,
                t.get("video_second_per_grid"))
        out[case] = (inputs, np.array(model(**inputs)), ref, pos.numpy(), deltas.numpy())
    return out


@pytest.mark.parametrize("case", CASES)
def test_positions_and_deltas_exact(q3, runs, case):
    model, _ = q3
    inputs, _, _, pos, deltas = runs[case]
    ours, our_deltas = model.get_rope_index(
        inputs["input_ids"], inputs.get("image_grid_thw"), inputs.get("video_grid_thw"), inputs["attention_mask"],
        inputs.get("use_audio_in_video", False), inputs.get("feature_attention_mask"),
        inputs.get("video_second_per_grid"))
    np.testing.assert_array_equal(ours, pos)
    np.testing.assert_array_equal(our_deltas, deltas)


def test_media_cases_exercise_mrope(runs):
    """The media cases really compress positions (non-zero deltas), and the audio-in-video block interleaves."""
    assert runs["text"][4].item() == 0
    assert runs["image"][4].item() == -8  # 12 tokens spread over 3x4 positions
    assert runs["video_audio"][4].item() < 0
    ids = runs["video_audio"][0]["input_ids"][0].tolist()
    kinds = [i for i in ids if i in (1012, 1013, 1032)]  # image, video, audio pads
    assert kinds.index(1032) < len(kinds) - kinds[::-1].index(1013) - 1  # an audio token before the last video one


@pytest.mark.parametrize("case", CASES)
def test_logits_match(runs, case):
    _, ours, ref, _, _ = runs[case]
    assert ours.shape == ref.shape
    assert np.abs(ref).max() > 1.0
    np.testing.assert_allclose(ours, ref, rtol=0, atol=LOGIT_TOL)


def test_image_encoder_and_deepstack_match(q3, q3_hf, runs):
    model, _ = q3
    inputs = runs["image"][0]
    with torch.no_grad():
        ref = q3_hf.model.get_image_features(torch.tensor(inputs["pixel_values"]),
                                             torch.tensor(inputs["image_grid_thw"]))
    feats, deep = model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    np.testing.assert_allclose(np.array(feats), torch.cat(list(ref.pooler_output)).numpy(), rtol=0, atol=ENCODER_TOL)
    assert len(deep) == len(ref.deepstack_features) == 2
    for ours, theirs in zip(deep, ref.deepstack_features):
        np.testing.assert_allclose(np.array(ours), torch.cat(list(theirs)).numpy(), rtol=0, atol=ENCODER_TOL)


def test_deepstack_changes_the_answer(q3, runs):
    """DeepStack is not a no-op here: dropping it moves the image prompt's logits by far more than the tolerance."""
    model, _ = q3
    inputs, ours, _, _, _ = runs["image"]
    embeds, positions, _, _, deepstack = model.prepare(**inputs)
    assert deepstack is not None
    without = np.array(model.language_model(embeds, None, positions[:, 0]))
    assert np.abs(without - ours).max() > 100 * LOGIT_TOL


@pytest.mark.parametrize("case", ["audio", "video_audio"])
def test_audio_encoder_matches(q3, q3_hf, runs, case):
    model, _ = q3
    inputs = runs[case][0]
    with torch.no_grad():
        ref = q3_hf.model.get_audio_features(torch.tensor(inputs["input_features"]),
                                             torch.tensor(inputs["feature_attention_mask"])).last_hidden_state
    ours = np.array(model.get_audio_features(inputs["input_features"], inputs["feature_attention_mask"]))
    np.testing.assert_allclose(ours, ref.numpy(), rtol=0, atol=ENCODER_TOL)


def test_two_clips_attend_separately(q3, q3_hf):
    """Two clips of different lengths in one call: windows restart at each clip (a 0.4 s clip's chunk is shorter
    than the padded width, so the padding path runs too)."""
    model, proc = q3
    rng = np.random.default_rng(3)
    clips = [(0.1 * rng.standard_normal(n)).astype(np.float32) for n in (6400, 40000)]
    inputs = proc(prompt("<|audio_start|><|audio_pad|><|audio_end|><|audio_start|><|audio_pad|><|audio_end|>"),
                  audio=clips)
    with torch.no_grad():
        ref = q3_hf.model.get_audio_features(torch.tensor(inputs["input_features"]),
                                             torch.tensor(inputs["feature_attention_mask"])).last_hidden_state
    ours = np.array(model.get_audio_features(inputs["input_features"], inputs["feature_attention_mask"]))
    np.testing.assert_allclose(ours, ref.numpy(), rtol=0, atol=ENCODER_TOL)


@pytest.mark.parametrize("case", CASES)
def test_greedy_continuation_equals_generate(q3, q3_hf, runs, case):
    model, _ = q3
    inputs = runs[case][0]
    t = to_torch(inputs)
    with torch.no_grad():
        ref = q3_hf.generate(**t, max_new_tokens=8, do_sample=False)[0, t["input_ids"].shape[1]:].tolist()
    eos = q3_hf.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    assert model.generate(max_new_tokens=8, stop_token_ids=eos, **inputs) == ref


def test_left_padded_batch_matches(q3, q3_hf):
    model, proc = q3
    inputs = proc([prompt("", "Hi."), prompt("", "A much longer question about many things at once?")])
    assert inputs["attention_mask"][0, 0] == 0
    with torch.no_grad():
        ref = q3_hf(**to_torch(inputs)).logits.numpy()
    ours = np.array(model(**inputs))
    valid = inputs["attention_mask"].astype(bool)
    np.testing.assert_allclose(ours[valid], ref[valid], rtol=0, atol=LOGIT_TOL)


def test_routing_matches_transformers_router(q3, q3_hf):
    """The experts each token picks and their weights equal transformers' top-k router on the same hidden states."""
    import mlx.core as mx

    model, _ = q3
    x = np.random.default_rng(1).standard_normal((20, 64)).astype(np.float32)
    block = model.language_model.layers[0].mlp
    inds, scores = block.route(mx.array(x))
    with torch.no_grad():
        _, ref_scores, ref_inds = q3_hf.model.language_model.layers[0].mlp.gate(torch.tensor(x))
    order = np.argsort(np.array(inds), axis=-1)
    ours_i = np.take_along_axis(np.array(inds), order, -1)
    ours_s = np.take_along_axis(np.array(scores), order, -1)
    ref_order = np.argsort(ref_inds.numpy(), axis=-1)
    np.testing.assert_array_equal(ours_i, np.take_along_axis(ref_inds.numpy(), ref_order, -1))
    np.testing.assert_allclose(ours_s, np.take_along_axis(ref_scores.numpy(), ref_order, -1), rtol=0, atol=1e-6)


@pytest.mark.parametrize("tokens", [3, 40, 200])
def test_grouped_experts_equal_gather_mm(q3, tokens):
    """The CPU prefill route (experts as one padded batched matmul) computes what mlx-lm's gathered matmul does,
    with experts that get no token, and is what a prefill on the CPU takes."""
    import mlx.core as mx

    from omnitide_mlx.models.qwen3_omni.language import CPU_GROUPED_MIN_PAIRS, _cpu_float, grouped_glu

    model, _ = q3
    glu = model.language_model.layers[0].mlp.switch_mlp
    rng = np.random.default_rng(tokens)
    x = mx.array(rng.standard_normal((1, tokens, 64)).astype(np.float32))
    inds = mx.array(np.stack([rng.choice(8, 2, replace=False) for _ in range(tokens)])[None].astype(np.int32))
    np.testing.assert_allclose(np.array(grouped_glu(glu, x, inds)), np.array(glu(x, inds)), rtol=0, atol=1e-5)
    assert _cpu_float(glu) == (mx.default_device() == mx.cpu) and CPU_GROUPED_MIN_PAIRS <= 2 * 40
