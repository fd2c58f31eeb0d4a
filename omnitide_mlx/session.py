"""OmniSession: the engine an app embeds. Media in, streamed answers out, KV memory bounded.

    session = OmniSession("Qwen/Qwen2.5-Omni-3B", policy=OmniTide(high=2500, low=1800))
    session.push(frame=rgb, audio=samples, sample_rate=48000)    # from the capture loop, about once a second
    for piece in session.ask("What colour is the square?"):      # from the UI thread, whenever the user asks
        print(piece, end="")

Every push assembles one unit per second of input, prefills it through the model into the OmniCache, and then
runs retention: above the policy's high watermark OmniPick plans which tokens stay, the cache frees the others
and re-rotates the kept keys, and (for the OmniTide policy) OmniPage migrates entries when that frees tiles.
A reply becomes a unit of the history too.

Threads: one producer (push) and one consumer (ask) may run at once. Pushes are validated in the caller's thread
(bad media raise MediaError there and never reach the cache) and queued; whoever holds the engine lock processes
the queue, so a capture loop never waits for a reply to finish.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import mlx.core as mx
import numpy as np

from .cache import OmniCache
from .core.page import AllocClass
from .core.pick import RetentionPolicy, apply_plan, make_policy
from .core.sim import make_layout
from .core.units import History, SpanKind, Unit, UnitKind
from .errors import MediaError
from .media import SAMPLE_RATE, as_mono_audio, as_rgb_frame
from .models.base import PreparedUnit, StreamAdapter, spans_from_runs, text_positions

SESSION_FORMAT = 1


@dataclass
class UpdateRecord:
    """What one streaming update did: the numbers `omnitide stream --stats / --json` report."""

    t: float | None
    uid: int
    kind: str
    tokens: int
    retained_cells: int
    physical_span: int
    active_pages: int
    active_subblocks: int
    kv_bytes: int
    prefill_ms: float
    maintenance_ms: float
    update_ms: float
    evicted_tokens: int = 0
    migrated_cells: int = 0


@dataclass
class _Pending:
    frame: np.ndarray | None
    audio: np.ndarray | None
    text: str | None
    t: float | None


@dataclass
class SessionCounters:
    units: int = 0
    evictions: int = 0
    evicted_tokens: int = 0
    migrations: int = 0
    migrated_cells: int = 0
    rejected_chunks: int = 0
    prefill_ms: float = 0.0
    maintenance_ms: float = 0.0
    decode_ms: float = 0.0
    decoded_tokens: int = 0
    peak_physical_span: int = 0


def policy_from(policy: RetentionPolicy | str | None, high: int | None = None, low: int | None = None) -> RetentionPolicy:
    """A policy object from a name (``omnitide``, ``omnipick``, ``full``, ``fifo``, ``token``, ``streamingllm``,
    ``h2o``, ``eager``) or an instance."""
    if policy is None:
        policy = "omnitide"
    if isinstance(policy, str):
        kw = {}
        if high is not None:
            kw["high"] = int(high)
        if low is not None:
            kw["low"] = int(low)
        return make_policy(policy, **kw)
    return policy


def watermarks_for_budget(budget_bytes: int, bytes_per_token: int, low_ratio: float = 0.72) -> tuple[int, int]:
    """High / low watermarks (tokens) that keep the KV under ``budget_bytes``: users think in memory.

    The low watermark keeps the paper's default 1800 / 2500 ratio, so trims leave room for the next units.
    """
    if budget_bytes <= 0:
        raise ValueError(f"KV budget must be positive (got {budget_bytes} bytes)")
    high = budget_bytes // bytes_per_token
    if high < 64:
        raise ValueError(f"a KV budget of {budget_bytes} bytes holds only {high} tokens "
                         f"({bytes_per_token} bytes per token); raise it")
    return int(high), max(1, int(high * low_ratio))


def parse_bytes(text: str) -> int:
    """``512MiB``, ``2GB``, ``1.5GiB``, ``100000`` -> bytes."""
    units = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
             "g": 1000**3, "gb": 1000**3, "gib": 1024**3}
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    if not num or unit not in units:
        raise ValueError(f"cannot read {text!r} as a size (examples: 512MiB, 2GB)")
    return int(float(num) * units[unit])


class OmniSession:
    """A streaming session over one model: push media, ask questions, bounded KV.

    ``model`` is a loaded model, a ``(model, processor)`` pair, or a local path / Hugging Face id.
    """

    def __init__(self, model, processor=None, *, system_prompt: str | None = None,
                 policy: RetentionPolicy | str | None = "omnitide", high: int | None = None, low: int | None = None,
                 kv_budget: int | str | None = None, kv_dtype: mx.Dtype | None = None, page_size: int = 64,
                 subblock_size: int = 32, on_update: Callable[[UpdateRecord], None] | None = None):
        self.model_path = None
        if isinstance(model, (str, os.PathLike)):
            from .models import load

            self.model_path = str(model)
            model, processor = load(model)
        elif isinstance(model, tuple):
            model, processor = model
        self.model, self.processor = model, processor
        self.adapter: StreamAdapter = model.stream_adapter(processor)
        spec = self.adapter.kv_spec
        self.kv_dtype = kv_dtype or _model_dtype(model)
        if kv_budget is not None:
            budget = parse_bytes(kv_budget) if isinstance(kv_budget, str) else int(kv_budget)
            high, low = watermarks_for_budget(budget, spec.bytes_per_token(self.kv_dtype))
        self.policy = policy_from(policy, high, low)
        self.system_prompt = system_prompt
        self.on_update = on_update
        table, self.planner = make_layout(self.policy.layout, page_size, subblock_size)
        self.cache = OmniCache.for_spec(spec, dtype=self.kv_dtype, page_size=page_size, subblock_size=subblock_size,
                                        placement=table.placement, collect_scores=self.policy.needs_scores)
        self.history = History()
        self.counters = SessionCounters()
        self.records: list[UpdateRecord] = []
        self._lock = threading.RLock()
        self._inbox_lock = threading.Lock()
        self._inbox: deque[_Pending] = deque()
        self._audio_buf = np.zeros(0, dtype=np.float32)
        self._pending_frame: np.ndarray | None = None
        self._pending_t: float | None = None
        self._audio_driven = False
        self._seconds = 0.0  # stream time assigned to units pushed without t
        self._last_logits: mx.array | None = None
        with self._lock:
            self._prefill(self.adapter.system_unit(system_prompt, 0), AllocClass.MUST_KEEP)

    # --- producer side --------------------------------------------------------------------------------------
    def push(self, frame=None, audio=None, text: str | None = None, t: float | None = None,
             sample_rate: int | None = SAMPLE_RATE) -> list[UpdateRecord]:
        """Queue a camera frame, a piece of audio (any rate, any length) and/or user text (context, no reply).

        Units are assembled at one per second of audio (each with the newest frame); without audio every frame
        is a unit. Input is validated here: a bad chunk raises MediaError and the session goes on unchanged.
        Returns the updates this call processed (empty when another thread holds the engine: it processes the
        queued chunk when it finishes).
        """
        if frame is None and audio is None and not text:
            raise MediaError("push() needs a frame, audio or text")
        pending = _Pending(
            frame=as_rgb_frame(frame) if frame is not None else None,
            audio=as_mono_audio(audio, sample_rate) if audio is not None else None,
            text=_check_text(text) if text else None,
            t=float(t) if t is not None else None,
        )
        with self._inbox_lock:
            self._inbox.append(pending)
        return self._drain(blocking=False)

    def flush(self) -> list[UpdateRecord]:
        """Turn buffered input (less than a second of audio, a frame waiting for its audio) into a unit."""
        records = self._drain(blocking=True)
        with self._lock:
            if self._audio_buf.size or self._pending_frame is not None:
                audio = self._audio_buf if self._audio_buf.size else None
                self._audio_buf = np.zeros(0, dtype=np.float32)
                records += self._media(self._take_frame(), audio)
        return records

    # --- consumer side --------------------------------------------------------------------------------------
    def ask(self, question: str, *, max_tokens: int = 256, temp: float = 0.0, top_p: float = 0.0, min_p: float = 0.0,
            top_k: int = 0, repetition_penalty: float | None = None, seed: int | None = None,
            stop: list[str] | None = None) -> Iterator[str]:
        """Ask a question about everything streamed so far; returns the reply as an iterator of text pieces.

        Sampling options follow mlx-lm (``temp`` 0 is greedy). The question and the reply become units of the
        history. Queued pushes are processed first, so the answer sees them.
        """
        question = _check_text(question)
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")

        def reply() -> Iterator[str]:
            self._lock.acquire()
            try:
                self._drain_locked()
                yield from self._reply(question, max_tokens=max_tokens, temp=temp, top_p=top_p, min_p=min_p,
                                       top_k=top_k, repetition_penalty=repetition_penalty, seed=seed,
                                       stop=stop or [])
            finally:
                self._lock.release()
                self._drain(blocking=False)

        return reply()

    def answer(self, question: str, **kwargs) -> str:
        """``ask`` collected into one string."""
        return "".join(self.ask(question, **kwargs))

    # --- introspection ----------------------------------------------------------------------------------------
    def stats(self) -> dict:
        with self._lock:
            layout = self.cache.layout_stats()
            c = self.counters
            return {
                "policy": self.policy.name,
                "layout": self.policy.layout,
                "high": self.policy.high,
                "low": self.policy.low,
                "units": len(self.history),
                "retained_cells": layout.retained_cells,
                "logical_tokens": self.history.total_tokens,
                "physical_span": layout.physical_span,
                "peak_physical_span": c.peak_physical_span,
                "active_pages": layout.active_pages,
                "active_subblocks": layout.active_subblocks,
                "capacity": layout.capacity,
                "kv_bytes": self.cache.nbytes,
                "kv_bytes_per_token": self.adapter.kv_spec.bytes_per_token(self.kv_dtype),
                "next_position": self.history.next_position(),
                "evictions": c.evictions,
                "evicted_tokens": c.evicted_tokens,
                "migrations": c.migrations,
                "migrated_cells": c.migrated_cells,
                "rejected_chunks": c.rejected_chunks,
                "timings": {
                    "prefill_ms": c.prefill_ms,
                    "maintenance_ms": c.maintenance_ms,
                    "decode_ms": c.decode_ms,
                    "decode_tokens_per_s": (c.decoded_tokens / (c.decode_ms / 1000)) if c.decode_ms else 0.0,
                },
            }

    # --- persistence --------------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """Write the whole state (KV, page table, units, positions, adapter protocol state) to a folder:
        safetensors for arrays, JSON for the rest."""
        path = Path(path)
        with self._lock:
            self._drain_locked()
            path.mkdir(parents=True, exist_ok=True)
            self.cache.save(path / "kv.safetensors")
            meta_adapter, arrays = self.adapter.state()
            arrays = dict(arrays)
            if self._audio_buf.size:
                arrays["session.audio_buf"] = mx.array(self._audio_buf)
            if self._pending_frame is not None:
                arrays["session.pending_frame"] = mx.array(self._pending_frame)
            if self._last_logits is not None:
                arrays["session.last_logits"] = self._last_logits
            if arrays:
                mx.save_safetensors(str(path / "session.safetensors"), arrays)
            meta = {
                "format": SESSION_FORMAT,
                "model_path": self.model_path,
                "system_prompt": self.system_prompt,
                "policy": self.policy.config(),
                "kv_dtype": str(self.kv_dtype).split(".")[-1],
                "history": self.history.to_json(),
                "adapter": meta_adapter,
                "counters": asdict(self.counters),
                "records": [asdict(r) for r in self.records],
                "stream": {"seconds": self._seconds, "audio_driven": self._audio_driven,
                           "pending_t": self._pending_t},
            }
            with open(path / "session.json", "w", encoding="utf-8") as f:
                json.dump(meta, f)
        return path

    @classmethod
    def restore(cls, path: str | os.PathLike, model=None, processor=None,
                on_update: Callable[[UpdateRecord], None] | None = None) -> "OmniSession":
        """Load a session written by ``save``. ``model`` defaults to the path the session was created from."""
        path = Path(path)
        try:
            with open(path / "session.json", encoding="utf-8") as f:
                meta = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"{path} holds no saved session (session.json missing)") from None
        if meta.get("format") != SESSION_FORMAT:
            raise ValueError(f"{path}: unsupported session format {meta.get('format')}")
        if model is None:
            if not meta.get("model_path"):
                raise ValueError("the saved session does not record its model; pass model=")
            model = meta["model_path"]
        self = cls.__new__(cls)
        self.model_path = meta.get("model_path") if isinstance(model, tuple) or not isinstance(model, (str, os.PathLike)) else str(model)
        if isinstance(model, (str, os.PathLike)):
            from .models import load

            model, processor = load(model)
        elif isinstance(model, tuple):
            model, processor = model
        self.model, self.processor = model, processor
        self.adapter = model.stream_adapter(processor)
        self.kv_dtype = getattr(mx, meta["kv_dtype"])
        cfg = dict(meta["policy"])
        self.policy = make_policy(cfg.pop("name"), **cfg)
        self.system_prompt = meta.get("system_prompt")
        self.on_update = on_update
        self.cache = OmniCache.load(path / "kv.safetensors")
        _, self.planner = make_layout(self.policy.layout, self.cache.page_table.page_size,
                                      self.cache.page_table.subblock_size)
        self.history = History.from_json(meta["history"])
        self.counters = SessionCounters(**meta["counters"])
        self.records = [UpdateRecord(**r) for r in meta.get("records", [])]
        self._lock = threading.RLock()
        self._inbox_lock = threading.Lock()
        self._inbox = deque()
        arrays = mx.load(str(path / "session.safetensors")) if (path / "session.safetensors").exists() else {}
        self._audio_buf = np.array(arrays.pop("session.audio_buf")) if "session.audio_buf" in arrays \
            else np.zeros(0, dtype=np.float32)
        self._pending_frame = np.array(arrays.pop("session.pending_frame")) if "session.pending_frame" in arrays \
            else None
        self._last_logits = arrays.pop("session.last_logits", None)
        stream = meta.get("stream", {})
        self._seconds = float(stream.get("seconds", 0.0))
        self._audio_driven = bool(stream.get("audio_driven", False))
        self._pending_t = stream.get("pending_t")
        self.adapter.load_state(meta.get("adapter", {}), {k: v for k, v in arrays.items()
                                                           if not k.startswith("session.")})
        return self

    # --- engine (lock held) -----------------------------------------------------------------------------------
    def _drain(self, blocking: bool) -> list[UpdateRecord]:
        records: list[UpdateRecord] = []
        while True:
            if not self._lock.acquire(blocking=blocking):
                return records
            try:
                records += self._drain_locked()
            finally:
                self._lock.release()
            with self._inbox_lock:
                if not self._inbox:
                    return records

    def _drain_locked(self) -> list[UpdateRecord]:
        records: list[UpdateRecord] = []
        while True:
            with self._inbox_lock:
                if not self._inbox:
                    return records
                item = self._inbox.popleft()
            try:
                records += self._process(item)
            except MediaError:
                self.counters.rejected_chunks += 1
                raise

    def _process(self, item: _Pending) -> list[UpdateRecord]:
        records: list[UpdateRecord] = []
        if item.t is not None:
            self._pending_t = item.t
        if item.frame is not None:
            if item.audio is None and not self._audio_driven:
                records += self._media(item.frame, None)
            else:
                self._pending_frame = item.frame
        if item.audio is not None:
            self._audio_driven = True
            self._audio_buf = np.concatenate([self._audio_buf, item.audio])
            while self._audio_buf.size >= SAMPLE_RATE:
                second, self._audio_buf = self._audio_buf[:SAMPLE_RATE], self._audio_buf[SAMPLE_RATE:]
                records += self._media(self._take_frame(), second)
        if item.text:
            records.append(self._unit(self.adapter.context_unit(item.text, self.history.next_position())))
        return records

    def _take_frame(self) -> np.ndarray | None:
        frame, self._pending_frame = self._pending_frame, None
        return frame

    def _media(self, frame: np.ndarray | None, audio: np.ndarray | None) -> list[UpdateRecord]:
        t = self._pending_t if self._pending_t is not None else self._seconds
        self._pending_t = None
        prepared = self.adapter.media_unit(frame, audio, t, self.history.next_position())
        self._seconds = t + 1.0
        return [self._unit(prepared)]

    def _unit(self, prepared: PreparedUnit, alloc_class: AllocClass = AllocClass.RECENT_CONTEXT) -> UpdateRecord:
        t0 = time.perf_counter()
        uid = self._prefill(prepared, alloc_class)
        t1 = time.perf_counter()
        evicted, migrated = self._maintain()
        t2 = time.perf_counter()
        layout = self.cache.layout_stats()
        rec = UpdateRecord(
            t=prepared.t, uid=uid, kind=prepared.kind.value, tokens=prepared.length,
            retained_cells=layout.retained_cells, physical_span=layout.physical_span,
            active_pages=layout.active_pages, active_subblocks=layout.active_subblocks, kv_bytes=self.cache.nbytes,
            prefill_ms=(t1 - t0) * 1000, maintenance_ms=(t2 - t1) * 1000, update_ms=(t2 - t0) * 1000,
            evicted_tokens=evicted, migrated_cells=migrated)
        self.records.append(rec)
        if self.on_update is not None:
            self.on_update(rec)
        return rec

    def _forward(self, embeds: mx.array, positions: np.ndarray) -> mx.array:
        pos = mx.array(positions if positions.shape[0] > 1 else positions[0])
        logits = self.model.language_model(embeds[None], self.cache, pos)
        return logits[0, -1]

    def _prefill(self, prepared: PreparedUnit, alloc_class: AllocClass = AllocClass.RECENT_CONTEXT) -> int:
        uid = self.history.next_uid()
        unit = prepared.to_unit(uid)  # validates spans / positions before the cache is touched
        t0 = time.perf_counter()
        self.cache.set_owner(uid, alloc_class)
        logits = self._forward(prepared.inputs_embeds, prepared.positions)
        mx.eval(logits)
        self.counters.prefill_ms += (time.perf_counter() - t0) * 1000
        self.history.append(unit)
        self.counters.units += 1
        self._last_logits = logits
        return uid

    def _maintain(self) -> tuple[int, int]:
        """Retention after a prefill: OmniPick (or the chosen policy) and, for OmniTide, OmniPage migration."""
        t0 = time.perf_counter()
        evicted = migrated = 0
        scores = self.cache.token_scores(self.history) if self.policy.needs_scores else None
        plan = self.policy.plan(self.history, scores=scores)
        if plan is not None and plan.tokens_after < plan.tokens_before:
            self.cache.evict(plan, self.history)
            self.history = apply_plan(self.history, plan)
            evicted = plan.tokens_before - plan.tokens_after
            self.counters.evictions += 1
            self.counters.evicted_tokens += evicted
            mplan = self.planner.plan(self.cache.page_table)
            if mplan.accepted:
                migrated = self.cache.migrate(mplan)
                self.counters.migrations += 1
                self.counters.migrated_cells += migrated
        span = self.cache.layout_stats().physical_span
        self.counters.peak_physical_span = max(self.counters.peak_physical_span, span)
        self.counters.maintenance_ms += (time.perf_counter() - t0) * 1000
        return evicted, migrated

    def _reply(self, question: str, *, max_tokens, temp, top_p, min_p, top_k, repetition_penalty, seed,
               stop) -> Iterator[str]:
        from mlx_lm.sample_utils import make_logits_processors, make_sampler

        self._unit(self.adapter.user_unit(question, self.history.next_position()))
        logits = self._last_logits
        sampler = make_sampler(temp=temp, top_p=top_p, min_p=min_p, top_k=top_k)
        processors = make_logits_processors(repetition_penalty=repetition_penalty) if repetition_penalty else []
        if seed is not None:
            mx.random.seed(seed)
        uid = self.history.next_uid()
        start = self.history.next_position()
        self.cache.set_owner(uid, AllocClass.RECENT_CONTEXT)
        generated: list[int] = []
        fed = 0
        emitted = ""
        stopped = False
        t0 = time.perf_counter()
        try:
            while len(generated) < max_tokens:
                lg = logits[None]
                for p in processors:
                    lg = p(mx.array(generated, dtype=mx.int32), lg)
                logprobs = lg - mx.logsumexp(lg, axis=-1, keepdims=True)
                token = int(sampler(logprobs).item())
                if token in self.adapter.stop_token_ids:
                    stopped = True
                    break
                generated.append(token)
                logits = self._forward(self.adapter.embed_tokens([token]), text_positions(start + fed, 1,
                                                                                          self.adapter.kv_spec.position_axes))
                fed += 1
                mx.async_eval(logits)
                text = self.adapter.decode(generated)
                cut = _stop_index(text, stop)
                if cut is not None:
                    text, stopped = text[:cut], True
                if not text.endswith("\ufffd") and len(text) > len(emitted):
                    piece, emitted = text[len(emitted):], text
                    yield piece
                if cut is not None:
                    break
        finally:
            self.counters.decode_ms += (time.perf_counter() - t0) * 1000
            self.counters.decoded_tokens += fed
            closing = list(self.adapter.finish_reply(generated, stopped))
            if closing:
                logits = self._forward(self.adapter.embed_tokens(closing),
                                       text_positions(start + fed, len(closing), self.adapter.kv_spec.position_axes))
                mx.eval(logits)
                self._last_logits = logits
            if fed + len(closing):
                spans = spans_from_runs([(SpanKind.RESPONSE, fed), (SpanKind.BOUNDARY, len(closing))])
                unit = Unit(uid=uid, kind=UnitKind.REPLY, spans=tuple(spans),
                            positions=text_positions(start, fed + len(closing), self.adapter.kv_spec.position_axes),
                            label=question[:40])
                self.history.append(unit)
                self.counters.units += 1
                self._maintain()
        text = self.adapter.decode(generated)
        cut = _stop_index(text, stop)
        if cut is not None:
            text = text[:cut]
        if len(text) > len(emitted) and not text.endswith("\ufffd"):
            yield text[len(emitted):]


def _check_text(text) -> str:
    if not isinstance(text, str):
        raise MediaError(f"text must be a string (got {type(text).__name__})")
    if not text.strip():
        raise MediaError("text is empty")
    return text


def _stop_index(text: str, stop: list[str]) -> int | None:
    hits = [text.find(s) for s in stop if s and s in text]
    return min(hits) if hits else None


def _model_dtype(model) -> mx.Dtype:
    """The activation dtype: ``model.dtype`` when the port has it, else the first floating parameter's (never a
    quantised weight's uint32)."""
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, mx.Dtype):
        return dtype
    from mlx.utils import tree_flatten

    for _, p in tree_flatten(model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating):
            return p.dtype
    return mx.float32
