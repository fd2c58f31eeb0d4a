"""Fuzzing the server's JSON and media parts: every FFmpeg container / protocol name as an audio format, every
image format PIL writes as a frame, random bytes behind the right magic, random and deeply nested JSON, huge
numbers and NaN, over the decoders, HTTP and the WebSocket. Each input gets a structured error (or a valid
answer), nothing is fetched, and the server (and its socket) lives afterwards. Bounded: under a minute."""

import base64
import io
import json
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_media_safety import _Recorder, encode, listener  # noqa: F401  (the fixture)
from test_ws import Client, new_session

from omnitide_mlx.serve.config import Limits
from omnitide_mlx.serve.decode import AUDIO_FILE_ALIASES, ClientError, decode_audio_file, decode_frame, pack_binary

LIMITS = Limits(max_frame_pixels=20000)


def test_every_ffmpeg_format_name_as_input_audio_fetches_and_reads_nothing(listener, tmp_path,  # noqa: F811
                                                                          monkeypatch):
    import av

    (tmp_path / "a.wav").write_bytes(encode("wav"))
    monkeypatch.chdir(tmp_path)
    payloads = [encode("wav"), encode("mp3"), b"ffconcat version 1.0\nfile 'a.wav'\n",
                f"#EXTM3U\n#EXTINF:1,\n{listener}/x\n#EXT-X-ENDLIST\n".encode(), f"{listener}/y".encode(),
                bytes(random.Random(0).randbytes(512))]
    names = sorted(av.formats_available) + ["file", "http", "https", "tcp", "udp", "rtmp", "crypto", "subfile",
                                            "data", "pipe", "fd", "async", "cache", "concatf", "WAV", "Mp3", ""]
    decoded = set()
    for name in names:
        for data in payloads:
            try:
                a, sr = decode_audio_file(data, name, LIMITS)
            except ClientError as e:
                assert e.code in ("bad_audio", "audio_too_long") and e.message
                continue
            assert a.dtype == np.float32 and sr == 16000
            decoded.add(name.lower())
    # only the named formats (an empty name is the default, wav), each only from its own bytes
    assert decoded <= {"wav", "mp3", ""} | {a for a, f in AUDIO_FILE_ALIASES.items() if f in ("wav", "mp3")}
    assert _Recorder.hits == []


@pytest.mark.parametrize("fmt", ["AVIF", "BMP", "DDS", "DIB", "EPS", "GIF", "ICNS", "ICO", "JPEG",
                                 "JPEG2000", "MPO", "MSP", "PCX", "PDF", "PNG", "PPM", "QOI", "SGI", "SPIDER", "TGA",
                                 "TIFF", "WEBP", "XBM"])
def test_every_image_format_pil_writes_is_a_frame_only_when_it_is_the_declared_one(fmt):
    from PIL import Image

    img = Image.new("RGB" if fmt not in ("XBM", "MSP") else "1", (32, 24), 1)
    buf = io.BytesIO()
    try:
        img.save(buf, format=fmt)
    except (OSError, KeyError, ValueError) as e:  # a writer this PIL build lacks
        pytest.skip(f"PIL cannot write {fmt} here: {e}")
    for declared in ("jpeg", "png", "rgb", "webp", "gif", "eps", "JPEG", ""):
        try:
            out = decode_frame(declared, buf.getvalue(), LIMITS)
        except ClientError as e:
            assert e.code == "bad_frame" and e.message
            continue
        assert declared == fmt.lower() or (declared == "jpeg" and fmt == "MPO")
        assert out.shape == (24, 32, 3)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(declared=st.sampled_from(["jpeg", "png"]), tail=st.binary(max_size=300))
def test_random_bytes_behind_the_right_magic_are_a_structured_error(declared, tail):
    magic = {"jpeg": b"\xff\xd8\xff", "png": b"\x89PNG\r\n\x1a\n"}[declared]
    try:
        decode_frame(declared, magic + tail, LIMITS)
    except ClientError as e:
        assert e.code in ("bad_frame", "frame_too_large")


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(fmt=st.sampled_from(["wav", "mp3", "flac", "ogg", "webm", "m4a", "aac"]), tail=st.binary(max_size=400))
def test_random_bytes_behind_an_audio_magic_are_a_structured_error(fmt, tail):
    head = {"wav": b"RIFF\0\0\0\0WAVE", "mp3": b"ID3", "flac": b"fLaC", "ogg": b"OggS",
            "webm": b"\x1a\x45\xdf\xa3", "m4a": b"\0\0\0\x18ftypM4A ", "aac": b"\xff\xf1"}[fmt]
    try:
        decode_audio_file(head + tail, fmt, LIMITS)
    except ClientError as e:
        assert e.code in ("bad_audio", "audio_too_long")


# --- over a live server -------------------------------------------------------------------------------------
ODD = st.one_of(st.none(), st.booleans(), st.integers(-10**30, 10**30), st.floats(allow_nan=True),
                st.just(float("inf")), st.just(10**400), st.text(max_size=8), st.lists(st.integers(), max_size=3),
                st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
FORMATS = st.sampled_from(["wav", "mp3", "hls", "concat", "ffconcat", "image2", "dash", "tee", "lavfi", "file",
                           "http", "jpeg", "png", "gif", "eps", "webp", "tiff", "bmp", "rgb", "rgba", "pcm_s16le"])
PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(st.text(max_size=20), ODD)}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": st.one_of(
        st.builds(lambda f, d: f"data:image/{f};base64,{base64.b64encode(d).decode()}", FORMATS,
                  st.binary(max_size=64)),
        st.sampled_from(["https://example.com/a.jpg", "file:///etc/passwd", "data:image/jpeg;base64,!!"]), ODD)})}),
    st.fixed_dictionaries({"type": st.just("input_audio"), "input_audio": st.fixed_dictionaries({
        "data": st.one_of(st.binary(max_size=64).map(lambda d: base64.b64encode(d).decode()), ODD),
        "format": st.one_of(FORMATS, ODD)})}),
    st.dictionaries(st.text(max_size=6), ODD, max_size=3))
MESSAGE = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "assistant", "system", "tool"]), ODD),
                                 "content": st.one_of(st.text(max_size=20), st.lists(PART, max_size=3), ODD)})
BODY = st.fixed_dictionaries(
    {"messages": st.one_of(st.lists(MESSAGE, min_size=1, max_size=3), ODD)},
    optional={"model": ODD, "temperature": ODD, "top_p": ODD, "stop": ODD, "stream": st.booleans(), "n": ODD,
              "seed": ODD, "tools": ODD, "logprobs": ODD, "response_format": ODD, "modalities": ODD,
              "max_tokens": st.one_of(st.just(1), st.just(10**400), st.just(float("nan")), st.just(-1), ODD)})


def _send(http, path, body):
    text = json.dumps(body, allow_nan=True)  # NaN and Infinity as JavaScript writes them
    return http.post(path, content=text, headers={"content-type": "application/json"})


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=BODY, path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/sessions"]))
def test_random_requests_get_a_structured_reply_and_the_server_lives(http, body, path):
    if body.get("max_tokens") not in (None, 1) or "max_tokens" not in body:
        body.setdefault("max_tokens", 1)
    if path == "/v1/completions":
        body["prompt"] = body.pop("messages")
    r = _send(http, path, body)
    if r.status_code in (200, 201):
        if path == "/v1/sessions":
            http.delete(f"/v1/sessions/{r.json()['id']}")
    else:
        assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
        err = r.json()["error"]
        assert isinstance(err["code"], str) and isinstance(err["message"], str) and err["message"]


def test_nested_and_huge_json_over_http(http):
    for text in ["[" * 100000, "{\"messages\":" * 20000, '{"max_tokens": 1e999, "messages": []}',
                 '{"temperature": NaN, "messages": [{"role": "user", "content": "hi"}]}',
                 '{"max_tokens": ' + "9" * 5000 + "}", '"just a string"', "null", "\udcff", "\x00"]:
        r = http.post("/v1/chat/completions", content=text.encode("utf-8", "surrogatepass"),
                      headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] in ("bad_request", "unsupported"), (text[:40],
                                                                                                      r.text[:200])
    assert http.get("/health").json()["status"] == "ok"


B64 = st.binary(max_size=40).map(lambda d: base64.b64encode(d).decode())
WS_MESSAGE = st.one_of(
    st.fixed_dictionaries({"type": st.just("unit"), "seq": ODD, "t": ODD,
                           "frame": st.one_of(ODD, st.fixed_dictionaries({"format": st.one_of(FORMATS, ODD),
                                                                          "data": st.one_of(ODD, B64),
                                                                          "width": ODD, "height": ODD})),
                           "audio": st.one_of(ODD, st.fixed_dictionaries({"format": st.one_of(FORMATS, ODD),
                                                                          "sample_rate": ODD, "channels": ODD,
                                                                          "data": ODD}))}),
    st.fixed_dictionaries({"type": st.just("ask"), "question": ODD, "max_tokens": ODD, "speak": ODD,
                           "speaker": st.one_of(ODD, st.sampled_from(["../../etc/passwd", "/tmp/x.safetensors"]))}),
    st.fixed_dictionaries({"type": st.one_of(st.sampled_from(["save", "cancel", "flush", "stats", "nope"]), ODD),
                           "name": ODD, "id": ODD}))


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(examples=st.lists(WS_MESSAGE, min_size=30, max_size=30), binary=st.lists(st.booleans(), min_size=30,
                                                                                max_size=30))
def test_random_websocket_messages_get_replies_and_the_socket_lives(server, http, examples, binary):
    sid = new_session(http)
    c = Client(server, sid)
    for i, (msg, as_binary) in enumerate(zip(examples, binary)):
        if msg.get("type") == "ask" and isinstance(msg.get("question"), str) and msg["question"].strip():
            msg["max_tokens"] = 1
        if as_binary:  # the same as a binary message: its header JSON
            c.send(pack_binary(msg))
        else:
            c.ws.send(json.dumps(msg, allow_nan=True))
        c.send({"type": "ping", "id": f"p{i}"})
        replies = c.until(lambda m, i=i: m["type"] == "pong" and m.get("id") == f"p{i}", timeout=60)
        for m in replies:
            if m["type"] == "error":
                assert isinstance(m["code"], str) and m["message"]
                assert m["code"] != "internal_error", (msg, m)
    c.ws.send("[" * 100000)
    c.send({"type": "ping", "id": "end"})
    assert c.until(lambda m: m["type"] == "pong" and m.get("id") == "end")[-1]["id"] == "end"
    c.close()
    http.delete(f"/v1/sessions/{sid}")
    assert http.get("/health").json()["status"] == "ok"
