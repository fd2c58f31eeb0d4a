"""Media sources: bundled files chunked per second, conversions, and clear errors for bad input."""

import struct

import mlx.core as mx
import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from omnitide_mlx.errors import MediaError
from omnitide_mlx.media import SAMPLE_RATE, as_mono_audio, as_rgb_frame, iter_chunks, probe_video, read_audio

# background colour of each second of the bundled clip (assets/media/README.md), RGB
SCENE_RGB = [(255, 0, 0), (0, 128, 0), (0, 0, 255), (255, 255, 0), (128, 0, 128)]


def test_bundled_clip_gives_one_chunk_per_second_with_its_frame_and_audio(media_dir):
    chunks = list(iter_chunks(media_dir / "video_10s_av.mp4"))
    assert [c.t for c in chunks] == [float(k) for k in range(10)]
    for c, rgb in zip(chunks, SCENE_RGB):
        assert c.frame.shape == (448, 448, 3) and c.frame.dtype == np.uint8
        corner = c.frame[440, 440].astype(int)  # background, away from the drawings
        assert np.abs(corner - np.array(rgb)).max() < 12, (c.t, corner, rgb)
        assert c.audio.shape == (SAMPLE_RATE,) and c.audio.dtype == np.float32
    # speech in the first seconds, silence padding at the very end of the track
    assert np.abs(chunks[1].audio).max() > 0.3


def test_audio_only_stream_and_separate_audio_file(media_dir):
    chunks = list(iter_chunks(audio=media_dir / "speech_16k.wav"))
    assert len(chunks) == 10 and all(c.frame is None for c in chunks)
    assert chunks[-1].audio.shape == (SAMPLE_RATE,)  # last partial second zero-padded
    both = list(iter_chunks(media_dir / "video_10s_av.mp4", audio=media_dir / "tone_440_1s_16k.wav"))
    assert len(both) == 10 and both[0].audio is not None and both[1].audio is None


def test_read_audio_resamples_other_rates(tmp_path):
    sr = 44100
    x = 0.5 * np.sin(2 * np.pi * 440 * np.arange(sr) / sr)
    f = tmp_path / "a.wav"
    sf.write(f, np.stack([x, x], axis=1), sr)  # stereo 44.1 kHz
    y = read_audio(f)
    assert y.shape == (SAMPLE_RATE,)
    ref = 0.5 * np.sin(2 * np.pi * 440 * np.arange(SAMPLE_RATE) / SAMPLE_RATE)
    assert np.abs(y[500:-500] - ref[500:-500]).max() < 2e-3


def test_frames_from_numpy_pil_mlx_and_float():
    rgb = (np.arange(4 * 5 * 3) % 256).astype(np.uint8).reshape(4, 5, 3)
    assert np.array_equal(as_rgb_frame(rgb), rgb)
    assert np.array_equal(as_rgb_frame(Image.fromarray(rgb)), rgb)
    assert np.array_equal(as_rgb_frame(mx.array(rgb)), rgb)
    assert np.array_equal(as_rgb_frame(rgb.astype(np.float32) / 255.0), rgb)
    rgba = np.concatenate([rgb, np.full((4, 5, 1), 255, np.uint8)], axis=2)
    assert np.array_equal(as_rgb_frame(rgba), rgb)


@pytest.mark.parametrize("bad, message", [
    (np.zeros((4, 5)), None),  # grey is accepted (replicated)
    (np.zeros((4, 5, 2), np.uint8), "shape"),
    (np.zeros((1, 5, 3), np.uint8), "too small"),
    (np.full((4, 5, 3), np.nan, np.float32), "NaN"),
    (np.full((4, 5, 3), 300.0), "outside"),
])
def test_bad_frames_are_rejected_clearly(bad, message):
    if message is None:
        assert as_rgb_frame(bad).shape == (4, 5, 3)
        return
    with pytest.raises(MediaError, match=message):
        as_rgb_frame(bad)


def test_audio_conversions_and_rejections():
    x = (np.sin(np.arange(8000) / 5) * 20000).astype(np.int16)
    y = as_mono_audio(x, 8000)
    assert y.shape == (16000,) and np.abs(y).max() <= 1.0
    assert as_mono_audio(mx.array(np.zeros(16000, np.float32)), 16000).shape == (16000,)
    for bad_rate in (None, 0, 12.5, 10**7, "fast"):
        with pytest.raises(MediaError, match="sample rate"):
            as_mono_audio(np.zeros(100, np.float32), bad_rate)
    with pytest.raises(MediaError, match="empty"):
        as_mono_audio(np.zeros(0, np.float32), 16000)
    with pytest.raises(MediaError, match="NaN"):
        as_mono_audio(np.array([0.0, np.inf], np.float32), 16000)
    with pytest.raises(MediaError, match="shape"):
        as_mono_audio(np.zeros((2, 3, 4), np.float32), 16000)


def test_missing_corrupt_and_unreadable_files(tmp_path):
    with pytest.raises(MediaError, match="does not exist"):
        list(iter_chunks(tmp_path / "nope.mp4"))
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(np.random.default_rng(0).integers(0, 256, 20000, dtype=np.uint8).tobytes())
    with pytest.raises(MediaError, match="junk.mp4"):
        probe_video(junk)
    with pytest.raises(MediaError):
        list(iter_chunks(junk))
    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    with pytest.raises(MediaError, match="empty"):
        read_audio(empty)
    # a WAV header that claims a sample rate of 0 Hz
    zero_rate = tmp_path / "zero.wav"
    data = np.zeros(100, np.int16).tobytes()
    header = b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, 0, 0, 2, 16) \
        + b"data" + struct.pack("<I", len(data))
    zero_rate.write_bytes(header + data)
    with pytest.raises(MediaError, match="zero.wav"):
        read_audio(zero_rate)
    with pytest.raises(MediaError, match="nothing to stream"):
        list(iter_chunks())
