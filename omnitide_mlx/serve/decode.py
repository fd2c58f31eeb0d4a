"""Turning client bytes into session input: frames (JPEG / PNG / raw RGB), PCM audio and WebSocket messages.

Everything here runs before a session is touched and raises ``ClientError`` with the limit or field at fault, so a
bad message costs the client one error reply and the session nothing.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
import re
import struct
from dataclasses import dataclass

import numpy as np

from ..errors import OmniTideError
from .config import Limits


class ClientError(OmniTideError):
    """A request the server refuses: ``code`` is stable for programs, ``message`` says what to change."""

    def __init__(self, code: str, message: str, status: int = 400):
        super().__init__(message)
        self.code, self.message, self.status = code, message, status

    def payload(self) -> dict:
        return {"error": {"message": self.message, "type": self.code, "code": self.code}}


FRAME_FORMATS = ("jpeg", "png", "rgb", "rgba")
# encoded frames: how the bytes begin, and the one PIL plugin allowed to open them (PIL would otherwise try every
# format it knows, EPS through Ghostscript among them)
FRAME_MAGIC = {"jpeg": (b"\xff\xd8\xff", "JPEG"), "png": (b"\x89PNG\r\n\x1a\n", "PNG")}
AUDIO_FORMATS = {"pcm_s16le": np.dtype("<i2"), "pcm_f32le": np.dtype("<f4")}


@dataclass
class PushItem:
    """One validated ``unit`` message: what ``OmniSession.push`` receives."""

    seq: int | None
    frame: np.ndarray | None = None
    audio: np.ndarray | None = None
    sample_rate: int | None = None
    text: str | None = None
    t: float | None = None


def parse_json(data: str | bytes, what: str):
    """JSON from a client; malformed or too deeply nested (Python's parser recurses) is a ``bad_request``."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ClientError("bad_request", f"{what} is nested too deeply") from None
    except ValueError as e:  # not JSON, not UTF-8, or an integer longer than Python converts (4300 digits)
        raise ClientError("bad_request", f"{what} is not JSON: {str(e)[:200]}") from None


def b64(data, what: str) -> bytes:
    if not isinstance(data, str):
        raise ClientError("bad_request", f"{what}.data must be a base64 string")
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", data):
        raise ClientError("bad_request", f"{what}: the server fetches no URLs and reads no files; send the bytes "
                                         "as base64 or a data: URL")
    if data.startswith("data:"):  # a data URL: data:image/jpeg;base64,....
        _, _, data = data.partition(",")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ClientError("bad_request", f"{what}.data is not valid base64") from None


def decode_frame(fmt: str, data: bytes, limits: Limits, width: int | None = None,
                 height: int | None = None) -> np.ndarray:
    """An ``HxWx3`` uint8 RGB frame; the pixel count is checked from the header before any decoding."""
    fmt = {"jpg": "jpeg"}.get(fmt, fmt)
    if fmt not in FRAME_FORMATS:
        raise ClientError("bad_frame", f"frame format {fmt!r} is not one of {', '.join(FRAME_FORMATS)}")
    if fmt in ("rgb", "rgba"):
        ch = 3 if fmt == "rgb" else 4
        if not isinstance(width, int) or not isinstance(height, int) or width < 2 or height < 2:
            raise ClientError("bad_frame", f"a raw {fmt} frame needs integer width and height (at least 2)")
        _check_pixels(width, height, limits)
        if len(data) != width * height * ch:
            raise ClientError("bad_frame", f"a {width}x{height} {fmt} frame is {width * height * ch} bytes, got "
                                           f"{len(data)}")
        return np.frombuffer(data, np.uint8).reshape(height, width, ch)[:, :, :3].copy()
    magic, plugin = FRAME_MAGIC[fmt]
    if not data.startswith(magic):  # before any decoder: only JPEG / PNG bytes reach PIL, and only its JPEG / PNG
        raise ClientError("bad_frame", f"the frame is not a {fmt} image")
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data), formats=[plugin])
        _check_pixels(img.size[0], img.size[1], limits)
        img.load()
    except ClientError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise ClientError("bad_frame", f"cannot decode the {fmt} frame: {e}") from None
    arr = np.asarray(img.convert("RGB"))
    if arr.shape[0] < 2 or arr.shape[1] < 2:
        raise ClientError("bad_frame", f"the frame is {arr.shape[1]}x{arr.shape[0]} pixels: too small")
    return arr


def _check_pixels(width: int, height: int, limits: Limits) -> None:
    if width * height > limits.max_frame_pixels:
        raise ClientError("frame_too_large", f"the frame is {width}x{height} = {width * height} pixels; the limit "
                                             f"is {limits.max_frame_pixels} (--max-frame-pixels)", 413)


def decode_audio(fmt: str, data: bytes, sample_rate, limits: Limits, channels: int = 1) -> np.ndarray:
    """Interleaved little-endian PCM -> ``[samples, channels]`` (mono ``[samples]``); rate and length checked,
    values (NaN, clipping) left to the session's own validation."""
    if fmt not in AUDIO_FORMATS:
        raise ClientError("bad_audio", f"audio format {fmt!r} is not one of {', '.join(AUDIO_FORMATS)}")
    if not isinstance(sample_rate, int) or isinstance(sample_rate, bool) or not 1000 <= sample_rate <= 384000:
        raise ClientError("bad_audio", f"audio sample_rate {sample_rate!r} must be an integer from 1000 to 384000")
    if not isinstance(channels, int) or not 1 <= channels <= 8:
        raise ClientError("bad_audio", f"audio channels {channels!r} must be an integer from 1 to 8")
    dtype = AUDIO_FORMATS[fmt]
    frame_bytes = dtype.itemsize * channels
    if not data or len(data) % frame_bytes:
        raise ClientError("bad_audio", f"{len(data)} bytes of {fmt} audio is not a whole number of "
                                       f"{channels}-channel samples")
    n = len(data) // frame_bytes
    if n / sample_rate > limits.max_audio_seconds:
        raise ClientError("audio_too_long", f"{n / sample_rate:.1f} s of audio in one message; the limit is "
                                            f"{limits.max_audio_seconds:g} s (send a unit a second)", 413)
    a = np.frombuffer(data, dtype).reshape(n, channels)
    return a[:, 0].copy() if channels == 1 else a.copy()


def _is_mp3(d: bytes) -> bool:  # an ID3 tag, or an MPEG audio frame sync with a layer (ADTS has layer 0)
    return d[:3] == b"ID3" or (len(d) > 1 and d[0] == 0xFF and d[1] & 0xE0 == 0xE0 and d[1] & 0x06 != 0)


def _is_adts(d: bytes) -> bool:
    return len(d) > 1 and d[0] == 0xFF and d[1] & 0xF6 == 0xF0


# The encoded audio a client may send (OpenAI's ``input_audio``; what browsers' MediaRecorder and apps produce):
# name -> (how its bytes begin, the one FFmpeg demuxer that reads it). The demuxer is ours, never the client's
# string: FFmpeg can be told to use demuxers that open other resources (hls and dash fetch URLs, concat and image2
# read local files, tee / lavfi / protocols...), so only these, each checked against the bytes first.
AUDIO_FILE_FORMATS = {
    "wav": (lambda d: d[:4] in (b"RIFF", b"RF64") and d[8:12] == b"WAVE", "wav"),
    "mp3": (_is_mp3, "mp3"),
    "flac": (lambda d: d[:4] == b"fLaC", "flac"),
    "ogg": (lambda d: d[:4] == b"OggS", "ogg"),
    "opus": (lambda d: d[:4] == b"OggS", "ogg"),
    "webm": (lambda d: d[:4] == b"\x1a\x45\xdf\xa3", "matroska"),
    "m4a": (lambda d: d[4:8] == b"ftyp", "mov"),
    "mp4": (lambda d: d[4:8] == b"ftyp", "mov"),
    "aac": (_is_adts, "aac"),
}
AUDIO_FILE_ALIASES = {"wave": "wav", "x-wav": "wav", "mpeg": "mp3", "oga": "ogg", "weba": "webm", "x-m4a": "m4a"}
# the audio codecs decoded inside those containers (a container may carry any codec FFmpeg has: only these)
AUDIO_CODECS = ("pcm_s16le", "pcm_s24le", "pcm_s32le", "pcm_u8", "pcm_f32le", "pcm_f64le", "pcm_mulaw", "pcm_alaw",
                "pcm_s16be", "mp3", "mp3float", "aac", "opus", "libopus", "vorbis", "libvorbis", "flac", "alac")
MAX_CLIP_SECONDS = 600


def decode_audio_file(data: bytes, fmt: str, limits: Limits) -> tuple[np.ndarray, int]:
    """An encoded clip (OpenAI's ``input_audio``: ``wav``, ``mp3``, ``flac``, ``ogg`` / ``opus``, ``webm``,
    ``m4a`` / ``mp4``, ``aac``) -> mono float32 at 16 kHz and its rate.

    Every refusal (a format not in ``AUDIO_FILE_FORMATS``, bytes that are not the declared format, a codec not in
    ``AUDIO_CODECS``, a clip FFmpeg cannot decode) has one wording, so the reply tells a client nothing about the
    server's files; the demuxer never opens anything but these bytes."""
    name = str(fmt or "wav").lower()
    name = AUDIO_FILE_ALIASES.get(name, name)
    shown = repr(name[:24])
    refused = ClientError("bad_audio", f"input_audio is not a {shown} clip this server decodes (formats: "
                                       f"{', '.join(AUDIO_FILE_FORMATS)})")
    spec = AUDIO_FILE_FORMATS.get(name)
    if spec is None or not spec[0](data[:16]):
        raise refused
    import av

    sr = 16000
    try:
        options = {"enable_drefs": "0"} if spec[1] == "mov" else {}  # mov may name external data files: never
        with av.open(io.BytesIO(data), format=spec[1], options=options) as container:
            streams = container.streams.audio
            if not streams or streams[0].codec_context.name not in AUDIO_CODECS:
                raise refused
            resampler = av.AudioResampler(format="flt", layout="mono", rate=sr)
            parts, total = [], 0
            for f in container.decode(streams[0]):
                for r in resampler.resample(f):
                    parts.append(r.to_ndarray().reshape(-1))
                    total += parts[-1].size
                if total > MAX_CLIP_SECONDS * sr:
                    raise ClientError("audio_too_long", f"the clip is longer than {MAX_CLIP_SECONDS} s, the most "
                                                        "one request takes", 413)
            parts += [r.to_ndarray().reshape(-1) for r in resampler.resample(None)]
    except ClientError:
        raise
    except Exception:  # FFmpeg's errors (no common base class): the same reply as any other refusal
        raise refused from None
    a = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    if a.size == 0:
        raise ClientError("bad_audio", f"the {shown} clip holds no samples")
    return a.astype(np.float32), sr


def split_binary(message: bytes) -> tuple[dict, bytes]:
    """A binary WebSocket message: a 4-byte big-endian header length, a UTF-8 JSON header, then the payload."""
    if len(message) < 4:
        raise ClientError("bad_request", "a binary message starts with a 4-byte big-endian header length")
    (n,) = struct.unpack(">I", message[:4])
    if n > len(message) - 4 or n > 65536:
        raise ClientError("bad_request", f"binary message header length {n} exceeds the message")
    header = parse_json(message[4:4 + n], "binary message header")
    if not isinstance(header, dict):
        raise ClientError("bad_request", "binary message header must be a JSON object")
    return header, message[4 + n:]


def pack_binary(header: dict, *payloads: bytes) -> bytes:
    """The inverse of ``split_binary`` (for Python clients and tests)."""
    h = json.dumps(header).encode()
    return struct.pack(">I", len(h)) + h + b"".join(payloads)


def unit_from_message(msg: dict, payload: bytes | None, limits: Limits) -> PushItem:
    """A ``unit`` message -> PushItem. JSON messages carry base64 ``data``; binary ones carry ``bytes`` counts and
    the frame's bytes then the audio's bytes in the payload."""
    seq = msg.get("seq")
    if seq is not None and (not isinstance(seq, int) or isinstance(seq, bool)):
        raise ClientError("bad_request", "seq must be an integer")
    t = msg.get("t")
    if t is not None and (not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 <= t <= 1e12
                          or not math.isfinite(t)):  # the range first: math.isfinite(10**400) overflows
        raise ClientError("bad_request", "t must be a non-negative number of seconds")
    item = PushItem(seq=seq, t=float(t) if t is not None else None)
    offset = 0

    def take(part: dict, what: str) -> bytes:
        nonlocal offset
        if payload is None:
            return b64(part.get("data"), what)
        n = part.get("bytes")
        if not isinstance(n, int) or n < 0 or offset + n > len(payload):
            raise ClientError("bad_request", f"{what}.bytes must count the {what}'s bytes in the binary payload")
        out = payload[offset:offset + n]
        offset += n
        return out

    frame, audio, text = msg.get("frame"), msg.get("audio"), msg.get("text")
    if frame is not None:
        if not isinstance(frame, dict):
            raise ClientError("bad_request", "frame must be an object {format, data | bytes[, width, height]}")
        item.frame = decode_frame(str(frame.get("format", "jpeg")).lower(), take(frame, "frame"), limits,
                                  frame.get("width"), frame.get("height"))
    if audio is not None:
        if not isinstance(audio, dict):
            raise ClientError("bad_request", "audio must be an object {format, sample_rate, data | bytes}")
        item.audio = decode_audio(str(audio.get("format", "pcm_s16le")).lower(), take(audio, "audio"),
                                  audio.get("sample_rate"), limits, audio.get("channels", 1))
        item.sample_rate = audio["sample_rate"]
    if text is not None:
        if not isinstance(text, str) or not text.strip():
            raise ClientError("bad_request", "text must be a non-empty string")
        item.text = text
    if item.frame is None and item.audio is None and item.text is None:
        raise ClientError("bad_request", "a unit needs a frame, audio or text")
    return item
