"""Misuse of a real ``omnitide serve`` (tiny checkpoint, the shared server of tests/serve): each refusal is a
structured error, and the server (and the WebSocket) goes on afterwards."""

import json

import pytest

from test_ws import Client, new_session


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

    from conftest import REPO

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
