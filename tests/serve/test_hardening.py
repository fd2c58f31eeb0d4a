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
