"""Streaming protocol of the Qwen3-Omni thinker on MLX: one unit per second of camera and microphone input.

Unit layouts (``[B]`` boundary, ``[I]`` image, ``[A]`` audio, ``[T]`` text, ``[S]`` system spans), as Qwen2.5-Omni's
adapter lays them out with Qwen3-Omni's markers and position rules (rope_index.py):

- system: ``[S] <|im_start|>system\\n{prompt}<|im_end|>\\n`` (no default prompt: the released template has none; the
  session's own prompt is used when given);
- media, frame + audio: ``[B] (<|im_start|>user\\n) <|vision_start|><|audio_start|> [I] V [A] A [B] <|audio_end|>
  <|vision_end|>``: an audio-in-video block holding one temporal patch (the frame duplicated, 1 s per patch) and the
  second's audio tokens (13 for 1 s), merged by time as transformers lays out ``use_audio_in_video``: all frame
  tokens sit at t = p + 2 and audio token i at p + 2 + i, so the frame comes first. The bos pair takes p and p + 1,
  the eos pair one past the last token's largest position and the next;
- media, frame only: ``[B] <|vision_start|> [I] V [B] <|vision_end|>``; audio only ``[B] <|audio_start|> [A] A [B]
  <|audio_end|>``;
- user ``[B] (<|im_start|>user\\n) [T] text [B] <|im_end|>\\n<|im_start|>assistant\\n``, context (text joining the open
  turn), reply closed by ``<|im_end|>\\n``.

DeepStack: a unit with a frame carries ``extras["deepstack"] = (slots [n] int32, [features [n, hidden] per level])``;
the MLX backend passes it on at the prefill (``model.language_model(embeds, cache, positions, deepstack=...)``:
the language model names the keyword; docs/models/qwen3_omni.md, "The family record").

Streaming N units through a cache gives the logits of one offline forward over the concatenated sequence in which
every unit's frame is a separate one-patch video (``video_second_per_grid`` 1.0) and its audio a separate clip,
as long as each unit's audio reaches at least as far as its frame's merged grid is high and wide (1 s: 13 tokens;
640x480 at the default budget: 13 x 9); otherwise transformers continues from the eos pair, below the block's
largest position, where the stream continues one past it.
"""

from __future__ import annotations

import time
from dataclasses import replace

import mlx.core as mx
import numpy as np

from ...core.stream_units import MediaSetting, StreamUnits
from ...core.units import SpanKind, UnitKind
from ...rope import RopeSpec
from ..base import KVSpec, MediaError, PreparedUnit, StreamAdapter, spans_from_runs
from ..qwen2_5_omni.processor import check_audio, check_frame, resize_bicubic, smart_resize
from .rope_index import audio_token_count, interleave_order, text_positions, vision_positions

FRAME_MIN_PIXELS = 4 * 32 * 32
FRAME_MAX_PIXELS = 128 * 32 * 32  # transformers' Qwen3-Omni video floor: 117 tokens for a 640x480 frame
HOP_LENGTH = 160


def frame_grid(width: int, height: int, patch: int = 16, merge: int = 2, min_pixels: int = FRAME_MIN_PIXELS,
               max_pixels: int = FRAME_MAX_PIXELS) -> tuple[int, int, int]:
    """The ``(t, h, w)`` patch grid of one frame (one temporal patch: the frame duplicated)."""
    h, w = smart_resize(height, width, patch * merge, min_pixels, max_pixels)
    return 1, h // patch, w // patch


def _ints(p: np.ndarray) -> np.ndarray:
    return np.asarray(p, dtype=np.float32).astype(np.int64)


def media_runs(start: int, grid, n_audio: int, *, merge: int = 2) -> list[tuple[SpanKind, list[str], np.ndarray]]:
    """The token runs of a media unit inside an open user turn: ``(span kind, token names, positions [3, n])``.

    One frame is one temporal patch at t offset 0, so its positions are integral (int64 here)."""
    runs: list[tuple[SpanKind, list[str], np.ndarray]] = []
    if grid is not None and n_audio:
        runs.append((SpanKind.BOUNDARY, ["<|vision_start|>", "<|audio_start|>"], _ints(text_positions(start, 2))))
        st = start + 2
        video = vision_positions(st, grid, merge, [0.0])
        audio = text_positions(st, n_audio)
        last = None
        for kind, a, e in interleave_order(video[0], audio[0]):
            p = (video if kind == "video" else audio)[:, a:e]
            runs.append((SpanKind.IMAGE if kind == "video" else SpanKind.AUDIO,
                         ["<|video_pad|>" if kind == "video" else "<|audio_pad|>"] * (e - a), _ints(p)))
            last = p
        eos = int(last[:, -1].max()) + 1
        runs.append((SpanKind.BOUNDARY, ["<|audio_end|>", "<|vision_end|>"], _ints(text_positions(eos, 2))))
    elif grid is not None:
        runs.append((SpanKind.BOUNDARY, ["<|vision_start|>"], _ints(text_positions(start, 1))))
        p = _ints(vision_positions(start + 1, grid, merge, [0.0]))
        runs.append((SpanKind.IMAGE, ["<|video_pad|>"] * p.shape[1], p))
        runs.append((SpanKind.BOUNDARY, ["<|vision_end|>"], _ints(text_positions(int(p.max()) + 1, 1))))
    elif n_audio:
        runs.append((SpanKind.BOUNDARY, ["<|audio_start|>"], _ints(text_positions(start, 1))))
        runs.append((SpanKind.AUDIO, ["<|audio_pad|>"] * n_audio, _ints(text_positions(start + 1, n_audio))))
        runs.append((SpanKind.BOUNDARY, ["<|audio_end|>"], _ints(text_positions(start + 1 + n_audio, 1))))
    else:
        raise MediaError("a media unit needs a frame, audio or both")
    return runs


def stream_units(setting: MediaSetting | None = None, *, patch: int = 16, merge: int = 2, n_window: int = 50,
                 sample_rate: int = 16000, frame: bool = True, audio: bool = True) -> StreamUnits:
    """The media unit (a frame and ``setting.audio_seconds`` of audio in an open turn) the adapter builds at
    ``setting`` (frame size ``setting.sim_frame_size``, pixel cap ``setting.max_pixels`` or the 128 x 32 x 32
    floor), for the simulator and the benchmarks. Defaults are the released model's."""
    setting = setting or MediaSetting()
    grid = size = None
    cap = setting.max_pixels or FRAME_MAX_PIXELS
    if frame:
        size = setting.sim_frame_size
        grid = frame_grid(size[0], size[1], patch, merge, FRAME_MIN_PIXELS, cap)
    n_audio = audio_token_count(int(round(setting.audio_seconds * sample_rate)) // HOP_LENGTH, n_window) if audio \
        else 0
    runs = media_runs(0, grid, n_audio, merge=merge)
    detail = (("merged_grid", [grid[1] // merge, grid[2] // merge] if grid else None), ("max_pixels", cap))
    return StreamUnits("qwen3_omni", setting, [(k, len(n)) for k, n, _ in runs],
                       np.concatenate([p for _, _, p in runs], axis=1), frame_size=size, detail=detail)


def kv_spec(config) -> KVSpec:
    """48 layers x 4 KV heads x 128 released; M-RoPE over 3 axes, NeoX halves over the whole head (a uniform shift
    of all axes is one plain rotation, so the cache's re-rotation after an eviction is exact)."""
    t = config.text_config
    return KVSpec(num_layers=t.num_hidden_layers, kv_heads=t.num_key_value_heads, head_dim=t.head_dim,
                  rope=RopeSpec(t.head_dim, t.rope_theta, traditional=False), position_axes=3)


def _text(start: int, n: int) -> np.ndarray:
    return np.broadcast_to(np.arange(start, start + n, dtype=np.int64), (3, n)).copy()


class Qwen3OmniAdapter(StreamAdapter):
    """One session's protocol state (whether a user turn opened by media units is still open) and the unit layouts
    over the MLX thinker (its token embeddings, vision encoder with DeepStack, and AuT)."""

    sample_rate = 16000

    def __init__(self, model, processor, *, frame_min_pixels: int = FRAME_MIN_PIXELS,
                 frame_max_pixels: int | None = None, system_prompt: str = "", media: MediaSetting | None = None):
        self.model = model
        self.processor = processor
        self.kv_spec = kv_spec(model.config)
        self.media = media or MediaSetting()
        self.frame_min_pixels = frame_min_pixels
        self.frame_max_pixels = frame_max_pixels or self.media.max_pixels or FRAME_MAX_PIXELS
        self.default_system_prompt = system_prompt
        ids = processor.token_ids
        c = model.config
        for name, cid in (("<|audio_pad|>", c.audio_token_id), ("<|image_pad|>", c.image_token_id),
                          ("<|video_pad|>", c.video_token_id), ("<|audio_start|>", c.audio_start_token_id),
                          ("<|audio_end|>", c.audio_end_token_id), ("<|vision_start|>", c.vision_start_token_id),
                          ("<|vision_end|>", c.vision_end_token_id)):
            if ids[name] != cid:
                raise ValueError(f"tokenizer and config disagree on {name}: {ids[name]} vs {cid}")
        self.ids = ids
        self.newline = processor.encode("\n")
        self.user_open = [ids["<|im_start|>"]] + processor.encode("user\n")
        self.turn_close = [ids["<|im_end|>"]] + self.newline + [ids["<|im_start|>"]] + processor.encode("assistant\n")
        self.stop_token_ids = frozenset({ids["<|im_end|>"], ids["<|endoftext|>"]})
        self.turn_open = False

    def stream_units(self, frame: bool = True, audio: bool = True) -> StreamUnits:
        """The media unit this adapter builds for a frame of the setting's size (see :func:`stream_units`)."""
        vs = self.processor.vision
        return stream_units(replace(self.media, max_pixels=self.frame_max_pixels), patch=vs.patch_size,
                            merge=vs.merge_size, n_window=self.model.config.audio_config.n_window,
                            sample_rate=self.sample_rate, frame=frame, audio=audio)

    def embed_tokens(self, ids) -> mx.array:
        return self.model.language_model.embed(mx.array(np.asarray(ids, dtype=np.int32)))

    def decode(self, ids) -> str:
        return self.processor.decode(ids, skip_special_tokens=True)

    def _text_unit(self, kind: UnitKind, runs, start: int, label: str = "") -> PreparedUnit:
        ids = [i for _, part in runs for i in part]
        return PreparedUnit(kind=kind, input_ids=np.asarray(ids, dtype=np.int32), inputs_embeds=self.embed_tokens(ids),
                            spans=spans_from_runs([(k, len(p)) for k, p in runs]), positions=_text(start, len(ids)),
                            label=label)

    def system_unit(self, prompt: str | None, start: int) -> PreparedUnit:
        prompt = self.default_system_prompt if prompt is None else prompt
        ids = [self.ids["<|im_start|>"]] + self.processor.encode(f"system\n{prompt}") + [self.ids["<|im_end|>"]] \
            + self.newline
        self.turn_open = False
        return self._text_unit(UnitKind.SYSTEM, [(SpanKind.SYSTEM, ids)], start, label="system")

    def user_unit(self, text: str, start: int) -> PreparedUnit:
        if not isinstance(text, str):
            raise TypeError(f"user text must be a string, got {type(text).__name__}")
        runs = [] if self.turn_open else [(SpanKind.BOUNDARY, self.user_open)]
        runs += [(SpanKind.TEXT, self.processor.encode(text)), (SpanKind.BOUNDARY, self.turn_close)]
        unit = self._text_unit(UnitKind.USER, runs, start, label=text[:40])
        self.turn_open = False
        return unit

    def context_unit(self, text: str, start: int) -> PreparedUnit:
        if not isinstance(text, str):
            raise TypeError(f"context text must be a string, got {type(text).__name__}")
        if not text:
            raise ValueError("context text is empty")
        runs = [] if self.turn_open else [(SpanKind.BOUNDARY, self.user_open)]
        unit = self._text_unit(UnitKind.USER, runs + [(SpanKind.TEXT, self.processor.encode(text))], start,
                               label=text[:40])
        self.turn_open = True
        return unit

    def finish_reply(self, generated: list[int], stopped: bool) -> list[int]:
        self.turn_open = False
        return [self.ids["<|im_end|>"]] + self.newline

    def _sized(self, frame: np.ndarray) -> np.ndarray:
        if self.media.frame_size is None:
            return frame
        w, h = self.media.frame_size
        return resize_bicubic(frame, h, w)

    def media_unit(self, frame: np.ndarray | None, audio: np.ndarray | None, t: float | None,
                   start: int) -> PreparedUnit:
        if frame is None and audio is None:
            raise MediaError("a media unit needs a frame, audio or both")
        vs = self.processor.vision
        rows = grid = mel = None
        if frame is not None:  # validate and preprocess everything before any model work
            rows, grid = vs.image(self._sized(check_frame(frame)), self.frame_min_pixels, self.frame_max_pixels)
        if audio is not None:
            a = check_audio(audio)
            if a.shape[0] < 2 * HOP_LENGTH:
                raise MediaError(f"audio of {a.shape[0]} samples is too short (needs >= {2 * HOP_LENGTH})")
            mel = self.processor.audio_features(a, self.sample_rate)
        ids, kinds, pos = [], [], []
        cursor = start
        if not self.turn_open:
            ids += self.user_open
            kinds += [SpanKind.BOUNDARY] * len(self.user_open)
            pos.append(_text(cursor, len(self.user_open)))
            cursor += len(self.user_open)
        n_audio = audio_token_count(mel.shape[1], self.model.config.audio_config.n_window) if mel is not None else 0
        for kind, names, p in media_runs(cursor, grid, n_audio, merge=vs.merge_size):
            ids += [self.ids[n] for n in names]
            kinds += [kind] * len(names)
            pos.append(p)
        input_ids = np.asarray(ids, dtype=np.int32)
        embeds = self.embed_tokens(input_ids)
        extras = {}
        if rows is not None:
            t0 = time.perf_counter()
            feats, levels = self.model.visual(mx.array(rows).astype(self.model.dtype), np.asarray([grid]))
            slots = np.nonzero(input_ids == self.ids["<|video_pad|>"])[0].astype(np.int32)
            embeds[mx.array(slots)] = feats.astype(embeds.dtype)
            if levels:
                extras["deepstack"] = (mx.array(slots), [f.astype(embeds.dtype) for f in levels])
            extras["vision_tokens"] = int(slots.size)
            extras["vision_s"] = time.perf_counter() - t0
        if mel is not None:
            t0 = time.perf_counter()
            feats = self.model.audio_tower(mx.array(mel).astype(self.model.dtype), [mel.shape[1]])
            slots = np.nonzero(input_ids == self.ids["<|audio_pad|>"])[0].astype(np.int32)
            embeds[mx.array(slots)] = feats.astype(embeds.dtype)
            extras["audio_tokens"] = int(slots.size)
            extras["audio_s"] = time.perf_counter() - t0
        self.turn_open = True
        label = "+".join(x for x, v in (("frame", rows), ("audio", mel)) if v is not None)
        return PreparedUnit(kind=UnitKind.MEDIA, input_ids=input_ids, inputs_embeds=embeds,
                            spans=spans_from_runs([(k, 1) for k in kinds]), positions=np.concatenate(pos, axis=1),
                            t=t, label=label, extras=extras)

    def state(self) -> tuple[dict, dict]:
        return {"turn_open": self.turn_open}, {}

    def load_state(self, meta: dict, arrays: dict) -> None:
        self.turn_open = bool(meta.get("turn_open", False))
