"""MiniCPM-o's media-unit layout and slicing arithmetic, numpy-only (no MLX, no tokenizer).

The adapter (adapter.py) assembles a media unit from :func:`frame_runs` and :func:`media_runs`; the simulator
and the benchmarks take the same unit from :func:`stream_units`. The slicing arithmetic is the official
processor's (``get_sliced_grid`` / ``find_best_resize``, reference/minicpm_o_4_5.md 1.6); the processor's methods
call these functions.

A media unit inside an open user turn (the duplex ``streaming_prefill`` order)::

    <unit> <image> source(64) </image> (<slice> 64 </slice>) x slices  audio(10 a second)  </unit>

with no ``"\\n"`` between slice rows and no ``<image_id>`` (the duplex unit, unlike the offline chat placeholder).
"""

from __future__ import annotations

import math

from ...core.stream_units import MediaSetting, StreamUnits
from ...core.units import SpanKind

SCALE_RESOLUTION = 448  # preprocessor_config.json of the release
PATCH_SIZE = 14
QUERY_NUM = 64  # resampler queries: LLM tokens per source image or slice
AUDIO_POOL_STEP = 5  # 4.5: 10 audio tokens a second (2.6 pools by 2: 25 a second)
STREAMING_MAX_SLICE_NUMS = 1  # the official streaming calls: unsliced frames


def ensure_divide(length: float, divisor: int) -> int:
    return max(round(length / divisor) * divisor, divisor)


def find_best_resize(size, scale_resolution: int = SCALE_RESOLUTION, patch_size: int = PATCH_SIZE,
                     allow_upscale: bool = False) -> tuple[int, int]:
    w, h = size
    if w * h > scale_resolution ** 2 or allow_upscale:
        r = w / h
        h = int(scale_resolution / math.sqrt(r))
        w = int(h * r)
    return ensure_divide(w, patch_size), ensure_divide(h, patch_size)


def get_refine_size(size, grid, scale_resolution: int = SCALE_RESOLUTION, patch_size: int = PATCH_SIZE,
                    allow_upscale: bool = False) -> tuple[int, int]:
    w, h = size
    cols, rows = grid
    refine_w, refine_h = ensure_divide(w, cols), ensure_divide(h, rows)
    best = find_best_resize((refine_w / cols, refine_h / rows), scale_resolution, patch_size, allow_upscale)
    return best[0] * cols, best[1] * rows


def get_sliced_grid(size, max_slice_nums: int, scale_resolution: int = SCALE_RESOLUTION,
                    never_split: bool = False) -> list[int] | None:
    """``[cols, rows]`` of the slices of an image of ``size`` (w, h), or None when it is not sliced."""
    w, h = size
    log_ratio = math.log(w / h)
    multiple = min(math.ceil(w * h / scale_resolution ** 2), max_slice_nums)
    if multiple <= 1 or never_split:
        return None
    candidates = []
    for n in (multiple - 1, multiple, multiple + 1):
        if n == 1 or n > max_slice_nums:
            continue
        candidates += [[m, n // m] for m in range(1, n + 1) if n % m == 0]
    best, best_err = [1, 1], float("inf")
    for g in candidates:
        err = abs(log_ratio - math.log(g[0] / g[1]))
        if err < best_err:
            best, best_err = g, err
    return best


def conv_output_length(mel_frames: int) -> int:
    """Whisper encoder frames after conv2 (stride 2, padding 1)."""
    return (mel_frames - 1) // 2 + 1


def audio_token_count(mel_frames: int, pool_step: int = AUDIO_POOL_STEP) -> int:
    """LLM tokens for ``mel_frames`` mel frames (``_get_feat_extract_output_lengths``): 100 frames -> 10."""
    return (conv_output_length(mel_frames) - pool_step) // pool_step + 1


def frame_runs(n_slices: int, query_num: int = QUERY_NUM) -> list[tuple[SpanKind, str | None, int]]:
    """A frame's runs as ``(span kind, marker name or None for embeddings, count)``: the source image, then
    ``n_slices`` slices (``n_slices`` 0: unsliced, typed ``image``; else ``image_source`` + ``image_slice``)."""
    runs: list[tuple[SpanKind, str | None, int]] = [
        (SpanKind.BOUNDARY, "image", 1),
        (SpanKind.IMAGE_SOURCE if n_slices else SpanKind.IMAGE, None, query_num),
        (SpanKind.BOUNDARY, "image_end", 1)]
    for _ in range(n_slices):
        runs += [(SpanKind.BOUNDARY, "slice", 1), (SpanKind.IMAGE_SLICE, None, query_num),
                 (SpanKind.BOUNDARY, "slice_end", 1)]
    return runs


def slice_count(frame_size, max_slice_nums: int, scale_resolution: int = SCALE_RESOLUTION) -> int:
    """Slices (besides the source image) the processor cuts from a ``frame_size`` (w, h) frame."""
    grid = get_sliced_grid(frame_size, max_slice_nums, scale_resolution)
    return 0 if grid is None else grid[0] * grid[1]


def stream_units(setting: MediaSetting | None = None, *, query_num: int = QUERY_NUM,
                 audio_pool_step: int = AUDIO_POOL_STEP, scale_resolution: int = SCALE_RESOLUTION,
                 frame: bool = True, audio: bool = True) -> StreamUnits:
    """The media unit (frame and ``setting.audio_seconds`` of audio, open turn) the adapter builds at
    ``setting``; frame size ``setting.sim_frame_size``, ``max_slice_nums`` None = unsliced (streaming)."""
    setting = setting or MediaSetting()
    runs: list[tuple[SpanKind, int]] = [(SpanKind.BOUNDARY, 1)]  # <unit>
    size = grid = None
    if frame:
        size = setting.sim_frame_size
        slices = setting.max_slice_nums or STREAMING_MAX_SLICE_NUMS
        grid = get_sliced_grid(size, slices, scale_resolution)
        runs += [(k, n) for k, _, n in frame_runs(0 if grid is None else grid[0] * grid[1], query_num)]
    if audio:
        runs.append((SpanKind.AUDIO, audio_token_count(int(round(setting.audio_seconds * 100)), audio_pool_step)))
    runs.append((SpanKind.BOUNDARY, 1))  # </unit>
    detail = (("slice_grid", grid), ("max_slice_nums", setting.max_slice_nums or STREAMING_MAX_SLICE_NUMS))
    return StreamUnits.sequential("minicpmo", setting, runs, frame_size=size, detail=detail)
