"""The processor against transformers' own pieces (its Qwen3-Omni processor needs torchvision, which the dev
environment does not carry): image patches vs ``Qwen2VLImageProcessorPil`` with the released 16-pixel / 0.5-mean
settings, log-mel vs ``WhisperFeatureExtractor``, audio token counts vs the processor's
``_get_feat_extract_output_lengths``, and the audio-in-video placeholder layout vs
``Qwen3OmniMoeProcessor.replace_video_with_audio_token``."""

from types import SimpleNamespace

import numpy as np
import pytest

from omnitide_mlx.models.qwen3_omni.rope_index import audio_token_count

pytest.importorskip("torch")


def test_image_patches_match_transformers(q3, q3_ckpt):
    from transformers import AutoImageProcessor

    _, proc = q3
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (100, 150, 3), dtype=np.uint8)  # resized to 96x160: grid [1, 6, 10]
    ref = AutoImageProcessor.from_pretrained(q3_ckpt)(images=[img], return_tensors="np")
    ours = proc("<|vision_start|><|image_pad|><|vision_end|>", images=[img])
    np.testing.assert_array_equal(ours["image_grid_thw"], ref["image_grid_thw"])
    np.testing.assert_allclose(ours["pixel_values"], ref["pixel_values"], rtol=0, atol=1e-6)
    assert (ours["input_ids"][0] == proc.token_ids["<|image_pad|>"]).sum() == 15


def test_audio_features_match_whisper(q3, q3_ckpt):
    from transformers import WhisperFeatureExtractor

    _, proc = q3
    audio = (0.1 * np.random.default_rng(1).standard_normal(23456)).astype(np.float32)
    ref = WhisperFeatureExtractor.from_pretrained(q3_ckpt)(audio, sampling_rate=16000, return_attention_mask=True,
                                                           padding=True, truncation=False, return_tensors="np")
    n = int(ref["attention_mask"].sum())
    ours = proc.audio_features(audio)
    assert ours.shape[1] == n
    np.testing.assert_allclose(ours, ref["input_features"][0, :, :n], rtol=0, atol=2e-4)


@pytest.mark.parametrize("frames", [1, 7, 99, 100, 101, 199, 200, 530, 1234, 30000])
def test_audio_token_count_matches_transformers(frames):
    import torch
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

    assert audio_token_count(frames) == int(_get_feat_extract_output_lengths(torch.tensor(frames), 50))


@pytest.mark.parametrize("grid,spg,n_audio", [((2, 4, 4), 1.0, 26), ((3, 2, 4), 2.0, 10), ((4, 2, 2), 0.6, 40)])
def test_audio_in_video_layout_matches_transformers(q3, grid, spg, n_audio):
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import Qwen3OmniMoeProcessor

    _, proc = q3
    fake = SimpleNamespace(audio_bos_token="<|audio_start|>", audio_eos_token="<|audio_end|>",
                           video_token="<|video_pad|>", audio_token="<|audio_pad|>",
                           video_processor=SimpleNamespace(merge_size=2))
    ref = Qwen3OmniMoeProcessor.replace_video_with_audio_token(
        fake, {"video_grid_thw": [np.array(grid)], "video_second_per_grid": [spg]}, 0,
        {"num_audio_tokens": [n_audio]}, 0, position_id_per_seconds=13)
    assert proc.interleave_video_audio(grid, spg, n_audio) == ref


def test_placeholder_count_mismatch_is_an_error(q3):
    _, proc = q3
    with pytest.raises(ValueError, match="1 image inputs but 0"):
        proc("no placeholder", images=[np.zeros((32, 32, 3), np.uint8)])
    with pytest.raises(ValueError, match="more audio placeholders"):
        proc("<|audio_start|><|audio_pad|><|audio_end|>")


def test_chat_template_frames_media(q3):
    _, proc = q3
    text = proc.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "audio"},
                                                                  {"type": "text", "text": "Hi"}]}])
    assert text == ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|><|audio_start|><|audio_pad|>"
                    "<|audio_end|>Hi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("n", [23456, 32000, 480])
def test_audio_end_frames_match_whisper_longest_padding(q3, q3_ckpt, n):
    """A clip whose length is a multiple of 160 samples: the last frame reflects the clip's own end (0.045 off with
    trailing zeros, as Qwen2.5-Omni's 300 s padding has it)."""
    from transformers import WhisperFeatureExtractor

    _, proc = q3
    audio = (0.1 * np.random.default_rng(n).standard_normal(n)).astype(np.float32)
    ref = WhisperFeatureExtractor.from_pretrained(q3_ckpt)(audio, sampling_rate=16000, return_attention_mask=True,
                                                           padding=True, truncation=False, return_tensors="np")
    ours = proc.audio_features(audio)
    assert ours.shape == ref["input_features"][0].shape == (128, n // 160)
    np.testing.assert_allclose(ours, ref["input_features"][0], rtol=0, atol=2e-4)
