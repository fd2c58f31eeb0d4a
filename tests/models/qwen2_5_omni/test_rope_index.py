"""TMRoPE position ids (numpy) against transformers' get_rope_index on hand-built token layouts.

The layouts cover the rules of the reference (section 4.3): mixed images and audio, videos at several seconds per
grid (truncation), audio-in-video with the audio longer or shorter than the video, a frame grid wider than the
last audio chunk (eos placement), temporal jumps over more than one 2 s chunk, media followed by more media, a
left-padded batch, and the text-only path.
"""

import re
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest

from omnitide_mlx.models.qwen2_5_omni.rope_index import audio_token_count

torch = pytest.importorskip("torch")

MEL_FRAMES = {"a1s": 100, "a237": 237, "a3s": 300, "a4s": 400, "a40": 40, "a10s": 1000}


def _hf_interleave(grid, spg, n_audio):
    """transformers' processor text for an audio-in-video placeholder (its own function, called directly)."""
    from transformers import Qwen2_5OmniProcessor

    fake = SimpleNamespace(video_processor=SimpleNamespace(merge_size=2), audio_bos_token="<|audio_bos|>",
                           audio_eos_token="<|audio_eos|>", video_token="<|VIDEO|>", audio_token="<|AUDIO|>",
                           get_chunked_index=partial(Qwen2_5OmniProcessor.get_chunked_index, None))
    return Qwen2_5OmniProcessor.replace_video_with_audio_token(
        fake, {"video_grid_thw": [grid], "video_second_per_grid": [spg]}, 0, {"num_audio_tokens": [n_audio]}, 0,
        position_id_per_seconds=25, seconds_per_chunk=2)


class Layout:
    """Builds token ids and the matching grids / audio lengths for a sequence of segments."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.names = {"<|vision_bos|>": cfg.vision_start_token_id, "<|vision_eos|>": cfg.vision_end_token_id,
                      "<|audio_bos|>": cfg.audio_start_token_id, "<|audio_eos|>": cfg.audio_end_token_id,
                      "<|IMAGE|>": cfg.image_token_id, "<|VIDEO|>": cfg.video_token_id,
                      "<|AUDIO|>": cfg.audio_token_id}
        self.ids, self.images, self.videos, self.spg, self.audio = [], [], [], [], []
        self.rng = np.random.default_rng(0)

    def _special(self, s):
        self.ids += [self.names[m] for m in re.findall(r"<\|[A-Za-z_]+\|>", s)]

    def text(self, n):
        self.ids += self.rng.integers(10, 900, n).tolist()
        return self

    def image(self, t, h, w):
        self.images.append([t, h, w])
        self._special("<|vision_bos|>" + "<|IMAGE|>" * (t * h * w // 4) + "<|vision_eos|>")
        return self

    def audio_clip(self, name):
        self.audio.append(MEL_FRAMES[name])
        self._special("<|audio_bos|>" + "<|AUDIO|>" * audio_token_count(MEL_FRAMES[name]) + "<|audio_eos|>")
        return self

    def video(self, t, h, w, spg):
        self.videos.append([t, h, w])
        self.spg.append(spg)
        self._special("<|vision_bos|>" + "<|VIDEO|>" * (t * h * w // 4) + "<|vision_eos|>")
        return self

    def video_with_audio(self, t, h, w, spg, name):
        self.videos.append([t, h, w])
        self.spg.append(spg)
        self.audio.append(MEL_FRAMES[name])
        self._special("<|vision_bos|>" + _hf_interleave([t, h, w], spg, audio_token_count(MEL_FRAMES[name]))
                      + "<|vision_eos|>")
        return self

    def arrays(self):
        return (np.asarray([self.ids]), np.asarray(self.images) if self.images else None,
                np.asarray(self.videos) if self.videos else None,
                np.asarray(self.audio) if self.audio else None, np.asarray(self.spg) if self.spg else None)


def _compare(model, hf, ids, images, videos, audio, spg, use_audio_in_video, mask=None):
    mask = np.ones_like(ids) if mask is None else mask
    ref, ref_d = hf.model.get_rope_index(
        torch.tensor(ids), None if images is None else torch.tensor(images),
        None if videos is None else torch.tensor(videos), torch.tensor(mask), use_audio_in_video,
        None if audio is None else torch.tensor(audio), None if spg is None else torch.tensor(spg, dtype=torch.float32))
    fam = None
    if audio is not None:  # the port takes the feature mask, as the processor returns it
        fam = np.zeros((len(audio), int(max(audio))), dtype=np.int32)
        for i, n in enumerate(audio):
            fam[i, :n] = 1
    ours, d = model.get_rope_index(ids, images, videos, mask, use_audio_in_video, fam, spg)
    np.testing.assert_array_equal(ours, ref.numpy())
    np.testing.assert_array_equal(d, ref_d.numpy())
    return ours


def test_mixed_image_audio_image(tiny, hf_thinker):
    model, _ = tiny
    lay = Layout(model.config).text(5).image(1, 6, 8).text(3).audio_clip("a237").text(2).image(1, 4, 4).text(4)
    _compare(model, hf_thinker, *lay.arrays(), False)


@pytest.mark.parametrize("spg", [0.5, 1.0, 1.3, 2.0, 2.5])
def test_video_seconds_per_grid(tiny, hf_thinker, spg):
    model, _ = tiny
    lay = Layout(model.config).text(4).video(4, 4, 6, spg).text(3)
    pos = _compare(model, hf_thinker, *lay.arrays(), False)
    assert len(np.unique(pos[0, 0])) > 4  # several distinct temporal values


@pytest.mark.parametrize("frames, audio, spg", [
    (4, "a4s", 1.0),  # V8 A50 V8 A50
    (2, "a10s", 1.0),  # audio longer than the video: its extra chunks follow
    (8, "a1s", 1.0),  # audio shorter than the video
    (3, "a3s", 2.5),  # video temporal values jump over a whole chunk
    (1, "a40", 1.0),  # a frame grid wider than the only audio chunk: eos after the last run, not the block
])
def test_audio_in_video(tiny, hf_thinker, frames, audio, spg):
    model, _ = tiny
    w = 40 if audio == "a40" else 6
    lay = Layout(model.config).text(4).video_with_audio(frames, 4, w, spg, audio).text(5)
    _compare(model, hf_thinker, *lay.arrays(), True)


def test_audio_in_video_then_image_and_audio(tiny, hf_thinker):
    model, _ = tiny
    lay = (Layout(model.config).text(3).video_with_audio(2, 4, 4, 1.0, "a4s").text(2).image(1, 4, 6).text(1)
           .audio_clip("a1s").text(3))
    _compare(model, hf_thinker, *lay.arrays(), True)


def test_left_padded_batch(tiny, hf_thinker):
    model, _ = tiny
    a = Layout(model.config).text(3).image(1, 4, 4).text(2)
    b = Layout(model.config).text(9).image(1, 6, 8).text(6)
    n = max(len(a.ids), len(b.ids))
    ids = np.asarray([[0] * (n - len(a.ids)) + a.ids, [0] * (n - len(b.ids)) + b.ids])
    mask = np.asarray([[0] * (n - len(a.ids)) + [1] * len(a.ids), [0] * (n - len(b.ids)) + [1] * len(b.ids)])
    images = np.asarray(a.images + b.images)
    _compare(model, hf_thinker, ids, images, None, None, None, False, mask)


def test_text_and_audio_only_path(tiny, hf_thinker):
    model, _ = tiny
    lay = Layout(model.config).text(6).audio_clip("a3s").text(4)
    pos = _compare(model, hf_thinker, *lay.arrays(), False)
    np.testing.assert_array_equal(pos[0, 0], np.arange(pos.shape[-1]))
