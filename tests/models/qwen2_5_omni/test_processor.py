"""The numpy processor against transformers: tokenizer, chat template, image patches, mel features, the whole
processor output for an image + audio prompt, and placeholder expansion for audio-in-video."""

from functools import partial
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest

from omnitide_mlx.models.base import MediaError
from omnitide_mlx.models.qwen2_5_omni.processor import (Processor, VisionSettings, load_tokenizer,
                                                        sample_frame_indices, smart_resize)
from omnitide_mlx.models.qwen2_5_omni.tiny import make_tiny_checkpoint

pytest.importorskip("torch")

TEXTS = [
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n",
    "你好，世界！用户在这里。 日本語のテキスト",
    "Tabs\tand  double  spaces,\r\nCRLF lines\n\n\nand 12345 digits 3.14159",
    "It's, we're, they'll, I'd've: contractions. Émojis 🎉🚀 and accents: naïve café",
    "<|vision_bos|><|IMAGE|><|IMAGE|><|vision_eos|><|audio_bos|><|AUDIO|><|audio_eos|> trailing   ",
]


@pytest.fixture(scope="module")
def real_vocab_ckpt(tmp_path_factory, qwen_tokenizer_dir):
    """Tokenizer files of a real-vocabulary checkpoint (the model weights are not needed here)."""
    d = tmp_path_factory.mktemp("qwen25real")
    make_tiny_checkpoint(d, tokenizer_dir=qwen_tokenizer_dir, vocab="real", text_layers=1, vision_depth=1,
                         audio_layers=1)
    return d


@pytest.fixture(scope="module")
def hf_processor(tiny_ckpt):
    """transformers' Qwen2_5OmniProcessor with the PIL image processor (no torchvision: the video processor is a
    placeholder, whose class check is skipped during construction)."""
    from transformers import (AutoTokenizer, Qwen2_5OmniProcessor, Qwen2VLImageProcessorPil,
                              WhisperFeatureExtractor)
    from transformers.processing_utils import ProcessorMixin
    from transformers.video_processing_utils import BaseVideoProcessor

    original = ProcessorMixin.check_argument_for_proper_class

    def check(self, name, arg):
        return None if name == "video_processor" else original(self, name, arg)

    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", check):
        return Qwen2_5OmniProcessor(
            image_processor=Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056),
            video_processor=BaseVideoProcessor(),
            feature_extractor=WhisperFeatureExtractor(feature_size=128, chunk_length=300, sampling_rate=16000,
                                                      n_fft=400, hop_length=160),
            tokenizer=AutoTokenizer.from_pretrained(tiny_ckpt))


def test_real_tokenizer_matches_transformers(real_vocab_ckpt):
    from transformers import AutoTokenizer

    ours = load_tokenizer(real_vocab_ckpt)
    ref = AutoTokenizer.from_pretrained(real_vocab_ckpt)
    assert ours.get_vocab_size(with_added_tokens=True) == len(ref) == 151643 + 22
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids)
    assert ours.encode("你好", add_special_tokens=False).ids == [108386]  # needs Qwen's own merges
    assert ours.token_to_id("<|vision_bos|>") == 151652 and ours.token_to_id("<|VIDEO|>") == 151656
    assert ours.encode("user", add_special_tokens=False).ids == [872]


def test_tokenizer_json_is_preferred(tmp_path, tiny_ckpt):
    import shutil

    for f in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        shutil.copy(tiny_ckpt / f, tmp_path / f)
    rebuilt = load_tokenizer(tmp_path)
    rebuilt.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "vocab.json").unlink()  # now only tokenizer.json can serve
    (tmp_path / "merges.txt").unlink()
    assert load_tokenizer(tmp_path).encode(TEXTS[0]).ids == rebuilt.encode(TEXTS[0]).ids


def test_default_special_tokens_follow_the_vocabulary(tmp_path, tiny_ckpt):
    """Without tokenizer_config.json the Omni special tokens are placed right after the BPE vocabulary."""
    import shutil

    for f in ("vocab.json", "merges.txt"):
        shutil.copy(tiny_ckpt / f, tmp_path / f)
    tok = load_tokenizer(tmp_path)
    assert tok.token_to_id("<|endoftext|>") == 1000 and tok.token_to_id("<|VIDEO|>") == 1013


def test_chat_template_matches_jinja(tiny, hf_processor):
    _, proc = tiny
    conversations = [
        [{"role": "user", "content": "Hi there"}],
        [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": [{"type": "image"}, {"type": "audio"}, {"type": "text", "text": "What?"}]},
         {"role": "assistant", "content": "A cat."},
         {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "And now?"}]}],
    ]
    for conv in conversations:
        for gen in (True, False):
            ref = hf_processor.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
            assert proc.apply_chat_template(conv, add_generation_prompt=gen) == ref


@pytest.mark.parametrize("hw", [(100, 150), (448, 448), (333, 517), (20, 30), (1080, 1920)])
def test_image_patches_match_pil_processor(hw):
    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil

    img = np.random.default_rng(hw[0]).integers(0, 256, (*hw, 3), dtype=np.uint8)
    max_px = 200_000 if hw == (1080, 1920) else 12845056  # a downscale case, kept small
    ref = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=max_px)(Image.fromarray(img), return_tensors="np")
    rows, grid = VisionSettings(max_pixels=max_px).image(img)
    assert list(grid) == ref["image_grid_thw"][0].tolist()
    np.testing.assert_allclose(rows, ref["pixel_values"], rtol=0, atol=1e-6)


def test_video_patches_layout():
    """A video of two copies of a frame gives the image's rows; distinct frames fill the temporal slots."""
    vs = VisionSettings()
    rng = np.random.default_rng(3)
    f0, f1 = (rng.integers(0, 256, (56, 84, 3), dtype=np.uint8) for _ in range(2))
    img_rows, img_grid = vs.image(f0, 56 * 84, 56 * 84)
    vid_rows, vid_grid = vs.video([f0, f0], 56 * 84, 56 * 84)
    assert img_grid == vid_grid == (1, 4, 6)
    np.testing.assert_array_equal(vid_rows, img_rows)
    rows, grid = vs.video([f0, f1, f1], 56 * 84, 56 * 84)  # three frames: padded with the last one
    assert grid == (2, 4, 6)
    x = rows.reshape(2, 24, 3, 2, 14, 14)  # [grid_t, patches, C, T, ph, pw]
    n0, n1 = vs.normalize(f0), vs.normalize(f1)
    np.testing.assert_allclose(x[0, 0, :, 0], n0[:, :14, :14], atol=1e-6)  # first patch, frame 0
    np.testing.assert_allclose(x[0, 0, :, 1], n1[:, :14, :14], atol=1e-6)  # first patch, frame 1
    np.testing.assert_allclose(x[0, 2, :, 0], n0[:, 14:28, :14], atol=1e-6)  # merge-block order: (1, 0) third
    np.testing.assert_allclose(x[1, 0, :, 0], n1[:, :14, :14], atol=1e-6)  # padded grid repeats frame 2


def test_processor_output_matches_transformers(tiny, hf_processor):
    from PIL import Image

    _, proc = tiny
    rng = np.random.default_rng(11)
    img = rng.integers(0, 256, (100, 150, 3), dtype=np.uint8)
    audio = [(0.1 * rng.standard_normal(n)).astype(np.float32) for n in (37920, 16000)]
    text = proc.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "audio"}, {"type": "text", "text": "Describe, 简短地."}, {"type": "audio"}]}])
    ref = hf_processor(text=text, images=[Image.fromarray(img)], audio=audio, return_tensors="np")
    ours = proc(text, images=[img], audio=audio)
    np.testing.assert_array_equal(ours["input_ids"], ref["input_ids"])
    np.testing.assert_array_equal(ours["pixel_values"], ref["pixel_values"])
    np.testing.assert_array_equal(ours["image_grid_thw"], ref["image_grid_thw"])
    lengths = ref["feature_attention_mask"].sum(-1)
    np.testing.assert_array_equal(ours["feature_attention_mask"].sum(-1), lengths)
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(ours["input_features"][i, :, :n], ref["input_features"][i, :, :n], atol=5e-5)


@pytest.mark.parametrize("grid, spg, n_audio", [((4, 4, 4), 1.0, 100), ((2, 4, 6), 1.0, 250), ((8, 2, 2), 0.5, 20),
                                                ((3, 4, 4), 2.5, 75)])
def test_audio_in_video_expansion_matches_transformers(tiny, grid, spg, n_audio):
    from transformers import Qwen2_5OmniProcessor

    _, proc = tiny
    fake = SimpleNamespace(video_processor=SimpleNamespace(merge_size=2), audio_bos_token="<|audio_bos|>",
                           audio_eos_token="<|audio_eos|>", video_token="<|VIDEO|>", audio_token="<|AUDIO|>",
                           get_chunked_index=partial(Qwen2_5OmniProcessor.get_chunked_index, None))
    ref = Qwen2_5OmniProcessor.replace_video_with_audio_token(
        fake, {"video_grid_thw": [np.array(grid)], "video_second_per_grid": [spg]}, 0,
        {"num_audio_tokens": [n_audio]}, 0, position_id_per_seconds=25, seconds_per_chunk=2)
    assert proc.interleave_video_audio(grid, spg, n_audio) == ref


def test_audio_at_other_rates_is_resampled(tiny):
    _, proc = tiny
    t = np.arange(48000 * 2) / 48000
    tone48 = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    tone16 = (0.3 * np.sin(2 * np.pi * 440 * np.arange(32000) / 16000)).astype(np.float32)
    a, b = proc.audio_features(tone48, 48000), proc.audio_features(tone16)
    assert a.shape == b.shape == (128, 200)
    assert np.abs(a[:, 5:-5] - b[:, 5:-5]).max() < 0.02


def test_bad_media_is_rejected(tiny):
    _, proc = tiny
    with pytest.raises(MediaError):
        proc.vision.image(np.zeros((20, 30), dtype=np.uint8))
    with pytest.raises(MediaError):
        proc.vision.image(np.zeros((20, 30, 3), dtype=np.float32))
    with pytest.raises(MediaError):
        proc.audio_features(np.array([0.0, np.nan, 0.0]))
    with pytest.raises(MediaError):
        proc.audio_features(np.zeros((100, 2), dtype=np.float32))
    with pytest.raises(MediaError):
        proc.audio_features(np.zeros(0, dtype=np.float32))
    with pytest.raises(ValueError, match="placeholders"):
        proc("<|audio_bos|><|AUDIO|><|audio_eos|>")  # a placeholder without audio


def test_smart_resize_and_frame_sampling():
    assert smart_resize(100, 150, min_pixels=3136, max_pixels=12845056) == (112, 140)
    assert smart_resize(448, 448) == (448, 448)
    h, w = smart_resize(1080, 1920, min_pixels=3136, max_pixels=100352)
    assert h % 28 == 0 and w % 28 == 0 and h * w <= 100352
    with pytest.raises(MediaError):
        smart_resize(1, 500)
    # 10 s at 30 fps sampled at 2 fps: 20 frames, evenly spread
    idx = sample_frame_indices(300, 30.0, 2.0)
    assert len(idx) == 20 and idx[0] == 0 and idx[1] == 15


def test_read_video_samples_the_bundled_clip(media_dir):
    from omnitide_mlx.models.qwen2_5_omni.processor import read_video

    path = media_dir / "video_10s_av.mp4"
    if not path.exists():
        pytest.skip("bundled sample media missing")
    import cv2

    frames, fps = read_video(path, fps=2.0)
    assert frames.ndim == 4 and frames.shape[-1] == 3 and frames.dtype == np.uint8
    assert len(frames) % 2 == 0 and 18 <= len(frames) <= 22 and fps == 2.0
    cap = cv2.VideoCapture(str(path))  # every frame, then the same sampling
    every, video_fps = [], cap.get(cv2.CAP_PROP_FPS)
    while (got := cap.read())[0]:
        every.append(cv2.cvtColor(got[1], cv2.COLOR_BGR2RGB))
    cap.release()
    idx = sample_frame_indices(len(every), video_fps, 2.0)
    np.testing.assert_array_equal(frames, np.stack([every[i] for i in idx]))


def test_processor_from_pretrained_reads_preprocessor_config(tiny_ckpt):
    proc = Processor.from_pretrained(tiny_ckpt)
    assert proc.vision.max_pixels == 12845056 and proc.n_mels == 128


def test_real_vocab_checkpoint_streams_with_real_ids(real_vocab_ckpt):
    from omnitide_mlx.models import load

    model, proc = load(real_vocab_ckpt)
    assert model.config.vision_start_token_id == 151652 and model.config.text_config.vocab_size == 151936
    adapter = model.stream_adapter(proc)
    assert adapter.user_open == [151644, 872, 198]
    assert adapter.turn_close == [151645, 198, 151644, 77091, 198]
    unit = adapter.media_unit(np.zeros((56, 56, 3), np.uint8), np.zeros(16000, np.float32), 0.0, 0)
    assert unit.input_ids[:5].tolist() == [151644, 872, 198, 151652, 151647]
    assert unit.input_ids[-2:].tolist() == [151648, 151653]
    system = adapter.system_unit(None, 0)
    assert proc.decode(system.input_ids) == "system\nYou are Qwen, a virtual human developed by the Qwen Team, " \
        "Alibaba Group, capable of perceiving auditory and visual inputs, as well as generating text and speech.\n"
    assert adapter.decode([151644] + proc.encode("用户 hi") + [151645]) == "用户 hi"
