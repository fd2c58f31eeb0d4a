"""The HTTP API of ``omnitide serve`` with a real client against a real server on loopback (tiny checkpoint):
OpenAI chat completions (text, image and audio parts, SSE), sessions and their limit, the guards, bad input."""

import base64
import io
import json
import time

import numpy as np
import pytest
import soundfile as sf

from omnitide_mlx.serve.config import Limits, ServeConfig
from omnitide_mlx.serve.guards import Guard


@pytest.fixture
def client(http):
    return http


def chat(client, content, **kw):
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 6, **kw}
    return client.post("/v1/chat/completions", json=body)


def wav_b64(samples: np.ndarray, rate: int = 16000) -> str:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="WAV", subtype="PCM_16")
    return base64.b64encode(buf.getvalue()).decode()


def test_health_and_models(client, tiny_qwen):
    assert client.get("/health").json()["status"] == "ok"
    assert client.get("/v1/models").json()["data"][0]["id"] == tiny_qwen.name  # a name, not a local path


def test_chat_completion_and_its_sse_stream_give_the_same_answer(client):
    r = chat(client, "What colour is the square?")
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion"
    text = out["choices"][0]["message"]["content"]
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 6
    assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + 6

    pieces, finish, usage = [], None, None
    with client.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "What colour is the square?"}], "max_tokens": 6,
            "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    for ln in lines[:-1]:
        chunk = json.loads(ln.removeprefix("data: "))
        assert chunk["object"] == "chat.completion.chunk"
        pieces.append(chunk["choices"][0]["delta"].get("content", ""))
        finish = chunk["choices"][0]["finish_reason"] or finish
        usage = chunk.get("usage") or usage
    assert "".join(pieces) == text  # greedy: the stream is the same answer, piece by piece
    assert len([p for p in pieces if p]) >= 2 and finish == "length" and usage == out["usage"]


def test_image_and_audio_parts_become_units(client, clip_units):
    jpeg, pcm, _ = clip_units[2]
    text_only = chat(client, "What do you see?").json()["usage"]["prompt_tokens"]
    image = {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()}}
    audio = {"type": "input_audio", "input_audio": {
        "data": wav_b64(np.frombuffer(pcm, "<i2").astype(np.float32) / 32767), "format": "wav"}}
    r = chat(client, [image, {"type": "text", "text": "What do you see?"}])
    assert r.status_code == 200, r.text
    with_image = r.json()["usage"]["prompt_tokens"]
    r = chat(client, [image, audio, {"type": "text", "text": "What do you see?"}])
    assert r.status_code == 200, r.text
    assert text_only < with_image < r.json()["usage"]["prompt_tokens"]
    # a system message replaces the default system prompt; earlier turns are context: the prompt grows with them
    system = {"role": "system", "content": "Be brief."}
    question = {"role": "user", "content": "What do you see?"}
    r = client.post("/v1/chat/completions", json={"max_tokens": 2, "messages": [system, question]})
    short = r.json()["usage"]["prompt_tokens"]
    assert r.status_code == 200 and short < text_only
    r = client.post("/v1/chat/completions", json={"max_tokens": 2, "messages": [
        system, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}, question]})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > short


@pytest.mark.parametrize("body, status, code", [
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "https://example.com/a.jpg"}}, {"type": "text", "text": "hi"}]}]}, 400, "bad_request"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/jpeg;base64,/9j/4AAQ"}}, {"type": "text", "text": "hi"}]}]}, 400, "bad_frame"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/jpeg;base64,!!"}}, {"type": "text", "text": "hi"}]}]}, 400, "bad_request"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {
        "data": base64.b64encode(b"RIFFjunk").decode(), "format": "wav"}}, {"type": "text", "text": "hi"}]}]},
     400, "bad_audio"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, 400, "bad_request"),
    ({"messages": [{"role": "user", "content": "  "}]}, 400, "bad_request"),
    ({"messages": []}, 400, "bad_request"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4o"}, 404, "model_not_found"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}, 400, "bad_request"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "bad_request"),
])
def test_bad_requests_get_a_specific_error(client, body, status, code):
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code and r.json()["error"]["message"]


def test_limits_on_body_and_frame_size(client):
    r = client.post("/v1/chat/completions", content=b"{" + b" " * (300 << 10) + b"}",
                    headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "message_too_large"
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (200, 200), (255, 0, 0)).save(buf, format="PNG")  # 40,000 pixels > 20,000
    r = chat(client, [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}}, {"type": "text", "text": "x"}])
    assert r.status_code == 413 and r.json()["error"]["code"] == "frame_too_large"
    assert "20000" in r.json()["error"]["message"]


def test_session_limit_and_lifecycle(client):
    a = client.post("/v1/sessions", json={"policy": "fifo", "high": 300, "low": 200})
    assert a.status_code == 201, a.text
    info = a.json()
    assert info["stats"]["policy"] == "fifo" and info["stats"]["high"] == 300
    others = [client.post("/v1/sessions", json={}) for _ in range(2)]
    assert [o.status_code for o in others] == [201, 201]
    c = client.post("/v1/sessions", json={})
    assert c.status_code == 429 and c.json()["error"]["code"] == "session_limit"
    assert "--max-sessions" in c.json()["error"]["message"]
    assert chat(client, "hi").status_code == 429  # one-shot requests count too
    ids = {info["id"]} | {o.json()["id"] for o in others}
    assert {s["id"] for s in client.get("/v1/sessions").json()["sessions"]} == ids
    assert client.delete(f"/v1/sessions/{info['id']}").status_code == 204
    assert client.get(f"/v1/sessions/{info['id']}").status_code == 404
    for o in others:
        assert client.delete(f"/v1/sessions/{o.json()['id']}").status_code == 204
    assert client.post("/v1/sessions", json={"policy": "nope"}).json()["error"]["code"] == "bad_request"
    r = client.post("/v1/sessions", json={"kv_budget": "1KiB"})
    assert r.status_code == 400 and "KV budget" in r.json()["error"]["message"]
    assert client.get("/health").json()["in_use"] == 0


def test_a_client_that_leaves_mid_stream_frees_its_slot(client):
    with client.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 4000, "stream": True}) as r:
        for line in r.iter_lines():
            if '"content": "' in line and '"content": ""' not in line:
                break  # the first piece arrived: leave
    deadline = time.monotonic() + 20
    while client.get("/health").json()["in_use"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert client.get("/health").json()["in_use"] == 0


def test_origin_and_host_guards_on_the_real_server(client, server):
    r = client.post("/v1/sessions", json={}, headers={"Origin": "http://evil.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "bad_origin"
    r = client.get("/health", headers={"Host": "evil.example:80"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "bad_host"
    host = server.url.removeprefix("http://")
    assert client.get("/health", headers={"Origin": f"http://{host}"}).status_code == 200  # the page's own origin
    assert client.get("/").status_code == 200 and "frame-ancestors 'none'" in client.get("/").headers[
        "content-security-policy"]


def guarded(config: ServeConfig):
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    async def ok(request):
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/", ok), Route("/v1/x", ok, methods=["GET", "POST"])])
    from starlette.testclient import TestClient

    return TestClient(Guard(app, config), base_url="http://127.0.0.1:8080")


def test_guard_token_origins_and_cors():
    token = "s3cret-token-0123456789"
    c = guarded(ServeConfig(host="0.0.0.0", token=token, allow_origins=["https://app.example"]))
    assert c.get("/v1/x").status_code == 401
    assert c.get("/v1/x", headers={"Authorization": "Bearer wrong-token-0123456789"}).status_code == 401
    assert c.get("/v1/x", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    assert c.get(f"/v1/x?token={token}").status_code == 401  # ?token= is for WebSocket URLs only
    assert c.get("/").status_code == 200  # the page holds no secret
    pre = c.options("/v1/x", headers={"Origin": "https://app.example", "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 204 and pre.headers["access-control-allow-origin"] == "https://app.example"
    r = c.get("/v1/x", headers={"Origin": "https://app.example", "Authorization": f"Bearer {token}"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    r = c.post("/v1/x", headers={"Origin": "https://other.example", "Authorization": f"Bearer {token}"})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    assert c.get("/v1/x", headers={"Origin": "null", "Authorization": f"Bearer {token}"}).status_code == 403


def test_config_refuses_an_exposed_server_without_a_token():
    with pytest.raises(ValueError, match="needs --token"):
        ServeConfig(host="0.0.0.0").check()
    with pytest.raises(ValueError, match="at least 16"):
        ServeConfig(host="0.0.0.0", token="short").check()
    with pytest.raises(ValueError, match="full origin"):
        ServeConfig(allow_origins=["*"]).check()
    with pytest.raises(ValueError, match="max_queued"):
        ServeConfig(limits=Limits(max_queued=0)).check()
    ServeConfig(host="::1").check()


def test_cli_refuses_a_public_bind_without_a_token_before_loading(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "omnitide_mlx", "serve", "--model", str(tmp_path / "missing"),
                        "--host", "0.0.0.0"], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(__import__("pathlib").Path(
                           __file__).resolve().parents[2])})
    assert r.returncode == 1 and "needs --token" in r.stderr and "loading" not in r.stderr
