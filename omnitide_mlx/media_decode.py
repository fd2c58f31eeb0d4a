"""Media decoding: audio and video files read into arrays, and the checks every frame and audio piece passes.

Frames are ``HxWx3`` uint8 RGB, audio is mono float32 at 16 kHz (any input rate is resampled). Audio files go
through soundfile or PyAV, video through OpenCV (frames) and PyAV (its audio track). Problems with an input raise
``MediaError`` naming the file and the reason. The one-second sources built on these (files, camera, microphone)
are in media.py.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from .errors import MediaError
from .models.audio_features import resample

SAMPLE_RATE = 16000
AUDIO_SUFFIXES_SOUNDFILE = {".wav", ".flac", ".ogg", ".oga", ".aiff", ".aif", ".au", ".caf"}


# --- validation --------------------------------------------------------------------------------------------------
AUDIO_PEAK_LIMIT = 2.0  # float audio beyond +-2 is a scaling mistake (int16 values as floats), not a loud sound


def _mlx_to_numpy(x) -> np.ndarray:
    """An MLX array as numpy; bfloat16 (which numpy lacks) goes through float32."""
    import mlx.core as mx

    if x.dtype == mx.bfloat16:
        x = x.astype(mx.float32)
    return np.array(x)


def as_rgb_frame(frame, name: str = "frame") -> np.ndarray:
    """An image as ``HxWx3`` uint8 RGB: accepts numpy (uint8 or float in [0, 1]), PIL images and MLX arrays."""
    if frame is None:
        raise MediaError(f"{name} is None")
    if hasattr(frame, "convert") and hasattr(frame, "size"):  # PIL
        frame = np.asarray(frame.convert("RGB"))
    elif type(frame).__module__.startswith("mlx"):
        frame = _mlx_to_numpy(frame)
    arr = np.asarray(frame)
    if arr.ndim == 2:
        arr = np.repeat(arr[:, :, None], 3, axis=2)
    if arr.ndim != 3 or arr.shape[2] not in (3, 4):
        raise MediaError(f"{name} has shape {arr.shape}; expected HxWx3 (RGB) or HxWx4 (RGBA)")
    if arr.shape[0] < 2 or arr.shape[1] < 2:
        raise MediaError(f"{name} is {arr.shape[1]}x{arr.shape[0]} pixels: too small")
    arr = arr[:, :, :3]
    if arr.dtype != np.uint8:
        if not np.issubdtype(arr.dtype, np.floating) and not np.issubdtype(arr.dtype, np.integer):
            raise MediaError(f"{name} has dtype {arr.dtype}; expected uint8 or float")
        a = arr.astype(np.float64)
        if not np.isfinite(a).all():
            raise MediaError(f"{name} holds NaN or infinite values")
        if np.issubdtype(arr.dtype, np.floating) and a.max(initial=0) <= 1.0 and a.min(initial=0) >= 0.0:
            a = a * 255.0
        if a.min(initial=0) < 0 or a.max(initial=0) > 255:
            raise MediaError(f"{name} values lie outside [0, 255] (or [0, 1] for floats)")
        arr = np.round(a).astype(np.uint8)
    return np.ascontiguousarray(arr)


def as_mono_audio(audio, sample_rate: int | None, name: str = "audio") -> np.ndarray:
    """Audio as mono float32 at 16 kHz. Accepts ``[n]`` or ``[n, channels]`` arrays (numpy or MLX), int or float."""
    if sample_rate is None:
        raise MediaError(f"{name}: a sample rate is required")
    try:
        sr = int(sample_rate)
    except (TypeError, ValueError):
        raise MediaError(f"{name}: sample rate {sample_rate!r} is not a number") from None
    if sr != sample_rate or sr < 1000 or sr > 384000:
        raise MediaError(f"{name}: unusable sample rate {sample_rate!r} Hz (expected 1 kHz to 384 kHz)")
    if type(audio).__module__.startswith("mlx"):
        audio = _mlx_to_numpy(audio)
    a = np.asarray(audio)
    if np.iscomplexobj(a):
        raise MediaError(f"{name} holds complex samples; expected real samples (take .real or abs() first)")
    if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
        raise MediaError(f"{name} has dtype {a.dtype}; expected int or float samples")
    if a.ndim == 2:
        a = a.mean(axis=1) if a.shape[1] <= 8 else a.mean(axis=0)  # [n, ch] or [ch, n]
    if a.ndim != 1:
        raise MediaError(f"{name} has shape {np.shape(audio)}; expected [samples] or [samples, channels]")
    if a.size == 0:
        raise MediaError(f"{name} is empty")
    if np.issubdtype(a.dtype, np.integer):
        a = a.astype(np.float32) / float(np.iinfo(a.dtype).max)
    a = a.astype(np.float32)
    if not np.isfinite(a).all():
        raise MediaError(f"{name} holds NaN or infinite samples")
    peak = float(np.abs(a).max())
    if peak > AUDIO_PEAK_LIMIT:
        raise MediaError(f"{name}: float samples must lie in [-1, 1], the peak is {peak:.4g} (integer PCM passed as "
                         "floats? divide by 32768)")
    if peak > 1.0:
        a = np.clip(a, -1.0, 1.0)  # an overshoot of a resampler or a mixer: clipped, as a sound card would
    return resample(a, sr, SAMPLE_RATE) if sr != SAMPLE_RATE else a


# --- files -------------------------------------------------------------------------------------------------------
def check_file(path: str | os.PathLike, what: str) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise MediaError(f"{what} {p} does not exist")
    if not p.is_file():
        raise MediaError(f"{what} {p} is not a file")
    if p.stat().st_size == 0:
        raise MediaError(f"{what} {p} is empty")
    return p


def _quiet_decoders() -> None:
    """Keep FFmpeg's own log lines (OpenCV's and PyAV's) off the user's terminal: problems reach users as
    MediaError messages instead. OpenCV reads the variable when it opens a file, so setting it here suffices."""
    os.environ.setdefault("OPENCV_FFMPEG_LOGLEVEL", "-8")
    os.environ.setdefault("OPENCV_LOG_LEVEL", "ERROR")
    try:
        import av.logging

        av.logging.set_level(None)
    except (ImportError, AttributeError):
        pass


def _import_av(p: Path):
    try:
        import av
    except ImportError:
        raise MediaError(f"cannot decode {p.name}: install PyAV (`pip install av`) for audio in "
                         f"{p.suffix or 'this'} files") from None
    _quiet_decoders()
    return av


def _iter_audio_av(p: Path) -> Iterator[np.ndarray]:
    """Mono float32 16 kHz pieces of the first audio stream of any container FFmpeg reads, decoded as they are
    needed (memory stays bounded whatever the length). Yields nothing when the file has no audio stream."""
    av = _import_av(p)
    try:
        container = av.open(str(p))
    except av.error.FFmpegError as e:
        raise MediaError(f"cannot read audio from {p}: {e}") from None
    try:
        if not container.streams.audio:
            return
        stream = container.streams.audio[0]
        resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
        try:
            for frame in container.decode(stream):
                for r in resampler.resample(frame):
                    yield r.to_ndarray().reshape(-1).astype(np.float32, copy=False)
            for r in resampler.resample(None):
                yield r.to_ndarray().reshape(-1).astype(np.float32, copy=False)
        except av.error.FFmpegError as e:
            raise MediaError(f"cannot read audio from {p}: {e}") from None
    finally:
        container.close()


def _soundfile_rate(p: Path, sr) -> int:
    if not 1000 <= int(sr) <= 384000:
        raise MediaError(f"{p}: unusable sample rate {sr!r} Hz (expected 1 kHz to 384 kHz)")
    return int(sr)


def _iter_audio_soundfile(p: Path) -> Iterator[np.ndarray]:
    """Mono float32 16 kHz pieces of a wav/flac/ogg file read a second at a time. Other rates are resampled in
    windows with enough context on each side that the result equals resampling the whole file at once."""
    import soundfile as sf

    try:
        f = sf.SoundFile(str(p))
    except Exception as e:
        raise MediaError(f"cannot read audio file {p}: {e}") from None
    with f:
        sr = _soundfile_rate(p, f.samplerate)
        if f.frames == 0:
            raise MediaError(f"audio file {p} holds no samples")

        def read(n: int) -> np.ndarray:
            try:
                return f.read(n, dtype="float32", always_2d=True).mean(axis=1).astype(np.float32)
            except Exception as e:
                raise MediaError(f"cannot read audio file {p}: {e}") from None

        if sr == SAMPLE_RATE:
            while (block := read(SAMPLE_RATE)).size:
                yield block
            return
        g = math.gcd(sr, SAMPLE_RATE)
        up, down = SAMPLE_RATE // g, sr // g
        half = int(math.ceil(24 / min(1.0, SAMPLE_RATE / sr)))  # the resampler's taps each side (input samples)
        pad = down * int(math.ceil((half + 2) / down))  # context each side, a whole number of output samples
        lead = pad * up // down
        window = np.zeros(pad, dtype=np.float32)  # input from k*sr - pad; zeros before the file, as resample pads
        eof = False
        while True:
            while not eof and window.size < pad + sr + pad:
                more = read(sr)
                eof = more.size == 0
                window = np.concatenate([window, more])
            remaining = window.size - pad  # input samples from k*sr on
            if remaining <= 0:
                return
            n_in = min(sr, remaining)
            n_out = SAMPLE_RATE if n_in == sr else int(math.ceil(n_in * up / down))
            w = window if n_in == sr else np.concatenate([window, np.zeros(pad, np.float32)])
            y = resample(w[:pad + sr + pad] if n_in == sr else w, sr, SAMPLE_RATE)
            yield y[lead:lead + n_out]
            window = window[n_in:]
            if n_in < sr:
                return


def iter_audio(path: str | os.PathLike) -> Iterator[np.ndarray]:
    """Mono float32 16 kHz pieces of an audio (or video) file, decoded as they are needed."""
    p = check_file(path, "audio file")
    if p.suffix.lower() in AUDIO_SUFFIXES_SOUNDFILE:
        return _iter_audio_soundfile(p)
    return _iter_audio_av(p)


def per_second(pieces: Iterator[np.ndarray]) -> Iterator[np.ndarray]:
    """Regroup audio pieces into one-second blocks (the last one may be shorter)."""
    buf: list[np.ndarray] = []
    n = 0
    for piece in pieces:
        buf.append(piece)
        n += piece.shape[0]
        if n >= SAMPLE_RATE:
            cat = np.concatenate(buf)
            k = 0
            while cat.shape[0] - k >= SAMPLE_RATE:
                yield cat[k:k + SAMPLE_RATE]
                k += SAMPLE_RATE
            buf, n = [cat[k:]], cat.shape[0] - k
    if n:
        yield np.concatenate(buf)


def read_audio(path: str | os.PathLike) -> np.ndarray:
    """The whole of a file's audio, mono float32 at 16 kHz (wav/flac/ogg through soundfile; anything else through
    PyAV). Streams use ``iter_audio`` instead, which holds a second at a time."""
    p = check_file(path, "audio file")
    parts = list(iter_audio(p))
    if not parts or sum(x.shape[0] for x in parts) == 0:
        raise MediaError(f"{p} has no audio stream" if p.suffix.lower() not in AUDIO_SUFFIXES_SOUNDFILE
                         else f"audio file {p} holds no samples")
    return np.concatenate(parts).astype(np.float32)


def probe_audio(path: str | os.PathLike, *, required: bool = True) -> float | None:
    """Seconds of audio in a file, checked without decoding it all; None when a container has no audio stream
    (a MediaError instead when ``required``)."""
    p = check_file(path, "audio file")
    if p.suffix.lower() in AUDIO_SUFFIXES_SOUNDFILE:
        import soundfile as sf

        try:
            info = sf.info(str(p))
        except Exception as e:
            raise MediaError(f"cannot read audio file {p}: {e}") from None
        sr = _soundfile_rate(p, info.samplerate)
        if info.frames <= 0:
            raise MediaError(f"audio file {p} holds no samples")
        return info.frames / sr
    av = _import_av(p)
    try:
        with av.open(str(p)) as container:
            if not container.streams.audio:
                if required:
                    raise MediaError(f"{p} has no audio stream")
                return None
            stream = container.streams.audio[0]
            if stream.duration is not None and stream.time_base is not None:
                seconds = float(stream.duration * stream.time_base)
            elif container.duration is not None:
                seconds = container.duration / 1e6
            else:
                seconds = None
            first = next(container.decode(stream), None)
            if first is None:
                if required:
                    raise MediaError(f"{p}: its audio stream holds no samples")
                return None
    except av.error.FFmpegError as e:
        raise MediaError(f"cannot read audio from {p}: {e}") from None
    return seconds


@dataclass
class VideoInfo:
    fps: float
    frames: int
    width: int
    height: int

    @property
    def duration(self) -> float:
        return self.frames / self.fps


def probe_video(path: str | os.PathLike) -> VideoInfo:
    p = check_file(path, "video file")
    _quiet_decoders()
    import cv2

    cap = cv2.VideoCapture(str(p))
    try:
        if not cap.isOpened():
            raise MediaError(f"cannot open video {p}: not a video OpenCV can decode (corrupt or unsupported)")
        fps = cap.get(cv2.CAP_PROP_FPS)
        frames = int(cap.get(cv2.CAP_PROP_FRAME_COUNT))
        w, h = int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)), int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT))
        ok, _ = cap.read()
    finally:
        cap.release()
    if not ok:
        raise MediaError(f"cannot decode any frame of {p}: corrupt or unsupported video")
    if not fps or not math.isfinite(fps) or fps <= 0:
        raise MediaError(f"video {p} reports no usable frame rate")
    return VideoInfo(fps=float(fps), frames=max(frames, 1), width=w, height=h)


def iter_video_frames(path: str | os.PathLike, every: float = 1.0, offset: float = 0.5) -> Iterator[tuple[float, np.ndarray]]:
    """Frames at ``offset, offset + every, ...`` seconds, as ``(second_index * every, RGB frame)``.

    Decodes sequentially (robust for any codec; seeking in long-GOP streams is not): frames between the sampled
    ones are grabbed without conversion, so one decoded frame is held at a time.
    """
    info = probe_video(path)
    import cv2

    cap = cv2.VideoCapture(str(path))
    try:
        k, index = 0, 0
        while True:
            target = int(round((k * every + offset) * info.fps))
            while index < target:
                if not cap.grab():
                    return
                index += 1
            ok, bgr = cap.read()
            index += 1
            if not ok:
                return
            yield k * every, cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
            k += 1
    finally:
        cap.release()


def has_av() -> bool:
    try:
        import av  # noqa: F401
    except ImportError:
        return False
    return True
