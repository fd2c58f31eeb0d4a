"""Qwen3-Omni's processor without torch: tokenizer, chat framing, image / video patches and audio features.

Built from Qwen2.5-Omni's pieces (models/qwen2_5_omni/processor.py: the Qwen2 byte-level BPE, ``smart_resize`` +
Pillow bicubic + patchify, Whisper log-mel) with Qwen3-Omni's settings and markers:

- images and video frames: 16-pixel patches, so sizes are multiples of 32; mean and std 0.5 (the released
  preprocessor_config.json); video frames within 128..768 x 32 x 32 pixels (transformers' processor default);
- placeholders ``<|image_pad|>``, ``<|video_pad|>``, ``<|audio_pad|>`` inside ``<|vision_start|> .. <|vision_end|>``
  and ``<|audio_start|> .. <|audio_end|>``; each expands to one token per LLM token, audio to
  ``audio_token_count(frames)`` (13 per second);
- audio: Whisper log-mel as the released processor computes one clip (``padding=True``, i.e. to the clip's own
  length): the centred STFT reflects the clip's own end (no trailing zeros) and the last frame is dropped, so a clip
  of n samples gives ``n // 160`` frames (Qwen2.5-Omni's processor pads to 300 s and gives ``ceil(n / 160)``);
- ``use_audio_in_video``: the video's ``<|video_pad|>`` becomes ``<|audio_start|>``, its video and audio tokens
  merged in time order (video t = frame-patch index x ``second_per_grid`` x 13, audio t = index), ``<|audio_end|>``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..audio_features import power_mel, resample
from ..base import MediaError
from ..loading import CheckpointError
from ..qwen2_5_omni.processor import VisionSettings, check_audio, load_tokenizer, read_preprocessor_config
from .rope_index import audio_token_count, interleave_order, video_t_index

MARKERS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
           "<|video_pad|>", "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>")
IMAGE, VIDEO, AUDIO = "<|image_pad|>", "<|video_pad|>", "<|audio_pad|>"
CLIP_HALF = (0.5, 0.5, 0.5)


def vision_settings(folder: Path | None) -> tuple[VisionSettings, dict]:
    """The image / video settings and audio keywords of a checkpoint's ``preprocessor_config.json`` (Qwen3-Omni's
    16-pixel patches and 0.5 mean / std where there is none), with transformers' Qwen3-Omni video pixel bounds."""
    vision, audio = read_preprocessor_config(folder) if folder is not None else (VisionSettings(), {})
    if folder is None or not (Path(folder) / "preprocessor_config.json").is_file():
        vision.patch_size, vision.image_mean, vision.image_std = 16, CLIP_HALF, CLIP_HALF
    vision.video_min_pixels, vision.video_max_pixels = 128 * 32 * 32, 768 * 32 * 32
    return vision, audio


class Processor:
    """Turns a prompt and media into the arrays ``Model.__call__`` takes (the names transformers uses)."""

    def __init__(self, tokenizer, vision: VisionSettings | None = None, *, sampling_rate: int = 16000,
                 n_mels: int = 128, n_fft: int = 400, hop_length: int = 160, position_id_per_seconds: float = 13,
                 n_window: int = 50):
        self.tokenizer = tokenizer
        self.vision = vision or vision_settings(None)[0]
        self.sampling_rate = sampling_rate
        self.n_mels, self.n_fft, self.hop_length = n_mels, n_fft, hop_length
        self.position_id_per_seconds = position_id_per_seconds
        self.n_window = n_window
        ids = {}
        for name in MARKERS:
            i = tokenizer.token_to_id(name)
            if i is None:
                raise CheckpointError(f"the tokenizer has no {name} token: not a Qwen3-Omni tokenizer")
            ids[name] = i
        self.token_ids = ids

    @classmethod
    def from_pretrained(cls, folder: Path, **kw) -> "Processor":
        folder = Path(folder)
        vision, audio = vision_settings(folder)
        return cls(load_tokenizer(folder), vision, **audio, **kw)

    # --- text ---------------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            system_prompt: str | None = None) -> str:
        """ChatML turns; media items become ``<|vision_start|><|image_pad|><|vision_end|>``,
        ``<|audio_start|><|audio_pad|><|audio_end|>`` or ``<|vision_start|><|video_pad|><|vision_end|>``. Unlike
        Qwen2.5-Omni's template, no system turn is inserted unless ``system_prompt`` is given."""
        out = []
        for i, msg in enumerate(messages):
            if i == 0 and msg["role"] != "system" and system_prompt is not None:
                out.append(f"<|im_start|>system\n{system_prompt}<|im_end|>\n")
            out.append(f"<|im_start|>{msg['role']}\n")
            content = msg["content"]
            if isinstance(content, str):
                out.append(content)
            else:
                for item in content:
                    kind = item.get("type")
                    if kind == "image" or "image" in item or "image_url" in item:
                        out.append(f"<|vision_start|>{IMAGE}<|vision_end|>")
                    elif kind == "audio" or "audio" in item or "audio_url" in item:
                        out.append(f"<|audio_start|>{AUDIO}<|audio_end|>")
                    elif kind == "video" or "video" in item:
                        out.append(f"<|vision_start|>{VIDEO}<|vision_end|>")
                    elif "text" in item:
                        out.append(item["text"])
            out.append("<|im_end|>\n")
        if add_generation_prompt:
            out.append("<|im_start|>assistant\n")
        return "".join(out)

    # --- media --------------------------------------------------------------------------------------------
    def audio_features(self, audio, sampling_rate: int | None = None) -> np.ndarray:
        """Log-mel ``[n_mels, n // hop]`` of one clip (resampled to 16 kHz first when needed), as
        ``WhisperFeatureExtractor(padding=True)`` computes a clip on its own."""
        a = check_audio(audio)
        sr = self.sampling_rate if sampling_rate is None else int(sampling_rate)
        if sr != self.sampling_rate:
            a = resample(a, sr, self.sampling_rate)
        if a.shape[0] < self.hop_length:
            raise MediaError(f"audio of {a.shape[0]} samples is shorter than one {self.hop_length}-sample frame")
        mel = power_mel(a.astype(np.float64), self.n_mels, sample_rate=self.sampling_rate, n_fft=self.n_fft,
                        hop_length=self.hop_length)[:, :-1]
        logm = np.log10(np.maximum(mel, 1e-10))
        logm = np.maximum(logm, logm.max() - 8.0)
        return ((logm + 4.0) / 4.0).astype(np.float32)

    def interleave_video_audio(self, grid_thw, second_per_grid: float, n_audio: int) -> str:
        """The text that replaces ``<|video_pad|>`` when the video's audio is used."""
        m = self.vision.merge_size
        t, h, w = (int(x) for x in grid_thw)
        video_t = np.repeat(video_t_index(t, second_per_grid, self.position_id_per_seconds), (h // m) * (w // m))
        runs = interleave_order(video_t, np.arange(n_audio, dtype=np.float32))
        return ("<|audio_start|>" + "".join((VIDEO if k == "video" else AUDIO) * (e - a) for k, a, e in runs)
                + "<|audio_end|>")

    def __call__(self, text: str | list[str], images=None, videos=None, audio=None, *,
                 use_audio_in_video: bool = False, sampling_rate: int | None = None, fps: float = 2.0,
                 image_min_pixels: int | None = None, image_max_pixels: int | None = None,
                 video_min_pixels: int | None = None, video_max_pixels: int | None = None) -> dict:
        """Arrays for ``Model.__call__`` (left-padded input_ids / attention_mask, pixel_values / image_grid_thw,
        pixel_values_videos / video_grid_thw / video_second_per_grid, input_features / feature_attention_mask).
        ``videos`` are sampled frame arrays ``[T, H, W, 3]`` at ``fps`` frames a second."""
        texts = [text] if isinstance(text, str) else list(text)
        out: dict = {}
        if images is not None:
            rows, grids = zip(*(self.vision.image(im, image_min_pixels, image_max_pixels) for im in images))
            out["pixel_values"] = np.concatenate(rows)
            out["image_grid_thw"] = np.asarray(grids, dtype=np.int64)
        if videos is not None:
            rows, grids = zip(*(self.vision.video(v, video_min_pixels, video_max_pixels) for v in videos))
            out["pixel_values_videos"] = np.concatenate(rows)
            out["video_grid_thw"] = np.asarray(grids, dtype=np.int64)
            out["video_second_per_grid"] = np.full(len(grids), self.vision.temporal_patch_size / fps)
        n_audio_tokens = []
        if audio is not None:
            mels = [self.audio_features(a, sampling_rate) for a in audio]
            width = max(m.shape[1] for m in mels)
            feats = np.zeros((len(mels), self.n_mels, width), dtype=np.float32)
            mask = np.zeros((len(mels), width), dtype=np.int32)
            for i, m in enumerate(mels):
                feats[i, :, :m.shape[1]] = m
                mask[i, :m.shape[1]] = 1
            out["input_features"], out["feature_attention_mask"] = feats, mask
            n_audio_tokens = [audio_token_count(m.shape[1], self.n_window) for m in mels]

        merge2 = self.vision.merge_size ** 2
        counters = {"image": 0, "video": 0, "audio": 0}

        def take(kind: str, available: int) -> int:
            i = counters[kind]
            if i >= available:
                raise ValueError(f"the prompt has more {kind} placeholders than {kind} inputs ({available})")
            counters[kind] += 1
            return i

        def expand(s: str) -> str:
            parts, rest = [], s
            while True:
                hits = [(rest.find(mk), mk) for mk in (IMAGE, VIDEO, AUDIO) if rest.find(mk) >= 0]
                if not hits:
                    parts.append(rest)
                    return "".join(parts)
                at, mk = min(hits)
                parts.append(rest[:at])
                rest = rest[at + len(mk):]
                if mk == IMAGE:
                    i = take("image", len(out.get("image_grid_thw", [])))
                    parts.append(mk * (int(np.prod(out["image_grid_thw"][i])) // merge2))
                elif mk == AUDIO:
                    parts.append(mk * n_audio_tokens[take("audio", len(n_audio_tokens))])
                else:
                    i = take("video", len(out.get("video_grid_thw", [])))
                    grid = out["video_grid_thw"][i]
                    if use_audio_in_video:
                        a = take("audio", len(n_audio_tokens))
                        parts.append(self.interleave_video_audio(grid, out["video_second_per_grid"][i],
                                                                 n_audio_tokens[a]))
                    else:
                        parts.append(mk * (int(np.prod(grid)) // merge2))

        ids = [self.encode(expand(t)) for t in texts]
        for kind, n in (("image", len(out.get("image_grid_thw", []))), ("video", len(out.get("video_grid_thw", []))),
                        ("audio", len(n_audio_tokens))):
            if counters[kind] != n:
                raise ValueError(f"{n} {kind} inputs but {counters[kind]} {kind} placeholders in the prompt")
        width = max(len(x) for x in ids)
        pad = self.token_ids["<|endoftext|>"]
        out["input_ids"] = np.asarray([[pad] * (width - len(x)) + x for x in ids], dtype=np.int64)
        out["attention_mask"] = np.asarray([[0] * (width - len(x)) + [1] * len(x) for x in ids], dtype=np.int64)
        if use_audio_in_video:
            out["use_audio_in_video"] = True
        return out
