"""Server-side sessions: many OmniSessions over one loaded model, each fed by a queue, all behind one compute gate.

Why this shape:
- One ``ComputeGate`` lets one model step (a unit's prefill, one answer token) run at a time across sessions. On
  the CPU backend the model already uses every core, so running two sessions' steps at once only makes both slower,
  and one gate keeps MLX evaluation to one thread at a time. Answers release the gate after every token, so other
  sessions' units interleave with a long answer instead of waiting for it.
- Each session has one worker task that runs its jobs (units, questions, saves) in order, so a session's own
  ``push`` never runs in the middle of its own reply; the queue in front of it is bounded (``max_queued``) and a
  client that outruns the model gets ``queue_full`` instead of unbounded memory.
- A client that goes away cancels its session's running answer (the generator is closed, so the partial reply is
  recorded as the engine records any stopped reply) and drops its queued jobs.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import MediaError
from .config import VOICE_NAME, ServeConfig, model_ref
from .decode import ClientError, PushItem

POLICIES = ("omnitide", "omnipick", "full", "fifo", "token", "streamingllm", "h2o", "eager")
SAVE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class ComputeGate:
    """One model step at a time, whichever session it belongs to."""

    def __init__(self):
        self._lock = threading.Lock()

    @contextmanager
    def step(self):
        import mlx.core as mx

        with self._lock:
            try:
                yield
            finally:
                mx.synchronize()  # nothing of this step may still run once the next session's step starts


@dataclass
class Job:
    kind: str  # push | flush | ask | save
    args: dict = field(default_factory=dict)
    future: asyncio.Future | None = None
    cancel: threading.Event = field(default_factory=threading.Event)


def sampling_from(req: dict, default_max_tokens: int, max_tokens_limit: int, *, openai: bool = False) -> dict:
    """Validated ``OmniSession.ask`` keyword arguments from a request (OpenAI names when ``openai``)."""

    def num(name, lo, hi, kind=float, default=None):
        v = req.get(name, default)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
            raise ClientError("bad_request", f"{name} must be {'an integer' if kind is int else 'a number'}")
        if not lo <= v <= hi:
            raise ClientError("bad_request", f"{name} must lie in [{lo}, {hi}] (got {v})")
        return kind(v)

    mt_name = "max_completion_tokens" if openai and req.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = num(mt_name, 1, 10**9, int, default_max_tokens)
    if max_tokens > max_tokens_limit:
        raise ClientError("bad_request", f"{mt_name} {max_tokens} exceeds the server's limit of {max_tokens_limit} "
                                         "(--max-tokens-limit)")
    stop = req.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or len(stop) > 4
                             or not all(isinstance(s, str) and s for s in stop)):
        raise ClientError("bad_request", "stop must be a string or a list of at most 4 non-empty strings")
    return dict(
        max_tokens=max_tokens,
        temp=num("temperature" if openai else "temp", 0.0, 10.0, default=0.0),
        top_p=num("top_p", 0.0, 1.0, default=0.0),
        min_p=num("min_p", 0.0, 1.0, default=0.0),
        top_k=num("top_k", 0, 10**6, int, default=0),
        repetition_penalty=num("repetition_penalty", 0.0, 10.0, default=None),
        seed=num("seed", 0, 2**63 - 1, int, default=None),
        stop=stop,
    )


def voice_args(msg: dict, manager: "SessionManager") -> dict:
    """Validated ``{"type": "voice"}`` settings (before anything runs): on/off, speech, barge-in, the detector's
    settings and the replies' sampling."""
    enabled = msg.get("enabled", True)
    speak, barge_in, speaker = msg.get("speak", False), msg.get("barge_in", True), msg.get("speaker")
    echo = msg.get("echo_reference", True)
    for name, v in (("enabled", enabled), ("speak", speak), ("barge_in", barge_in), ("echo_reference", echo)):
        if not isinstance(v, bool):
            raise ClientError("bad_request", f"{name} must be true or false")
    if speaker is not None and not isinstance(speaker, str):
        raise ClientError("bad_request", "speaker must be a voice name")
    from dataclasses import replace

    from ..vad import VADConfig

    kw = {}
    for name, field_, lo, hi in (("hangover", "hangover_s", 0.05, 10.0), ("vad_threshold", "threshold", 0.01, 0.99),
                                 ("max_utterance", "max_utterance_s", 1.0, 600.0)):
        v = msg.get(name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
            raise ClientError("bad_request", f"{name} must be a number in [{lo}, {hi}]")
        kw[field_] = float(v)
    try:
        vad = replace(VADConfig(), **kw)
    except ValueError as e:
        raise ClientError("bad_request", str(e)) from None
    sampling = sampling_from(msg, manager.config.default_max_tokens, manager.config.limits.max_tokens)
    return {"enabled": enabled, "speak": speak, "speaker": speaker, "barge_in": barge_in, "echo_reference": echo,
            "vad": vad,
            "sampling": sampling}


def record_json(rec) -> dict:
    d = asdict(rec)
    for k in ("prefill_ms", "maintenance_ms", "update_ms"):
        d[k] = round(d[k], 3)
    return d


class ManagedSession:
    """One OmniSession with its job queue, its worker task and the WebSocket (if any) it reports to."""

    def __init__(self, sid: str, manager: "SessionManager", ephemeral: bool):
        self.id = sid
        self.manager = manager
        self.ephemeral = ephemeral
        self.session = None  # set by the manager once built
        self.created = time.time()
        self.detached_since: float | None = time.monotonic()
        self.closed = False
        self.queued = 0
        self.answering = False
        self.counts = {"units_received": 0, "units_pushed": 0, "rejected": 0, "answers": 0, "cancelled_answers": 0,
                       "pieces": 0, "audio_chunks": 0}
        self.last_stats: dict = {}
        self.conversation = None  # a Conversation while the client talks to it ({"type": "voice"})
        self._sink: Callable[[dict], None] | None = None
        self._jobs: asyncio.Queue[Job | None] = asyncio.Queue()
        self._current: Job | None = None
        self._loop = asyncio.get_running_loop()
        self._worker: asyncio.Task | None = None

    # --- wiring -----------------------------------------------------------------------------------------------
    def start(self, session) -> None:
        self.session = session
        self.last_stats = session.stats()
        self._worker = asyncio.create_task(self._work(), name=f"omnitide-session-{self.id}")

    def on_update(self, rec) -> None:
        """OmniSession's callback (worker thread): every update goes to the attached client."""
        job = self._current
        self.emit({"type": "update", "seq": job.args.get("seq") if job else None, "record": record_json(rec)})

    def emit(self, msg: dict) -> None:
        """Thread-safe: queue ``msg`` for the attached WebSocket (dropped when none is attached)."""
        self._loop.call_soon_threadsafe(self._deliver, msg)

    def _deliver(self, msg: dict) -> None:
        if self._sink is not None:
            self._sink(msg)

    def attach(self, sink: Callable[[dict], None]) -> None:
        if self._sink is not None:
            raise ClientError("session_busy", f"session {self.id} already has a WebSocket; one client drives a "
                                              "session", 409)
        self._sink = sink
        self.detached_since = None

    def detach(self) -> None:
        """The client went away: stop its answer, drop what it queued."""
        self._sink = None
        self.detached_since = time.monotonic()
        self.cancel_all()
        if self.conversation is not None:  # its reply stops at the next step; the conversation ends with the client
            conv, self.conversation = self.conversation, None
            conv.interrupt()
            self._loop.run_in_executor(self.manager.executor, conv.close)

    def cancel_all(self) -> None:
        if self._current is not None:
            self._current.cancel.set()
        for job in list(self._jobs._queue):  # noqa: SLF001  (asyncio.Queue has no public iteration)
            if job is not None:
                job.cancel.set()

    def cancel_answer(self, qid=None) -> bool:
        """Stop the running answer (``qid`` None: whichever runs); its partial reply stays in the history."""
        job = self._current
        if job is not None and job.kind == "ask" and (qid is None or job.args.get("id") == qid):
            job.cancel.set()
            return True
        return False

    def info(self) -> dict:
        return {"id": self.id, "created": self.created, "ephemeral": self.ephemeral,
                "connected": self._sink is not None, "answering": self.answering, "queued": self.queued,
                "counts": dict(self.counts), "stats": self.last_stats}

    # --- jobs -------------------------------------------------------------------------------------------------
    def check_room(self) -> None:
        """Refuse a job the queue has no room for (called before a unit's media are decoded, and by ``submit``)."""
        if self.closed:
            raise ClientError("no_session", f"session {self.id} was deleted", 404)
        limit = self.manager.config.limits.max_queued
        if self.queued >= limit:
            raise ClientError("queue_full", f"{self.queued} units / questions already wait for session {self.id} "
                                            f"(limit {limit}, --max-queued); wait for their replies before sending more",
                              429)

    def submit(self, job: Job) -> asyncio.Future:
        self.check_room()
        job.future = self._loop.create_future()
        self.queued += 1
        self._jobs.put_nowait(job)
        return job.future

    async def _work(self) -> None:
        while True:
            job = await self._jobs.get()
            if job is None:
                return
            self.queued -= 1
            if job.cancel.is_set():
                if not job.future.done():
                    job.future.set_exception(ClientError("cancelled", f"{job.kind} cancelled"))
                continue
            self._current = job
            try:
                result = await self._loop.run_in_executor(self.manager.executor, self._run, job)
            except ClientError as e:
                result = e
            except Exception as e:  # a bug must not kill the worker: report it to the client
                result = ClientError("internal_error", f"{type(e).__name__}: {e}", 500)
            finally:
                self._current = None
            if not job.future.done():
                if isinstance(result, Exception):
                    job.future.set_exception(result)
                else:
                    job.future.set_result(result)

    def _run(self, job: Job) -> Any:
        """Worker thread: one job against the session, model steps through the gate."""
        gate = self.manager.gate
        s = self.session
        try:
            if job.kind == "push":
                item: PushItem = job.args["item"]
                if item.text:
                    self.manager.check_prompt(self.manager.prompt_tokens([item.text]))
                try:
                    if self.conversation is not None:  # the conversation takes the gate for each model step
                        self.conversation.push(frame=item.frame, audio=item.audio, text=item.text, t=item.t,
                                               sample_rate=item.sample_rate or 16000)
                        recs = ()
                    else:
                        with gate.step():
                            recs = s.push(frame=item.frame, audio=item.audio, text=item.text, t=item.t,
                                          sample_rate=item.sample_rate or 16000)
                except MediaError as e:
                    self.counts["rejected"] += 1
                    raise ClientError("bad_media", str(e)) from None
                self.counts["units_pushed"] += 1
                return {"type": "pushed", "seq": item.seq, "updates": len(recs)}
            if job.kind == "flush":
                with gate.step():
                    recs = s.flush()
                return {"type": "flushed", "updates": len(recs)}
            if job.kind == "ask":
                if self.conversation is not None:  # a typed question in a conversation is one of its turns
                    self.conversation.ask(job.args["question"])
                    return {"type": "asked", "id": job.args.get("id")}
                return self._ask(job)
            if job.kind == "voice":
                return self._voice(job.args)
            if job.kind == "save":
                with gate.step():
                    s.save(job.args["path"])
                return {"type": "saved", "name": job.args["name"]}
            raise ClientError("bad_request", f"unknown job {job.kind}")
        finally:
            self.last_stats = s.stats()

    def _ask(self, job: Job) -> dict:
        gate, s, qid = self.manager.gate, self.session, job.args.get("id")
        self.manager.check_prompt(self.manager.prompt_tokens([job.args["question"]]))
        before = s.counters.decoded_tokens
        speak = job.args.get("speak", False)
        from ..speech import SpeechUnavailable, speech_for

        try:
            if speak:  # loads the talker and token2wav on first use: a model step's worth of work
                from ..speech import SpeechOptions

                options = SpeechOptions().with_sampling(**job.args.get("speech_sampling", {}))
                try:
                    with gate.step():
                        it = s.ask(job.args["question"], speak=True, speaker=job.args.get("speaker"), speech=options,
                                   **job.args["sampling"])
                except SpeechUnavailable as e:
                    raise ClientError("speech_unavailable", f"this model cannot speak: {e}") from None
                except ValueError:  # the model's own message names its folders: say which voices there are
                    name = job.args.get("speaker")
                    speakers = [str(v) for v in speech_for(s).speakers]
                    if name is None or name in speakers or name in self.manager.config.voices.values():
                        raise
                    raise ClientError("bad_request", f"unknown speaker {name!r} (voices: "
                                                     f"{', '.join(speakers + list(self.manager.config.voices))})"
                                      ) from None
            else:
                it = s.ask(job.args["question"], **job.args["sampling"])
        except (MediaError, ValueError) as e:
            raise ClientError("bad_request", str(e)) from None
        pieces: list[str] = []
        audio = {"next": 0, "final": False}
        self.answering = True
        self.emit({"type": "answer_start", "id": qid})
        try:
            while not job.cancel.is_set():
                with gate.step():
                    piece = next(it, None)
                if piece is None:
                    break
                if not isinstance(piece, str):  # an AudioChunk of the spoken reply
                    self.counts["audio_chunks"] += 1
                    audio.update(next=piece.index + 1, final=piece.final)
                    self.emit({"type": "audio", "id": qid, "index": piece.index, "format": "pcm_s16le",
                               "sample_rate": piece.sample_rate, "final": piece.final, "note": piece.note,
                               "data": base64.b64encode(piece.int16().astype("<i2").tobytes()).decode()})
                    continue
                pieces.append(piece)
                self.counts["pieces"] += 1
                self.emit({"type": "piece", "id": qid, "text": piece})
        finally:
            with gate.step():
                it.close()  # a cancelled answer ends here: the engine records the partial reply and frees nothing else
            self.answering = False
        tokens = s.counters.decoded_tokens - before
        cancelled = job.cancel.is_set()
        if speak and not audio["final"]:  # cancelled (or no speech at all): the audio still ends with a final message
            self.emit({"type": "audio", "id": qid, "index": audio["next"], "format": "pcm_s16le",
                       "sample_rate": speech_for(s).sample_rate, "final": True,
                       "note": "cancelled" if cancelled else "no speech", "data": ""})
        self.counts["cancelled_answers" if cancelled else "answers"] += 1
        finish = "cancelled" if cancelled else ("length" if tokens >= job.args["sampling"]["max_tokens"] else "stop")
        return {"type": "answer_end", "id": qid, "text": "".join(pieces), "tokens": tokens, "finish_reason": finish}

    # --- spoken turns -----------------------------------------------------------------------------------------
    def _voice(self, args: dict) -> dict:
        """Turn the conversation on (voice-activity detection on the pushed audio, a reply per utterance, barge-in)
        or off. Worker thread."""
        if self.conversation is not None:
            self.conversation.close()
            self.conversation = None
        if not args["enabled"]:
            return {"type": "voice", "enabled": False}
        from ..conversation import Conversation
        from ..vad import UtteranceDetector

        speech = None
        if args["speak"]:
            from ..speech import SpeechOptions, SpeechUnavailable, speech_for

            try:
                with self.manager.gate.step():
                    speech_for(self.session).voice(args.get("speaker"))
            except SpeechUnavailable as e:
                raise ClientError("speech_unavailable", f"this model cannot speak: {e}") from None
            except ValueError as e:
                raise ClientError("bad_request", str(e)) from None
            speech = SpeechOptions(speaker=args.get("speaker"))
        try:
            with self.manager.gate.step():  # the conversation warms the session up (imports, speech models)
                self.conversation = Conversation(
                    self.session, detector=UtteranceDetector(args["vad"], candidates=True), speak=args["speak"], speech=speech,
                    barge_in=args["barge_in"], threaded=True, on_event=self._turn_event, step=self.manager.gate.step,
                    echo_reference=args["echo_reference"],
                    **args["sampling"])
        except ValueError as e:
            raise ClientError("bad_request", str(e)) from None
        return {"type": "voice", "enabled": True, "speak": args["speak"], "barge_in": args["barge_in"]}

    def _turn_event(self, ev) -> None:
        """A conversation event (any thread) as WebSocket messages: ``turn`` for the turn's life, ``piece`` and
        ``audio`` for the reply (id ``turn-N``), like an asked answer's."""
        rid = f"turn-{ev.turn}"
        if ev.kind == "reply_text":
            self.counts["pieces"] += 1
            self.emit({"type": "piece", "id": rid, "text": ev.text})
            return
        if ev.kind == "reply_audio":
            a = ev.audio
            self.counts["audio_chunks"] += 1
            self.emit({"type": "audio", "id": rid, "index": a.index, "format": "pcm_s16le",
                       "sample_rate": a.sample_rate, "final": a.final, "note": a.note,
                       "data": base64.b64encode(a.int16().astype("<i2").tobytes()).decode()})
            return
        if ev.kind == "reply_started":
            self.answering = True
        elif ev.kind in ("reply_done", "reply_interrupted", "turn_error"):
            self.answering = False
            self.counts["cancelled_answers" if ev.kind == "reply_interrupted" else "answers"] += 1
            if ev.kind == "reply_interrupted" and self.conversation is not None and self.conversation.speak:
                # the docs promise a final audio message last, also for a reply that was cut short
                self.emit({"type": "audio", "id": rid, "index": -1, "format": "pcm_s16le", "sample_rate": 0,
                           "final": True, "note": "interrupted", "data": ""})
        self.emit({"type": "turn", "event": ev.kind, "turn": ev.turn, "id": rid, "t": round(ev.t, 3), **ev.data})

    async def close(self) -> None:
        self.closed = True
        if self.conversation is not None:
            conv, self.conversation = self.conversation, None
            await self._loop.run_in_executor(self.manager.executor, conv.close)
        self.cancel_all()
        self._deliver({"type": "session_deleted", "session": self.id})
        self._jobs.put_nowait(None)
        if self._worker is not None:
            await self._worker
        while not self._jobs.empty():
            job = self._jobs.get_nowait()
            if job is not None and not job.future.done():
                job.future.set_exception(ClientError("no_session", f"session {self.id} was deleted", 404))
        self.session = None  # the KV cache goes with the last reference


def _malloc_trim() -> None:
    """glibc keeps freed heap pages (decoded frames, the processor's arrays) unless asked; other C libraries
    (macOS's) return large blocks themselves and lack the call."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


class SessionManager:
    """The sessions of one server: creation within the limit, lookup, deletion, idle expiry, one-shot slots."""

    def __init__(self, model, processor, config: ServeConfig):
        self.model, self.processor, self.config = model, processor, config
        self.gate = ComputeGate()
        self.sessions: dict[str, ManagedSession] = {}
        self.oneshots = 0
        self._creating = 0
        self._counter = None  # a stream adapter that only counts prompt tokens (prompt_tokens)
        lim = config.limits
        self.executor = ThreadPoolExecutor(max_workers=lim.max_sessions + 2, thread_name_prefix="omnitide-serve")

    def in_use(self) -> int:
        return len(self.sessions) + self.oneshots + self._creating

    def _claim(self) -> None:
        limit = self.config.limits.max_sessions
        if self.in_use() >= limit:
            raise ClientError("session_limit", f"the server already runs {self.in_use()} sessions and requests (limit "
                                               f"{limit}, --max-sessions); delete one or try again later", 429)

    def session_kwargs(self, req: dict) -> dict:
        cfg = self.config
        policy = req.get("policy", cfg.policy)
        if policy not in POLICIES:
            raise ClientError("bad_request", f"policy {policy!r} is not one of {', '.join(POLICIES)}")
        kw: dict = {"policy": policy, "system_prompt": req.get("system_prompt", cfg.system_prompt)}
        if kw["system_prompt"] is not None and not isinstance(kw["system_prompt"], str):
            raise ClientError("bad_request", "system_prompt must be a string")
        given = {k: req[k] for k in ("high", "low", "kv_budget") if req.get(k) is not None}
        if given:
            if "kv_budget" in given and ("high" in given or "low" in given):
                raise ClientError("bad_request", "give kv_budget or high / low, not both")
            for k in ("high", "low"):
                if k in given and (not isinstance(given[k], int) or isinstance(given[k], bool) or given[k] < 1):
                    raise ClientError("bad_request", f"{k} must be a positive integer (tokens)")
            if "kv_budget" in given and not isinstance(given["kv_budget"], (str, int)):
                raise ClientError("bad_request", "kv_budget must be bytes or a size such as '512MiB'")
            kw.update(high=given.get("high"), low=given.get("low"), kv_budget=given.get("kv_budget"))
        else:
            kw.update(high=cfg.high, low=cfg.low, kv_budget=cfg.kv_budget)
        return kw

    def save_path(self, name) -> Path:
        if not self.config.session_dir:
            raise ClientError("saving_disabled", "this server keeps no sessions: start it with --session-dir DIR", 403)
        if not isinstance(name, str) or not SAVE_NAME.match(name) or ".." in name:
            raise ClientError("bad_request", "a session name is 1-64 letters, digits, '_', '-' or '.', starting with "
                                             "a letter or digit")
        return Path(self.config.session_dir) / name

    async def create(self, req: dict) -> ManagedSession:
        from ..session import OmniSession

        restore = req.get("restore")
        ephemeral = req.get("ephemeral", False)
        if ephemeral is None:
            ephemeral = False
        if not isinstance(ephemeral, bool):
            raise ClientError("bad_request", f"ephemeral must be true or false, not {json.dumps(ephemeral)[:40]}")
        kw = None if restore is not None else self.session_kwargs(req)
        path = self.save_path(restore) if restore is not None else None
        if path is not None and not (path / "session.json").is_file():
            raise ClientError("no_saved_session", f"no saved session named {restore!r}", 404)
        self._claim()
        self._creating += 1
        try:
            sid = secrets.token_urlsafe(12)
            ms = ManagedSession(sid, self, ephemeral=ephemeral)

            def build():
                with self.gate.step():
                    if path is not None:
                        s = OmniSession.restore(path, model=(self.model, self.processor), on_update=ms.on_update)
                        saved = s.model_path
                        if saved and self.config.model and model_ref(saved) != self.config.model_ref:
                            raise ClientError("model_mismatch", f"session {restore!r} was saved with "
                                                                f"{Path(saved).name}; this server runs "
                                                                f"{self.config.model_id}", 409)
                    else:
                        s = OmniSession((self.model, self.processor), on_update=ms.on_update, **kw)
                    s.model_path = self.config.model_ref or None
                    return s

            try:
                session = await asyncio.get_running_loop().run_in_executor(self.executor, build)
            except ValueError as e:  # watermarks / budget the engine refuses
                raise ClientError("bad_request", str(e)) from None
            ms.start(session)
            self.sessions[sid] = ms
            return ms
        finally:
            self._creating -= 1

    def get(self, sid: str) -> ManagedSession:
        ms = self.sessions.get(sid)
        if ms is None:
            raise ClientError("no_session", f"no session {sid!r} (deleted, expired or never created)", 404)
        return ms

    async def delete(self, sid: str) -> None:
        ms = self.get(sid)
        del self.sessions[sid]
        await ms.close()

    def prompt_tokens(self, texts: list[str], system: str | None = None) -> int:
        """Tokens these texts take as prompt units (``system``: plus the system unit), counted by a scratch stream
        adapter of the model (its own protocol and tokenizer; nothing is computed, the embeddings stay lazy)."""
        texts = [t for t in texts if isinstance(t, str) and t]
        if not texts and system is None:
            return 0
        with self.gate.step():  # MLX graphs are built one thread at a time
            if self._counter is None:
                self._counter = self.model.stream_adapter(self.processor)
            n = sum(self._counter.context_unit(t, 0).length for t in texts)
            if system is not None:
                n += self._counter.system_unit(system, 0).length
        return n

    def speaker(self, name):
        """A client's ``speaker`` -> what ``OmniSession.ask`` gets: an operator's ``--voice`` file, or a voice
        name of the checkpoint. Never a path from the client (MiniCPM-o would open it)."""
        if name is None:
            return None
        if isinstance(name, str) and name in self.config.voices:
            return self.config.voices[name]
        if not isinstance(name, str) or not VOICE_NAME.match(name):
            raise ClientError("bad_request", "speaker must be a voice name (letters, digits, '_', '-'): one of the "
                                             "model's voices or one the server allows (--voice), not a path")
        return name

    def check_prompt(self, tokens: int, counted: str = "") -> None:
        limit = self.config.limits.max_prompt_tokens
        if tokens > limit:
            raise ClientError("prompt_too_long", f"the prompt is {tokens} tokens{' ' + counted if counted else ''}; "
                                                 f"the limit is {limit} (--max-prompt-tokens)", 413)

    def claim_oneshot(self) -> None:
        """A slot for one chat completion (it builds its own short-lived session); give it back with
        ``release_oneshot``."""
        self._claim()
        self.oneshots += 1

    def release_oneshot(self) -> None:
        """Give the slot back and MLX's freed buffers to the system: a one-shot request's session is gone, and
        without this its KV and activations stayed resident as MLX's buffer cache (2 GiB on the CPU backend, the
        memory limit on Metal): 100 1080p frames left the tiny model's server 2.1 GB larger."""
        self.oneshots -= 1
        self.executor.submit(self._trim)

    def _trim(self) -> None:
        import mlx.core as mx

        with self.gate.step():
            mx.clear_cache()
        _malloc_trim()

    async def expire_idle(self) -> list[str]:
        timeout = self.config.limits.idle_timeout_s
        now = time.monotonic()
        gone = [sid for sid, ms in self.sessions.items()
                if ms.detached_since is not None and now - ms.detached_since > timeout]
        for sid in gone:
            if sid in self.sessions:
                await self.delete(sid)
        return gone

    async def close(self) -> None:
        for sid in list(self.sessions):
            await self.delete(sid)
        self.executor.shutdown(wait=False, cancel_futures=True)
