"""The processor against the official MiniCPM-o 4.5 processing facts: tokenizer, chat template, slicing grids and
token counts, placeholders and bounds, streaming mel."""

import numpy as np
import pytest
from PIL import Image

from omnitide_mlx.models.audio_features import log_mel
from omnitide_mlx.models.minicpmo.processor import MiniCPMOProcessor, StreamingMel, buffer_log_mel

from ._helpers import max_diff


@pytest.fixture(scope="module")
def proc(data_dir):
    return MiniCPMOProcessor.from_pretrained(data_dir / "tokenizers" / "minicpm-o-4_5")


def test_tokenizer_rebuilt_from_vocab_and_merges(proc):
    tok = proc.tokenizer
    assert len(tok) == 151748
    assert tok.encode("<|im_start|>user\n<image>./</image>") == [151644, 872, 198, 151669, 1725, 151670]
    assert tok.encode("<audio>./</audio>") == [9312, 3230, 29, 1725, 522, 16736, 29]
    assert tok.encode("<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n<|tts_bos|>") == \
        [151645, 198, 151644, 77091, 198, 151667, 271, 151668, 271, 151703]
    for token, i in [("<unk>", 128244), ("<unit>", 151683), ("</unit>", 151684), ("<|listen|>", 151705),
                     ("<|tts_eos|>", 151704), ("<image_id>", 151681), ("<|audio_start|>", 151697)]:
        assert tok.token_id(token) == i
    assert tok.token_id("</s>") == 128247  # a plain BPE vocab entry (an official terminator)
    assert tok.token_id("：") == 128244  # not one token: convert_tokens_to_ids gives the unk id
    assert len(tok.bad_token_ids) == 6965
    text = "Hello, 世界! It's 2026.\t  spaces\r\n"
    assert tok.decode(tok.encode(text)) == text


def test_chat_template(proc):
    assert proc.apply_chat_template([{"role": "system", "content": "Be brief."}]) == \
        "<|im_start|>system\nBe brief.<|im_end|>\n"
    out = proc.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                   enable_thinking=False, use_tts_template=True)
    assert out == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n<|tts_bos|>"


# (w, h) -> grid, slices, offline chat tokens (max_slice 9 + image_id), streaming tokens (max_slice 1, no id)
SLICING = [((448, 448), None, 1, 69), ((500, 300), None, 1, 69), ((640, 480), [2, 1], 3, 201),
           ((1024, 768), [2, 2], 5, 334), ((1280, 720), [3, 2], 7, 466), ((1344, 896), [3, 2], 7, 466),
           ((1920, 1080), [4, 2], 9, 598), ((2048, 2048), [3, 3], 10, 665), ((800, 2400), [2, 4], 9, 600)]


@pytest.mark.parametrize("size, grid, n_slices, offline_tokens", SLICING)
def test_slicing_grids_and_token_counts(proc, size, grid, n_slices, offline_tokens):
    img = Image.new("RGB", size, (120, 30, 200))
    offline = proc(f"<image>./</image>", images=[img])
    assert offline["grids"][0][0] == grid
    assert len(offline["pixel_values"][0]) == n_slices
    assert offline["input_ids"].shape[1] == offline_tokens
    bounds = offline["image_bound"][0]
    assert len(bounds) == n_slices and ((bounds[:, 1] - bounds[:, 0]) == 64).all()
    assert (offline["input_ids"][0][np.concatenate([np.arange(s, e) for s, e in bounds])] == 128244).all()
    streaming = proc("<image>./</image>", images=[img], max_slice_nums=1, use_image_id=False)
    assert streaming["input_ids"].shape[1] == 66 and len(streaming["pixel_values"][0]) == 1
    for s, (h, w) in zip(offline["pixel_values"][0], offline["tgt_sizes"][0]):
        assert s.shape == (3, 14, h * w * 14) and s.dtype == np.float32


@pytest.mark.parametrize("size, tgt", [((448, 448), (32, 32)), ((500, 300), (25, 41)), ((640, 480), (28, 37)),
                                       ((800, 2400), (55, 18))])
def test_source_image_sizes(proc, size, tgt):
    assert tuple(proc.process_image(Image.new("RGB", size)).tgt_sizes[0]) == tgt


def test_placeholder_layout_with_slices_and_image_id(proc):
    ph = proc.image_placeholder([2, 2], image_idx=3)
    unk = "<unk>" * 64
    assert ph == (f"<image_id>3</image_id><image>{unk}</image>" + f"<slice>{unk}</slice>" * 2 + "\n"
                  + f"<slice>{unk}</slice>" * 2)


def test_pixels_are_the_bicubic_resize_normalised(proc):
    rng = np.random.default_rng(0)
    arr = (rng.random((300, 500, 3)) * 255).astype(np.uint8)
    out = proc.process_image(arr, max_slice_nums=1)
    ref = np.asarray(Image.fromarray(arr).resize((574, 350), Image.Resampling.BICUBIC), dtype=np.float32)
    ref = (ref / 255 - 0.5) / 0.5
    h, w = out.tgt_sizes[0]
    assert (h, w) == (25, 41)
    back = out.slices[0].reshape(3, 14, h, w, 14).transpose(0, 2, 1, 3, 4).reshape(3, h * 14, w * 14)
    np.testing.assert_array_equal(back, ref.transpose(2, 0, 1))


def test_prompt_with_image_and_audio(proc):
    rng = np.random.default_rng(1)
    audio = (0.1 * rng.standard_normal(25000)).astype(np.float32)  # 1.5625 s -> 157 frames -> 15 tokens
    out = proc("<|im_start|>user\n<image>./</image>\n<audio>./</audio>what?<|listen|><|im_end|>",
               images=[Image.new("RGB", (300, 200))], audios=[audio])
    ids = out["input_ids"][0]
    assert 151705 not in ids  # <|listen|> is stripped from prompts
    (a0, a1), = out["audio_bounds"][0]
    assert a1 - a0 == 15 and ids[a0 - 1] == 151697 and ids[a1] == 151699
    assert out["audio_feature_lens"][0].tolist() == [157]
    assert out["audio_features"].shape == (1, 80, 157)
    chunked = proc.audio_placeholder(25000, chunk_input=True)
    assert chunked == "<|audio_start|>" + "<unk>" * 10 + "<|audio_end|><|audio_start|>" + "<unk>" * 5 + \
        "<|audio_end|>"


def test_audio_over_30s_is_split(proc):
    audio = np.zeros(16000 * 65, dtype=np.float32)
    audio[::97] = 0.3
    feats, lens = proc.audio_features([audio])
    assert lens.tolist() == [3000, 3000, 500]
    assert max_diff(feats[2, :, :500], log_mel(audio[16000 * 60:], 80)) == 0.0


def _torch_buffer_mel(buf, floor):
    """The official MiniCPMAAudioProcessor torch path on an unpadded buffer (padding=False)."""
    torch = pytest.importorskip("torch")
    from transformers import WhisperFeatureExtractor

    filters = torch.from_numpy(WhisperFeatureExtractor(feature_size=80).mel_filters).float()
    w = torch.from_numpy(buf).float()
    stft = torch.stft(w, n_fft=400, hop_length=160, window=torch.hann_window(400), return_complex=True)
    mel = filters.T @ (stft[..., :-1].abs() ** 2)
    logm = torch.clamp(mel, min=1e-10).log10()
    logm = torch.maximum(logm, torch.tensor(floor)) if floor is not None else torch.maximum(logm, logm.max() - 8)
    return ((logm + 4) / 4).numpy()


@pytest.mark.parametrize("seconds, floor", [(1.03, -10.0), (3.2, -10.0), (6.0, None)])
def test_buffer_mel_matches_the_official_torch_path(seconds, floor):
    rng = np.random.default_rng(2)
    buf = (0.05 * rng.standard_normal(int(seconds * 16000))).astype(np.float32)
    ours = buffer_log_mel(buf, 80, floor)
    ref = _torch_buffer_mel(buf, floor)
    assert ours.shape == ref.shape == (80, len(buf) // 160)
    assert max_diff(ours, ref) < 2e-5


@pytest.mark.parametrize("redundancy_ms, windows", [(0, [(0, 100), (100, 200), (200, 300)]),
                                                    (20, [(0, 102), (98, 202), (198, 302)])])
def test_streaming_mel_emits_stable_frames(redundancy_ms, windows):
    rng = np.random.default_rng(3)
    audio = (0.1 * rng.standard_normal(16480 + 2 * 16000 + 400)).astype(np.float32)
    sm = StreamingMel(cnn_redundancy_ms=redundancy_ms)
    assert sm.chunk_size() == 16480
    full = log_mel(audio, 80, floor=-10.0)  # < 5 s: the fixed floor, so frames do not depend on later audio
    pos = 0
    for k, (a, b) in enumerate(windows):
        n = sm.chunk_size()
        if k == len(windows) - 1:
            n += 400  # the last window's right context
        out = sm.process(audio[pos:pos + n])
        pos += n
        assert out.shape == (80, b - a)
        assert max_diff(out, full[:, a:b]) < 2e-5
    assert sm.chunk_size() == 16000


def test_streaming_mel_waits_for_right_context():
    sm = StreamingMel()
    assert sm.process(np.zeros(16480, np.float32)).shape == (80, 100)
    assert sm.process(np.zeros(8000, np.float32)).shape == (80, 0)  # half a second: nothing stable to emit
    assert sm.process(np.zeros(8000, np.float32)).shape == (80, 100)
    assert sm.process(np.zeros(800, np.float32), is_last_chunk=True).shape[1] > 0  # the final flush
