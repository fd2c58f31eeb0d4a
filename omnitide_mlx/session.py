"""OmniSession: the engine an app embeds, on MLX. Media in, streamed answers out, KV memory bounded.

    session = OmniSession("Qwen/Qwen2.5-Omni-3B", policy=OmniTide(high=2500, low=1800))
    session.push(frame=rgb, audio=samples, sample_rate=48000)    # from the capture loop, about once a second
    for piece in session.ask("What colour is the square?"):      # from the UI thread, whenever the user asks
        print(piece, end="")

The streaming logic (units, retention, replies, threads, persistence) is in engine.py; this module supplies the
MLX backend (backend.py's protocol): the OmniCache, the model call, mlx-lm's samplers and safetensors through MLX.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import mlx.core as mx
import numpy as np

from .cache import OmniCache
from .core.layout import layout_spec
from .engine import (  # noqa: F401  (re-exported for users of the session API)
    Sampling,
    SessionCounters,
    StreamingSession,
    UpdateRecord,
    kv_budget_bytes,
    parse_bytes,
    policy_from,
    watermarks_for_budget,
)


# MLX's CPU allocator keeps only 32 MiB of freed buffers for reuse (on Metal the cache defaults to the memory limit),
# so every update's large temporaries (MLP activations and attention blocks of a 2,333-token unit: about 1 GB for one
# layer of the 3B shape) go back to the OS and are page-faulted in again at the next update: 220,000 minor faults and
# 5 % of a 3B-shape update (6.92 s against 6.57 s with them kept; docs/benchmarks.md, "Stream loop").
CPU_BUFFER_CACHE_BYTES = 2 << 30


def keep_cpu_buffers(limit: int = CPU_BUFFER_CACHE_BYTES) -> None:
    """On the CPU backend, let MLX keep up to ``limit`` bytes of freed buffers for reuse; never lowers a larger
    limit, and leaves Metal (whose cache already defaults to the memory limit) alone."""
    if mx.default_device() != mx.cpu:
        return
    previous = mx.set_cache_limit(limit)
    if previous > limit:
        mx.set_cache_limit(previous)



def language_model_inputs(fn, extras: dict | None) -> dict:
    """The entries of a unit's ``extras`` that ``fn`` (a language model's forward) names as keyword arguments:
    model inputs an adapter prepares beside the embeddings (Qwen3-Omni's ``deepstack``), passed on without the
    engine asking which model it has; the rest (encoder timings, token counts) is bookkeeping."""
    if not extras:
        return {}
    names = inspect.signature(fn).parameters
    return {k: v for k, v in extras.items() if k in names and v is not None}

class MlxBackend:
    """The MLX backend (backend.py's protocol): the MLX ports, the OmniCache, mlx-lm's samplers, MLX safetensors."""

    name = "mlx"
    quantised_kv = True

    def load_model(self, path):
        from .models import load

        return load(path)

    def default_kv_dtype(self, model) -> mx.Dtype:
        """The activation dtype: ``model.dtype`` when the port has it, else the first floating parameter's (never
        a quantised weight's uint32)."""
        dtype = getattr(model, "dtype", None)
        if isinstance(dtype, mx.Dtype):
            return dtype
        from mlx.utils import tree_flatten

        for _, p in tree_flatten(model.parameters()):
            if mx.issubdtype(p.dtype, mx.floating):
                return p.dtype
        return mx.float32

    def dtype_from_name(self, name: str) -> mx.Dtype:
        return getattr(mx, name)

    def dtype_name(self, dtype) -> str:
        return str(dtype).split(".")[-1]

    def layout_spec(self, name: str):
        return layout_spec(name)

    def kv_bytes_per_token(self, spec, dtype, kv_quant: dict) -> int:
        return spec.bytes_per_token(dtype, kv_quant.get("kv_bits"), kv_quant.get("kv_group_size", 64))

    def make_cache(self, model, spec, *, dtype, placement, page_size, subblock_size, collect_scores,
                   kv_quant) -> OmniCache:
        keep_cpu_buffers()  # every session creates (or, in load_cache, loads) its cache once
        return OmniCache.for_spec(spec, dtype=dtype, page_size=page_size, subblock_size=subblock_size,
                                  placement=placement, collect_scores=collect_scores, **kv_quant)

    def load_cache(self, model, path: Path) -> OmniCache:
        keep_cpu_buffers()
        return OmniCache.load(path)

    def make_recall_store(self, cache: OmniCache, budget: int, bits: int | None):
        """The evicted-unit store of a session with recall (recall.py)."""
        from .recall import RecallStore

        return RecallStore(cache, budget, bits)

    def load_recall_store(self, cache: OmniCache, path: Path, meta: dict):
        from .recall import RecallStore

        return RecallStore.load(cache, path, meta)

    def forward(self, model, cache, embeds: mx.array, positions: np.ndarray, *, hidden: bool = False,
                extras: dict | None = None):
        pos = mx.array(positions if positions.shape[0] > 1 else positions[0])
        lm = model.language_model
        if hidden:  # a spoken reply: the talker reads these (same logits as the path below)
            states = lm.hidden_states(embeds[None], cache, pos, **language_model_inputs(lm.hidden_states, extras))
            out = lm.logits(states[:, -1:])[0, -1]
            mx.async_eval(out, states[0])
            return out, states[0]
        out = lm(embeds[None], cache, pos, last_only=True, **language_model_inputs(lm.__call__, extras))[0, -1]
        mx.async_eval(out)
        return out, None

    def eval(self, *arrays) -> None:
        mx.eval(*[a for a in arrays if a is not None])

    def sampler(self, sampling):
        from mlx_lm.sample_utils import make_logits_processors, make_sampler

        sampler = make_sampler(temp=sampling.temp, top_p=sampling.top_p, min_p=sampling.min_p, top_k=sampling.top_k)
        processors = (make_logits_processors(repetition_penalty=sampling.repetition_penalty)
                      if sampling.repetition_penalty else [])
        if sampling.seed is not None:
            mx.random.seed(sampling.seed)

        def sample(logits: mx.array, generated: list[int]) -> int:
            lg = logits[None]
            for p in processors:
                lg = p(mx.array(generated, dtype=mx.int32), lg)
            return int(sampler(lg - mx.logsumexp(lg, axis=-1, keepdims=True)).item())

        return sample

    def to_numpy(self, array) -> np.ndarray:
        return np.array(array.astype(mx.float32))

    def save_arrays(self, path: Path, arrays: dict) -> None:
        mx.save_safetensors(str(path), {k: v if isinstance(v, mx.array) else mx.array(v) for k, v in arrays.items()})

    def load_arrays(self, path: Path) -> dict:
        return dict(mx.load(str(path)))


class OmniSession(StreamingSession):
    """A streaming session over one MLX model: push media, ask questions, bounded KV.

    ``model`` is a loaded model, a ``(model, processor)`` pair, or a local path / Hugging Face id. ``policy`` is a
    policy object (``OmniTide(high=2500, low=1800)``) or its name; ``kv_budget`` (bytes or ``"512MiB"``) sets
    the watermarks from the model's KV bytes per token instead. The engine (engine.py) with the MLX backend.
    """

    def __init__(self, model, processor=None, **kwargs):
        kwargs.setdefault("backend", MlxBackend())
        super().__init__(model, processor, **kwargs)

    def warm_up(self, speak: bool = False) -> None:
        """Load what the first answer would otherwise load (mlx-lm's samplers: ~8 s of imports on a cold Linux CPU;
        with ``speak`` the speech models), so that a conversation's first turn is answered as fast as the rest.
        Raises SpeechUnavailable (with ``speak``) for a checkpoint that cannot speak."""
        import mlx_lm.sample_utils  # noqa: F401

        if speak:
            from .speech import speech_for

            speech_for(self)

    def ask(self, question: str, *, speak: bool = False, speaker: str | None = None, speech=None, **kwargs):
        """The engine's ``ask`` (text pieces); with ``speak=True`` the iterator also yields
        :class:`~omnitide_mlx.speech.AudioChunk` objects as the spoken reply is ready (``speaker``: a voice of the
        checkpoint, default Chelsie; ``speech``: :class:`~omnitide_mlx.speech.SpeechOptions`; ``seed`` seeds the
        speech where those options leave its seeds unset). A checkpoint
        without a talker raises ``SpeechUnavailable`` and an unknown speaker ``ValueError``, before anything runs."""
        if not speak:
            if speaker is not None or speech is not None:  # not silently ignored: a spoken answer was meant
                raise ValueError("speaker= / speech= go with speak=True")
            return super().ask(question, **kwargs)
        from dataclasses import replace

        from .speech import SpeechOptions, speech_for, spoken_reply

        options = replace(speech or SpeechOptions(), speaker=speaker if speaker is not None else
                          (speech.speaker if speech else None))
        seed = kwargs.get("seed")
        if seed is not None:  # the ask's seed reproduces the spoken reply too, unless the speech options set theirs
            if options.seed is None:
                options = replace(options, seed=seed)
            if options.sampling.seed is None:
                options = replace(options, sampling=replace(options.sampling, seed=seed))
        model = speech_for(self, options.token2wav_version)
        model.voice(options.speaker)  # an unknown speaker fails here, not mid-reply
        text_ask = super().ask
        text_ask(question, **kwargs).close()  # validates the question and options the same way, eagerly
        return spoken_reply(self, text_ask, question, model, options, **kwargs)
