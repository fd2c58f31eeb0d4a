"""Media sources: files, cameras and microphones cut into one-second chunks (a frame plus its second of audio).

A streaming unit stands for one second of input. ``iter_chunks`` reads a video file (and its audio track, or a
separate audio file) and yields ``Chunk``s; ``LiveCapture`` does the same from a webcam and a microphone. Frames
are ``HxWx3`` uint8 RGB, audio is mono float32 at 16 kHz (any input rate is resampled). Problems with an input
raise ``MediaError`` naming the file and the reason.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from .errors import MediaError
from .models.audio_features import resample

SAMPLE_RATE = 16000
AUDIO_SUFFIXES_SOUNDFILE = {".wav", ".flac", ".ogg", ".oga", ".aiff", ".aif", ".au", ".caf"}


@dataclass
class Chunk:
    """One second of input: ``t`` is its start in seconds."""

    t: float
    frame: np.ndarray | None = None  # HxWx3 uint8 RGB
    audio: np.ndarray | None = None  # mono float32 at SAMPLE_RATE


# --- validation --------------------------------------------------------------------------------------------------
def as_rgb_frame(frame, name: str = "frame") -> np.ndarray:
    """An image as ``HxWx3`` uint8 RGB: accepts numpy (uint8 or float in [0, 1]), PIL images and MLX arrays."""
    if frame is None:
        raise MediaError(f"{name} is None")
    if hasattr(frame, "convert") and hasattr(frame, "size"):  # PIL
        frame = np.asarray(frame.convert("RGB"))
    elif type(frame).__module__.startswith("mlx"):
        frame = np.array(frame)
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
        audio = np.array(audio)
    a = np.asarray(audio)
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
    return resample(a, sr, SAMPLE_RATE) if sr != SAMPLE_RATE else a


# --- files -------------------------------------------------------------------------------------------------------
def _check_file(path: str | os.PathLike, what: str) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise MediaError(f"{what} {p} does not exist")
    if not p.is_file():
        raise MediaError(f"{what} {p} is not a file")
    if p.stat().st_size == 0:
        raise MediaError(f"{what} {p} is empty")
    return p


def _read_audio_av(p: Path) -> np.ndarray | None:
    """Decode the first audio stream of any container PyAV/FFmpeg understands; None when it has no audio."""
    try:
        import av
    except ImportError:
        raise MediaError(f"cannot decode {p.name}: install PyAV (`pip install av`) for audio in "
                         f"{p.suffix or 'this'} files") from None
    try:
        with av.open(str(p)) as container:
            if not container.streams.audio:
                return None
            stream = container.streams.audio[0]
            resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
            parts = []
            for frame in container.decode(stream):
                for r in resampler.resample(frame):
                    parts.append(r.to_ndarray().reshape(-1))
            for r in resampler.resample(None):
                parts.append(r.to_ndarray().reshape(-1))
    except av.error.FFmpegError as e:
        raise MediaError(f"cannot read audio from {p}: {e}") from None
    if not parts:
        return None
    return np.concatenate(parts).astype(np.float32)


def read_audio(path: str | os.PathLike) -> np.ndarray:
    """Mono float32 16 kHz audio of a file (wav/flac/ogg through soundfile; anything else through PyAV)."""
    p = _check_file(path, "audio file")
    if p.suffix.lower() in AUDIO_SUFFIXES_SOUNDFILE:
        import soundfile as sf

        try:
            data, sr = sf.read(str(p), dtype="float32", always_2d=True)
        except Exception as e:
            raise MediaError(f"cannot read audio file {p}: {e}") from None
        if data.shape[0] == 0:
            raise MediaError(f"audio file {p} holds no samples")
        return as_mono_audio(data.mean(axis=1), sr, name=str(p))
    audio = _read_audio_av(p)
    if audio is None:
        raise MediaError(f"{p} has no audio stream")
    return audio


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
    import cv2

    p = _check_file(path, "video file")
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
    ones are grabbed without conversion.
    """
    import cv2

    info = probe_video(path)
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


def iter_chunks(video: str | os.PathLike | None = None, audio: str | os.PathLike | None = None, *,
                use_video_audio: bool = True, seconds: float | None = None) -> Iterator[Chunk]:
    """One ``Chunk`` per second of a video file (its frame at t + 0.5 s) and/or an audio file.

    With a video and no ``audio``, the video's own audio track is used when it has one (``use_video_audio``).
    ``seconds`` caps the stream length. Every problem with the files is raised before the first chunk.
    """
    if video is None and audio is None:
        raise MediaError("nothing to stream: give a video and/or an audio file")
    samples = None
    if audio is not None:
        samples = read_audio(audio)
    elif video is not None and use_video_audio:
        samples = _read_audio_av(_check_file(video, "video file")) if _has_av() else None
    duration = 0.0
    if video is not None:
        duration = probe_video(video).duration
    if audio is not None:  # a separate audio file may outlast the video; the video's own track is cut to it
        duration = max(duration, samples.shape[0] / SAMPLE_RATE)
    n = int(math.ceil(duration - 1e-6))
    if seconds is not None:
        n = min(n, int(math.ceil(seconds)))
    frames = iter_video_frames(video) if video is not None else None
    for k in range(n):
        frame = None
        if frames is not None:
            nxt = next(frames, None)
            frame = nxt[1] if nxt is not None else None
        chunk_audio = None
        if samples is not None and k * SAMPLE_RATE < samples.shape[0]:
            piece = samples[k * SAMPLE_RATE:(k + 1) * SAMPLE_RATE]
            chunk_audio = np.pad(piece, (0, SAMPLE_RATE - piece.shape[0])) if piece.shape[0] < SAMPLE_RATE else piece
        if frame is None and chunk_audio is None:
            break
        yield Chunk(t=float(k), frame=frame, audio=chunk_audio)


def _has_av() -> bool:
    try:
        import av  # noqa: F401
    except ImportError:
        return False
    return True


# --- live capture ------------------------------------------------------------------------------------------------
class LiveCapture:
    """Webcam (OpenCV) and microphone (sounddevice) cut into one-second chunks, on a background thread.

    ``chunks()`` yields a ``Chunk`` per second: the latest camera frame at that second and the second of audio
    recorded. sounddevice is optional: without it (or with ``microphone=False``) chunks carry frames only.
    """

    def __init__(self, camera: int | None = 0, microphone: bool = True, device_rate: int = SAMPLE_RATE):
        self.camera, self.microphone, self.device_rate = camera, microphone, device_rate
        self._audio: queue.Queue[np.ndarray] = queue.Queue()
        self._stop = threading.Event()
        self._cap = None
        self._stream = None

    def __enter__(self) -> "LiveCapture":
        if self.camera is not None:
            import cv2

            self._cap = cv2.VideoCapture(self.camera)
            if not self._cap.isOpened():
                raise MediaError(f"cannot open camera {self.camera}")
        if self.microphone:
            try:
                import sounddevice as sd
            except (ImportError, OSError) as e:
                raise MediaError("microphone input needs the optional package sounddevice "
                                 f"(`pip install sounddevice`, and PortAudio): {e}") from None
            self._stream = sd.InputStream(samplerate=self.device_rate, channels=1, dtype="float32",
                                          callback=lambda data, frames, t, status: self._audio.put(data[:, 0].copy()))
            self._stream.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._stream is not None:
            self._stream.stop()
            self._stream.close()
        if self._cap is not None:
            self._cap.release()

    def stop(self) -> None:
        self._stop.set()

    def chunks(self) -> Iterator[Chunk]:
        import cv2

        k, start = 0, time.monotonic()
        pending = np.zeros(0, dtype=np.float32)
        while not self._stop.is_set():
            frame = None
            if self._cap is not None:
                ok, bgr = self._cap.read()
                frame = cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB) if ok else None
            deadline = start + k + 1
            time.sleep(max(0.0, deadline - time.monotonic()))
            audio = None
            if self._stream is not None:
                while not self._audio.empty():
                    pending = np.concatenate([pending, self._audio.get_nowait()])
                need = self.device_rate
                piece, pending = pending[:need], pending[need:]
                piece = np.pad(piece, (0, need - piece.shape[0]))
                audio = as_mono_audio(piece, self.device_rate, name="microphone")
            yield Chunk(t=float(k), frame=frame, audio=audio)
            k += 1
