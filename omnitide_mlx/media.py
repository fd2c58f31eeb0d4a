"""Media sources: files, cameras and microphones cut into one-second chunks (a frame plus its second of audio).

A streaming unit stands for one second of input. ``iter_chunks`` reads a video file (and its audio track, or a
separate audio file) and yields ``Chunk``s; ``LiveCapture`` does the same from a webcam and a microphone. Frames
are ``HxWx3`` uint8 RGB, audio is mono float32 at 16 kHz (any input rate is resampled). Problems with an input
raise ``MediaError`` naming the file and the reason. Decoding and the input checks live in media_decode.py
(re-exported here).
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from .errors import MediaError
from .media_decode import (
    AUDIO_PEAK_LIMIT,
    AUDIO_SUFFIXES_SOUNDFILE,
    SAMPLE_RATE,
    VideoInfo,
    as_mono_audio,
    as_rgb_frame,
    check_file,
    has_av,
    iter_audio,
    iter_video_frames,
    per_second,
    probe_audio,
    probe_video,
    read_audio,
)

__all__ = ["AUDIO_PEAK_LIMIT", "AUDIO_SUFFIXES_SOUNDFILE", "SAMPLE_RATE", "Chunk", "LiveCapture", "MediaStream",
           "VideoInfo", "as_mono_audio", "as_rgb_frame", "iter_audio", "iter_chunks", "iter_video_frames",
           "per_second", "probe_audio", "probe_video", "read_audio"]


@dataclass
class Chunk:
    """One second of input: ``t`` is its start in seconds."""

    t: float
    frame: np.ndarray | None = None  # HxWx3 uint8 RGB
    audio: np.ndarray | None = None  # mono float32 at SAMPLE_RATE


class MediaStream:
    """A video and/or an audio file as one ``Chunk`` a second, decoded as it is read (bounded memory whatever the
    length).

    Both files are checked when the stream is made (a bad file fails before any model is loaded); ``units`` is the
    number of chunks to expect (for a progress bar). When one track ends before the other, the rest of the other
    still streams: frames with a second of silence once the audio has ended, audio without frames once the video
    has. While iterating, ``frames``, ``audio_seconds`` (of the files' own audio) and ``silence_seconds`` (padding)
    count what was streamed, for the final summary.
    """

    def __init__(self, video: str | os.PathLike | None = None, audio: str | os.PathLike | None = None, *,
                 use_video_audio: bool = True, seconds: float | None = None):
        if video is None and audio is None:
            raise MediaError("nothing to stream: give a video and/or an audio file")
        if seconds is not None and not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
            raise MediaError(f"seconds must be a positive number (got {seconds!r})")
        self.video, self.audio_path = video, None
        self.video_info = probe_video(video) if video is not None else None
        self.audio_duration: float | None = None
        if audio is not None:
            self.audio_path = check_file(audio, "audio file")
            self.audio_duration = probe_audio(self.audio_path)
        elif video is not None and use_video_audio and has_av():
            self.audio_path = check_file(video, "video file")
            self.audio_duration = probe_audio(self.audio_path, required=False)
            if self.audio_duration is None:
                self.audio_path = None
        duration = self.video_info.duration if self.video_info is not None else 0.0
        if audio is not None:  # a separate audio file may outlast the video; the video's own track is cut to it
            duration = max(duration, self.audio_duration or 0.0)
        self.duration = duration
        n = max(1, int(math.ceil(duration - 1e-6)))
        if seconds is not None:
            n = min(n, int(math.ceil(seconds)))
        self.units = n
        self.frames = 0
        self.audio_seconds = 0.0
        self.silence_seconds = 0.0

    def __iter__(self) -> Iterator[Chunk]:
        frames = iter_video_frames(self.video) if self.video is not None else None
        seconds = per_second(iter_audio(self.audio_path)) if self.audio_path is not None else None
        try:
            for k in range(self.units):
                frame = None
                if frames is not None:
                    nxt = next(frames, None)
                    frame = nxt[1] if nxt is not None else None
                    if nxt is None:
                        frames = None
                piece = next(seconds, None) if seconds is not None else None
                if seconds is not None and piece is None:
                    seconds = None
                if frame is None and piece is None:
                    break
                chunk_audio = None
                if piece is not None:
                    self.audio_seconds += piece.shape[0] / SAMPLE_RATE
                    if piece.shape[0] < SAMPLE_RATE:
                        self.silence_seconds += (SAMPLE_RATE - piece.shape[0]) / SAMPLE_RATE
                        piece = np.pad(piece, (0, SAMPLE_RATE - piece.shape[0]))
                    chunk_audio = piece
                elif self.audio_path is not None:  # the audio has ended: the frame comes with a second of silence
                    chunk_audio = np.zeros(SAMPLE_RATE, dtype=np.float32)
                    self.silence_seconds += 1.0
                if frame is not None:
                    self.frames += 1
                yield Chunk(t=float(k), frame=frame, audio=chunk_audio)
        finally:
            if frames is not None:
                frames.close()
            if seconds is not None:
                seconds.close()

    def summary(self) -> str:
        """What was streamed, per track: e.g. ``10 s: video 10 s, audio 1.0 s (+ 9.0 s of silence)``."""
        parts = []
        if self.video is not None:
            parts.append(f"video {self.frames} s")
        if self.audio_path is not None:
            a = f"audio {self.audio_seconds:.1f} s"
            if self.silence_seconds >= 0.05:
                a += f" (+ {self.silence_seconds:.1f} s of silence)"
            parts.append(a)
        elif self.video is not None:
            parts.append("no audio track")
        return ", ".join(parts)


def iter_chunks(video: str | os.PathLike | None = None, audio: str | os.PathLike | None = None, *,
                use_video_audio: bool = True, seconds: float | None = None) -> Iterator[Chunk]:
    """One ``Chunk`` per second of a video file (its frame at t + 0.5 s) and/or an audio file (see
    ``MediaStream``).

    With a video and no ``audio``, the video's own audio track is used when it has one (``use_video_audio``).
    ``seconds`` caps the stream length. Problems with the files are raised before the first chunk.
    """
    yield from MediaStream(video, audio, use_video_audio=use_video_audio, seconds=seconds)


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
