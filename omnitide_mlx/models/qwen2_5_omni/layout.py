"""Streaming protocol of the Qwen2.5-Omni thinker, framework-free: one unit per second of camera and microphone input.

Unit layouts (``[B]`` boundary span, ``[I]`` image span, ``[A]`` audio span, ``[T]`` text, ``[S]`` system):

- system: ``[S] <|im_start|>system\\n{prompt}<|im_end|>\\n`` (default: Qwen2.5-Omni's own system prompt)
- media, frame + audio: ``[B] (<|im_start|>user\\n) <|vision_bos|><|audio_bos|> [I] V [A] A [B] <|audio_eos|>
  <|vision_eos|>``: an audio-in-video block holding one temporal grid (the frame duplicated to the temporal patch
  of 2, 1 s per grid) and its ~25 audio tokens, interleaved in 2 s chunks as transformers lays out a video with
  ``use_audio_in_video``. The bos pair shares one position; V sits at t = p, A at p .. p + 24; the eos pair at one
  past the last run's largest position.
- media, frame only: ``[B] <|vision_bos|> [I] V [B] <|vision_eos|>`` (a one-grid video).
- media, audio only: ``[B] <|audio_bos|> [A] A [B] <|audio_eos|>``.
  The first media unit of a turn starts with ``<|im_start|>user\\n`` (boundary); the turn stays open.
- user: ``[B] (<|im_start|>user\\n) [T] text [B] <|im_end|>\\n<|im_start|>assistant\\n``: it closes the open media
  turn (the question belongs to the same user message as the media before it) or opens and closes its own.
- context: ``[B] (<|im_start|>user\n) [T] text``: user text that joins the open turn like a media unit.
- reply: the session's generated tokens; ``finish_reply`` returns ``<|im_end|>\\n`` to close the assistant turn.

Positions are TMRoPE positions starting at ``start`` (the history's next position, after any OmniPick shift).
Fed unit by unit through a cache they give the same logits as one offline forward over the concatenated sequence,
where every unit's frame is a separate one-grid video and its audio a separate clip (see the tests).

This module decides token ids, spans, positions and which encoder output goes to which placeholder, with numpy
only. A backend's embedder (:class:`QwenOmniEmbedder`) supplies the arrays: token embeddings, the vision and audio
encoders, and the scatter of their outputs into the placeholder rows (adapter.py on MLX,
omnitide_mlx/torch/qwen2_5_omni.py on PyTorch); the layout is composed with one, so both backends lay out every
unit identically.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Protocol

import numpy as np

from ...core.stream_units import MediaSetting, StreamUnits
from ...core.units import SpanKind, UnitKind
from ...rope import RopeSpec
from ..base import KVSpec, MediaError, PreparedUnit, StreamAdapter, spans_from_runs
from .processor import DEFAULT_SYSTEM_PROMPT, VisionSettings, check_audio, check_frame, resize_bicubic, smart_resize
from .rope_index import audio_in_video_positions, audio_token_count, text_positions, vision_positions

FRAME_MIN_PIXELS = 4 * 28 * 28
FRAME_MAX_PIXELS = 128 * 28 * 28  # the video processor's per-frame floor: 117 tokens for a 640x480 frame
HOP_LENGTH = 160  # the audio processor's mel hop: 100 frames a second at 16 kHz


def frame_grid(width: int, height: int, vision: VisionSettings | None = None, min_pixels: int = FRAME_MIN_PIXELS,
               max_pixels: int = FRAME_MAX_PIXELS) -> tuple[int, int, int]:
    """The ``(t, h, w)`` patch grid of one frame of ``width x height`` (the processor's smart_resize; one temporal
    grid: the frame is duplicated to the temporal patch)."""
    vs = vision or VisionSettings()
    h, w = smart_resize(height, width, vs.patch_size * vs.merge_size, min_pixels, max_pixels)
    return 1, h // vs.patch_size, w // vs.patch_size


def media_runs(start: int, grid, n_audio: int, *, merge: int = 2, position_id_per_seconds: int = 25,
               seconds_per_chunk: int = 2) -> list[tuple[SpanKind, list[str], np.ndarray]]:
    """The token runs of a media unit inside an open user turn, as ``(span kind, token names, positions [3, n])``.

    The one place the layout is decided: the adapters map the names to ids, :func:`stream_units` hands the
    kinds and positions to the simulator and the benchmarks."""
    runs: list[tuple[SpanKind, list[str], np.ndarray]] = []
    if grid is not None and n_audio:  # one grid of 1 s: the frame, then its audio in 2 s chunks
        runs.append((SpanKind.BOUNDARY, ["<|vision_bos|>", "<|audio_bos|>"], text_positions(start, 1).repeat(2, 1)))
        inner = audio_in_video_positions(start, grid, merge, 1.0, n_audio, position_id_per_seconds,
                                         seconds_per_chunk)
        for kind, p in inner:
            video = kind == "video"
            runs.append((SpanKind.IMAGE if video else SpanKind.AUDIO,
                         ["<|VIDEO|>" if video else "<|AUDIO|>"] * p.shape[1], p))
        eos = int(inner[-1][1].max()) + 1
        runs.append((SpanKind.BOUNDARY, ["<|audio_eos|>", "<|vision_eos|>"], text_positions(eos, 1).repeat(2, 1)))
    elif grid is not None:
        runs.append((SpanKind.BOUNDARY, ["<|vision_bos|>"], text_positions(start, 1)))
        p = vision_positions(start + 1, grid, merge, [0])
        runs.append((SpanKind.IMAGE, ["<|VIDEO|>"] * p.shape[1], p))
        runs.append((SpanKind.BOUNDARY, ["<|vision_eos|>"], text_positions(int(p.max()) + 1, 1)))
    elif n_audio:
        runs.append((SpanKind.BOUNDARY, ["<|audio_bos|>"], text_positions(start, 1)))
        runs.append((SpanKind.AUDIO, ["<|AUDIO|>"] * n_audio, text_positions(start + 1, n_audio)))
        runs.append((SpanKind.BOUNDARY, ["<|audio_eos|>"], text_positions(start + 1 + n_audio, 1)))
    else:
        raise MediaError("a media unit needs a frame, audio or both")
    return runs


def stream_units(setting: MediaSetting | None = None, *, vision: VisionSettings | None = None,
                 position_id_per_seconds: int = 25, seconds_per_chunk: int = 2, sample_rate: int = 16000,
                 frame: bool = True, audio: bool = True) -> StreamUnits:
    """The media unit (a frame and ``setting.audio_seconds`` of audio in an open turn) the engine builds at
    ``setting``; frame size: ``setting.sim_frame_size``. Defaults are the released 3B / 7B configs."""
    setting = setting or MediaSetting()
    vs = vision or VisionSettings()
    grid = size = None
    if frame:
        size = setting.sim_frame_size
        grid = frame_grid(size[0], size[1], vs, FRAME_MIN_PIXELS, setting.max_pixels or FRAME_MAX_PIXELS)
    n_audio = audio_token_count(-(-int(round(setting.audio_seconds * sample_rate)) // HOP_LENGTH)) if audio else 0
    runs = media_runs(0, grid, n_audio, merge=vs.merge_size, position_id_per_seconds=position_id_per_seconds,
                      seconds_per_chunk=seconds_per_chunk)
    detail = (("merged_grid", [grid[1] // vs.merge_size, grid[2] // vs.merge_size] if grid else None),
              ("max_pixels", setting.max_pixels or FRAME_MAX_PIXELS))
    return StreamUnits("qwen2_5_omni", setting, [(k, len(n)) for k, n, _ in runs],
                       np.concatenate([p for _, _, p in runs], axis=1), frame_size=size, detail=detail)


def kv_spec(config) -> KVSpec:
    """The thinker's KV cache shape and RoPE (M-RoPE: 3 position axes, NeoX rotation over the whole head) from a
    :class:`~.config.ModelConfig`; both backends' models report it."""
    t = config.text_config
    return KVSpec(num_layers=t.num_hidden_layers, kv_heads=t.num_key_value_heads, head_dim=t.head_dim,
                  rope=RopeSpec(t.head_dim, t.rope_theta, traditional=False), position_axes=3)


class QwenOmniEmbedder(Protocol):
    """What a backend supplies to the unit layouts: the arrays (MLX arrays or torch tensors) of one model."""

    def embed_tokens(self, ids) -> Any:
        """Token embeddings ``[T, hidden]``."""

    def vision_features(self, rows: np.ndarray, grid: tuple[int, int, int]) -> Any:
        """The vision encoder's merged outputs ``[tokens, hidden]`` for one frame's patch rows and grid."""

    def audio_features(self, mel: np.ndarray) -> Any:
        """The audio encoder's outputs ``[tokens, hidden]`` for one clip's log-mel ``[mels, frames]``."""

    def scatter(self, embeds: Any, slots: np.ndarray, feats: Any) -> Any:
        """``embeds`` with rows ``slots`` replaced by ``feats`` (cast to the embeddings' dtype)."""


class QwenOmniLayout(StreamAdapter):
    """One session's protocol state (whether a user turn opened by media units is still open) and the unit layouts,
    composed with a backend's :class:`QwenOmniEmbedder` (``embedder``) that computes the arrays.

    ``model`` needs ``kv_spec()`` and ``config`` (a :class:`~.config.ModelConfig`).
    """

    sample_rate = 16000

    def __init__(self, model, processor, embedder: QwenOmniEmbedder, *, frame_min_pixels: int = FRAME_MIN_PIXELS,
                 frame_max_pixels: int | None = None, system_prompt: str = DEFAULT_SYSTEM_PROMPT,
                 media: MediaSetting | None = None):
        self.model = model
        self.processor = processor
        self.embedder = embedder
        self.kv_spec = model.kv_spec()
        self.media = media or MediaSetting()
        if frame_max_pixels is None:
            frame_max_pixels = self.media.max_pixels or FRAME_MAX_PIXELS
        self.frame_min_pixels, self.frame_max_pixels = frame_min_pixels, frame_max_pixels
        self.default_system_prompt = system_prompt
        ids = processor.token_ids
        c = model.config
        for name, cid in (("<|AUDIO|>", c.audio_token_id), ("<|IMAGE|>", c.image_token_id),
                          ("<|VIDEO|>", c.video_token_id), ("<|audio_bos|>", c.audio_start_token_id),
                          ("<|audio_eos|>", c.audio_end_token_id), ("<|vision_bos|>", c.vision_start_token_id),
                          ("<|vision_eos|>", c.vision_end_token_id)):
            if ids[name] != cid:
                raise ValueError(f"tokenizer and config disagree on {name}: {ids[name]} vs {cid}")
        self.ids = ids
        self.newline = processor.encode("\n")
        self.user_open = [ids["<|im_start|>"]] + processor.encode("user\n")
        self.turn_close = [ids["<|im_end|>"]] + self.newline + [ids["<|im_start|>"]] + processor.encode("assistant\n")
        self.stop_token_ids = frozenset({ids["<|im_end|>"], ids["<|endoftext|>"]})
        self.turn_open = False

    def embed_tokens(self, ids) -> Any:
        return self.embedder.embed_tokens(ids)

    # --- helpers --------------------------------------------------------------------------------------------
    def stream_units(self, frame: bool = True, audio: bool = True) -> StreamUnits:
        """The media unit this adapter builds for a frame of the setting's size (see :func:`stream_units`)."""
        c = self.model.config
        setting = replace(self.media, max_pixels=self.frame_max_pixels)
        return stream_units(setting, vision=self.processor.vision, position_id_per_seconds=c.position_id_per_seconds,
                            seconds_per_chunk=c.seconds_per_chunk, sample_rate=self.sample_rate, frame=frame,
                            audio=audio)

    def _sized(self, frame: np.ndarray) -> np.ndarray:
        """The frame at the setting's frame size (Pillow bicubic), or as it came."""
        if self.media.frame_size is None:
            return frame
        w, h = self.media.frame_size
        return resize_bicubic(frame, h, w)

    def decode(self, ids) -> str:
        return self.processor.decode(ids, skip_special_tokens=True)

    def _text_unit(self, kind: UnitKind, runs: list[tuple[SpanKind, list[int]]], start: int, t=None,
                   label: str = "") -> PreparedUnit:
        ids = [i for _, part in runs for i in part]
        return PreparedUnit(kind=kind, input_ids=np.asarray(ids, dtype=np.int32), inputs_embeds=self.embed_tokens(ids),
                            spans=spans_from_runs([(k, len(p)) for k, p in runs]),
                            positions=text_positions(start, len(ids)), t=t, label=label)

    # --- units ----------------------------------------------------------------------------------------------
    def system_unit(self, prompt: str | None, start: int) -> PreparedUnit:
        prompt = self.default_system_prompt if prompt is None else prompt
        ids = [self.ids["<|im_start|>"]] + self.processor.encode(f"system\n{prompt}") + [self.ids["<|im_end|>"]] \
            + self.newline
        self.turn_open = False
        return self._text_unit(UnitKind.SYSTEM, [(SpanKind.SYSTEM, ids)], start, label="system")

    def user_unit(self, text: str, start: int) -> PreparedUnit:
        if not isinstance(text, str):
            raise TypeError(f"user text must be a string, got {type(text).__name__}")
        runs = []
        if not self.turn_open:
            runs.append((SpanKind.BOUNDARY, self.user_open))
        runs.append((SpanKind.TEXT, self.processor.encode(text)))
        runs.append((SpanKind.BOUNDARY, self.turn_close))
        unit = self._text_unit(UnitKind.USER, runs, start, label=text[:40])
        self.turn_open = False
        return unit

    def turn_unit(self, start: int) -> PreparedUnit:
        """A spoken question: the user's words are the audio of the open turn's media units, as the model hears a
        spoken question in its chat format (``<|im_start|>user\\n <audio...> <|im_end|>\\n<|im_start|>assistant\\n``);
        this closes the turn and opens the reply. MediaError when no media has opened a turn since the last reply."""
        if not self.turn_open:
            raise MediaError("there is no spoken turn to answer: no media has been streamed since the last reply")
        unit = self._text_unit(UnitKind.USER, [(SpanKind.BOUNDARY, self.turn_close)], start, label="(spoken)")
        self.turn_open = False
        return unit

    def context_unit(self, text: str, start: int) -> PreparedUnit:
        if not isinstance(text, str):
            raise TypeError(f"context text must be a string, got {type(text).__name__}")
        if not text:
            raise ValueError("context text is empty")
        runs = []
        if not self.turn_open:
            runs.append((SpanKind.BOUNDARY, self.user_open))
        runs.append((SpanKind.TEXT, self.processor.encode(text)))
        unit = self._text_unit(UnitKind.USER, runs, start, label=text[:40])
        self.turn_open = True
        return unit

    def finish_reply(self, generated: list[int], stopped: bool) -> list[int]:
        self.turn_open = False
        return [self.ids["<|im_end|>"]] + self.newline

    def media_unit(self, frame: np.ndarray | None, audio: np.ndarray | None, t: float | None,
                   start: int) -> PreparedUnit:
        if frame is None and audio is None:
            raise MediaError("a media unit needs a frame, audio or both")
        vs = self.processor.vision
        rows = grid = mel = None
        if frame is not None:  # validate and preprocess everything before any model work
            rows, grid = vs.image(self._sized(check_frame(frame)), self.frame_min_pixels, self.frame_max_pixels)
        if audio is not None:
            mel = self.processor.audio_features(check_audio(audio), self.sample_rate)
            if audio_token_count(mel.shape[1]) < 1:
                raise MediaError(f"audio of {np.asarray(audio).shape[0]} samples is too short (needs >= 321)")

        ids, kinds, pos = [], [], []  # kinds: SpanKind per token, pos: [3, n] blocks

        def add(tokens: list[int], kind: SpanKind, positions: np.ndarray):
            ids.extend(tokens)
            kinds.extend([kind] * len(tokens))
            pos.append(positions)

        cursor = start
        if not self.turn_open:
            add(self.user_open, SpanKind.BOUNDARY, text_positions(cursor, len(self.user_open)))
            cursor += len(self.user_open)
        ids_, cfg = self.ids, self.model.config
        n_audio = audio_token_count(mel.shape[1]) if mel is not None else 0
        for kind, names, p in media_runs(cursor, grid, n_audio, merge=vs.merge_size,
                                         position_id_per_seconds=cfg.position_id_per_seconds,
                                         seconds_per_chunk=cfg.seconds_per_chunk):
            add([ids_[n] for n in names], kind, p)

        input_ids = np.asarray(ids, dtype=np.int32)
        embeds = self.embed_tokens(input_ids)
        extras = {}
        if rows is not None:
            t0 = time.perf_counter()
            slots = np.nonzero(input_ids == ids_["<|VIDEO|>"])[0]
            embeds = self.embedder.scatter(embeds, slots, self.embedder.vision_features(rows, grid))
            extras["vision_tokens"] = int(slots.size)
            extras["vision_s"] = time.perf_counter() - t0
        if mel is not None:
            t0 = time.perf_counter()
            slots = np.nonzero(input_ids == ids_["<|AUDIO|>"])[0]
            embeds = self.embedder.scatter(embeds, slots, self.embedder.audio_features(mel))
            extras["audio_tokens"] = int(slots.size)
            extras["audio_s"] = time.perf_counter() - t0
        spans = spans_from_runs([(k, 1) for k in kinds])
        self.turn_open = True
        label = "+".join(x for x, v in (("frame", rows), ("audio", mel)) if v is not None)
        return PreparedUnit(kind=UnitKind.MEDIA, input_ids=input_ids, inputs_embeds=embeds, spans=spans,
                            positions=np.concatenate(pos, axis=1), t=t, label=label, extras=extras)

    # --- session save / restore -----------------------------------------------------------------------------
    def state(self) -> tuple[dict, dict]:
        return {"turn_open": self.turn_open}, {}

    def load_state(self, meta: dict, arrays: dict) -> None:
        self.turn_open = bool(meta.get("turn_open", False))
