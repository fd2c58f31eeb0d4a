"""MiniCPM-o 4.5 processor: tokenizer and chat template, image slicing, placeholders, mel features.

Everything here reproduces the official ``processing_minicpmo.py`` (MiniCPM-o 4.5) in numpy and PIL:

- Images: a source image resized to about 448^2 pixels plus, when the image is larger, a grid of up to
  ``max_slice_nums`` slices cut from a refined resize (PIL bicubic, sizes multiples of 14), each normalised to
  [-1, 1] and laid out patch by patch as ``(3, 14, L*14)``. Placeholder:
  ``[<image_id>i</image_id>]<image><unk>*64</image>`` then the slices' ``<slice><unk>*64</slice>``, rows joined
  by ``\\n``.
- Audio: Whisper log-mel (80 bins, pad to 30 s, cut to ``ceil(n / 160)`` frames), audio over 30 s split into 30 s
  pieces; placeholder ``<|audio_start|><unk>*N<|audio_end|>`` with N = 10 per second.
- Streaming audio: ``StreamingMel``, the official ``StreamingMelProcessorExact``: the whole buffer's mel is
  recomputed on every chunk and only frames that no longer depend on future samples are emitted.
- Text: the real tokenizer (rebuilt from vocab.json + merges.txt when tokenizer.json is absent or empty, as in
  the released checkpoint), ``<|listen|>`` stripped from prompts, the chat template rendered with jinja2.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from ..audio_features import log_mel, power_mel
from ..loading import CheckpointError
from . import layout

SAMPLE_RATE = 16000
HOP = 160
N_FFT = 400
MAX_AUDIO_SECONDS = 30

_QWEN2_PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
              r"""\s*[\r\n]+|\s+(?!\S)|\s+""")


# --- tokenizer ----------------------------------------------------------------------------------------------------

def build_tokenizer(path: Path):
    """The fast tokenizer: tokenizer.json when it holds one, else rebuilt from vocab.json + merges.txt and the
    added tokens of tokenizer_config.json with the Qwen2 settings (the released tokenizer.json is empty)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    tj = path / "tokenizer.json"
    if tj.is_file() and tj.stat().st_size > 0:
        return Tokenizer.from_file(str(tj))
    missing = [f for f in ("vocab.json", "merges.txt", "tokenizer_config.json") if not (path / f).is_file()]
    if missing:
        raise CheckpointError(f"{path} has no usable tokenizer.json and lacks {', '.join(missing)} to rebuild it")
    vocab = json.loads((path / "vocab.json").read_text(encoding="utf-8"))
    merges = [tuple(line.split(" ")) for line in (path / "merges.txt").read_text(encoding="utf-8").split("\n")
              if line and not line.startswith("#version")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, continuing_subword_prefix="",
                               end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_PAT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    added = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8")).get("added_tokens_decoder", {})
    tok.add_tokens([AddedToken(t["content"], special=t["special"], normalized=t["normalized"], lstrip=t["lstrip"],
                               rstrip=t["rstrip"], single_word=t["single_word"])
                    for _, t in sorted(added.items(), key=lambda kv: int(kv[0]))])
    for i, t in added.items():
        if tok.token_to_id(t["content"]) != int(i):
            raise CheckpointError(f"rebuilt tokenizer gives {t['content']!r} id {tok.token_to_id(t['content'])}, "
                                  f"tokenizer_config.json says {i}")
    return tok


class TextTokenizer:
    """The pieces of the Hugging Face tokenizer the port uses (encode adds no special tokens: add_bos_token is
    false for MiniCPM-o)."""

    def __init__(self, tok, bad_token_ids=()):
        self.tok = tok
        self.bad_token_ids = list(bad_token_ids)
        self.unk_id = self.token_id("<unk>")

    def __len__(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int:
        """``convert_tokens_to_ids``: the unk id for a string that is not one token."""
        i = self.tok.token_to_id(token)
        return self.unk_id if i is None else i


# --- images -------------------------------------------------------------------------------------------------------

@dataclass
class ImageInputs:
    """One image as the model takes it: the source image then the slices, row by row."""

    slices: list[np.ndarray]  # (3, 14, L*14) float32 each
    tgt_sizes: np.ndarray  # [n_slices, 2] (h, w) in patches
    grid: list[int] | None  # (cols, rows), None when not sliced
    source_size: tuple[int, int]  # resized source image (w, h) in pixels


# --- audio --------------------------------------------------------------------------------------------------------

def split_long_audio(audio: np.ndarray, sample_rate: int = SAMPLE_RATE) -> list[np.ndarray]:
    """Audio over 30 s in 30 s pieces (the last one shorter), as the official processor feeds Whisper."""
    n = MAX_AUDIO_SECONDS * sample_rate
    if len(audio) <= n:
        return [audio]
    return [audio[i:i + n] for i in range(0, len(audio), n)]


def buffer_log_mel(buffer: np.ndarray, n_mels: int = 80, floor: float | None = None) -> np.ndarray:
    """Log-mel of an unpadded buffer as ``MiniCPMAAudioProcessor(padding=False)`` computes it: a centred STFT
    with reflect padding at both ends, the last frame dropped (``len // 160`` frames), clamped at ``floor`` or
    at max - 8 over those frames."""
    mel = power_mel(buffer, n_mels)[:, :-1]
    logm = np.log10(np.maximum(mel, 1e-10))
    logm = np.maximum(logm, logm.max() - 8.0 if floor is None else floor)
    return ((logm + 4.0) / 4.0).astype(np.float32)


class StreamingMel:
    """``StreamingMelProcessorExact``: emits ``chunk_ms`` of mel frames per call, plus ``cnn_redundancy_ms`` of
    extra frames on each side, once the buffer holds them with their full right context.

    The mel uses a fixed -10 floor while the buffer is under 5 s and the dynamic max - 8 range after; with
    ``sliding`` the buffer drops 10 s once it reaches 30 s (frame indices stay global).
    """

    def __init__(self, chunk_ms: int = 1000, first_chunk_ms: int = 1035, cnn_redundancy_ms: int = 0,
                 sliding: bool = True, trigger_s: float = 30.0, stride_s: float = 10.0, n_mels: int = 80):
        self.n_mels = n_mels
        self.chunk_samples = int(round(chunk_ms * SAMPLE_RATE / 1000))
        self.chunk_frames = self.chunk_samples // HOP
        self.first_chunk_samples = max(HOP, (int(round(first_chunk_ms * SAMPLE_RATE / 1000)) // HOP) * HOP)
        self.redundancy_frames = max(0, int(cnn_redundancy_ms * SAMPLE_RATE / 1000) // HOP)
        self.sliding, self.trigger_s, self.stride_s = sliding, trigger_s, stride_s
        self.reset()

    def reset(self) -> None:
        self.buffer = np.zeros(0, dtype=np.float32)
        self.last_emitted = 0  # global frame index of the next core frame
        self.base = 0  # global frame index of buffer frame 0
        self.is_first = True

    def chunk_size(self) -> int:
        return self.first_chunk_samples if self.is_first else self.chunk_samples

    def _slide(self) -> None:
        n = len(self.buffer)
        if not self.sliding or n < int(self.trigger_s * SAMPLE_RATE):
            return
        drop = int(self.stride_s * SAMPLE_RATE)
        guard = min(SAMPLE_RATE, n - drop)
        drop = (min(drop, max(0, n - guard)) // HOP) * HOP
        if drop > 0:
            self.buffer = self.buffer[drop:]
            self.base += drop // HOP

    def _mel(self) -> np.ndarray:
        if len(self.buffer) < N_FFT:
            raise ValueError(f"audio buffer of {len(self.buffer)} samples is shorter than one FFT window ({N_FFT})")
        floor = -10.0 if len(self.buffer) < 5 * SAMPLE_RATE else None
        return buffer_log_mel(self.buffer, self.n_mels, floor)

    def process(self, chunk: np.ndarray, is_last_chunk: bool = False) -> np.ndarray:
        """Append ``chunk``; returns the emitted frames ``[n_mels, n]`` (n = 0 while not enough is buffered)."""
        self.buffer = np.concatenate([self.buffer, np.asarray(chunk, dtype=np.float32).reshape(-1)])
        self._slide()
        mel = self._mel()
        total = mel.shape[1]
        stable = min(total, max(0, (len(self.buffer) - N_FFT // 2) // HOP + 1)) + self.base
        core_end = self.last_emitted + self.chunk_frames
        self.is_first = False
        if stable < core_end + self.redundancy_frames and not is_last_chunk:
            return mel[:, :0]
        start = max(0, max(0, self.last_emitted - self.redundancy_frames) - self.base)
        end = core_end + self.redundancy_frames - self.base
        start = max(0, min(start, total))
        end = max(start, min(end, total))
        self.last_emitted = core_end
        return mel[:, start:end]

    def state(self) -> dict:
        return {"buffer": self.buffer.copy(), "last_emitted": self.last_emitted, "base": self.base,
                "is_first": self.is_first}

    def load_state(self, s: dict) -> None:
        self.buffer = np.asarray(s["buffer"], dtype=np.float32).copy()
        self.last_emitted, self.base, self.is_first = int(s["last_emitted"]), int(s["base"]), bool(s["is_first"])


# --- the processor ------------------------------------------------------------------------------------------------

class MiniCPMOProcessor:
    def __init__(self, tokenizer: TextTokenizer, *, max_slice_nums: int = 9, scale_resolution: int = 448,
                 patch_size: int = 14, use_image_id: bool = True, image_feature_size: int = 64,
                 slice_mode: bool = True, norm_mean=(0.5, 0.5, 0.5), norm_std=(0.5, 0.5, 0.5),
                 audio_pool_step: int = 5, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.max_slice_nums = max_slice_nums
        self.scale_resolution = scale_resolution
        self.patch_size = patch_size
        self.use_image_id = use_image_id
        self.image_feature_size = image_feature_size
        self.slice_mode = slice_mode
        self.mean = np.asarray(norm_mean, dtype=np.float32)
        self.std = np.asarray(norm_std, dtype=np.float32)
        self.pool_step = audio_pool_step
        self.chat_template = chat_template
        t = tokenizer.token_id
        self.ids = {name: t(tok) for name, tok in [
            ("im_start", "<image>"), ("im_end", "</image>"), ("slice_start", "<slice>"), ("slice_end", "</slice>"),
            ("unk", "<unk>"), ("audio_start", "<|audio_start|>"), ("audio_end", "<|audio_end|>"),
            ("spk_start", "<|spk_bos|>"), ("spk_end", "<|spk_eos|>"), ("listen", "<|listen|>")]}

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "MiniCPMOProcessor":
        path = Path(path)
        tok_cfg = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8")) \
            if (path / "tokenizer_config.json").is_file() else {}
        pre = json.loads((path / "preprocessor_config.json").read_text(encoding="utf-8")) \
            if (path / "preprocessor_config.json").is_file() else {}
        tokenizer = TextTokenizer(build_tokenizer(path), tok_cfg.get("bad_token_ids", []))
        if pre.get("image_feature_size", 64) != 64 or pre.get("im_start", "<image>") != "<image>":
            raise CheckpointError(f"{path / 'preprocessor_config.json'}: only the MiniCPM-o 4.5 placeholders "
                                  "(64 image tokens, <image>/<slice> markers) are supported")
        return cls(tokenizer, max_slice_nums=pre.get("max_slice_nums", 9),
                   scale_resolution=pre.get("scale_resolution", 448), patch_size=pre.get("patch_size", 14),
                   use_image_id=pre.get("use_image_id", True), slice_mode=pre.get("slice_mode", True),
                   norm_mean=pre.get("norm_mean", (0.5,) * 3), norm_std=pre.get("norm_std", (0.5,) * 3),
                   audio_pool_step=pre.get("audio_pool_step", 5), chat_template=tok_cfg.get("chat_template"))

    # --- chat template ------------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False,
                            enable_thinking: bool = False, use_tts_template: bool = False) -> str:
        if not self.chat_template:
            raise ValueError("the tokenizer has no chat_template")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking,
            use_tts_template=use_tts_template, tools=None)

    # --- images -------------------------------------------------------------------------------------------------
    def find_best_resize(self, size, allow_upscale: bool = False) -> tuple[int, int]:
        return layout.find_best_resize(size, self.scale_resolution, self.patch_size, allow_upscale)

    def get_refine_size(self, size, grid, allow_upscale: bool = False) -> tuple[int, int]:
        return layout.get_refine_size(size, grid, self.scale_resolution, self.patch_size, allow_upscale)

    def get_sliced_grid(self, size, max_slice_nums: int, never_split: bool = False) -> list[int] | None:
        return layout.get_sliced_grid(size, max_slice_nums, self.scale_resolution, never_split)

    def slice_image(self, image: Image.Image, max_slice_nums: int):
        """(source image, rows of slice images, grid)."""
        grid = self.get_sliced_grid(image.size, max_slice_nums)
        if grid is None:
            return image.resize(self.find_best_resize(image.size, allow_upscale=True), Image.Resampling.BICUBIC), \
                [], None
        source = image.copy().resize(self.find_best_resize(image.size), Image.Resampling.BICUBIC)
        refine = image.resize(self.get_refine_size(image.size, grid, allow_upscale=True), Image.Resampling.BICUBIC)
        cell_w, cell_h = refine.size[0] // grid[0], refine.size[1] // grid[1]
        rows = [[refine.crop((x, y, x + cell_w, y + cell_h)) for x in range(0, refine.size[0], cell_w)]
                for y in range(0, refine.size[1], cell_h)]
        return source, rows, grid

    def reshape_by_patch(self, chw: np.ndarray) -> np.ndarray:
        """(3, h*p, w*p) -> (3, p, h*w*p): patches in row-major order, side by side."""
        p = self.patch_size
        c, hh, ww = chw.shape
        h, w = hh // p, ww // p
        return chw.reshape(c, h, p, w, p).transpose(0, 2, 1, 3, 4).reshape(c, p, h * w * p)

    def normalize(self, image: Image.Image) -> np.ndarray:
        x = np.asarray(image.convert("RGB"), dtype=np.uint8).astype(np.float32) / 255
        return ((x - self.mean) / self.std).transpose(2, 0, 1)

    def process_image(self, image, max_slice_nums: int | None = None) -> ImageInputs:
        """One image (PIL, or HxWx3 uint8) -> the source image and its slices in the model's layout."""
        image = to_pil(image)
        max_slice_nums = self.max_slice_nums if max_slice_nums is None else int(max_slice_nums)
        if max_slice_nums < 1:
            raise ValueError(f"max_slice_nums must be >= 1 (got {max_slice_nums})")
        if self.slice_mode:
            source, rows, grid = self.slice_image(image, max_slice_nums)
        else:
            source, rows, grid = image, [], None
        images = [source] + [s for row in rows for s in row]
        slices, sizes = [], []
        for im in images:
            chw = self.normalize(im)
            slices.append(self.reshape_by_patch(chw))
            sizes.append((chw.shape[1] // self.patch_size, chw.shape[2] // self.patch_size))
        return ImageInputs(slices, np.asarray(sizes, dtype=np.int32), grid, source.size)

    def image_placeholder(self, grid, image_idx: int = 0, use_image_id: bool | None = None) -> str:
        unk = "<unk>" * self.image_feature_size
        ph = f"<image>{unk}</image>"
        if self.use_image_id if use_image_id is None else use_image_id:
            ph = f"<image_id>{image_idx}</image_id>" + ph
        if self.slice_mode and grid is not None:
            row = f"<slice>{unk}</slice>" * grid[0]
            ph += "\n".join([row] * grid[1])
        return ph

    # --- audio --------------------------------------------------------------------------------------------------
    def audio_placeholder(self, n_samples: int, chunk_input: bool = False, chunk_length: float = 1) -> str:
        frames = math.ceil(n_samples / HOP)
        n = ((frames - 1) // 2 + 1 - self.pool_step) // self.pool_step + 1
        if not chunk_input:
            return "<|audio_start|>" + "<unk>" * n + "<|audio_end|>"
        per_chunk = ((int(chunk_length * 100) - 1) // 2 + 1 - self.pool_step) // self.pool_step + 1
        out, done = "", 0
        for _ in range((n + per_chunk - 1) // per_chunk):
            k = min(per_chunk, n - done)
            out += "<|audio_start|>" + "<unk>" * k + "<|audio_end|>"
            done += k
        return out

    def audio_features(self, audios: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Offline mel features ``[N, 80, Tmax]`` (zero-padded) and lengths ``[N]`` of every audio, each split
        into 30 s pieces."""
        feats = [log_mel(piece, 80) for a in audios for piece in split_long_audio(np.asarray(a, np.float32))]
        lens = np.asarray([f.shape[1] for f in feats], dtype=np.int64)
        out = np.zeros((len(feats), 80, int(lens.max()) if len(feats) else 0), dtype=np.float32)
        for i, f in enumerate(feats):
            out[i, :, : f.shape[1]] = f
        return out, lens

    # --- prompts ------------------------------------------------------------------------------------------------
    def __call__(self, text: str, images=None, audios=None, max_slice_nums: int | None = None,
                 use_image_id: bool = True, chunk_input: bool = False) -> dict:
        """One prompt with ``<image>./</image>`` and ``<audio>./</audio>`` markers -> the official model inputs:
        ``input_ids`` [1, T], ``pixel_values`` [[slices]], ``tgt_sizes`` [[n, 2]], ``image_bound`` [[k, 2]],
        ``audio_features`` [N, 80, T], ``audio_feature_lens`` [[N]], ``audio_bounds`` [[m, 2]]."""
        images = list(images or [])
        audios = list(audios or [])
        text = text.replace("(<image>./</image>)", "<image>./</image>")
        chunks = re.split(r"(<image>\./</image>|<audio>\./</audio>)", text)
        n_img = sum(c == "<image>./</image>" for c in chunks)
        n_aud = sum(c == "<audio>./</audio>" for c in chunks)
        if n_img != len(images) or n_aud != len(audios):
            raise ValueError(f"the prompt has {n_img} image and {n_aud} audio markers for {len(images)} images "
                             f"and {len(audios)} audios")
        image_inputs = [self.process_image(im, max_slice_nums) for im in images]
        ii = ai = 0
        for k, c in enumerate(chunks):
            if c == "<image>./</image>":
                chunks[k] = self.image_placeholder(image_inputs[ii].grid, ii, use_image_id)
                ii += 1
            elif c == "<audio>./</audio>":
                chunks[k] = self.audio_placeholder(len(audios[ai]), chunk_input)
                ai += 1
        ids = np.asarray([i for i in self.tokenizer.encode("".join(chunks)) if i != self.ids["listen"]],
                         dtype=np.int32)
        starts = np.where((ids == self.ids["im_start"]) | (ids == self.ids["slice_start"]))[0] + 1
        ends = np.where((ids == self.ids["im_end"]) | (ids == self.ids["slice_end"]))[0]
        k = max(len(starts), len(ends))
        image_bound = np.stack([starts[:k], ends[:k]], axis=-1) if k else np.zeros((0, 2), np.int64)
        a_start = np.where(ids == self.ids["audio_start"])[0] + 1
        a_end = np.where(ids == self.ids["audio_end"])[0]
        if len(a_start) != len(a_end):
            raise ValueError("unbalanced <|audio_start|> / <|audio_end|> in the prompt")
        audio_bounds = np.stack([a_start, a_end], axis=-1) if len(a_start) else np.zeros((0, 2), np.int64)
        out = {"input_ids": ids[None], "image_bound": [image_bound], "audio_bounds": [audio_bounds],
               "pixel_values": [[s for im in image_inputs for s in im.slices]],
               "tgt_sizes": [np.concatenate([im.tgt_sizes for im in image_inputs]) if image_inputs
                             else np.zeros((0, 2), np.int32)],
               "grids": [[im.grid for im in image_inputs]]}
        if audios:
            feats, lens = self.audio_features(audios)
            out["audio_features"], out["audio_feature_lens"] = feats, [lens]
        else:
            out["audio_features"], out["audio_feature_lens"] = None, [np.zeros(0, np.int64)]
        return out


def to_pil(image) -> Image.Image:
    """A PIL image, or an ``HxWx3`` uint8 RGB array, as an RGB PIL image."""
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    a = np.asarray(image)
    if a.ndim != 3 or a.shape[2] != 3:
        raise ValueError(f"an image must be HxWx3 RGB, got shape {a.shape}")
    if a.dtype != np.uint8:
        raise ValueError(f"an image array must be uint8, got {a.dtype}")
    if a.shape[0] < 1 or a.shape[1] < 1:
        raise ValueError(f"empty image of shape {a.shape}")
    return Image.fromarray(a, "RGB")
