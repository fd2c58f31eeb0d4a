"""What the server decodes from a client, and what it never touches: audio only in the containers and codecs it
names (no FFmpeg demuxer that opens other resources: hls, concat, playlists, protocols), frames only as JPEG / PNG
(checked from their bytes before any decoder runs), no URL fetched, no local file read."""

import http.server
import io
import threading

import numpy as np
import pytest

from omnitide_mlx.serve.config import Limits
from omnitide_mlx.serve.decode import AUDIO_FILE_FORMATS, ClientError, decode_audio_file, decode_frame

LIMITS = Limits()


def encode(fmt: str, seconds: float = 0.5) -> bytes:
    """A real clip in ``fmt``, encoded with FFmpeg as a browser or an app would send it."""
    import av

    container, codec, rate = {"wav": ("wav", "pcm_s16le", 16000), "mp3": ("mp3", "libmp3lame", 16000),
                              "flac": ("flac", "flac", 16000), "ogg": ("ogg", "libopus", 48000),
                              "opus": ("ogg", "libopus", 48000), "webm": ("webm", "libopus", 48000),
                              "m4a": ("ipod", "aac", 16000), "mp4": ("mp4", "aac", 16000),
                              "aac": ("adts", "aac", 16000)}[fmt]
    n = int(rate * seconds)
    samples = (0.3 * np.sin(np.arange(n) * 2 * np.pi * 440 / rate)).astype(np.float32)
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as c:
        s = c.add_stream(codec, rate=rate)
        s.layout = "mono"
        frame = av.AudioFrame.from_ndarray(samples[None], format="flt", layout="mono")
        frame.sample_rate = rate
        for p in s.encode(frame):
            c.mux(p)
        for p in s.encode(None):
            c.mux(p)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["wav", "mp3", "flac", "ogg", "opus", "webm", "m4a", "mp4", "aac"])
def test_every_accepted_audio_format_decodes(fmt):
    assert fmt in AUDIO_FILE_FORMATS
    a, sr = decode_audio_file(encode(fmt), fmt, LIMITS)
    assert a.dtype == np.float32 and a.ndim == 1 and 0.3 < a.size / sr < 0.7
    assert 0.1 < np.abs(a).max() < 0.5  # the tone, not silence or noise


class _Recorder(http.server.BaseHTTPRequestHandler):
    hits: list = []

    def do_GET(self):  # noqa: N802
        _Recorder.hits.append(self.path)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"#EXTM3U\n")

    def log_message(self, *a):
        pass


@pytest.fixture
def listener():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    _Recorder.hits = []
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_demuxers_that_open_other_resources_are_refused_and_fetch_nothing(listener, tmp_path, monkeypatch):
    wav = encode("wav")
    (tmp_path / "a.wav").write_bytes(wav)
    monkeypatch.chdir(tmp_path)  # concat resolves relative names against the working directory
    attempts = {
        "hls": f"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1,\n{listener}/admin\n#EXT-X-ENDLIST\n".encode(),
        "applehttp": f"#EXTM3U\n#EXTINF:1,\n{listener}/x\n#EXT-X-ENDLIST\n".encode(),
        "concat": b"ffconcat version 1.0\nfile 'a.wav'\n",
        "ffconcat": b"ffconcat version 1.0\nfile 'a.wav'\n",
        "image2": b"a.wav",
        "dash": f'<?xml version="1.0"?><MPD><Period><BaseURL>{listener}/d</BaseURL></Period></MPD>'.encode(),
        "tee": wav, "lavfi": b"sine", "http": wav, "file": wav, "pipe": wav, "data": wav,
    }
    messages = {}
    for fmt, data in attempts.items():
        with pytest.raises(ClientError) as e:
            decode_audio_file(data, fmt, LIMITS)
        assert e.value.code == "bad_audio" and e.value.status == 400
        messages[fmt] = e.value.message
    assert _Recorder.hits == []  # no URL was fetched
    # one uniform message for every refused format: nothing tells the client what exists on the server
    assert len({m.replace(repr(f), "F") for f, m in messages.items()}) == 1, messages
    assert "wav" in messages["hls"] and "mp3" in messages["hls"]  # it names what the server does decode


def test_an_existing_and_a_missing_file_give_the_same_error(tmp_path, monkeypatch):
    (tmp_path / "a.wav").write_bytes(encode("wav"))
    monkeypatch.chdir(tmp_path)
    errors = []
    for name in ("a.wav", "missing.wav"):
        for fmt in ("concat", "wav", "mp3"):
            with pytest.raises(ClientError) as e:
                decode_audio_file(f"ffconcat version 1.0\nfile '{name}'\n".encode(), fmt, LIMITS)
            errors.append((fmt, e.value.message))
    assert errors[:3] == errors[3:]


@pytest.mark.parametrize("declared, actual", [("wav", "mp3"), ("mp3", "wav"), ("flac", "ogg"), ("ogg", "flac"),
                                              ("m4a", "webm"), ("webm", "m4a"), ("aac", "mp3")])
def test_bytes_that_are_not_the_declared_format_are_refused(declared, actual):
    with pytest.raises(ClientError) as e:
        decode_audio_file(encode(actual), declared, LIMITS)
    assert e.value.code == "bad_audio" and declared in e.value.message


@pytest.mark.parametrize("url", ["https://example.com/a.wav", "http://127.0.0.1:1/x", "file:///etc/passwd",
                                 "ftp://h/a.mp3"])
def test_urls_in_media_data_are_refused_clearly(client, url):
    r = client.post("/v1/chat/completions", json={"max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": url, "format": "wav"}}, {"type": "text", "text": "hi"}]}]})
    assert r.status_code == 400 and "fetches no URLs" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={"max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]}]})
    assert r.status_code == 400 and "fetches nothing" in r.json()["error"]["message"]


def test_a_playlist_sent_as_input_audio_is_refused_by_the_server(client, listener):
    import base64

    for fmt in ("hls", "concat", "wav"):
        playlist = f"#EXTM3U\n#EXTINF:1,\n{listener}/admin\n#EXT-X-ENDLIST\n".encode()
        r = client.post("/v1/chat/completions", json={"max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": base64.b64encode(playlist).decode(), "format": fmt}},
            {"type": "text", "text": "hi"}]}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "bad_audio", r.text
    assert _Recorder.hits == []
    assert client.get("/health").json()["status"] == "ok"


@pytest.fixture
def client(http):
    return http


def image_bytes(fmt: str) -> bytes:
    from PIL import Image

    img = Image.new("RGB", (16, 12), (200, 30, 30))
    buf = io.BytesIO()
    if fmt == "EPS":
        buf.write(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 16 12\n0 0 moveto 16 12 lineto stroke\n%%EOF\n")
    else:
        img.save(buf, format=fmt)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["EPS", "GIF", "TIFF", "BMP", "WEBP", "ICO", "PPM", "TGA", "JPEG2000", "PNG", "JPEG"])
@pytest.mark.parametrize("declared", ["jpeg", "png"])
def test_frames_are_only_decoded_as_the_declared_jpeg_or_png(fmt, declared, monkeypatch):
    """Other formats never reach a PIL decoder (EPS would run Ghostscript on client PostScript): the bytes are
    checked first, and PIL may only use the declared format's plugin."""
    from PIL import Image

    reached = []
    Image.init()
    for name, (factory, _) in Image.OPEN.items():
        if name not in ("JPEG", "PNG", "MPO"):
            monkeypatch.setattr(factory, "_open", lambda self, f=name: reached.append(f) or 1 / 0)
    data = image_bytes(fmt)
    if fmt == declared.upper():
        assert decode_frame(declared, data, LIMITS).shape == (12, 16, 3)
    else:
        with pytest.raises(ClientError) as e:
            decode_frame(declared, data, LIMITS)
        assert e.value.code == "bad_frame" and e.value.message == f"the frame is not a {declared} image"
    assert reached == []
