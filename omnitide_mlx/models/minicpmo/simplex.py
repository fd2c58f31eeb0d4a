"""The official simplex streaming API (``MiniCPMO.streaming_prefill`` / ``streaming_generate``) on MLX.

A ``SimplexSession`` holds what the official model keeps per ``session_id``: the LLM KV cache (mlx-lm
``KVCache``), the streaming Whisper cache and the streaming mel buffer, and the turn state that decides each
prompt's prefix. It feeds exactly the official token layout, so ``kv_length`` after each call equals the official
cache length (``fixtures/minicpmo45-tiny/stream_ref.json``: 69, 81, 147, 159, then 189 after a 12-token
generate). Not ported: the text sliding window (8000 / 6000 tokens; OmniSession's retention policies do that)
and speech output (TTS).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import mlx.core as mx
import numpy as np
from PIL import Image

from .audio import WhisperStreamCache
from .processor import SAMPLE_RATE, StreamingMel, to_pil

FIRST_CHUNK_MS = 1035
CHUNK_MS = 1000
GENERATE_CHUNK = 10  # tokens per generation chunk (the first one has one more)
PENALTY_WINDOW = 128
TERMINATORS = ("<|tts_eos|>", "<|im_end|>", "</s>")  # "</s>" is a plain vocab entry (128247)
# suppressed in every step, plus tokenizer_config's bad_token_ids; strings that are not one token map to <unk>
FORBIDDEN = (":", "：", "；", "#", "“", "”", "‘", "’", "@", "*", "【", "】", "「", "」", "(", ")", "（", "）", "[", "]",
             "&", "/", "$")


@dataclass
class GenerateConfig:
    do_sample: bool = True
    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 100
    repetition_penalty: float = 1.02
    length_penalty: float = 1.0


class SimplexSession:
    """One official simplex session: ``streaming_prefill`` a frame / 1 s audio chunk / text at a time, then
    ``streaming_generate`` a reply; ``kv_length`` is the LLM cache length."""

    def __init__(self, model, processor, seed: int | None = None):
        self.model = model
        self.processor = processor
        self.tok = processor.tokenizer
        self.rng = np.random.default_rng(seed)
        self.terminator_ids = [self.tok.token_id(t) for t in TERMINATORS]
        self.forbidden_ids = sorted(set([self.tok.token_id(t) for t in FORBIDDEN] + list(self.tok.bad_token_ids)))
        self.reset()

    def reset(self) -> None:
        self.cache = self.model.language_model.make_cache()
        self.audio_cache = WhisperStreamCache()
        self.mel = StreamingMel(chunk_ms=CHUNK_MS, first_chunk_ms=FIRST_CHUNK_MS, cnn_redundancy_ms=0)
        self.audio_chunk_idx = 0
        self.started = False
        self.new_user_msg = True
        self.llm_generated = False
        self.llm_generate_completed = False
        self.pending_logits = None

    @property
    def kv_length(self) -> int:
        return int(self.cache[0].offset)

    # --- prefill ------------------------------------------------------------------------------------------------
    def streaming_prefill(self, content, role: str = "user", omni_mode: bool = True, max_slice_nums: int = 1,
                          is_last_chunk: bool = False, use_tts_template: bool = True,
                          enable_thinking: bool = False) -> str:
        """Feed one message (a PIL image / HxWx3 uint8 frame, a float32 16 kHz audio array, text, or a list of
        them). Returns the prompt text before placeholder expansion, as the official call does."""
        if role not in ("system", "user", "assistant"):
            raise ValueError(f"role must be system, user or assistant (got {role!r})")
        items = content if isinstance(content, list) else [content]
        images, audios, parts = [], [], []
        for c in items:
            if isinstance(c, Image.Image) or (isinstance(c, np.ndarray) and c.ndim == 3):
                images.append(to_pil(c))
                parts.append("<image>./</image>")
            elif isinstance(c, np.ndarray):
                if c.ndim != 1 or c.size == 0:
                    raise ValueError(f"audio must be a non-empty 1-D array at 16 kHz, got shape {c.shape}")
                audios.append(np.asarray(c, dtype=np.float32))
                parts.append("<audio>./</audio>")
            elif isinstance(c, str):
                parts.append(c)
            else:
                raise ValueError(f"unsupported content item {type(c).__name__}")
        contents = ("" if omni_mode else "\n").join(parts)
        streaming = role != "system"
        if role in ("system", "assistant"):
            self.new_user_msg = True
            self.audio_cache = WhisperStreamCache()
        first = not self.started
        if first:
            self.reset()
            self.started = True
            if role == "user":
                prompt = "<|im_start|>user\n" + contents
                self.new_user_msg = False
            else:
                prompt = self.processor.apply_chat_template([{"role": role, "content": contents}],
                                                            use_tts_template=use_tts_template,
                                                            enable_thinking=enable_thinking)
        elif self.new_user_msg and role == "user":
            opener = "<|im_start|>user\n"
            if self.llm_generated:
                opener = ("<|im_end|>\n" if self.llm_generate_completed else "<|tts_eos|><|im_end|>\n") + opener
            prompt = opener + contents
            self.new_user_msg = False
        else:
            prompt = contents
        if streaming and audios and self.audio_chunk_idx == 0:
            if len(audios) != 1:
                raise ValueError("streaming mode takes one audio per call")
            need = int(FIRST_CHUNK_MS * SAMPLE_RATE / 1000)
            if len(audios[0]) < need:  # the first chunk is left-padded with zeros to 1035 ms
                audios[0] = np.concatenate([np.zeros(need - len(audios[0]), np.float32), audios[0]])
        inputs = self.processor(prompt, images=images, audios=audios, max_slice_nums=max_slice_nums,
                                use_image_id=False)
        embeds = self._embed(inputs, audios, streaming, is_last_chunk)
        if streaming and audios:
            self.audio_chunk_idx += 1
        if first:
            self.audio_cache = WhisperStreamCache()  # the official session drops the first call's Whisper cache
        logits = self.model.language_model(embeds, cache=self.cache, positions=self.kv_length)
        mx.eval(logits)
        self.pending_logits = logits[:, -1]
        return prompt

    def _embed(self, inputs: dict, audios: list, streaming: bool, is_last_chunk: bool) -> mx.array:
        m = self.model
        if not (streaming and audios):  # a system message's audio: offline, full attention (chunk_length -1)
            return m.embed_inputs(inputs["input_ids"], inputs["pixel_values"], inputs["tgt_sizes"],
                                  inputs["image_bound"], inputs["audio_features"], inputs["audio_feature_lens"],
                                  inputs["audio_bounds"], chunk_length=-1)
        embeds = m.embed_inputs(inputs["input_ids"], inputs["pixel_values"], inputs["tgt_sizes"],
                                inputs["image_bound"])
        mel = self.mel.process(audios[0], is_last_chunk=is_last_chunk)
        if mel.shape[1] == 0:
            raise ValueError(f"audio chunk of {len(audios[0])} samples leaves no complete second of stable mel "
                             "frames; send 1 s chunks (or is_last_chunk=True for the final one)")
        tokens, self.audio_cache = m.audio_embeddings_streaming(mel[None], self.audio_cache)
        (s, e), = inputs["audio_bounds"][0]
        if tokens.shape[0] != e - s:
            raise ValueError(f"the audio placeholder has {e - s} slots for {tokens.shape[0]} streamed tokens")
        embeds[0, int(s):int(e)] = tokens.astype(embeds.dtype)
        return embeds

    # --- generate -----------------------------------------------------------------------------------------------
    def streaming_generate(self, max_new_tokens: int = 256, do_sample: bool = True, enable_thinking: bool = False,
                           use_tts_template: bool = True, **sampling) -> Iterator[tuple[str, bool]]:
        """Yield ``(text_piece, finished)`` per generation chunk of 10 tokens (11 in the first), as the official
        text-only ``streaming_generate``; the closing ``<|tts_eos|><|im_end|>`` goes in front of the next user
        prompt."""
        cfg = GenerateConfig(do_sample=do_sample, **sampling)
        self.new_user_msg = True
        self.llm_generated = True
        self.llm_generate_completed = False
        self.audio_cache = WhisperStreamCache()
        self.mel.reset()
        self.audio_chunk_idx = 0
        bos = "<|im_end|>\n<|im_start|>assistant\n" + ("" if enable_thinking else "<think>\n\n</think>\n\n") \
            + ("<|tts_bos|>" if use_tts_template else "")
        pending = self.model.language_model.embed_tokens(mx.array(self.tok.encode(bos)))[None]
        generated: list[int] = []
        decoded, shown = [], 0
        for chunk_idx in range((max_new_tokens + GENERATE_CHUNK - 1) // GENERATE_CHUNK):
            first = chunk_idx == 0
            ids, finished, pending = self._chunk(pending, first, GENERATE_CHUNK + int(first), generated, cfg)
            yield_ids = (ids if finished else ids[:-1]) if first else generated[-1:] + (ids if finished else ids[:-1])
            generated += ids
            decoded += yield_ids
            text = self.tok.decode(decoded, skip_special_tokens=False)
            piece = text[shown:]
            if not finished:
                while piece.endswith("\ufffd"):
                    piece = piece[:-1]
            shown += len(piece)
            yield piece, finished
            if finished:
                break

    def _chunk(self, pending: mx.array, first: bool, size: int, history: list[int], cfg: GenerateConfig):
        """``ChunkPrefillChunkGenerate.chunk_generate``: up to ``size`` tokens; every generated token but the
        last is fed back; a terminator ends the chunk without being fed."""
        lm = self.model.language_model
        out: list[int] = []
        finished = False
        for step in range(size):
            feed = pending if (first and step == 0) else pending[:, -1:]
            logits = lm(feed, cache=self.cache, positions=self.kv_length)[0, -1].astype(mx.float32)
            token = self._select(np.array(logits), history[-PENALTY_WINDOW:] + out, cfg)
            if token in self.terminator_ids:
                finished = True
                break
            out.append(token)
            pending = mx.concatenate([pending, lm.embed_tokens(mx.array([token]))[None]], axis=1)
        return out, finished, pending

    def _select(self, logits: np.ndarray, recent: list[int], cfg: GenerateConfig) -> int:
        logits = logits.astype(np.float32).copy()
        logits[self.forbidden_ids] = -np.inf
        if cfg.repetition_penalty != 1.0 and recent:
            ids = np.unique(np.asarray(recent))
            v = logits[ids]
            logits[ids] = np.where(v > 0, v / cfg.repetition_penalty, v * cfg.repetition_penalty)
        if cfg.length_penalty != 1.0:
            v = logits[self.terminator_ids]
            logits[self.terminator_ids] = np.where(v > 0, v / cfg.length_penalty, v * cfg.length_penalty)
        if cfg.temperature != 1.0:
            logits = logits / np.float32(cfg.temperature)
        if not cfg.do_sample:
            return int(np.argmax(logits))
        if cfg.top_k > 0:
            kth = np.sort(logits)[-min(cfg.top_k, logits.size)]
            logits = np.where(logits < kth, -np.inf, logits)
        if cfg.top_p < 1.0:
            order = np.argsort(-logits, kind="stable")
            p = np.exp(logits[order] - logits[order[0]])
            p /= p.sum()
            remove = np.cumsum(p) > cfg.top_p
            remove[1:] = remove[:-1].copy()
            remove[0] = False
            logits[order[remove]] = -np.inf
        p = np.exp(logits - logits.max())
        p /= p.sum()
        return int(self.rng.choice(p.size, p=p))
