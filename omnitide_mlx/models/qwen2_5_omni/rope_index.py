"""TMRoPE position ids (time-aligned multimodal RoPE), in numpy.

Every token gets a (t, h, w) position. Text and marker tokens advance all three together. An image or video
frame's merged patches share one temporal value and spread over h and w; video frames are ``second_per_grid *
25`` temporal units apart (truncated to an integer), audio tokens are one unit (40 ms) apart. In an audio-in-video
block the two bos markers share a position, video and audio tokens are interleaved in 2-second chunks (50 units),
and the two eos markers share a position. The next segment starts one past the largest position so far.

``get_rope_index`` follows transformers' ``Qwen2_5OmniPreTrainedModelForConditionalGeneration.get_rope_index``
token for token (including how it splits chunks); the small helpers are what the streaming adapter builds units
from.
"""

from __future__ import annotations

import numpy as np


def audio_token_count(mel_frames: int) -> int:
    """LLM tokens for an audio of ``mel_frames`` mel frames (100 per second): conv stride 2, then 2x pooling."""
    after_conv = (int(mel_frames) - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


def vision_positions(start: int, grid_thw, merge: int, t_index) -> np.ndarray:
    """``[3, t * h/merge * w/merge]`` positions of one image or video: frame-major, then row-major merged grid."""
    _, gh, gw = (int(x) for x in grid_thw)
    lh, lw = gh // merge, gw // merge
    t_index = np.asarray(t_index, dtype=np.int64)
    nt = t_index.shape[0]
    t = np.repeat(t_index, lh * lw)
    h = np.tile(np.repeat(np.arange(lh, dtype=np.int64), lw), nt)
    w = np.tile(np.arange(lw, dtype=np.int64), nt * lh)
    return np.stack([t, h, w]) + start


def video_t_index(grid_t: int, second_per_grid: float, position_id_per_seconds: int) -> np.ndarray:
    """Temporal offsets of a video's frames: ``int(t * second_per_grid * 25)``, computed in float32 like torch."""
    t = np.arange(int(grid_t), dtype=np.float32) * np.float32(second_per_grid) * np.float32(position_id_per_seconds)
    return t.astype(np.int64)


def chunked_index(token_values: np.ndarray, tokens_per_chunk: int, remove_index: int) -> list[tuple[int, int]]:
    """Split a non-decreasing run of temporal values into ``[start, end)`` index ranges, one per chunk of
    ``tokens_per_chunk`` units. Like transformers, a value that jumps past several chunk borders opens only one
    new chunk per token."""
    out, start, chunk = [], 0, 1
    for i, v in enumerate(np.asarray(token_values).tolist()):
        if v - remove_index >= chunk * tokens_per_chunk:
            out.append((start, i))
            start = i
            chunk += 1
    out.append((start, len(token_values)))
    return out


def text_positions(start: int, n: int) -> np.ndarray:
    return np.broadcast_to(np.arange(start, start + n, dtype=np.int64), (3, n)).copy()


def audio_in_video_positions(start: int, grid_thw, merge: int, second_per_grid: float, n_audio: int,
                             position_id_per_seconds: int = 25, seconds_per_chunk: int = 2
                             ) -> list[tuple[str, np.ndarray]]:
    """The interleaved middle of an audio-in-video block (between ``<|audio_bos|>`` and ``<|audio_eos|>``).

    ``start`` is the position of the shared bos pair; media positions begin at ``start + 1``. Returns the runs
    in token order: ``[("video" | "audio", positions [3, n]), ...]``. (transformers places the eos pair one past
    the largest position of the *last* run, not of the whole block.)
    """
    st = start + 1
    audio_pos = text_positions(st, n_audio)
    video_pos = vision_positions(st, grid_thw, merge,
                                 video_t_index(int(grid_thw[0]), second_per_grid, position_id_per_seconds))
    per_chunk = int(position_id_per_seconds * seconds_per_chunk)
    v_chunks = chunked_index(video_pos[0], per_chunk, st)
    a_chunks = chunked_index(audio_pos[0], per_chunk, st)
    runs = []
    for j in range(max(len(v_chunks), len(a_chunks))):
        if j < len(v_chunks):
            a, b = v_chunks[j]
            runs.append(("video", video_pos[:, a:b]))
        if j < len(a_chunks):
            a, b = a_chunks[j]
            runs.append(("audio", audio_pos[:, a:b]))
    return [(k, p) for k, p in runs if p.shape[1] > 0]


def get_rope_index(input_ids, image_grid_thw=None, video_grid_thw=None, attention_mask=None,
                   use_audio_in_video: bool = False, audio_seqlens=None, second_per_grids=None, *,
                   image_token_id: int, video_token_id: int, audio_token_id: int, vision_start_token_id: int,
                   audio_start_token_id: int, spatial_merge_size: int = 2, position_id_per_seconds: int = 25,
                   seconds_per_chunk: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Positions ``[3, B, S]`` and rope deltas ``[B, 1]`` for a batch, as transformers computes them.

    ``audio_seqlens`` are mel-frame counts (``feature_attention_mask.sum(-1)``), not token counts. Padded slots
    (``attention_mask`` 0) get position 1.
    """
    ids = np.asarray(input_ids, dtype=np.int64)
    if ids.ndim == 1:
        ids = ids[None]
    b, s = ids.shape
    mask = np.ones_like(ids, dtype=bool) if attention_mask is None else np.asarray(attention_mask) == 1
    img = None if image_grid_thw is None else np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3)
    vid = None if video_grid_thw is None else np.asarray(video_grid_thw, dtype=np.int64).reshape(-1, 3)
    aud = None if audio_seqlens is None else np.asarray(audio_seqlens, dtype=np.int64).reshape(-1)
    spg = None if second_per_grids is None else np.asarray(second_per_grids, dtype=np.float64).reshape(-1)
    if img is None and vid is None:
        pos = np.cumsum(mask, axis=-1) - 1
        pos = np.where(mask, pos, 1)
        pos3 = np.broadcast_to(pos, (3, b, s)).copy()
        deltas = pos3.max(axis=(0, 2)) + 1 - mask.sum(-1)
        return pos3, deltas.reshape(b, 1)

    positions = np.ones((3, b, s), dtype=np.int64)
    deltas = []
    image_idx = video_idx = audio_idx = 0
    merge = spatial_merge_size
    for i in range(b):
        tokens = ids[i][mask[i]].tolist()
        n_tok = len(tokens)
        starts = [k for k, t in enumerate(tokens) if t == vision_start_token_id]
        after = [tokens[k + 1] for k in starts if k + 1 < n_tok]
        n_audio = sum(1 for t in tokens if t == audio_start_token_id)
        n_image = sum(1 for t in after if t == image_token_id)
        n_video = sum(1 for t in after if t == (audio_start_token_id if use_audio_in_video else video_token_id))
        parts: list[np.ndarray] = []

        def nxt() -> int:
            return int(parts[-1].max()) + 1 if parts else 0

        def index_or_end(token: int, remaining: int, st: int) -> int:
            if remaining > 0 and token in tokens[st:]:
                return tokens.index(token, st)
            return n_tok + 1

        st = 0
        rem_img, rem_vid, rem_aud = n_image, n_video, n_audio
        total = n_image + n_audio if use_audio_in_video else n_image + n_video + n_audio
        for _ in range(total):
            ed_image = index_or_end(image_token_id, rem_img, st)
            ed_video = index_or_end(video_token_id, rem_vid, st)
            ed_audio = index_or_end(audio_token_id, rem_aud, st)
            min_ed = min(ed_image, ed_video, ed_audio)
            if min_ed == ed_audio:
                text_len = min_ed - st - 1
                if text_len != 0:
                    parts.append(text_positions(nxt(), text_len))
                parts.append(text_positions(nxt(), 1))
                a_len = audio_token_count(aud[audio_idx])
                parts.append(text_positions(nxt(), a_len))
                parts.append(text_positions(nxt(), 1))
                st += text_len + 2 + a_len
                audio_idx += 1
                rem_aud -= 1
            elif min_ed == ed_image:
                text_len = min_ed - st - 1
                if text_len != 0:
                    parts.append(text_positions(nxt(), text_len))
                parts.append(text_positions(nxt(), 1))
                g = img[image_idx]
                t_index = np.arange(g[0], dtype=np.int64) * position_id_per_seconds
                parts.append(vision_positions(nxt(), g, merge, t_index))
                parts.append(text_positions(nxt(), 1))
                st += text_len + 2 + int(g.prod()) // merge ** 2
                image_idx += 1
                rem_img -= 1
            elif min_ed == ed_video and not use_audio_in_video:
                text_len = min_ed - st - 1
                if text_len != 0:
                    parts.append(text_positions(nxt(), text_len))
                parts.append(text_positions(nxt(), 1))
                g = vid[video_idx]
                parts.append(vision_positions(nxt(), g, merge,
                                              video_t_index(g[0], spg[video_idx], position_id_per_seconds)))
                parts.append(text_positions(nxt(), 1))
                st += text_len + 2 + int(g.prod()) // merge ** 2
                video_idx += 1
                rem_vid -= 1
            elif min_ed == ed_video and use_audio_in_video:
                text_len = min_ed - st - 2
                if text_len != 0:
                    parts.append(text_positions(nxt(), text_len))
                bos = nxt()
                parts.append(text_positions(bos, 1))
                parts.append(text_positions(bos, 1))
                g = vid[video_idx]
                a_len = audio_token_count(aud[audio_idx])
                for _, run in audio_in_video_positions(bos, g, merge, spg[video_idx], a_len,
                                                       position_id_per_seconds, seconds_per_chunk):
                    parts.append(run)
                eos = nxt()
                parts.append(text_positions(eos, 1))
                parts.append(text_positions(eos, 1))
                st += text_len + 4 + a_len + int(g.prod()) // merge ** 2
                audio_idx += 1
                video_idx += 1
                rem_vid -= 1
                rem_aud -= 1
        if st < n_tok:
            parts.append(text_positions(nxt(), n_tok - st))
        llm = np.concatenate(parts, axis=1)
        positions[:, i, mask[i]] = llm
        deltas.append(int(llm.max()) + 1 - n_tok)
    return positions, np.asarray(deltas, dtype=np.int64).reshape(b, 1)
