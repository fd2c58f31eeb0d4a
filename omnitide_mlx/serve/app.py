"""The ASGI application: routes, the session WebSocket protocol, and the page.

Why Starlette + uvicorn: the server needs HTTP routes, Server-Sent Events, WebSockets and a static page, and
nothing more. Starlette is the small, well-kept ASGI toolkit that gives exactly these (FastAPI is Starlette plus
pydantic validation and OpenAPI generation, which a dozen routes with hand-checked bodies do not need), and
uvicorn is the standard ASGI server for it (HTTP/1.1 + WebSockets through the ``websockets`` package). Both are
pure Python wheels with few dependencies.

WebSocket protocol (``/v1/sessions/{id}/ws``; JSON text messages, or binary ``[u32 header length][JSON header]
[payload]`` messages for media without base64). Client -> server:
  {"type": "unit", "seq": 7, "t": 3.0, "frame": {"format": "jpeg"|"png"|"rgb"|"rgba", "data": b64 | "bytes": n,
   "width", "height"}, "audio": {"format": "pcm_s16le"|"pcm_f32le", "sample_rate": 48000, "channels": 1,
   "data": b64 | "bytes": n}, "text": "..."}        (any of frame / audio / text)
  {"type": "ask", "id": "q1", "question": "...", "max_tokens", "temp", "top_p", "min_p", "top_k", "seed", "stop",
   "speak": false, "speaker": "Chelsie", "speech_sampling": {"temperature", "top_k", "top_p", "repetition_penalty",
   "greedy"}}   (speech_sampling: the talker's / TTS's own settings, each optional, unset = the model's official
   defaults; temperature 0 = greedy; the text's temp / top_p / top_k do not apply to speech)
  {"type": "cancel"[, "id"]}   {"type": "flush"}   {"type": "stats"}   {"type": "save", "name": "..."}
  {"type": "ping"}
  {"type": "voice", "enabled": true, "speak": false, "speaker": null, "barge_in": true, "echo_reference": true,
   "hangover": 0.5, "vad_threshold": 0.5, "max_utterance": 30, + ask's sampling fields}: spoken turns (docs/usage.md)
Server -> client:
  ready {session, stats, limits}; pushed {seq, updates}; update {seq, record}; answer_start / piece {id, text} /
  audio {id, index, format: pcm_s16le, sample_rate, data: b64, final, note} (spoken answers);
  answer_end {id, text, tokens, finish_reason}; flushed; saved {name}; stats {info}; pong;
  error {code, message, seq | id}: the session goes on; session_deleted, then the socket closes.
  voice {enabled}; turn {event: speech_started | speech_ended | reply_started | reply_interrupted | reply_done |
  turn_error, turn, id: "turn-N", t (stream seconds), ...}; a turn's reply comes as piece / audio with id "turn-N".
"""

from __future__ import annotations

import asyncio
import contextlib
from importlib import resources

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from .config import ServeConfig
from .decode import ClientError, parse_json, split_binary, unit_from_message
from .guards import Guard
from .openai import chat_completions
from .sessions import Job, SessionManager, sampling_from, voice_args

PAGE_HEADERS = {
    "Cache-Control": "no-store",
    "X-Frame-Options": "DENY",  # the page can switch the camera on: no framing by other sites
    "Content-Security-Policy": ("default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' "
                                "'unsafe-inline'; img-src 'self' data: blob:; media-src 'self' blob: mediastream:; "
                                "connect-src 'self' ws: wss:; frame-ancestors 'none'"),
}


async def read_json(request: Request, limit: int) -> dict:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ClientError("message_too_large", f"the request body is {int(length)} bytes; the limit is {limit} "
                                               "(--max-message-bytes)", 413)
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise ClientError("message_too_large", f"the request body exceeds {limit} bytes (--max-message-bytes)",
                              413)
    data = parse_json(body or b"{}", "the body")
    if not isinstance(data, dict):
        raise ClientError("bad_request", "the body must be a JSON object")
    return data


def create_app(config: ServeConfig, model, processor) -> Starlette:
    """The server for one loaded model. ``config.check()`` should have passed (the CLI does it before loading)."""
    manager = SessionManager(model, processor, config)
    limits = config.limits

    async def page(request: Request):
        html = resources.files(__package__).joinpath("static/index.html").read_text(encoding="utf-8")
        return HTMLResponse(html, headers=PAGE_HEADERS)

    async def health(request: Request):
        return JSONResponse({"status": "ok", "model": config.model_id, "sessions": len(manager.sessions),
                             "in_use": manager.in_use(), "max_sessions": limits.max_sessions})

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [{"id": config.model_id, "object": "model", "created": 0,
                                                         "owned_by": "omnitide"}]})

    async def completions(request: Request):
        return await chat_completions(manager, await read_json(request, limits.max_message_bytes), request)

    async def text_completions(request: Request):
        return await chat_completions(manager, await read_json(request, limits.max_message_bytes), request,
                                      text=True)

    async def create_session(request: Request):
        body = await read_json(request, limits.max_message_bytes)
        ms = await manager.create(body)
        return JSONResponse({"id": ms.id, "websocket": f"/v1/sessions/{ms.id}/ws", **ms.info()}, status_code=201)

    async def list_sessions(request: Request):
        return JSONResponse({"sessions": [ms.info() for ms in manager.sessions.values()]})

    async def get_session(request: Request):
        return JSONResponse(manager.get(request.path_params["sid"]).info())

    async def delete_session(request: Request):
        await manager.delete(request.path_params["sid"])
        return Response(status_code=204)

    async def save_session(request: Request):
        ms = manager.get(request.path_params["sid"])
        body = await read_json(request, limits.max_message_bytes)
        path = manager.save_path(body.get("name"))
        return JSONResponse(await ms.submit(Job("save", {"name": body["name"], "path": path})))

    async def session_ws(ws: WebSocket):
        await ws.accept()
        try:
            ms = manager.get(ws.path_params["sid"])
            outbox: asyncio.Queue = asyncio.Queue()
            ms.attach(outbox.put_nowait)
        except ClientError as e:
            await ws.send_json({"type": "error", "code": e.code, "message": e.message})
            await ws.close(code=4000 + e.status)
            return
        sender = asyncio.create_task(_sender(ws, outbox))
        outbox.put_nowait({"type": "ready", "session": ms.id, "stats": ms.last_stats,
                           "limits": {"max_message_bytes": limits.max_message_bytes,
                                      "max_frame_pixels": limits.max_frame_pixels,
                                      "max_audio_seconds": limits.max_audio_seconds,
                                      "max_queued": limits.max_queued, "max_tokens": limits.max_tokens}})
        try:
            await _receive(ws, ms, outbox, manager)
        finally:
            ms.detach()
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await sender
            if ms.ephemeral and manager.sessions.get(ms.id) is ms:
                await manager.delete(ms.id)

    async def client_error(request: Request, exc: ClientError):
        return JSONResponse(exc.payload(), status_code=exc.status)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        reaper = asyncio.create_task(_reap(manager))
        try:
            yield
        finally:
            reaper.cancel()
            await manager.close()

    app = Starlette(routes=[
        Route("/", page),
        Route("/health", health),
        Route("/v1/models", models),
        Route("/v1/chat/completions", completions, methods=["POST"]),
        Route("/v1/completions", text_completions, methods=["POST"]),
        Route("/v1/sessions", create_session, methods=["POST"]),
        Route("/v1/sessions", list_sessions, methods=["GET"]),
        Route("/v1/sessions/{sid}", get_session, methods=["GET"]),
        Route("/v1/sessions/{sid}", delete_session, methods=["DELETE"]),
        Route("/v1/sessions/{sid}/save", save_session, methods=["POST"]),
        WebSocketRoute("/v1/sessions/{sid}/ws", session_ws),
    ], exception_handlers={ClientError: client_error}, lifespan=lifespan)
    app.state.manager = manager
    return Guard(app, config)


async def _reap(manager: SessionManager) -> None:
    period = max(1.0, min(30.0, manager.config.limits.idle_timeout_s / 4))
    while True:
        await asyncio.sleep(period)
        await manager.expire_idle()


async def _sender(ws: WebSocket, outbox: asyncio.Queue) -> None:
    while True:
        msg = await outbox.get()
        await ws.send_json(msg)
        if msg.get("type") == "session_deleted":
            await ws.close(code=1000)
            return


async def _receive(ws: WebSocket, ms, outbox: asyncio.Queue, manager: SessionManager) -> None:
    limits = manager.config.limits
    loop = asyncio.get_running_loop()

    def reply(fut: asyncio.Future, ref: dict) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is None:
            outbox.put_nowait(fut.result())
        elif isinstance(exc, ClientError):
            if exc.code != "cancelled":
                outbox.put_nowait({"type": "error", "code": exc.code, "message": exc.message, **ref})
        else:
            outbox.put_nowait({"type": "error", "code": "internal_error", "message": repr(exc), **ref})

    while True:
        try:
            raw = await ws.receive()
        except WebSocketDisconnect:
            return
        if raw["type"] == "websocket.disconnect":
            return
        data = raw.get("bytes") if raw.get("bytes") is not None else raw.get("text")
        ref: dict = {}
        kind = None
        try:
            if data is None:
                raise ClientError("bad_request", "empty message")
            if len(data) > limits.max_message_bytes:
                if isinstance(data, bytes):  # name the unit in the error: a binary header is cheap to read
                    with contextlib.suppress(ClientError):
                        seq = split_binary(data)[0].get("seq")
                        if seq is not None:
                            ref["seq"] = seq
                raise ClientError("message_too_large", f"the message is {len(data)} bytes; the limit is "
                                                       f"{limits.max_message_bytes} (--max-message-bytes)", 413)
            if isinstance(data, bytes):
                msg, payload = split_binary(data)
            else:
                msg, payload = parse_json(data, "the message"), None
                if not isinstance(msg, dict):
                    raise ClientError("bad_request", "a message is a JSON object with a type")
            kind = msg.get("type")
            if "seq" in msg:
                ref["seq"] = msg["seq"]
            if "id" in msg:
                ref["id"] = msg["id"]
            if kind == "unit":
                ms.counts["units_received"] += 1
                ms.check_room()  # a unit the queue cannot take is refused before its media are decoded
                item = await loop.run_in_executor(None, unit_from_message, msg, payload, limits)
                ms.submit(Job("push", {"item": item, "seq": item.seq})).add_done_callback(
                    lambda f, r=ref: reply(f, r))
            elif kind == "ask":
                q = msg.get("question")
                if not isinstance(q, str) or not q.strip():
                    raise ClientError("bad_request", "ask needs a non-empty question")
                sampling = sampling_from(msg, manager.config.default_max_tokens, limits.max_tokens)
                speak, speaker = msg.get("speak", False), msg.get("speaker")
                if not isinstance(speak, bool):
                    raise ClientError("bad_request", "speak must be true or false")
                if speaker is not None and not speak:
                    raise ClientError("bad_request", "speaker picks the voice of a spoken answer: send speak: true "
                                                     "with it")
                speaker = manager.speaker(speaker)
                speech_sampling = speech_sampling_from(msg)
                ms.submit(Job("ask", {"id": msg.get("id"), "question": q, "sampling": sampling, "speak": speak,
                                      "speaker": speaker, "speech_sampling": speech_sampling})).add_done_callback(
                    lambda f, r=ref: reply(f, r))
            elif kind == "voice":
                ms.submit(Job("voice", voice_args(msg, manager))).add_done_callback(lambda f, r=ref: reply(f, r))
            elif kind == "cancel":
                ms.cancel_answer(msg.get("id"))
            elif kind == "flush":
                ms.submit(Job("flush")).add_done_callback(lambda f, r=ref: reply(f, r))
            elif kind == "save":
                path = manager.save_path(msg.get("name"))
                ms.submit(Job("save", {"name": msg["name"], "path": path})).add_done_callback(
                    lambda f, r=ref: reply(f, r))
            elif kind == "stats":
                outbox.put_nowait({"type": "stats", **ms.info()})
            elif kind == "ping":
                outbox.put_nowait({"type": "pong", **ref})
            else:
                raise ClientError("bad_request", f"unknown message type {kind!r} (unit, ask, voice, cancel, flush, "
                                                 "save, stats, ping)")
        except ClientError as e:
            if kind == "unit":
                ms.counts["rejected"] += 1
            outbox.put_nowait({"type": "error", "code": e.code, "message": e.message, **ref})
        except Exception as e:  # a bug must not drop the client's socket: say so and go on
            outbox.put_nowait({"type": "error", "code": "internal_error", "message": f"{type(e).__name__}: {e}",
                               **ref})


SPEECH_SAMPLING_KEYS = ("temperature", "top_k", "top_p", "repetition_penalty", "greedy")


def speech_sampling_from(msg: dict) -> dict:
    """An ask message's ``speech_sampling`` object -> ``SpeechOptions.with_sampling`` keywords, checked here (a
    ``bad_request`` naming the field) so that nothing is queued for a bad value."""
    raw = msg.get("speech_sampling")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ClientError("bad_request", "speech_sampling must be an object with " + ", ".join(SPEECH_SAMPLING_KEYS))
    unknown = sorted(set(raw) - set(SPEECH_SAMPLING_KEYS))
    if unknown:
        raise ClientError("bad_request", f"speech_sampling has unknown fields {unknown} (known: "
                                         f"{', '.join(SPEECH_SAMPLING_KEYS)})")
    if raw and not msg.get("speak", False):
        raise ClientError("bad_request", "speech_sampling needs speak: true")
    kw = {k: v for k, v in raw.items() if v is not None}
    try:
        from ..speech import SpeechOptions

        SpeechOptions().with_sampling(**kw)
    except ValueError as e:
        raise ClientError("bad_request", str(e)) from None
    return kw

