"""Who may drive the model: the Host, Origin and token checks, as one ASGI middleware in front of every route.

A model on loopback is still reachable from any web page the user opens: a page can POST to 127.0.0.1 and open a
WebSocket to it, and DNS rebinding lets a page reach it under its own host name. So:
- **Host**: the Host header must name this machine's loopback (or the bound address, or ``--allow-host``), which
  defeats DNS rebinding (the rebound request carries the attacker's host name);
- **Origin**: a request that carries an Origin (every cross-site fetch, every browser WebSocket) must come from the
  page this server serves or from an ``--allow-origin``; apps (Swift, curl, Python) send none and pass;
- **token**: with ``--token`` every API route needs ``Authorization: Bearer TOKEN`` (browsers' WebSockets, which
  cannot set headers, may pass ``?token=``); any non-loopback bind requires one.
CORS headers are added for allowed cross-origin callers only; everyone else gets a 403 before any route runs.
"""

from __future__ import annotations

import hmac
import json
from urllib.parse import parse_qs

from .config import ServeConfig, is_loopback, origin_flag_problem

OPEN_PATHS = ("/", "/favicon.ico")  # the page itself holds no secret; everything it does goes through the API


class Guard:
    def __init__(self, app, config: ServeConfig):
        self.app = app
        self.config = config
        self.wildcard = config.host in ("0.0.0.0", "::", "")
        self.hosts = {"localhost", "127.0.0.1", "::1", config.host.strip("[]").lower()}
        self.hosts.update(h.lower() for h in config.allow_hosts)
        self.origins = set(config.allow_origins)

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        host = headers.get("host", "")
        origin = headers.get("origin")
        preflight = (scope["type"] == "http" and scope["method"] == "OPTIONS" and origin is not None
                     and "access-control-request-method" in headers)
        problem = self.refuse(scope, headers, host, origin, check_token=not preflight)
        if problem is not None:
            status, code, message = problem
            if scope["type"] == "websocket":
                # closing before accept makes the server answer the handshake with HTTP 403
                return await send({"type": "websocket.close", "code": 1008, "reason": message[:120]})
            return await _json(send, status, {"error": {"message": message, "type": code, "code": code}})
        if scope["type"] == "http" and origin is not None and origin in self.origins:
            if preflight:  # browsers send no credentials on a preflight: the origin alone decides
                return await _preflight(send, origin)
            send = _with_cors(send, origin)
        return await self.app(scope, receive, send)

    def hostname_allowed(self, host: str) -> bool:
        if self.wildcard:
            return True  # bound to every address: only the token (required then) protects it
        name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        name = name.strip("[]").lower()
        return name in self.hosts or (is_loopback(name) and name != "")

    def refuse(self, scope, headers, host, origin, check_token: bool = True):
        if not self.hostname_allowed(host):
            return 403, "bad_host", (f"Host {host!r} is not this server's (DNS rebinding guard); add it with "
                                     "--allow-host if you reach the server under that name")
        if origin is not None:
            same = origin in (f"http://{host}", f"https://{host}")
            if not same and origin not in self.origins:
                if origin_flag_problem(origin) is None:
                    return 403, "bad_origin", (f"origin {origin!r} may not use this server; start it with "
                                               f"--allow-origin {origin} to allow that page")
                return 403, "bad_origin", (f"origin {origin!r} may not use this server, and no flag allows it (a "
                                           "file:// page, a sandboxed frame or an extension): serve the page over "
                                           "http(s) and allow that origin with --allow-origin")
        if check_token and self.config.token and scope["path"] not in OPEN_PATHS:
            given = None
            auth = headers.get("authorization", "")
            if auth.lower().startswith("bearer "):
                given = auth[7:].strip()
            elif scope["type"] == "websocket":  # browsers cannot set headers on a WebSocket: only there
                q = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token")
                given = q[0] if q else None
            if given is None or not hmac.compare_digest(given.encode(), self.config.token.encode()):
                return 401, "bad_token", ("this server needs its token: send 'Authorization: Bearer TOKEN' (a "
                                          "WebSocket URL may carry ?token=TOKEN instead)")
        return None


async def _json(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


async def _preflight(send, origin: str) -> None:
    await send({"type": "http.response.start", "status": 204, "headers": [
        (b"access-control-allow-origin", origin.encode()), (b"vary", b"Origin"),
        (b"access-control-allow-methods", b"GET, POST, DELETE, OPTIONS"),
        (b"access-control-allow-headers", b"authorization, content-type"),
        (b"access-control-max-age", b"600")]})
    await send({"type": "http.response.body", "body": b""})


def _with_cors(send, origin: str):
    async def wrapped(message):
        if message["type"] == "http.response.start":
            message = dict(message)
            message["headers"] = list(message.get("headers", [])) + [
                (b"access-control-allow-origin", origin.encode()), (b"vary", b"Origin")]
        await send(message)

    return wrapped
