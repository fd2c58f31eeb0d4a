"""Qwen2.5-Omni's processor without torch: tokenizer, chat template, image / video patches and audio features.

- Tokenizer: the checkpoint's ``tokenizer.json`` when it has one, else rebuilt with the ``tokenizers`` library from
  its ``vocab.json`` + ``merges.txt`` (the Qwen2 byte-level BPE) and the special tokens of ``tokenizer_config.json``
  (or, when that is missing, Qwen2.5-Omni's special-token table placed right after the vocabulary).
- Images: ``smart_resize`` to multiples of 28 pixels inside the pixel budget, Pillow bicubic (what transformers'
  PIL image processor uses), CLIP normalisation, then patches of 2 (duplicated) frames x 14 x 14 in merge-block
  order. Video: frames sampled at 2 fps (OpenCV decodes files), the same per frame with the video pixel budget,
  two frames per temporal patch; ``video_second_per_grid`` = 2 / fps.
- Audio: Whisper log-mel (128 bins, 16 kHz, ``models/audio_features.log_mel``), other sample rates resampled.
  ``input_features`` is padded to the longest clip (transformers pads to 300 s; the model only reads the frames
  ``feature_attention_mask`` marks, so both give the same result).
- Placeholders in the prompt (``<|IMAGE|>``, ``<|AUDIO|>``, ``<|VIDEO|>``) are expanded to one token per LLM
  token, as transformers' processor does, including the chunk-interleaved audio-in-video layout.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..audio_features import log_mel, resample
from ..base import MediaError
from ..loading import CheckpointError
from .rope_index import audio_token_count, chunked_index

DEFAULT_SYSTEM_PROMPT = ("You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of "
                         "perceiving auditory and visual inputs, as well as generating text and speech.")
TEMPLATE_SYSTEM_PROMPT = "You are a helpful assistant."  # what the released chat template inserts by default

# Qwen2.5-Omni's added tokens, in id order right after the 151,643 BPE tokens (151643 + index).
SPECIAL_TOKENS: list[tuple[str, bool]] = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|AUDIO|>", True),
    ("<|audio_bos|>", True), ("<|audio_eos|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_bos|>", True), ("<|vision_eos|>", True), ("<|vision_pad|>", True),
    ("<|IMAGE|>", True), ("<|VIDEO|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False),
]

PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                     r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


# --- tokenizer ------------------------------------------------------------------------------------------------
def build_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]], added: list[dict]):
    """The Qwen2 byte-level BPE pipeline (NFC, regex split, byte level) with ``added`` tokens at their ids."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, continuing_subword_prefix="",
                               end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    added = sorted(added, key=lambda t: t["id"])
    for t in added:
        if t["id"] != tok.get_vocab_size(with_added_tokens=True):
            raise CheckpointError(f"added token {t['content']!r} has id {t['id']}, but the vocabulary continues at "
                                  f"{tok.get_vocab_size(with_added_tokens=True)}")
        tok.add_tokens([AddedToken(t["content"], special=t.get("special", True), normalized=t.get("normalized", False),
                                   lstrip=t.get("lstrip", False), rstrip=t.get("rstrip", False),
                                   single_word=t.get("single_word", False))])
    return tok


def read_bpe_files(folder: Path) -> tuple[dict[str, int], list[tuple[str, str]]]:
    with open(folder / "vocab.json", encoding="utf-8") as f:
        vocab = json.load(f)
    with open(folder / "merges.txt", encoding="utf-8") as f:
        merges = [tuple(line.split(" ")) for line in f.read().split("\n") if line and not line.startswith("#version")]
    return vocab, merges


def load_tokenizer(folder: Path):
    """The checkpoint's tokenizer: ``tokenizer.json``, or rebuilt from ``vocab.json`` + ``merges.txt``."""
    from tokenizers import Tokenizer

    folder = Path(folder)
    if (folder / "tokenizer.json").is_file():
        return Tokenizer.from_file(str(folder / "tokenizer.json"))
    if not ((folder / "vocab.json").is_file() and (folder / "merges.txt").is_file()):
        raise CheckpointError(f"{folder} has no tokenizer (tokenizer.json, or vocab.json + merges.txt)")
    vocab, merges = read_bpe_files(folder)
    added = None
    cfg_file = folder / "tokenizer_config.json"
    if cfg_file.is_file():
        with open(cfg_file, encoding="utf-8") as f:
            decoder = json.load(f).get("added_tokens_decoder")
        if decoder:
            added = [dict(v, id=int(k)) for k, v in decoder.items()]
    if added is None:
        base = max(vocab.values()) + 1
        added = [{"content": c, "special": s, "id": base + i} for i, (c, s) in enumerate(SPECIAL_TOKENS)]
    return build_tokenizer(vocab, merges, added)


# --- images and video -----------------------------------------------------------------------------------------
def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 14 * 14 * 4 * 1280) -> tuple[int, int]:
    """Height and width rounded to multiples of ``factor``, aspect ratio kept, area within the pixel budget."""
    if min(height, width) < 1:
        raise MediaError(f"image of {width}x{height} pixels is empty")
    if max(height, width) / min(height, width) > 200:
        raise MediaError(f"image aspect ratio {max(height, width) / min(height, width):.0f} is over 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def check_frame(frame, name: str = "frame") -> np.ndarray:
    """An ``HxWx3`` uint8 RGB array, or MediaError."""
    if frame is None:
        raise MediaError(f"{name} is None")
    if hasattr(frame, "convert") and hasattr(frame, "size"):  # a PIL image
        frame = np.asarray(frame.convert("RGB"))
    arr = np.asarray(frame)
    if arr.ndim != 3 or arr.shape[2] != 3:
        raise MediaError(f"{name} has shape {arr.shape}; expected HxWx3 RGB")
    if arr.dtype != np.uint8:
        raise MediaError(f"{name} has dtype {arr.dtype}; expected uint8")
    if arr.shape[0] < 2 or arr.shape[1] < 2:
        raise MediaError(f"{name} is {arr.shape[1]}x{arr.shape[0]} pixels: too small")
    return arr


def resize_bicubic(frame: np.ndarray, height: int, width: int) -> np.ndarray:
    """Pillow's bicubic resize of a uint8 ``HxWx3`` frame (the transformers PIL image processor's resample)."""
    from PIL import Image

    if frame.shape[:2] == (height, width):
        return frame
    return np.asarray(Image.fromarray(frame).resize((width, height), resample=Image.BICUBIC))


@dataclass
class VisionSettings:
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 12845056  # the released preprocessor_config.json
    video_min_pixels: int = 128 * 28 * 28
    video_max_pixels: int = 768 * 28 * 28
    image_mean: tuple = CLIP_MEAN
    image_std: tuple = CLIP_STD

    def normalize(self, frame: np.ndarray) -> np.ndarray:
        """uint8 ``HxWx3`` -> float32 ``3xHxW``, rescaled and normalised as transformers does (float32 math)."""
        x = (frame.astype(np.float64) * (1 / 255)).astype(np.float32).transpose(2, 0, 1)
        mean = np.asarray(self.image_mean, dtype=np.float32)[:, None, None]
        std = np.asarray(self.image_std, dtype=np.float32)[:, None, None]
        return (x - mean) / std

    def patchify(self, frames: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        """Normalised frames ``[T, 3, H, W]`` (T a multiple of the temporal patch) -> rows ``[N, 3*tp*p*p]`` in
        merge-block order, and the grid ``(t, h, w)`` in patches."""
        t, c, h, w = frames.shape
        p, tp, m = self.patch_size, self.temporal_patch_size, self.merge_size
        gt, gh, gw = t // tp, h // p, w // p
        x = frames.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p)
        x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # gt, bh, bw, mh, mw, C, tp, ph, pw
        return np.ascontiguousarray(x.reshape(gt * gh * gw, c * tp * p * p)), (gt, gh, gw)

    def image(self, frame, min_pixels: int | None = None, max_pixels: int | None = None):
        """One image -> (rows, grid): resized, normalised, the frame duplicated to the temporal patch."""
        frame = check_frame(frame, "image")
        f = self.patch_size * self.merge_size
        h, w = smart_resize(frame.shape[0], frame.shape[1], f, min_pixels or self.min_pixels,
                            max_pixels or self.max_pixels)
        x = self.normalize(resize_bicubic(frame, h, w))
        return self.patchify(np.repeat(x[None], self.temporal_patch_size, axis=0))

    def video(self, frames, min_pixels: int | None = None, max_pixels: int | None = None):
        """Sampled frames ``[T, H, W, 3]`` uint8 -> (rows, grid); T is padded with the last frame to a multiple of
        the temporal patch."""
        frames = [check_frame(fr, f"video frame {i}") for i, fr in enumerate(frames)]
        if not frames:
            raise MediaError("video has no frames")
        if len({fr.shape for fr in frames}) != 1:
            raise MediaError("video frames differ in size")
        f = self.patch_size * self.merge_size
        h, w = smart_resize(frames[0].shape[0], frames[0].shape[1], f, min_pixels or self.video_min_pixels,
                            max_pixels or self.video_max_pixels)
        x = np.stack([self.normalize(resize_bicubic(fr, h, w)) for fr in frames])
        if pad := -len(frames) % self.temporal_patch_size:
            x = np.concatenate([x, np.repeat(x[-1:], pad, axis=0)])
        return self.patchify(x)


def read_preprocessor_config(folder: Path) -> tuple[VisionSettings, dict]:
    """The vision settings and the audio feature keywords of a checkpoint's ``preprocessor_config.json`` (the
    defaults where it has none): JSON only, no tokenizer, no weights."""
    vision, audio = VisionSettings(), {}
    pp = Path(folder) / "preprocessor_config.json"
    if pp.is_file():
        with open(pp, encoding="utf-8") as f:
            cfg = json.load(f)
        for k in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
            if k in cfg:
                setattr(vision, k, int(cfg[k]))
        for k in ("image_mean", "image_std"):
            if k in cfg:
                setattr(vision, k, tuple(cfg[k]))
        for k, name in (("feature_size", "n_mels"), ("sampling_rate", "sampling_rate"), ("n_fft", "n_fft"),
                        ("hop_length", "hop_length")):
            if k in cfg:
                audio[name] = int(cfg[k])
    return vision, audio


def sample_frame_indices(total_frames: int, video_fps: float, fps: float = 2.0, temporal_patch: int = 2,
                         min_frames: int = 4, max_frames: int = 768) -> np.ndarray:
    """Which frames to keep to sample ``fps`` frames a second (transformers' Qwen2-VL rule)."""
    max_frames = math.floor(min(max_frames, total_frames) / temporal_patch) * temporal_patch
    n = total_frames / video_fps * fps
    n = min(max(n, min_frames), max_frames, total_frames)
    n = math.floor(n / temporal_patch) * temporal_patch
    if n <= 0:
        raise MediaError(f"a video of {total_frames} frames is too short to sample")
    return np.arange(0, total_frames, total_frames / n).astype(np.int64)[:n]


def read_video(path, fps: float = 2.0) -> tuple[np.ndarray, float]:
    """Decode a video file with OpenCV and sample it at ``fps``: (frames ``[T, H, W, 3]`` uint8 RGB, fps used).

    Decodes sequentially and keeps only the sampled frames; when the container's frame count is wrong, a second
    pass samples from the true count."""
    import cv2

    def decode(keep: set[int] | None) -> tuple[dict[int, np.ndarray], int, float]:
        cap = cv2.VideoCapture(str(path))
        try:
            if not cap.isOpened():
                raise MediaError(f"cannot open video {path}")
            video_fps, reported = cap.get(cv2.CAP_PROP_FPS), int(cap.get(cv2.CAP_PROP_FRAME_COUNT))
            if keep is None and reported > 0 and video_fps and math.isfinite(video_fps) and video_fps > 0:
                keep = set(sample_frame_indices(reported, video_fps, fps).tolist())
            frames, n = {}, 0
            while True:
                if keep is not None and not cap.grab():
                    break
                if keep is not None:
                    if n in keep:
                        ok, bgr = cap.retrieve()
                        if ok:
                            frames[n] = cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
                else:
                    ok, bgr = cap.read()
                    if not ok:
                        break
                    frames[n] = cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
                n += 1
            return frames, n, video_fps
        finally:
            cap.release()

    frames, total, video_fps = decode(None)
    if total == 0:
        raise MediaError(f"no frame of {path} could be decoded")
    if not video_fps or not math.isfinite(video_fps) or video_fps <= 0:
        raise MediaError(f"video {path} reports no usable frame rate")
    idx = sample_frame_indices(total, video_fps, fps).tolist()
    if any(i not in frames for i in idx):  # the reported frame count was off: sample again from the true one
        frames, _, _ = decode(set(idx))
    return np.stack([frames[i] for i in idx]), fps


# --- audio ----------------------------------------------------------------------------------------------------
def check_audio(audio, name: str = "audio") -> np.ndarray:
    """Finite, non-empty, 1-D float audio, or MediaError."""
    if audio is None:
        raise MediaError(f"{name} is None")
    a = np.asarray(audio)
    if a.ndim != 1:
        raise MediaError(f"{name} has shape {a.shape}; expected mono samples [n]")
    if a.size == 0:
        raise MediaError(f"{name} is empty")
    if not np.issubdtype(a.dtype, np.floating):
        raise MediaError(f"{name} has dtype {a.dtype}; expected float samples")
    if not np.isfinite(a).all():
        raise MediaError(f"{name} holds NaN or infinite samples")
    return a.astype(np.float32)


# --- the processor --------------------------------------------------------------------------------------------
class Processor:
    """Turns a prompt and media into the arrays ``Model.__call__`` takes (the names transformers uses)."""

    def __init__(self, tokenizer, vision: VisionSettings | None = None, *, sampling_rate: int = 16000,
                 n_mels: int = 128, n_fft: int = 400, hop_length: int = 160, position_id_per_seconds: int = 25,
                 seconds_per_chunk: int = 2):
        self.tokenizer = tokenizer
        self.vision = vision or VisionSettings()
        self.sampling_rate = sampling_rate
        self.n_mels, self.n_fft, self.hop_length = n_mels, n_fft, hop_length
        self.position_id_per_seconds = position_id_per_seconds
        self.seconds_per_chunk = seconds_per_chunk
        ids = {}
        for name in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>",
                     "<|vision_bos|>", "<|vision_eos|>", "<|IMAGE|>", "<|VIDEO|>"):
            i = tokenizer.token_to_id(name)
            if i is None:
                raise CheckpointError(f"the tokenizer has no {name} token: not a Qwen2.5-Omni tokenizer")
            ids[name] = i
        self.token_ids = ids

    @classmethod
    def from_pretrained(cls, folder: Path, **kw) -> "Processor":
        folder = Path(folder)
        vision, audio = read_preprocessor_config(folder)
        return cls(load_tokenizer(folder), vision, **audio, **kw)

    # --- text ---------------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            system_prompt: str | None = TEMPLATE_SYSTEM_PROMPT) -> str:
        """Qwen2.5-Omni's chat template: ChatML turns; media items become ``<|vision_bos|><|IMAGE|><|vision_eos|>``,
        ``<|audio_bos|><|AUDIO|><|audio_eos|>`` or ``<|vision_bos|><|VIDEO|><|vision_eos|>``; a system turn is
        inserted first when the conversation has none."""
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
                        out.append("<|vision_bos|><|IMAGE|><|vision_eos|>")
                    elif kind == "audio" or "audio" in item or "audio_url" in item:
                        out.append("<|audio_bos|><|AUDIO|><|audio_eos|>")
                    elif kind == "video" or "video" in item:
                        out.append("<|vision_bos|><|VIDEO|><|vision_eos|>")
                    elif "text" in item:
                        out.append(item["text"])
            out.append("<|im_end|>\n")
        if add_generation_prompt:
            out.append("<|im_start|>assistant\n")
        return "".join(out)

    # --- media --------------------------------------------------------------------------------------------
    def audio_features(self, audio, sampling_rate: int | None = None) -> np.ndarray:
        """Log-mel ``[n_mels, frames]`` of one clip (resampled to 16 kHz first when needed)."""
        a = check_audio(audio)
        sr = self.sampling_rate if sampling_rate is None else int(sampling_rate)
        if sr != self.sampling_rate:
            a = resample(a, sr, self.sampling_rate)
        return log_mel(a, self.n_mels, sample_rate=self.sampling_rate, n_fft=self.n_fft, hop_length=self.hop_length)

    def interleave_video_audio(self, grid_thw, second_per_grid: float, n_audio: int) -> str:
        """The text that replaces ``<|VIDEO|>`` when the video's audio is used: audio bos, video and audio tokens
        interleaved in 2-second chunks, audio eos (transformers' ``replace_video_with_audio_token``)."""
        m = self.vision.merge_size
        t, h, w = (int(x) for x in grid_thw)
        video_t = np.repeat(np.arange(t), (h // m) * (w // m)) * second_per_grid * self.position_id_per_seconds
        per_chunk = int(self.position_id_per_seconds * self.seconds_per_chunk)
        v_chunks = chunked_index(video_t, per_chunk, 0)
        a_chunks = chunked_index(np.arange(n_audio), per_chunk, 0)
        s = "<|audio_bos|>"
        for j in range(max(len(v_chunks), len(a_chunks))):
            if j < len(v_chunks):
                s += "<|VIDEO|>" * (v_chunks[j][1] - v_chunks[j][0])
            if j < len(a_chunks):
                s += "<|AUDIO|>" * (a_chunks[j][1] - a_chunks[j][0])
        return s + "<|audio_eos|>"

    def __call__(self, text: str | list[str], images=None, videos=None, audio=None, *,
                 use_audio_in_video: bool = False, sampling_rate: int | None = None, fps: float = 2.0,
                 image_min_pixels: int | None = None, image_max_pixels: int | None = None,
                 video_min_pixels: int | None = None, video_max_pixels: int | None = None) -> dict:
        """Arrays for ``Model.__call__``: input_ids and attention_mask ``[B, S]`` (left padded), and when media
        are given pixel_values / image_grid_thw, pixel_values_videos / video_grid_thw / video_second_per_grid,
        input_features ``[n, mels, frames]`` / feature_attention_mask. ``videos`` are sampled frame arrays
        ``[T, H, W, 3]`` (``read_video`` samples a file) at ``fps`` frames a second."""
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
            n_audio_tokens = [audio_token_count(m.shape[1]) for m in mels]

        merge2 = self.vision.merge_size ** 2
        counters = {"image": 0, "video": 0, "audio": 0}

        def take(kind: str, available: int) -> int:
            i = counters[kind]
            if i >= available:
                raise ValueError(f"the prompt has more <|{kind.upper()}|> placeholders than {kind} inputs "
                                 f"({available})")
            counters[kind] += 1
            return i

        def expand(s: str) -> str:
            parts, rest = [], s
            marks = ("<|IMAGE|>", "<|VIDEO|>", "<|AUDIO|>")
            while True:
                hits = [(rest.find(mk), mk) for mk in marks if rest.find(mk) >= 0]
                if not hits:
                    parts.append(rest)
                    return "".join(parts)
                at, mk = min(hits)
                parts.append(rest[:at])
                rest = rest[at + len(mk):]
                if mk == "<|IMAGE|>":
                    i = take("image", len(out.get("image_grid_thw", [])))
                    parts.append(mk * (int(np.prod(out["image_grid_thw"][i])) // merge2))
                elif mk == "<|AUDIO|>":
                    i = take("audio", len(n_audio_tokens))
                    parts.append(mk * n_audio_tokens[i])
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
                raise ValueError(f"{n} {kind} inputs but {counters[kind]} <|{kind.upper()}|> placeholders in the "
                                 "prompt")
        width = max(len(x) for x in ids)
        pad = self.token_ids["<|endoftext|>"]
        out["input_ids"] = np.asarray([[pad] * (width - len(x)) + x for x in ids], dtype=np.int64)
        out["attention_mask"] = np.asarray([[0] * (width - len(x)) + [1] * len(x) for x in ids], dtype=np.int64)
        if use_audio_in_video:
            out["use_audio_in_video"] = True
        return out
