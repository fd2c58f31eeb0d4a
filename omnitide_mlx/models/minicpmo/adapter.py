"""MiniCPM-o 4.5's unit protocol for OmniSession.

Layout (token counts for the real placeholders: 64 tokens per image or slice, 10 per second of audio)::

    system   <|im_start|>system\\n{prompt}<|im_end|>\\n                          (the chat template)
    media    [<|im_start|>user\\n] <unit> [<image> 64 </image> (<slice> 64 </slice>)*] [audio x10] </unit>
    context  [<|im_start|>user\\n] <unit> text </unit>
    user     [<|im_start|>user\\n] text <|im_end|>\\n<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n[<|tts_bos|>]
    reply    generated text, then <|tts_eos|><|im_end|>\\n (finish_reply)

A media unit is the official duplex unit (``MiniCPMODuplex.streaming_prefill``): ``<unit>``, the frame as
``<image>`` + 64 + ``</image>`` (streaming mode: unsliced, 66 tokens, as the official streaming calls do; offline
mode: the source image plus ``<slice>`` + 64 + ``</slice>`` per slice), then 10 audio embeddings with no
markers, from the streaming Whisper encoder with 2 mel frames of CNN context on each side (equal to the offline
chunked encoder). The user turn opens (``<|im_start|>user\\n``) with the first unit after the system prompt or a
reply, and a question closes it with the tokens that open the assistant's reply, as the official simplex
``streaming_generate`` feeds them. ``<|tts_bos|>`` (on by default, ``tts_template=False`` drops it): the
official streaming protocol and the offline chat with audio input both put it there, so the model's text is the
text it would speak and ends with ``<|tts_eos|>``; the reply is then closed with ``<|tts_eos|><|im_end|>\\n``,
which the official simplex session feeds in front of the next user turn.

Positions are ``start + arange(T)`` (plain 1-D RoPE). Spans: ``boundary`` for every marker, ``image`` for an
unsliced frame, ``image_source`` / ``image_slice`` for a sliced one, ``audio``, ``text``, ``system``.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
from PIL import Image

from ...core.stream_units import MediaSetting, StreamUnits
from ...core.units import SpanKind, UnitKind
from ..base import MediaError, PreparedUnit, StreamAdapter, spans_from_runs, text_positions
from .audio import WhisperStreamCache
from .layout import STREAMING_MAX_SLICE_NUMS, frame_runs, stream_units
from .processor import SAMPLE_RATE, StreamingMel

DEFAULT_SYSTEM_PROMPT = ("You are a helpful assistant. You can accept audio and text input and output voice and "
                         "text.")  # the official get_sys_prompt default
FIRST_CHUNK_PAD = int(1035 * SAMPLE_RATE / 1000)  # the duplex session left-pads its first audio to 1035 ms
CNN_REDUNDANCY_MS = 20  # 2 mel frames of context on each side of a streamed chunk


class MiniCPMOStreamAdapter(StreamAdapter):
    sample_rate = SAMPLE_RATE

    def __init__(self, model, processor, mode: str = "streaming", max_slice_nums: int | None = None,
                 tts_template: bool = True, media: MediaSetting | None = None):
        """``max_slice_nums`` (or ``media.max_slice_nums``): slices per frame; default 1 (unsliced) in streaming
        mode, as the official streaming calls do, and the processor's (9) in offline mode. ``media.frame_size``:
        frames are resized to it first."""
        if mode not in ("streaming", "offline"):
            raise ValueError(f"mode must be 'streaming' or 'offline' (got {mode!r})")
        self.model = model
        self.processor = processor
        self.tok = processor.tokenizer
        self.mode = mode
        self.media = media or MediaSetting()
        default = STREAMING_MAX_SLICE_NUMS if mode == "streaming" else processor.max_slice_nums
        self.max_slice_nums = int(max_slice_nums or self.media.max_slice_nums or default)
        if self.max_slice_nums < 1:
            raise ValueError(f"max_slice_nums must be >= 1 (got {self.max_slice_nums})")
        self.tts_template = tts_template
        self.kv_spec = model.kv_spec()
        t = self.tok.token_id
        self.stop_token_ids = frozenset({t("<|im_end|>"), t("<|endoftext|>"), t("<|tts_eos|>")})
        self.ids = {k: t(v) for k, v in [("unit", "<unit>"), ("unit_end", "</unit>"), ("image", "<image>"),
                                         ("image_end", "</image>"), ("slice", "<slice>"), ("slice_end", "</slice>"),
                                         ("unk", "<unk>")]}
        self.user_open = self.tok.encode("<|im_start|>user\n")
        self.reply_open = self.tok.encode("<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
                                          + ("<|tts_bos|>" if tts_template else ""))
        self.reply_close = self.tok.encode(("<|tts_eos|>" if tts_template else "") + "<|im_end|>\n")
        self.reset()

    def reset(self) -> None:
        self.in_user_turn = False
        self.audio_buffer = np.zeros(0, dtype=np.float32)
        self.audio_chunks = 0
        self.audio_cache = WhisperStreamCache()
        self.mel = StreamingMel(chunk_ms=1000, first_chunk_ms=1035, cnn_redundancy_ms=CNN_REDUNDANCY_MS)

    # --- helpers ------------------------------------------------------------------------------------------------
    def embed_tokens(self, ids) -> mx.array:
        return self.model.language_model.embed_tokens(mx.array(np.asarray(ids, dtype=np.int32).reshape(-1)))

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def _unit(self, kind: UnitKind, runs: list[tuple[SpanKind, list[int], mx.array | None]], start: int,
              t: float | None = None, label: str = "", extras: dict | None = None) -> PreparedUnit:
        """Assemble ``(span kind, token ids, embeddings or None)`` runs into a prepared unit."""
        ids = np.asarray([i for _, r, _ in runs for i in r], dtype=np.int32)
        embeds = self.embed_tokens(ids)
        cursor = 0
        for _, r, e in runs:
            if e is not None:
                embeds[cursor:cursor + len(r)] = e.astype(embeds.dtype)
            cursor += len(r)
        spans = spans_from_runs([(k, len(r)) for k, r, _ in runs])
        return PreparedUnit(kind=kind, input_ids=ids, inputs_embeds=embeds, spans=spans,
                            positions=text_positions(start, len(ids), 1), t=t, label=label, extras=extras or {})

    def _opener(self) -> list:
        if self.in_user_turn:
            return []
        return [(SpanKind.BOUNDARY, self.user_open, None)]

    # --- units --------------------------------------------------------------------------------------------------
    def system_unit(self, prompt: str | None, start: int) -> PreparedUnit:
        text = self.processor.apply_chat_template(
            [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT if prompt is None else prompt}])
        return self._unit(UnitKind.SYSTEM, [(SpanKind.SYSTEM, self.tok.encode(text), None)], start, label="system")

    def media_unit(self, frame: np.ndarray | None, audio: np.ndarray | None, t: float | None,
                   start: int) -> PreparedUnit:
        frame, audio = self._check_media(frame, audio)
        t0 = time.perf_counter()
        runs = self._opener() + [(SpanKind.BOUNDARY, [self.ids["unit"]], None)]
        extras = {}
        if frame is not None:
            runs += self._frame_runs(frame)
            extras["vision_ms"] = (time.perf_counter() - t0) * 1000
        if audio is not None:
            t1 = time.perf_counter()
            tokens = self._audio_tokens(audio)
            if tokens is not None:
                runs.append((SpanKind.AUDIO, [self.ids["unk"]] * tokens.shape[0], tokens))
            extras["audio_ms"] = (time.perf_counter() - t1) * 1000
        runs.append((SpanKind.BOUNDARY, [self.ids["unit_end"]], None))
        self.in_user_turn = True
        return self._unit(UnitKind.MEDIA, runs, start, t=t, label="media" if t is None else f"t={t:.1f}s",
                          extras=extras)

    def context_unit(self, text: str, start: int) -> PreparedUnit:
        ids = self._check_text(text)
        runs = self._opener() + [(SpanKind.BOUNDARY, [self.ids["unit"]], None), (SpanKind.TEXT, ids, None),
                                 (SpanKind.BOUNDARY, [self.ids["unit_end"]], None)]
        self.in_user_turn = True
        return self._unit(UnitKind.USER, runs, start, label=text[:40])

    def user_unit(self, text: str, start: int) -> PreparedUnit:
        ids = self._check_text(text)
        runs = self._opener() + [(SpanKind.TEXT, ids, None), (SpanKind.BOUNDARY, self.reply_open, None)]
        self.in_user_turn = False
        return self._unit(UnitKind.USER, runs, start, label=text[:40])

    def turn_unit(self, start: int) -> PreparedUnit:
        """A spoken question: the user's words are the audio of the open turn's units (the official turn-based
        chat hears a spoken question the same way); this closes the turn and opens the reply. MediaError when no
        media has opened a turn since the last reply."""
        if not self.in_user_turn:
            raise MediaError("there is no spoken turn to answer: no media has been streamed since the last reply")
        self.in_user_turn = False
        return self._unit(UnitKind.USER, [(SpanKind.BOUNDARY, self.reply_open, None)], start, label="(spoken)")

    def finish_reply(self, generated: list[int], stopped: bool) -> list[int]:
        """The reply's closing tokens, whether it stopped on a stop token (never fed, as in the official
        decoder) or ran out of tokens: ``<|tts_eos|><|im_end|>\\n`` (``<|im_end|>\\n`` without the tts
        template). The next unit then opens a new user turn."""
        self.in_user_turn = False
        return list(self.reply_close)

    # --- media --------------------------------------------------------------------------------------------------
    def _check_text(self, text) -> list[int]:
        if not isinstance(text, str) or not text.strip():
            raise MediaError(f"text must be a non-empty string (got {text!r:.40})")
        ids = [i for i in self.tok.encode(text) if i != self.processor.ids["listen"]]
        if not ids:
            raise MediaError("text has no tokens")
        return ids

    def _check_media(self, frame, audio):
        if frame is None and audio is None:
            raise MediaError("a media unit needs a frame, audio or both")
        if frame is not None:
            frame = np.asarray(frame)
            if frame.ndim != 3 or frame.shape[2] != 3:
                raise MediaError(f"frame has shape {frame.shape}; expected HxWx3 RGB")
            if frame.dtype != np.uint8:
                raise MediaError(f"frame has dtype {frame.dtype}; expected uint8")
            if frame.shape[0] < 2 or frame.shape[1] < 2:
                raise MediaError(f"frame is {frame.shape[1]}x{frame.shape[0]} pixels: too small")
        if audio is not None:
            audio = np.asarray(audio)
            if audio.ndim != 1 or audio.size == 0:
                raise MediaError(f"audio has shape {audio.shape}; expected mono samples at {SAMPLE_RATE} Hz")
            if not np.issubdtype(audio.dtype, np.floating):
                raise MediaError(f"audio has dtype {audio.dtype}; expected float32 samples in [-1, 1]")
            audio = audio.astype(np.float32)
            if not np.isfinite(audio).all():
                raise MediaError("audio holds NaN or infinite samples")
            if frame is None and len(self._padded_buffer(audio)) < self.mel.chunk_size():
                raise MediaError(f"{len(audio)} audio samples is not enough for a unit: the stream needs "
                                 f"{self.mel.chunk_size()} buffered samples ({len(self.audio_buffer)} held)")
        return frame, audio

    def _padded_buffer(self, audio: np.ndarray) -> np.ndarray:
        buf = np.concatenate([self.audio_buffer, audio])
        if self.mel.is_first and len(buf) < FIRST_CHUNK_PAD:
            buf = np.concatenate([np.zeros(FIRST_CHUNK_PAD - len(buf), np.float32), buf])
        return buf

    def stream_units(self, frame: bool = True, audio: bool = True) -> StreamUnits:
        """The media unit this adapter builds for a frame of the setting's size (layout.stream_units)."""
        from dataclasses import replace

        p = self.processor
        return stream_units(replace(self.media, max_slice_nums=self.max_slice_nums),
                            query_num=self.model.config.query_num, audio_pool_step=self.model.config.audio_pool_step,
                            scale_resolution=p.scale_resolution, frame=frame, audio=audio)

    def _frame_runs(self, frame: np.ndarray) -> list:
        if self.media.frame_size is not None:
            frame = np.asarray(Image.fromarray(frame).resize(self.media.frame_size, Image.Resampling.BICUBIC))
        image = self.processor.process_image(frame, self.max_slice_nums)
        feats = self.model.vision_embeddings(image.slices, image.tgt_sizes)  # [n, 64, H]
        runs, k = [], 0
        for kind, marker, n in frame_runs(len(image.slices) - 1, feats.shape[1]):
            if marker is not None:
                runs.append((kind, [self.ids[marker]] * n, None))
            else:
                runs.append((kind, [self.ids["unk"]] * n, feats[k]))
                k += 1
        return runs

    def _audio_tokens(self, audio: np.ndarray) -> mx.array | None:
        """The duplex session's audio path: buffer, cut the next 1 s chunk (1030 ms first), streaming mel with
        context frames, streaming Whisper. None while less than a chunk is buffered. (The official duplex session
        also counts a frame-only unit as an audio chunk, so audio arriving after frames alone gets a 2-frame
        prefix trim on its first, context-less chunk; here the first audio chunk is the stream's first.)"""
        first = self.mel.is_first
        self.audio_buffer = self._padded_buffer(audio)
        need = self.mel.chunk_size()
        if len(self.audio_buffer) < need:
            return None
        mel = self.mel.process(self.audio_buffer[:need])
        self.audio_buffer = self.audio_buffer[need:]
        if mel.shape[1] == 0:
            return None
        tokens, self.audio_cache = self.model.audio_embeddings_streaming(
            mel[None], self.audio_cache, prefix_extra_frames=0 if first else 2, suffix_extra_frames=2)
        self.audio_chunks += 1
        return tokens

    # --- persistence --------------------------------------------------------------------------------------------
    def state(self) -> tuple[dict, dict[str, mx.array]]:
        mel = self.mel.state()
        meta = {"in_user_turn": self.in_user_turn, "audio_chunks": self.audio_chunks, "mode": self.mode,
                "mel_last_emitted": mel["last_emitted"], "mel_base": mel["base"], "mel_is_first": mel["is_first"],
                "whisper_layers": len(self.audio_cache.kv)}
        arrays = {"audio_buffer": mx.array(self.audio_buffer), "mel_buffer": mx.array(mel["buffer"])}
        for i, (k, v) in enumerate(self.audio_cache.kv):
            arrays[f"whisper_k{i}"], arrays[f"whisper_v{i}"] = k, v
        return meta, arrays

    def load_state(self, meta: dict, arrays: dict[str, mx.array]) -> None:
        self.reset()
        if not meta:
            return
        if meta.get("mode", self.mode) != self.mode:
            raise ValueError(f"the saved adapter state is for {meta['mode']} mode, this adapter is {self.mode}")
        self.in_user_turn = bool(meta["in_user_turn"])
        self.audio_chunks = int(meta["audio_chunks"])
        self.audio_buffer = np.array(arrays["audio_buffer"], dtype=np.float32)
        self.mel.load_state({"buffer": np.array(arrays["mel_buffer"]), "last_emitted": meta["mel_last_emitted"],
                             "base": meta["mel_base"], "is_first": meta["mel_is_first"]})
        self.audio_cache = WhisperStreamCache([(arrays[f"whisper_k{i}"], arrays[f"whisper_v{i}"])
                                               for i in range(int(meta["whisper_layers"]))])
