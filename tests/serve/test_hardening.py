"""Misuse of a real ``omnitide serve`` (tiny checkpoint, the shared server of tests/serve): each refusal is a
structured error, and the server (and the WebSocket) goes on afterwards."""

import json
import pathlib
import time

import pytest

from test_ws import Client, new_session

REPO = pathlib.Path(__file__).resolve().parents[2]  # (a bare `from conftest import` finds whichever conftest
# module the whole suite imported last)


@pytest.mark.parametrize("body", [b"[" * 200000, b'{"a":' * 40000 + b"1" + b"}" * 40000,
                                  b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"])
def test_deeply_nested_json_over_http_is_a_structured_400(http, body):
    for path in ("/v1/chat/completions", "/v1/sessions"):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text[:200]
        assert r.json()["error"]["code"] == "bad_request" and "nested" in r.json()["error"]["message"]
    assert http.get("/health").json()["status"] == "ok"


def test_deeply_nested_json_over_the_websocket_is_an_error_message_and_the_socket_lives(server, http):
    from omnitide_mlx.serve.decode import pack_binary

    sid = new_session(http)
    c = Client(server, sid)
    c.ws.send("[" * 200000)  # raw text, not JSON-encoded by the helper
    err = c.until(lambda m: m["type"] == "error")[-1]
    assert err["code"] == "bad_request" and "nested" in err["message"]
    raw = b"[" * 60000
    c.send(len(raw).to_bytes(4, "big") + raw)  # the same inside a binary message's header
    assert c.until(lambda m: m["type"] == "error")[-1]["code"] == "bad_request"
    c.send(pack_binary({"type": "ping", "id": "alive"}))
    assert c.until(lambda m: m["type"] == "pong")[-1]["id"] == "alive"
    c.close()
    http.delete(f"/v1/sessions/{sid}")


@pytest.mark.slow
def test_a_server_restores_its_own_sessions_whatever_the_model_path_looks_like(tiny_qwen, make_server, tmp_path,
                                                                              clip_units):
    """Saved under a relative path ending in '/', restored by that server and by one started through a symlink."""
    import os

    import httpx


    saved = tmp_path / "saved"
    relative = os.path.relpath(tiny_qwen, REPO) + "/"  # the servers run in REPO
    link = tmp_path / "link-to-model"
    link.symlink_to(tiny_qwen, target_is_directory=True)
    a = make_server("--model", relative, "--session-dir", str(saved))
    with httpx.Client(base_url=a.url, timeout=60) as h:
        models = h.get("/v1/models").json()["data"]
        assert [m["id"] for m in models] == [tiny_qwen.name]  # a name, never the server's local path
        assert str(tiny_qwen.parent) not in h.get("/health").text
        sid = new_session(h)
        c = Client(a, sid)
        c.send(__import__("test_ws").binary_unit(0, *clip_units[0][:2]))
        c.until(lambda m: m["type"] == "pushed")
        c.send({"type": "save", "name": "mine"})
        assert c.until(lambda m: m["type"] in ("saved", "error"))[-1]["type"] == "saved"
        c.close()
        units = h.get(f"/v1/sessions/{sid}").json()["stats"]["units"]
        r = h.post("/v1/sessions", json={"restore": "mine"})
        assert r.status_code == 201, r.text
        for model in ("default_model", tiny_qwen.name, relative, None):
            r = h.post("/v1/chat/completions", json={"model": model, "max_tokens": 1,
                                                     "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, (model, r.text)
    b = make_server("--model", str(link), "--session-dir", str(saved))
    with httpx.Client(base_url=b.url, timeout=60) as h:
        r = h.post("/v1/sessions", json={"restore": "mine"})
        assert r.status_code == 201, r.text
        assert r.json()["stats"]["units"] == units


def _ask(http, content, **kw):
    return http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                   "max_tokens": 2, **kw})


def test_one_shot_prompts_have_a_token_cap(http):
    """The shared server runs with --max-prompt-tokens 2000: a long question is refused at once (not prefilled for
    minutes), and so is a prompt whose media pass the cap."""
    t0 = time.monotonic()
    r = _ask(http, "word " * 50000)
    assert r.status_code == 413 and r.json()["error"]["code"] == "prompt_too_long", r.text
    assert "2000" in r.json()["error"]["message"] and "--max-prompt-tokens" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 10
    history = [{"role": "user", "content": "word " * 900}, {"role": "assistant", "content": "ok"}] * 3
    r = http.post("/v1/chat/completions", json={"max_tokens": 2, "messages": history + [
        {"role": "user", "content": "and?"}]})
    assert r.status_code == 413 and r.json()["error"]["code"] == "prompt_too_long", r.text
    assert _ask(http, "word " * 100).status_code == 200
    assert http.get("/health").json()["in_use"] == 0


def test_a_websocket_question_has_the_same_cap(server, http):
    sid = new_session(http)
    c = Client(server, sid)
    c.send({"type": "ask", "id": "big", "question": "word " * 50000, "max_tokens": 2})
    err = c.until(lambda m: m["type"] in ("error", "answer_end"))[-1]
    assert err["type"] == "error" and err["code"] == "prompt_too_long" and err["id"] == "big"
    c.send({"type": "ask", "id": "small", "question": "hi", "max_tokens": 2})
    assert c.until(lambda m: m["type"] == "answer_end")[-1]["tokens"] == 2
    c.close()
    http.delete(f"/v1/sessions/{sid}")


def test_media_are_not_decoded_before_the_session_limit_is_checked(http, clip_units):
    """At the session limit a request is refused with 429 before its media are looked at (a broken image would
    otherwise give 400), so a refused request costs no decoding and no memory."""
    import base64

    ids = [new_session(http) for _ in range(3)]  # the shared server's --max-sessions 3
    try:
        broken = {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(
            b"\xff\xd8\xff" + b"\0" * 100).decode()}}
        r = _ask(http, [broken] * 20 + [{"type": "text", "text": "hi"}])
        assert r.status_code == 429 and r.json()["error"]["code"] == "session_limit", r.text
    finally:
        for sid in ids:
            http.delete(f"/v1/sessions/{sid}")
    r = _ask(http, [broken, {"type": "text", "text": "hi"}])
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_frame"
    assert http.get("/health").json()["in_use"] == 0


def test_a_websocket_unit_is_not_decoded_when_the_queue_is_full(server, http, clip_units):
    from test_ws import binary_unit

    from omnitide_mlx.serve.decode import pack_binary

    sid = new_session(http)
    c = Client(server, sid)
    jpeg, pcm, _ = clip_units[0]
    c.send({"type": "ask", "id": "long", "question": "Tell a long story.", "max_tokens": 300})
    c.until(lambda m: m["type"] == "piece")
    for seq in range(3):  # the shared server's --max-queued 3: the queue is full behind the answer
        c.send(binary_unit(seq, jpeg, pcm))
    bad = b"\xff\xd8\xff" + b"\0" * 100
    c.send(pack_binary({"type": "unit", "seq": 99, "frame": {"format": "jpeg", "bytes": len(bad)}}, bad))
    err = c.until(lambda m: m["type"] == "error" and m.get("seq") == 99)[-1]
    assert err["code"] == "queue_full"  # not bad_frame: the frame was never decoded
    c.send({"type": "cancel"})
    c.close()
    http.delete(f"/v1/sessions/{sid}")


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_a_one_shot_request_stops_it(server, http, stream):
    """A non-streaming client that times out (or a streaming one that closes) frees its slot within a second or
    two, not after its max_tokens."""
    import httpx

    body = {"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 4000, "stream": stream,
            "stop": ["\u2603never"]}
    with httpx.Client(base_url=server.url, timeout=httpx.Timeout(60, read=1.5)) as short:
        if stream:
            with short.stream("POST", "/v1/chat/completions", json=body) as r:
                next(r.iter_lines())  # the first event came: leave
        else:
            with pytest.raises(httpx.ReadTimeout):
                short.post("/v1/chat/completions", json=body)
    deadline = time.monotonic() + 5
    while http.get("/health").json()["in_use"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert http.get("/health").json()["in_use"] == 0


def test_ephemeral_must_be_a_boolean(http):
    for bad in ("no", "false", 0, 1, [True]):
        r = http.post("/v1/sessions", json={"ephemeral": bad})
        assert r.status_code == 400 and "ephemeral" in r.json()["error"]["message"], (bad, r.text)
    assert http.get("/health").json()["sessions"] == 0


def test_the_token_rides_in_the_query_only_on_websocket_routes():
    from test_api import guarded

    from omnitide_mlx.serve.config import ServeConfig

    token = "s3cret-token-0123456789"
    c = guarded(ServeConfig(host="0.0.0.0", token=token))
    assert c.get(f"/v1/x?token={token}").status_code == 401  # HTTP: the Authorization header only
    r = c.get("/v1/x")
    assert "Authorization" in r.json()["error"]["message"]
    assert c.get("/v1/x", headers={"Authorization": f"Bearer {token}"}).status_code == 200


def test_the_origin_refusal_suggests_only_what_the_server_accepts():
    from test_api import guarded

    from omnitide_mlx.serve.config import ServeConfig

    c = guarded(ServeConfig())
    for origin in ("null", "file://", "chrome-extension://abc", "http://evil.example"):
        r = c.get("/v1/x", headers={"Origin": origin})
        assert r.status_code == 403
        message = r.json()["error"]["message"]
        suggested = message.split("--allow-origin ", 1)[1].split()[0] if "--allow-origin " in message else None
        if suggested is None:
            assert "http(s)" in message
        else:  # the flag it suggests is one the server takes
            ServeConfig(allow_origins=[suggested]).check()


@pytest.mark.parametrize("args, needle", [
    (["--port", "99999"], "port"), (["--port", "-1"], "port"), (["--idle-timeout", "-1"], "idle-timeout"),
    (["--idle-timeout", "nan"], "idle-timeout"), (["--max-prompt-tokens", "0"], "max-prompt-tokens")])
def test_bad_serve_flags_are_usage_errors_before_loading(tmp_path, args, needle):
    import subprocess
    import sys


    r = subprocess.run([sys.executable, "-m", "omnitide_mlx", "serve", "--model", str(tmp_path / "missing"), *args],
                       capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin",
                                                                       "PYTHONPATH": str(REPO)})
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr and "loading" not in r.stderr


def test_a_session_dir_that_is_a_file_is_a_clear_error(tmp_path):
    import subprocess
    import sys


    f = tmp_path / "afile"
    f.write_text("x")
    r = subprocess.run([sys.executable, "-m", "omnitide_mlx", "serve", "--model", str(tmp_path / "missing"),
                        "--session-dir", str(f)], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    assert r.returncode in (1, 2) and "--session-dir" in r.stderr and "not a folder" in r.stderr, r.stderr
    assert "Errno" not in r.stderr and "loading" not in r.stderr


@pytest.mark.parametrize("extra, needle", [
    ({"n": 2}, "n"), ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"tool_choice": "required"}, "tool"), ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ({"logprobs": True}, "logprobs"), ({"top_logprobs": 2}, "logprobs"),
    ({"modalities": ["text", "audio"]}, "audio"), ({"audio": {"voice": "Chelsie", "format": "wav"}}, "audio"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "Chelsie", "format": "mp3"}}, "audio.format"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "Chelsie", "format": "wav"}, "stream": True}, "pcm16"),
    ({"modalities": ["video"]}, "modalities"), ({"n": "2"}, "n"), ({"modalities": "text"}, "modalities")])
def test_openai_options_the_server_does_not_do_are_refused(http, extra, needle):
    r = _ask(http, "hi", **extra)
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported", r.text
    assert needle in r.json()["error"]["message"]


def test_openai_requests_as_clients_send_them(http):
    ok = {"n": 1, "tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "logprobs": False,
          "modalities": ["text"], "model": "default_model", "user": "u1", "stream": False}
    r = _ask(http, "hi", **ok)
    assert r.status_code == 200, r.text
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                      "function": {"name": "w", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "Sunny, 21 C."},
               {"role": "assistant", "content": None}, {"role": "user", "content": "So?"}]
    r = http.post("/v1/chat/completions", json={"max_tokens": 2, "messages": history})
    assert r.status_code == 200, r.text
    without_tool = http.post("/v1/chat/completions", json={"max_tokens": 2, "messages": [
        history[0], history[1], history[-1]]})
    assert r.json()["usage"]["prompt_tokens"] > without_tool.json()["usage"]["prompt_tokens"]  # the tool's result


def test_text_completions(http):
    r = http.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 4, "model": "default_model"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion" and isinstance(out["choices"][0]["text"], str)
    assert out["choices"][0]["finish_reason"] in ("length", "stop") and out["usage"]["completion_tokens"] <= 4
    with http.stream("POST", "/v1/completions", json={"prompt": ["Once upon a time"], "max_tokens": 4,
                                                      "stream": True}) as s:
        lines = [ln for ln in s.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == out["choices"][0]["text"]  # greedy: the same
    for bad in ({"prompt": ["a", "b"]}, {"prompt": ""}, {"prompt": 5}, {}, {"prompt": "a", "echo": True},
                {"prompt": "a", "suffix": "z"}, {"prompt": "a", "best_of": 2}):
        r = http.post("/v1/completions", json={"max_tokens": 2, **bad})
        assert r.status_code == 400 and r.json()["error"]["message"], (bad, r.text)


@pytest.mark.parametrize("speaker", ["../../../../etc/passwd", "/etc/hosts", "voices/../../x.safetensors",
                                     "~/v.safetensors", "default.safetensors", "..", "", "a" * 65, "C:\\\\v"])
def test_a_speaker_is_a_voice_name_never_a_path(server, http, speaker):
    """MiniCPM-o reads a voice file named by ``speaker``: over the server only a name reaches it (the checkpoint's
    voices, or those the operator allowed with --voice), so no client can make it open a file."""
    sid = new_session(http)
    c = Client(server, sid)
    c.send({"type": "ask", "id": "v", "question": "Say hi.", "max_tokens": 2, "speak": True, "speaker": speaker})
    err = c.until(lambda m: m["type"] in ("error", "answer_end"))[-1]
    assert err["type"] == "error" and err["code"] == "bad_request" and "speaker" in err["message"], err
    assert "/" not in err["message"].split("speaker", 1)[1].replace(speaker, "")  # no server path in the reply
    c.close()
    http.delete(f"/v1/sessions/{sid}")


def test_voice_files_the_operator_allows_are_checked_before_loading(tmp_path):
    import subprocess
    import sys


    for flag in (f"calm={tmp_path / 'missing.safetensors'}", "calm", f"../x={tmp_path}"):
        r = subprocess.run([sys.executable, "-m", "omnitide_mlx", "serve", "--model", str(tmp_path / "m"),
                            "--voice", flag], capture_output=True, text=True, timeout=60,
                           env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
        assert r.returncode in (1, 2) and "--voice" in r.stderr and "loading" not in r.stderr, (flag, r.stderr)


def test_a_spoken_answer_from_a_model_without_a_talker_is_a_clear_error(http):
    r = _ask(http, "hi", modalities=["text", "audio"], audio={"voice": "Chelsie", "format": "wav"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "speech_unavailable", r.text
    r = _ask(http, "hi", modalities=["text", "audio"], audio={"voice": "../x", "format": "wav"})
    assert r.status_code == 400 and "speaker" in r.json()["error"]["message"]
    assert http.get("/health").json()["in_use"] == 0


@pytest.mark.slow
def test_spoken_answers_as_openai_audio_output(tmp_path, make_server, data_dir):
    import base64
    import io

    import httpx
    import numpy as np
    import soundfile as sf

    from omnitide_mlx.models.qwen2_5_omni.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "tiny-speech", vocab="real", speech=True,
                                tokenizer_dir=data_dir / "tokenizers/qwen2")
    srv = make_server("--model", str(ckpt))
    body = {"messages": [{"role": "user", "content": "Hello?"}], "max_tokens": 8, "seed": 0,
            "modalities": ["text", "audio"], "audio": {"voice": "Chelsie", "format": "wav"}}
    with httpx.Client(base_url=srv.url, timeout=240) as h:
        r = h.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        assert message["content"] is None and message["audio"]["transcript"]
        wav, rate = sf.read(io.BytesIO(base64.b64decode(message["audio"]["data"])), dtype="int16")
        assert rate == 24000 and wav.size > 0
        text = h.post("/v1/chat/completions", json={**body, "modalities": ["text"], "audio": None}).json()
        assert text["choices"][0]["message"]["content"] == message["audio"]["transcript"]  # greedy: the same reply
        pcm, transcript = [], []
        with h.stream("POST", "/v1/chat/completions", json={**body, "stream": True,
                                                             "audio": {"voice": "Chelsie", "format": "pcm16"}}) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    audio = delta.get("audio") or {}
                    transcript.append(audio.get("transcript", ""))
                    if audio.get("data"):
                        pcm.append(np.frombuffer(base64.b64decode(audio["data"]), "<i2"))
        assert "".join(transcript) == message["audio"]["transcript"]
        assert np.array_equal(np.concatenate(pcm), wav)  # seeded: the same speech, streamed
        r = h.post("/v1/chat/completions", json={**body, "audio": {"voice": "alloy", "format": "wav"}})
        assert r.status_code == 400 and "Chelsie" in r.json()["error"]["message"]
        assert h.get("/health").json()["in_use"] == 0


def test_a_speaker_without_speak_is_refused(server, http):
    sid = new_session(http)
    c = Client(server, sid)
    c.send({"type": "ask", "id": "q", "question": "hi", "max_tokens": 2, "speaker": "Chelsie"})
    err = c.until(lambda m: m["type"] in ("error", "answer_end"))[-1]
    assert err["type"] == "error" and err["code"] == "bad_request" and "speak" in err["message"]
    c.close()
    http.delete(f"/v1/sessions/{sid}")


@pytest.mark.slow
def test_a_one_shot_request_leaves_no_memory_behind(tiny_qwen, make_server):
    """40 1080p frames in one request: the server's resident memory comes back to where it was (it stayed 2 GB
    higher: MLX's buffer cache and glibc's freed heap), and a request refused at the session limit costs none."""
    import base64
    import io
    import re

    import httpx
    import numpy as np
    from PIL import Image

    srv = make_server("--model", str(tiny_qwen), "--max-sessions", "1")

    def rss_mib() -> int:
        return int(re.search(r"VmRSS:\s+(\d+)", open(f"/proc/{srv.proc.pid}/status").read()).group(1)) // 1024

    buf = io.BytesIO()
    Image.fromarray(np.full((1080, 1920, 3), 120, np.uint8)).save(buf, "JPEG", quality=50)
    part = {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(
        buf.getvalue()).decode()}}
    body = {"messages": [{"role": "user", "content": [part] * 40 + [{"type": "text", "text": "hi"}]}],
            "max_tokens": 1}
    with httpx.Client(base_url=srv.url, timeout=300) as h:
        before = rss_mib()
        sid = h.post("/v1/sessions", json={}).json()["id"]
        r = h.post("/v1/chat/completions", json=body)
        assert r.status_code == 429 and rss_mib() - before < 100
        h.delete(f"/v1/sessions/{sid}")
        before = rss_mib()
        assert h.post("/v1/chat/completions", json=body).status_code == 200
        deadline = time.monotonic() + 15
        while rss_mib() - before > 250 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert rss_mib() - before < 250, (before, rss_mib())
