"""Spoken replies against transformers' Qwen3OmniMoeForConditionalGeneration.generate(return_audio=True) with greedy
decoding, on the tiny checkpoint's complete random talker (MoE with a shared expert, 2 layers), code predictor and
Code2Wav: the reply ids, the talker prompt and trailing rows, every codebook of every frame, and the waveform."""

import json

import numpy as np
import pytest

from omnitide_mlx.models.qwen3_omni.speech import generate, load_speech

torch = pytest.importorskip("torch")

THINKER_EOS = 1002  # <|im_end|> in the tiny vocabulary
WAV_TOL = 1e-5


@pytest.fixture(scope="module")
def hf_full(q3_ckpt):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model, info = Qwen3OmniMoeForConditionalGeneration.from_pretrained(q3_ckpt, dtype=torch.float32,
                                                                       output_loading_info=True)
    assert not any(info.values()), info
    model.eval()
    captured = {}
    original = model.talker.generate

    def keep(*args, **kw):  # records the talker's inputs and result; transformers' generate returns only audio
        if captured.get("use_audio_in_video"):  # the second 5.24 quirk (docs): generate does not pass it on
            kw["use_audio_in_video"] = True
        captured["kwargs"], captured["result"] = kw, original(*args, **kw)
        return captured["result"]

    model.talker.generate = keep
    # transformers 5.24 bug: the talker's M-RoPE reads ``self.config.audio_config.n_window``, which the talker
    # config lacks, so a spoken reply to a prompt with audio and an image or video raises AttributeError (the
    # thinker's audio window is what the positions need; docs/models/qwen3_omni.md)
    model.talker.config.audio_config = model.config.thinker_config.audio_config
    return model, captured


@pytest.fixture(scope="module")
def speech(q3_ckpt):
    return load_speech(q3_ckpt, json.loads((q3_ckpt / "config.json").read_text()))


def hf_generate(hf_full, inputs, speaker="Ethan"):
    model, captured = hf_full
    captured["use_audio_in_video"] = inputs.get("use_audio_in_video", False)
    t = {k: torch.tensor(v) if isinstance(v, np.ndarray) else v for k, v in inputs.items()}
    if "video_second_per_grid" in t:
        t["video_second_per_grid"] = t["video_second_per_grid"].float()
    with torch.no_grad():
        seq, wav = model.generate(**t, speaker=speaker, thinker_max_new_tokens=6, thinker_eos_token_id=THINKER_EOS,
                                  talker_do_sample=False, talker_max_new_tokens=9)
    r = captured["result"]
    codes = torch.stack([h[-1] for h in r.hidden_states if h[-1] is not None], dim=1).transpose(1, 2)[0].numpy()
    return seq[0, inputs["input_ids"].shape[1]:].tolist(), codes, wav.reshape(-1).numpy(), captured["kwargs"]


def case_inputs(proc, case):
    rng = np.random.default_rng(11)
    q = "<|im_start|>user\n{}Say something.<|im_end|>\n<|im_start|>assistant\n"
    if case == "text":
        return proc(q.format(""))
    if case == "audio":
        return proc(q.format("<|audio_start|><|audio_pad|><|audio_end|>"),
                    audio=[(0.1 * rng.standard_normal(24000)).astype(np.float32)])
    if case == "video_audio":
        frames = rng.integers(0, 256, (4, 64, 64, 3), dtype=np.uint8)
        return proc(q.format("<|vision_start|><|video_pad|><|vision_end|>"), videos=[frames],
                    audio=[(0.1 * rng.standard_normal(32000)).astype(np.float32)], use_audio_in_video=True,
                    video_min_pixels=64 * 64, video_max_pixels=64 * 64)
    if case == "image_audio":
        img = rng.integers(0, 256, (64, 96, 3), dtype=np.uint8)
        return proc(q.format("<|vision_start|><|image_pad|><|vision_end|><|audio_start|><|audio_pad|><|audio_end|>"),
                    images=[img], audio=[(0.1 * rng.standard_normal(20000)).astype(np.float32)])
    raise ValueError(case)


def test_transformers_talker_crashes_on_audio_with_vision(q3, hf_full):
    """The bug the fixture works around, reproduced: without the thinker's audio config on the talker config,
    transformers cannot speak a reply to an image + audio prompt (the port can: the tests below)."""
    model, _ = hf_full
    saved = model.talker.config.audio_config
    del model.talker.config.audio_config
    try:
        with pytest.raises(AttributeError, match="audio_config"):
            hf_generate(hf_full, case_inputs(q3[1], "image_audio"))
    finally:
        model.talker.config.audio_config = saved


@pytest.mark.parametrize("case", ["text", "audio", "image_audio", "video_audio"])
def test_spoken_reply_matches_transformers(q3, hf_full, speech, case):
    model, proc = q3
    inputs = case_inputs(proc, case)
    ref_ids, ref_codes, ref_wav, kw = hf_generate(hf_full, inputs)
    ids, codes, wav = generate(model, speech, inputs, thinker_max_new_tokens=6, talker_max_new_tokens=9,
                               eos_ids=(THINKER_EOS,))
    assert ids == ref_ids
    assert ref_codes.shape[0] == 4 and ref_codes.shape[1] >= 2  # all four codebooks of every frame
    np.testing.assert_array_equal(codes, ref_codes)
    assert wav.shape == ref_wav.shape and np.abs(ref_wav).mean() > 0.1
    np.testing.assert_allclose(wav, ref_wav, rtol=0, atol=WAV_TOL)


def test_talker_prompt_rows_match(q3, hf_full, speech):
    """The talker's prompt (user rows, nine assistant rows) and its trailing text rows, before any decoding."""
    from omnitide_mlx.models.qwen3_omni.talker import talker_prompt

    model, proc = q3
    inputs = case_inputs(proc, "audio")
    ref_ids, _, _, kw = hf_generate(hf_full, inputs, speaker="Chelsie")
    embeds0, hidden = speech.thinker_states(model, inputs, ref_ids)
    prompt, talker_ids, trailing, pad = talker_prompt(model, speech.talker, speech.config, inputs["input_ids"],
                                                      ref_ids, embeds0, hidden, "Chelsie", eos_ids=(THINKER_EOS,))
    np.testing.assert_array_equal(talker_ids, kw["talker_input_ids"][0].numpy())
    np.testing.assert_allclose(np.array(prompt), kw["inputs_embeds"].numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.array(trailing), kw["trailing_text_hidden"].numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.array(pad), kw["tts_pad_embed"].numpy(), rtol=0, atol=1e-6)


def test_unknown_speaker_is_refused(q3, speech):
    model, proc = q3
    inputs = case_inputs(proc, "text")
    with pytest.raises(ValueError, match="unknown speaker 'Nobody'"):
        speech.reply(model, inputs, [5, 6, THINKER_EOS], "Nobody", eos_ids=(THINKER_EOS,))


def test_transformers_talker_drops_use_audio_in_video(q3, hf_full, speech):
    """transformers' generate does not hand ``use_audio_in_video`` to the talker, whose positions then treat the
    interleaved block as one audio run; the port keeps the thinker's layout (the released intent), so the two
    differ unless the flag is passed on (the test above)."""
    model, proc = q3
    _, captured = hf_full
    inputs = case_inputs(proc, "video_audio")
    t = {k: torch.tensor(v) if isinstance(v, np.ndarray) else v for k, v in inputs.items()}
    t["video_second_per_grid"] = t["video_second_per_grid"].float()
    captured["use_audio_in_video"] = False
    with torch.no_grad():
        hf_full[0].generate(**t, speaker="Ethan", thinker_max_new_tokens=6, thinker_eos_token_id=THINKER_EOS,
                            talker_do_sample=False, talker_max_new_tokens=9)
    r = captured["result"]
    ref = torch.stack([h[-1] for h in r.hidden_states if h[-1] is not None], dim=1).transpose(1, 2)[0].numpy()
    _, codes, _ = generate(model, speech, inputs, thinker_max_new_tokens=6, talker_max_new_tokens=9,
                           eos_ids=(THINKER_EOS,))
    assert not np.array_equal(codes, ref)


def test_thinking_layout_loads_without_speech(tmp_path, q3_tokenizer_dir, q3):
    """A -Thinking style folder (no talker or Code2Wav) loads the same thinker and says clearly it cannot speak."""
    from omnitide_mlx.models.loading import CheckpointError
    from omnitide_mlx.models.qwen3_omni import load
    from omnitide_mlx.models.qwen3_omni.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "thinking", tokenizer_dir=q3_tokenizer_dir, speech=False)
    model, proc = load(ckpt)
    ids = proc("<|im_start|>user\nHi<|im_end|>\n")["input_ids"]
    np.testing.assert_array_equal(np.array(model(ids)), np.array(q3[0](ids)))
    with pytest.raises(CheckpointError, match="no talker_config"):
        load_speech(ckpt, json.loads((ckpt / "config.json").read_text()))


def test_sampled_codes_are_reproducible_and_top_k_1_is_greedy(q3, speech):
    """Sampling as transformers' defaults (top-k 50, temperature 0.9; predictor top-k 50, top-p 0.8): a seed
    reproduces a reply, top-k 1 is the greedy path (penalty included), and codes stay in the codebooks."""
    from dataclasses import replace

    from omnitide_mlx.models.qwen3_omni.talker import PREDICTOR_SAMPLING, TALKER_SAMPLING

    model, proc = q3
    inputs = case_inputs(proc, "text")
    reply = [5, 6, 7, THINKER_EOS]
    kw = dict(max_new_tokens=9, eos_ids=(THINKER_EOS,))
    greedy, _ = speech.reply(model, inputs, reply, **kw)
    seeded = replace(TALKER_SAMPLING, seed=3)
    a, _ = speech.reply(model, inputs, reply, sampling=seeded, **kw)
    b, _ = speech.reply(model, inputs, reply, sampling=seeded, **kw)
    np.testing.assert_array_equal(a, b)
    assert a.shape[0] == 4 and a.size and (a >= 0).all() and (a < 32).all()
    one = replace(TALKER_SAMPLING, top_k=1, seed=0)
    c, _ = speech.reply(model, inputs, reply, sampling=one, predictor_sampling=replace(PREDICTOR_SAMPLING, top_k=1),
                        **kw)
    np.testing.assert_array_equal(c, greedy)
    others = [speech.reply(model, inputs, reply, sampling=replace(TALKER_SAMPLING, seed=s), **kw)[0]
              for s in (4, 5)]
    assert any(o.shape != a.shape or not np.array_equal(o, a) for o in others)


@pytest.mark.parametrize("case", ["text", "image_audio"])
def test_streamed_reply_equals_offline(q3, speech, case):
    """Spoken while the reply's tokens arrive one by one: the same codes as the offline reply, and PCM pieces that
    concatenate to the offline waveform decoded with the same chunks (here 3 frames, 5 of context)."""
    from omnitide_mlx.models.qwen3_omni.code2wav import Code2WavStream

    model, proc = q3
    inputs = case_inputs(proc, case)
    reply = [model_id for model_id in (17, 230, 45, 99, 8)] + [THINKER_EOS]
    codes, _ = speech.reply(model, inputs, reply, max_new_tokens=12, eos_ids=(THINKER_EOS,))
    pieces = list(speech.stream(model, inputs, iter(reply), chunk_size=3, left_context_size=5, max_new_tokens=12,
                                eos_ids=(THINKER_EOS,)))
    np.testing.assert_array_equal(speech.last_codes, codes)
    assert codes.shape[1] >= 4 and len(pieces) == -(-codes.shape[1] // 3)
    whole = np.concatenate([np.array(p).reshape(-1) for p in speech.code2wav.decode_stream(codes[None], 3, 5)])
    np.testing.assert_allclose(np.concatenate(pieces), whole, rtol=0, atol=1e-6)
    stream = Code2WavStream(speech.code2wav, 3, 5)
    assert sum(stream.add(f).size for f in codes.T) + stream.finish().size == whole.size


def test_quantised_talker_speaks(q3, q3_ckpt):
    """``Speech.quantize``: experts through the gathered quantised matmul, routers in float, and a reply still comes
    out in the codebooks' range."""
    model, proc = q3
    sp = load_speech(q3_ckpt, json.loads((q3_ckpt / "config.json").read_text()))
    sp.quantize(bits=4, group_size=32)  # the tiny experts' down projections (16 wide) stay float
    layer = sp.talker.model.layers[0].mlp
    assert type(layer.switch_mlp.gate_proj).__name__ == "QuantizedSwitchLinear"
    assert type(layer.gate).__name__ == "Linear" and type(layer.shared_expert_gate).__name__ == "Linear"
    assert type(sp.talker.code_predictor.lm_head[0]).__name__ == "QuantizedLinear"
    codes, wav = sp.reply(model, case_inputs(proc, "text"), [5, 6, 7, THINKER_EOS], max_new_tokens=6,
                          eos_ids=(THINKER_EOS,))
    assert codes.shape[0] == 4 and ((codes >= 0) & (codes < 32)).all() and np.isfinite(wav).all()
