"""Media sources: bundled files chunked per second, conversions, and clear errors for bad input."""

import struct

import mlx.core as mx
import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from omnitide_mlx.errors import MediaError
from omnitide_mlx.media import (SAMPLE_RATE, MediaStream, as_mono_audio, as_rgb_frame, iter_audio, iter_chunks,
                                probe_video, read_audio)
from omnitide_mlx.models.audio_features import resample

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
    assert len(both) == 10 and np.abs(both[0].audio).max() > 0.1


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


def test_when_the_audio_ends_first_the_frames_go_on_with_silence(media_dir):
    """issue 15 item 2: a 1 s audio file with the 10 s clip streamed 2 of 10 seconds (frames after the audio
    never became units); every frame must still stream, each with a second of silence, and the summary says so."""
    stream = MediaStream(media_dir / "video_10s_av.mp4", audio=media_dir / "tone_440_1s_16k.wav")
    chunks = list(stream)
    assert stream.units == 10 and [c.t for c in chunks] == [float(k) for k in range(10)]
    assert all(c.frame is not None and c.audio is not None and c.audio.shape == (SAMPLE_RATE,) for c in chunks)
    assert np.abs(chunks[0].audio).max() > 0.1 and all(not c.audio.any() for c in chunks[1:])
    assert (stream.frames, stream.audio_seconds, stream.silence_seconds) == (10, 1.0, 9.0)
    assert stream.summary() == "video 10 s, audio 1.0 s (+ 9.0 s of silence)"


def test_when_the_video_ends_first_the_audio_goes_on_without_frames(media_dir, tmp_path):
    import cv2

    short = tmp_path / "short.mp4"
    out = cv2.VideoWriter(str(short), cv2.VideoWriter_fourcc(*"mp4v"), 5, (64, 48))
    for _ in range(15):  # 3 s at 5 fps
        out.write(np.full((48, 64, 3), 90, np.uint8))
    out.release()
    stream = MediaStream(short, audio=media_dir / "speech_16k.wav")  # 9.85 s of speech
    chunks = list(stream)
    assert len(chunks) == 10 == stream.units
    assert [c.frame is not None for c in chunks] == [True] * 3 + [False] * 7
    assert all(c.audio is not None for c in chunks)
    assert stream.frames == 3 and abs(stream.audio_seconds - 9.849) < 1e-3
    assert stream.summary().startswith("video 3 s, audio 9.8 s")


def test_audio_streams_a_second_at_a_time(tmp_path):
    """issue 15 item 3: the audio was decoded whole before the first unit. Read by the second, a minute of audio
    must never hold more than a few seconds of it."""
    import tracemalloc

    x = (np.random.default_rng(1).standard_normal(SAMPLE_RATE * 60) * 0.1).astype(np.float32)
    f = tmp_path / "long.wav"
    sf.write(f, x, SAMPLE_RATE, subtype="FLOAT")
    tracemalloc.start()
    try:
        pieces = iter_audio(f)
        first = [next(pieces) for _ in range(3)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 10 * SAMPLE_RATE * 4, peak  # a few seconds; the whole minute is 60 * SAMPLE_RATE * 4 bytes
    got = np.concatenate(first + list(pieces))
    assert np.array_equal(got, x) and all(p.shape == (SAMPLE_RATE,) for p in first)


@pytest.mark.parametrize("rate", [44100, 8000])
def test_audio_resampled_by_the_second_equals_the_whole_file_resampled(tmp_path, rate):
    x = (np.random.default_rng(1).standard_normal(rate * 3 + rate // 3) * 0.1).astype(np.float32)
    f = tmp_path / "a.wav"
    sf.write(f, x, rate, subtype="FLOAT")
    whole = resample(x, rate, SAMPLE_RATE)
    pieces = list(iter_audio(f))
    assert [p.shape[0] for p in pieces] == [SAMPLE_RATE] * 3 + [whole.shape[0] - 3 * SAMPLE_RATE]
    assert np.abs(np.concatenate(pieces) - whole).max() < 1e-6
    assert np.array_equal(read_audio(f), np.concatenate(pieces))


def test_streams_are_checked_when_made_and_decoded_as_read(media_dir, tmp_path):
    junk = tmp_path / "junk.wav"
    junk.write_bytes(b"RIFF not really a wav file")
    with pytest.raises(MediaError, match="junk.wav"):
        MediaStream(media_dir / "video_10s_av.mp4", audio=junk)
    with pytest.raises(MediaError, match="seconds"):
        MediaStream(audio=media_dir / "speech_16k.wav", seconds=-2)
    stream = MediaStream(media_dir / "video_10s_av.mp4", seconds=2.5)
    assert stream.units == 3 and stream.frames == 0  # nothing decoded yet
    assert len(list(stream)) == 3
