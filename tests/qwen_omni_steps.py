"""The streamed steps both Qwen2.5-Omni streaming tests use (MLX: tests/models/qwen2_5_omni/test_streaming.py,
PyTorch: tests/torch/test_torch_qwen.py): random frames and audio, the system / frame+audio / question sequence,
the unit a step prepares, and the offline processor inputs of the same sequence. Numpy only.

Offline reference: every unit's frame is a separate one-grid video (the frame duplicated to the temporal patch,
1 s per grid) and its audio a separate clip, in one sequence with ``use_audio_in_video=True``.
"""

import numpy as np

from omnitide_mlx.models.qwen2_5_omni.layout import FRAME_MAX_PIXELS, FRAME_MIN_PIXELS

TOL = 2e-5  # float32 against float32; logits of magnitude ~4
SR = 16000


def random_frame(rng, h, w):
    return rng.integers(0, 256, (h, w, 3), dtype=np.uint8)


def random_audio(rng, seconds):
    return (0.1 * rng.standard_normal(int(SR * seconds))).astype(np.float32)


def av_steps(seed=0):
    """System, three frame+audio seconds (one with 2.4 s of audio, two encoder / interleave chunks), one
    audio-only second, then the question."""
    rng = np.random.default_rng(seed)
    return [("system", None),
            ("media", (random_frame(rng, 112, 112), random_audio(rng, 1.0))),
            ("media", (random_frame(rng, 84, 112), random_audio(rng, 1.5))),
            ("media", (None, random_audio(rng, 1.0))),
            ("media", (random_frame(rng, 112, 84), random_audio(rng, 2.4))),
            ("user", "What happened in these seconds?")]


def prepare_unit(adapter, kind, args, index, start):
    """The adapter's unit for step ``index`` of a step list (``kind``: system / media / context / user)."""
    if kind == "system":
        return adapter.system_unit(args, start)
    if kind == "media":
        return adapter.media_unit(*args, t=float(index), start=start)
    if kind == "context":
        return adapter.context_unit(args, start)
    return adapter.user_unit(args, start)


def offline_inputs(proc, units, steps):
    """The concatenated sequence as processor outputs (the same frames and clips as separate videos / audios)."""
    rows, grids, mels = [], [], []
    for kind, args in steps:
        if kind != "media":
            continue
        frame, audio = args
        if frame is not None:
            r, g = proc.vision.image(frame, FRAME_MIN_PIXELS, FRAME_MAX_PIXELS)
            rows.append(r)
            grids.append(g)
        if audio is not None:
            mels.append(proc.audio_features(audio))
    width = max(m.shape[1] for m in mels)
    feats = np.zeros((len(mels), 128, width), np.float32)
    mask = np.zeros((len(mels), width), np.int32)
    for i, m in enumerate(mels):
        feats[i, :, :m.shape[1]], mask[i, :m.shape[1]] = m, 1
    ids = np.concatenate([u.input_ids for u in units]).astype(np.int64)[None]
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "pixel_values_videos": np.concatenate(rows),
            "video_grid_thw": np.asarray(grids, np.int64), "video_second_per_grid": np.ones(len(grids)),
            "input_features": feats, "feature_attention_mask": mask, "use_audio_in_video": True}
