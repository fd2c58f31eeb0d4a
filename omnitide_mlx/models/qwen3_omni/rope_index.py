"""Qwen3-Omni's M-RoPE position ids, in numpy, as transformers 5.24's ``get_rope_index`` computes them.

Every token gets a (t, h, w) position. Text and marker tokens advance all three together. An image's merged patches
share one t and spread over h and w; video frames are ``second_per_grid * position_id_per_seconds`` t-units apart
(13 units a second released; *not* truncated to an integer: positions are float32, as in transformers); audio tokens
are one unit apart (the AuT encoder gives 12.5 tokens a second, so audio runs about one unit per 80 ms).

Differences from Qwen2.5-Omni's TMRoPE (models/qwen2_5_omni/rope_index.py), each checked against transformers:

- audio-in-video: the two bos markers (``<|vision_start|><|audio_start|>``) take two consecutive positions, as do the
  two eos markers, where Qwen2.5 gives each pair one shared position;
- video and audio tokens interleave token by token in time order (a video token first on a tie), not in 2-second
  chunks; the processor lays the placeholders out the same way;
- the eos pair starts one past the largest position of the *last interleaved token* (the audio's t when the audio
  runs last), not of the whole block, so it can fall below a video token's h/w positions;
- audio token counts follow the AuT's 100-frame chunks (``audio_token_count``).
"""

from __future__ import annotations

import numpy as np


def audio_token_count(mel_frames, n_window: int = 50):
    """LLM tokens for ``mel_frames`` mel frames (100 a second): 13 per full chunk of ``2 * n_window`` frames, and
    three stride-2 convolutions over the remainder."""
    n = np.asarray(mel_frames, dtype=np.int64)
    chunk = 2 * n_window
    rest = n % chunk
    f = (rest - 1) // 2 + 1
    out = ((f - 1) // 2 + 1 - 1) // 2 + 1 + (n // chunk) * 13
    return int(out) if out.ndim == 0 else out


def text_positions(start, n: int) -> np.ndarray:
    return (np.broadcast_to(np.arange(n, dtype=np.float32), (3, n)) + np.float32(start)).astype(np.float32)


def vision_positions(start, grid_thw, merge: int, t_index) -> np.ndarray:
    """``[3, t * h/merge * w/merge]`` positions of one image or video: frame-major, then row-major merged grid."""
    _, gh, gw = (int(x) for x in grid_thw)
    lh, lw = gh // merge, gw // merge
    t_index = np.asarray(t_index, dtype=np.float32)
    nt = t_index.shape[0]
    t = np.repeat(t_index, lh * lw)
    h = np.tile(np.repeat(np.arange(lh, dtype=np.float32), lw), nt)
    w = np.tile(np.arange(lw, dtype=np.float32), nt * lh)
    return np.stack([t, h, w]) + np.float32(start)


def video_t_index(grid_t: int, second_per_grid: float, position_id_per_seconds: float) -> np.ndarray:
    """t offsets of a video's temporal patches, in float32 like torch (``arange * float32(spg) * pps``)."""
    return (np.arange(int(grid_t)).astype(np.float32) * np.float32(second_per_grid)
            * np.float32(position_id_per_seconds)).astype(np.float32)


def interleave_order(video_t, audio_t) -> list[tuple[str, int, int]]:
    """The token order of an audio-in-video block: runs ``(kind, start, end)`` over the video's tokens (t values
    ``video_t``) and the audio's (``audio_t``), merged by time, a video token first on a tie."""
    runs: list[tuple[str, int, int]] = []
    v = a = 0
    nv, na = len(video_t), len(audio_t)
    while v < nv or a < na:
        if a >= na or (v < nv and video_t[v] <= audio_t[a]):
            kind, i = "video", v
            v += 1
        else:
            kind, i = "audio", a
            a += 1
        if runs and runs[-1][0] == kind:
            runs[-1] = (kind, runs[-1][1], i + 1)
        else:
            runs.append((kind, i, i + 1))
    return runs


def get_rope_index(input_ids, image_grid_thw=None, video_grid_thw=None, attention_mask=None,
                   use_audio_in_video: bool = False, audio_seqlens=None, second_per_grids=None, *,
                   image_token_id: int, video_token_id: int, audio_token_id: int, vision_start_token_id: int,
                   audio_start_token_id: int, spatial_merge_size: int = 2, position_id_per_seconds: float = 13,
                   n_window: int = 50) -> tuple[np.ndarray, np.ndarray]:
    """Positions ``[3, B, S]`` (float32) and rope deltas ``[B, 1]`` for a batch, as transformers computes them.

    ``audio_seqlens`` are mel-frame counts (``feature_attention_mask.sum(-1)``). Padded slots get position 1 on the
    text-only path and 0 on the media path (transformers' two branches differ there; padded slots are masked out)."""
    ids = np.asarray(input_ids, dtype=np.int64)
    if ids.ndim == 1:
        ids = ids[None]
    b, s = ids.shape
    mask = np.ones_like(ids, dtype=bool) if attention_mask is None else np.asarray(attention_mask) == 1
    img = None if image_grid_thw is None else np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3)
    vid = None if video_grid_thw is None else np.asarray(video_grid_thw, dtype=np.int64).reshape(-1, 3)
    aud = None if audio_seqlens is None else np.asarray(audio_seqlens, dtype=np.int64).reshape(-1)
    spg = None if second_per_grids is None else np.asarray(second_per_grids, dtype=np.float32).reshape(-1)
    if img is None and vid is None:
        pos = np.cumsum(mask, axis=-1).astype(np.float32) - 1
        pos = np.where(mask, pos, np.float32(1))
        pos3 = np.broadcast_to(pos, (3, b, s)).copy()
        deltas = pos3.max(axis=(0, 2)) + 1 - mask.sum(-1)
        return pos3, deltas.reshape(b, 1).astype(np.float32)

    positions = np.zeros((3, b, s), dtype=np.float32)
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
        st = 0
        rem_img, rem_vid, rem_aud = n_image, n_video, n_audio
        total = n_image + n_audio if use_audio_in_video else n_image + n_video + n_audio
        has_vision = image_token_id in tokens or video_token_id in tokens
        for _ in range(total):
            st_idx = parts[-1].max() + 1 if parts else np.float32(0)
            if has_vision and (rem_vid > 0 or rem_img > 0):
                ed_vision = tokens.index(vision_start_token_id, st)
            else:
                ed_vision = n_tok + 1
            if audio_token_id in tokens and rem_aud > 0:
                ed_audio = tokens.index(audio_start_token_id, st)
            else:
                ed_audio = n_tok + 1
            min_ed = min(ed_vision, ed_audio)
            text_len = min_ed - st
            if text_len:
                parts.append(text_positions(st_idx, text_len))
                st_idx = st_idx + text_len
            in_video = min_ed == ed_vision and ed_vision + 1 == ed_audio
            bos_len = eos_len = 2 if in_video else 1
            parts.append(text_positions(st_idx, bos_len))
            st_idx = st_idx + bos_len
            if min_ed == ed_audio:
                a_len = audio_token_count(aud[audio_idx], n_window)
                parts.append(text_positions(st_idx, a_len))
                st += text_len + bos_len + a_len + eos_len
                audio_idx += 1
                rem_aud -= 1
            elif min_ed == ed_vision and tokens[ed_vision + 1] == image_token_id:
                g = img[image_idx]
                t_index = np.arange(g[0]).astype(np.float32) * np.float32(position_id_per_seconds)
                parts.append(vision_positions(st_idx, g, merge, t_index))
                st += text_len + bos_len + int(g.prod()) // merge ** 2 + eos_len
                image_idx += 1
                rem_img -= 1
            elif min_ed == ed_vision and tokens[ed_vision + 1] == video_token_id:
                g = vid[video_idx]
                parts.append(vision_positions(st_idx, g, merge,
                                              video_t_index(g[0], spg[video_idx], position_id_per_seconds)))
                st += text_len + bos_len + int(g.prod()) // merge ** 2 + eos_len
                video_idx += 1
                rem_vid -= 1
            elif in_video:
                a_len = audio_token_count(aud[audio_idx], n_window)
                g = vid[video_idx]
                t_index = video_t_index(g[0], spg[video_idx], position_id_per_seconds)
                video_pos = vision_positions(st_idx, g, merge, t_index)
                audio_pos = text_positions(st_idx, a_len)
                for kind, a, e in interleave_order(video_pos[0], audio_pos[0]):
                    parts.append((video_pos if kind == "video" else audio_pos)[:, a:e])
                st += text_len + bos_len + a_len + int(g.prod()) // merge ** 2 + eos_len
                audio_idx += 1
                video_idx += 1
                rem_vid -= 1
                rem_aud -= 1
            st_idx = parts[-1].max() + 1 if parts else np.float32(0)
            parts.append(text_positions(st_idx, eos_len))
        if st < n_tok:
            st_idx = parts[-1].max() + 1 if parts else np.float32(0)
            parts.append(text_positions(st_idx, n_tok - st))
        llm = np.concatenate(parts, axis=1).astype(np.float32)
        positions[:, i, mask[i]] = llm
        deltas.append(llm.max() + 1 - n_tok)
    return positions, np.asarray(deltas, dtype=np.float32).reshape(b, 1)
