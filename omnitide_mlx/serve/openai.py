"""``POST /v1/chat/completions``: OpenAI-compatible one-shot requests, as ``mlx_lm.server`` serves them.

Each request gets its own short-lived session with the ``full`` policy (one request is one bounded context, so
nothing needs evicting): the system messages become its system prompt, the media parts (``image_url`` as data
URLs, ``input_audio``) and the earlier turns' text are pushed as units, and the last user message's text is the
question. The server fetches nothing: remote image URLs are refused. ``POST /v1/completions`` asks a plain
``prompt`` the same way; a spoken answer (``modalities: ["text", "audio"]``) comes as OpenAI's audio output, and
the options this server does not do (``n`` > 1, tools, structured output, logprobs) are refused, never ignored.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
from starlette.responses import JSONResponse, StreamingResponse

from ..errors import MediaError
from .decode import ClientError, b64, decode_audio_file, decode_frame
from .sessions import SessionManager, sampling_from


ROLES = ("system", "developer", "user", "assistant", "tool")
AUDIO_OUT = ("wav", "pcm16")  # spoken answers (OpenAI's audio output): 16-bit PCM, whole or in a WAV file
AUDIO_OUT_STREAM = ("pcm16",)  # streamed as OpenAI streams it: base64 PCM pieces


@dataclass
class ChatRequest:
    system: str | None
    # ("frame", (format, data URL, where)) | ("audio", (format, base64, where)) | ("text", str): media still encoded
    context: list = field(default_factory=list)
    question: str = ""
    sampling: dict = field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False
    speak: bool = False  # modalities ["text", "audio"]: the answer is spoken too (OpenAI's audio output)
    speaker: str | None = None
    audio_format: str = "wav"


def unsupported(body: dict) -> None:
    """Refuse the OpenAI options this server does not do, rather than ignore them and answer something else."""
    def refuse(message: str):
        raise ClientError("unsupported", message)

    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        refuse("n: this server gives one choice per request (n 1); send several requests for more")
    if body.get("best_of") not in (None, 1):
        refuse("best_of: this server gives one choice per request")
    if body.get("tools") not in (None, []) or body.get("functions") not in (None, []):
        refuse("tools / functions: this server does no function calling")
    if body.get("tool_choice") not in (None, "none", "auto") or body.get("function_call") not in (None, "none",
                                                                                                  "auto"):
        refuse("tool_choice: this server does no function calling")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        refuse("response_format: this server answers in plain text only ({\"type\": \"text\"})")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        refuse("logprobs / top_logprobs: this server returns no log probabilities")
    modalities = body.get("modalities")
    if modalities is not None and (not isinstance(modalities, list) or not all(isinstance(m, str) for m in modalities)
                                   or set(modalities) - {"text", "audio"}):
        refuse("modalities: a list of \"text\" and \"audio\"")
    speak = modalities is not None and "audio" in modalities
    audio = body.get("audio")
    if speak or audio is not None:
        if not speak or not isinstance(audio, dict):
            refuse("audio output needs modalities [\"text\", \"audio\"] and audio {\"voice\", \"format\"}")
        formats = AUDIO_OUT_STREAM if body.get("stream") else AUDIO_OUT
        if audio.get("format") not in formats:
            refuse(f"audio.format {str(audio.get('format'))[:20]!r}: spoken answers come as "
                   f"{' or '.join(formats)}{' when streamed' if body.get('stream') else ''} (24 kHz mono)")


def _parts(content, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ClientError("bad_request", f"{where}.content must be a string or a list of content parts")
    for i, p in enumerate(content):
        if not isinstance(p, dict) or not isinstance(p.get("type"), str):
            raise ClientError("bad_request", f"{where}.content[{i}] must be an object with a type")
    return content


def parse_chat(body: dict, manager: SessionManager) -> ChatRequest:
    """Validate a request's shape before any slot or session is taken; its media stay encoded (``_prepare``
    decodes them one at a time once the request holds a slot, so a refused request decodes nothing)."""
    cfg = manager.config
    lim = cfg.limits
    model = body.get("model")
    # mlx_lm.server calls the model it serves "default_model"; clients also send the id from /v1/models or the
    # --model the server was started with
    names = (None, "", "default", "default_model", cfg.model, cfg.model_id, cfg.model.rstrip("/").split("/")[-1])
    if model not in names:
        raise ClientError("model_not_found", f"this server runs {cfg.model_id!r}, not {str(model)[:100]!r} (see GET "
                                             "/v1/models)", 404)
    unsupported(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ClientError("bad_request", "messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ClientError("bad_request", f"messages[{i}].role must be one of {', '.join(ROLES)}")
    if messages[-1]["role"] != "user":
        raise ClientError("bad_request", "the last message must be the user's question")
    req = ChatRequest(system=None, stream=bool(body.get("stream", False)),
                      sampling=sampling_from(body, cfg.default_max_tokens, lim.max_tokens, openai=True))
    if "audio" in (body.get("modalities") or []):
        req.speak, req.audio_format = True, body["audio"]["format"]
        voice = body["audio"].get("voice")
        req.speaker = manager.speaker(voice.get("id") if isinstance(voice, dict) else voice)
    opts = body.get("stream_options") or {}
    req.include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
    system = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        content = m.get("content")
        if content is None and m["role"] in ("assistant", "tool"):
            content = ""  # an assistant turn that only called a tool, or an empty tool result
        parts = _parts(content, where)
        last = i == len(messages) - 1
        texts = []
        for j, p in enumerate(parts):
            kind = p["type"]
            if kind in ("text", "input_text"):
                if not isinstance(p.get("text"), str):
                    raise ClientError("bad_request", f"{where}.content[{j}].text must be a string")
                texts.append(p["text"])
            elif kind == "image_url":
                if m["role"] != "user":
                    raise ClientError("bad_request", f"{where}: only user messages may hold images")
                url = p.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str) or not url.startswith("data:image/"):
                    raise ClientError("bad_request", f"{where}.content[{j}]: images must be data URLs "
                                                     "(data:image/jpeg;base64,...); the server fetches nothing")
                fmt = url[len("data:image/"):].split(";", 1)[0].lower()
                req.context.append(("frame", ({"jpg": "jpeg"}.get(fmt, fmt), url, f"{where}.content[{j}].image_url")))
            elif kind == "input_audio":
                if m["role"] != "user":
                    raise ClientError("bad_request", f"{where}: only user messages may hold audio")
                a = p.get("input_audio")
                if not isinstance(a, dict):
                    raise ClientError("bad_request", f"{where}.content[{j}].input_audio must be {{data, format}}")
                req.context.append(("audio", (str(a.get("format", "wav")), a.get("data"), "input_audio")))
            else:
                raise ClientError("bad_request", f"{where}.content[{j}]: content type {kind!r} is not supported "
                                                 "(text, image_url, input_audio)")
        text = "\n".join(t for t in texts if t.strip())
        if m["role"] in ("system", "developer"):
            if text:
                system.append(text)
        elif last:
            if not text.strip():
                raise ClientError("bad_request", "the last user message needs text: the question to answer")
            req.question = text
        elif text.strip():  # earlier turns are context the question is asked about
            req.context.append(("text", text if m["role"] == "user" else f"({m['role']}) {text}"))
    req.system = "\n".join(system) or cfg.system_prompt
    return req


def _prepare(manager: SessionManager, req: ChatRequest, cancel: threading.Event):
    """Worker thread (the request holds a slot): a fresh full-context session holding the request's media and
    earlier turns. The prompt's text is counted first; media are decoded one at a time and pushed a unit (a
    frame, a second of audio) at a time, the prompt checked against ``--max-prompt-tokens`` after each, so
    neither a long prompt nor many media run for long or stay in memory; a client that leaves stops it."""
    from ..session import OmniSession

    lim, gate = manager.config.limits, manager.gate
    texts = [val for kind, val in req.context if kind == "text"]
    question = manager.prompt_tokens([req.question])
    manager.check_prompt(manager.prompt_tokens(texts, system=req.system) + question)
    with gate.step():
        s = OmniSession((manager.model, manager.processor), policy="full", system_prompt=req.system)

    def push(**kw) -> None:
        if cancel.is_set():
            raise ClientError("cancelled", "the client left")
        with gate.step():
            s.push(**kw)
        manager.check_prompt(s.history.total_tokens + question, counted="so far")

    try:
        for kind, val in req.context:
            if kind == "frame":
                fmt, url, where = val
                push(frame=decode_frame(fmt, b64(url, where), lim))
            elif kind == "audio":
                fmt, data, where = val
                samples, rate = decode_audio_file(b64(data, where), fmt, lim)
                for i in range(0, samples.size, rate):
                    push(audio=samples[i:i + rate], sample_rate=rate)
                del samples
            else:
                push(text=val)
        with gate.step():
            s.flush()
        manager.check_prompt(s.history.total_tokens + question, counted="so far")
    except MediaError as e:
        s = None  # the traceback keeps this frame: let the refused request's session (and its KV) go now
        raise ClientError("bad_media", str(e)) from None
    except BaseException:
        s = None
        raise
    return s


def _spoken(pieces: list, fmt: str) -> bytes:
    """The AudioChunks among ``pieces`` as 16-bit PCM, raw (``pcm16``) or in a WAV file."""
    chunks = [p for p in pieces if not isinstance(p, str)]
    pcm = np.concatenate([c.int16() for c in chunks]) if chunks else np.zeros(0, np.int16)
    if fmt == "pcm16":
        return pcm.astype("<i2").tobytes()
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, pcm, chunks[0].sample_rate if chunks else 24000, format="WAV", subtype="PCM_16")
    return buf.getvalue()


async def _until_disconnect(request, cancel: threading.Event) -> None:
    """Set ``cancel`` when the client goes away (the body is read: the next ASGI message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            cancel.set()
            return


def _open_answer(manager: SessionManager, s, req: ChatRequest):
    """Worker thread: the answer's iterator (text pieces; with ``req.speak`` AudioChunks too). A spoken answer loads
    the speech models and checks the voice here, so its errors come before any response has started."""
    if not req.speak:
        return s.ask(req.question, **req.sampling)
    from ..speech import SpeechUnavailable, speech_for

    try:
        with manager.gate.step():
            return s.ask(req.question, speak=True, speaker=req.speaker, **req.sampling)
    except SpeechUnavailable as e:
        raise ClientError("speech_unavailable", f"this model cannot speak: {e}") from None
    except ValueError:
        voices = [str(v) for v in speech_for(s).speakers] + list(manager.config.voices)
        raise ClientError("bad_request", f"unknown voice {req.speaker!r} (voices: {', '.join(voices)})") from None


def _answer(manager: SessionManager, s, req: ChatRequest, it, emit, cancel: threading.Event) -> dict:
    """Worker thread: the answer, one gated step per token, each piece (text, or an AudioChunk of a spoken answer)
    handed to ``emit``."""
    gate = manager.gate
    before = s.counters.decoded_tokens
    try:
        while not cancel.is_set():
            with gate.step():
                piece = next(it, None)
            if piece is None:
                break
            emit(piece)
    finally:
        with gate.step():
            it.close()
    completion = s.counters.decoded_tokens - before
    last = s.history[-1]
    reply_tokens = last.length if last.kind.value == "reply" else 0
    prompt = s.history.total_tokens - reply_tokens
    finish = "length" if completion >= req.sampling["max_tokens"] else "stop"
    return {"finish_reason": finish,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}


def completion_as_chat(body: dict) -> dict:
    """``POST /v1/completions`` (a plain-text ``prompt``) as a chat request: the engine streams conversations, so
    the prompt is asked as the user's question (no raw continuation of the text, no ``echo`` or ``suffix``)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt.strip():
        raise ClientError("bad_request", "prompt must be a non-empty string (or a list of one)")
    if body.get("echo"):
        raise ClientError("unsupported", "echo: the prompt is asked as a question, not continued; it is not echoed")
    if body.get("suffix") is not None:
        raise ClientError("unsupported", "suffix: this server does no insertion")
    if body.get("modalities") is not None or body.get("audio") is not None:
        raise ClientError("unsupported", "modalities / audio: spoken answers come from /v1/chat/completions")
    chat = {k: v for k, v in body.items() if k not in ("prompt", "echo", "suffix", "messages")}
    chat["messages"] = [{"role": "user", "content": prompt}]
    return chat


async def chat_completions(manager: SessionManager, body: dict, request, *, text: bool = False):
    """A chat completion (``text``: a ``/v1/completions`` reply shape for the same request)."""
    loop = asyncio.get_running_loop()
    req = parse_chat(completion_as_chat(body) if text else body, manager)
    manager.claim_oneshot()
    cancel = threading.Event()
    watcher = asyncio.create_task(_until_disconnect(request, cancel))
    s = it = None
    try:
        s = await loop.run_in_executor(manager.executor, _prepare, manager, req, cancel)
        it = await loop.run_in_executor(manager.executor, _open_answer, manager, s, req)
    except BaseException:
        watcher.cancel()
        s = it = None
        manager.release_oneshot()
        raise
    cid = f"{'cmpl' if text else 'chatcmpl'}-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    model = manager.config.model_id

    aid = f"audio_{uuid.uuid4().hex[:24]}"
    if not req.stream:
        pieces: list = []
        try:  # the watcher stops the answer at its next token if the client leaves
            result = await loop.run_in_executor(manager.executor, _answer, manager, s, req, it, pieces.append,
                                                cancel)
        finally:
            watcher.cancel()
            s = it = None  # the session goes before the slot's release gives MLX's buffers back
            manager.release_oneshot()
        reply = "".join(p for p in pieces if isinstance(p, str))
        if req.speak:  # OpenAI's audio output: the text is the audio's transcript
            message = {"role": "assistant", "content": None, "audio": {
                "id": aid, "expires_at": created + 3600, "transcript": reply,
                "data": base64.b64encode(_spoken(pieces, req.audio_format)).decode()}}
        else:
            message = {"role": "assistant", "content": reply}
        choice = ({"index": 0, "text": reply, "logprobs": None} if text else {"index": 0, "message": message})
        return JSONResponse({
            "id": cid, "object": "text_completion" if text else "chat.completion", "created": created,
            "model": model, "choices": [{**choice, "finish_reason": result["finish_reason"]}],
            "usage": result["usage"]})

    watcher.cancel()  # from here the streaming response watches the client itself (and ``closed`` stops the answer)
    queue: asyncio.Queue = asyncio.Queue()
    state: dict = {"task": None}

    def emit(piece) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, piece)

    def chunk(delta: dict, finish=None, usage=None) -> str:
        if text:
            d = {"id": cid, "object": "text_completion", "created": created, "model": model,
                 "choices": [{"index": 0, "text": delta.get("content", ""), "logprobs": None,
                              "finish_reason": finish}]}
        else:
            d = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        if usage is not None:
            d["usage"] = usage
        return f"data: {json.dumps(d)}\n\n"

    async def events():
        task = state["task"] = loop.run_in_executor(manager.executor, _answer, manager, s, req, it, emit, cancel)
        # the slot is given back when the worker has really stopped, however the response ended
        task.add_done_callback(lambda _: manager.release_oneshot())
        task.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, None))
        if not text:
            yield chunk({"role": "assistant", "content": None if req.speak else ""})
        while True:
            piece = await queue.get()
            if piece is None:
                break
            if not req.speak:
                yield chunk({"content": piece})
            elif isinstance(piece, str):  # a spoken answer streams its text as the audio's transcript
                yield chunk({"audio": {"id": aid, "transcript": piece}})
            elif piece.pcm.size:
                yield chunk({"audio": {"id": aid, "data": base64.b64encode(_spoken([piece], "pcm16")).decode()}})
        result = await task
        yield chunk({}, result["finish_reason"], result["usage"] if req.include_usage else None)
        yield "data: [DONE]\n\n"

    def closed() -> None:
        cancel.set()  # the client left (or the answer is done): the worker stops at its next token
        if state["task"] is None:
            manager.release_oneshot()  # the answer never started

    return _EventStream(events(), closed)


class _EventStream(StreamingResponse):
    """Server-Sent Events whose ``on_close`` runs however the response ends (done, client gone, cancelled): a
    generator's own ``finally`` cannot await anything once Starlette cancels it, and never runs if it never started."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
