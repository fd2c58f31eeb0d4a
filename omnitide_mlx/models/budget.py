"""What a KV budget has to hold, read from a checkpoint's files without loading it: the KV bytes per token from
config.json (layers, KV heads, head dim), the safetensors headers (the dtype the weights, and so the K/V, are held
in) and ``--kv-bits``; the media unit from the model's own unit layout (``models/<family>/layout.py``, the code the
adapters build units with) at the stream's frame size. No MLX, no weights: the CLI checks ``--kv-budget`` with it
before the "loading" line.
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from ..core.shapes import kv_bytes_per_token
from ..core.stream_units import MediaSetting
from .loading import CheckpointError, load_config

PAGE = 64  # the session's default page size (slots)
SAFETENSORS_FLOAT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
CONFIG_FLOAT_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}
# the tokens that open the user turn in front of the first media unit after the system prompt or a reply
# ("<|im_start|>user\n" in both families' templates: <|im_start|>, "user", "\n")
TURN_OPEN_TOKENS = {"qwen2_5_omni": 3, "minicpmo": 3}


@dataclass(frozen=True)
class KVNeed:
    family: str
    bytes_per_token: int
    unit_tokens: int  # one media unit at the stream's frame size and tracks, inside an open user turn
    dtype_bytes: int

    @property
    def first_unit_tokens(self) -> int:
        """The unit that opens a user turn (the first one, and the first after each reply): the largest."""
        return self.unit_tokens + TURN_OPEN_TOKENS[self.family]


def weight_float_bytes(path: Path, config: dict) -> int:
    """Bytes per element of the checkpoint's floating weights (the loaders keep them as stored, and the KV cache
    takes the model's dtype): the commonest float dtype in the first safetensors header, else config.json's
    ``torch_dtype``, else 2."""
    counts: Counter = Counter()
    shards = sorted(Path(path).glob("*.safetensors"))
    if shards:
        try:
            with open(shards[0], "rb") as f:
                n = struct.unpack("<Q", f.read(8))[0]
                if 0 < n < 100 << 20:
                    header = json.loads(f.read(n))
                    counts.update(SAFETENSORS_FLOAT_BYTES[v["dtype"]] for k, v in header.items()
                                  if k != "__metadata__" and isinstance(v, dict)
                                  and v.get("dtype") in SAFETENSORS_FLOAT_BYTES)
        except (OSError, ValueError, struct.error):
            pass  # the loader will say what is wrong with the file
    if counts:
        return counts.most_common(1)[0][0]
    dtype = config.get("torch_dtype") or (config.get("thinker_config") or {}).get("torch_dtype")
    return CONFIG_FLOAT_BYTES.get(str(dtype), 2)


def kv_need(path: str | Path, *, media: MediaSetting | None = None, frame_size: tuple[int, int] | None = None,
            frame: bool = True, audio: bool = True, kv_bits: int | None = None,
            kv_group_size: int = 64) -> KVNeed | None:
    """The KV bytes per token and the media unit size of the checkpoint at ``path`` for a stream of frames of
    ``frame_size`` (when the setting has none) and/or audio; None for a model family without a unit layout."""
    path = Path(path)
    config = load_config(path)
    model_type = config.get("model_type")
    media = media or MediaSetting()
    if frame and media.frame_size is None and frame_size is not None:
        media = replace(media, frame_size=tuple(frame_size))
    dtype_bytes = weight_float_bytes(path, config)
    try:
        if model_type in ("qwen2_5_omni", "qwen2_5_omni_thinker"):
            from .qwen2_5_omni.config import ModelConfig
            from .qwen2_5_omni.layout import FRAME_MAX_PIXELS, stream_units
            from .qwen2_5_omni.processor import read_preprocessor_config

            cfg = ModelConfig.from_dict(config)
            t = cfg.text_config
            vision, _ = read_preprocessor_config(path)
            units = stream_units(replace(media, max_pixels=media.max_pixels or FRAME_MAX_PIXELS), vision=vision,
                                 position_id_per_seconds=cfg.position_id_per_seconds,
                                 seconds_per_chunk=cfg.seconds_per_chunk, frame=frame, audio=audio)
            family, shape = "qwen2_5_omni", (t.num_hidden_layers, t.num_key_value_heads, t.head_dim)
        elif model_type == "minicpmo":
            from .minicpmo.config import ModelConfig
            from .minicpmo.layout import SCALE_RESOLUTION, STREAMING_MAX_SLICE_NUMS, stream_units

            cfg = ModelConfig.from_dict(config)
            t = cfg.text
            pre = path / "preprocessor_config.json"
            scale = json.loads(pre.read_text(encoding="utf-8")).get("scale_resolution", SCALE_RESOLUTION) \
                if pre.is_file() else SCALE_RESOLUTION
            units = stream_units(replace(media, max_slice_nums=media.max_slice_nums or STREAMING_MAX_SLICE_NUMS),
                                 query_num=cfg.query_num, audio_pool_step=cfg.audio_pool_step,
                                 scale_resolution=int(scale), frame=frame, audio=audio)
            family, shape = "minicpmo", (t.num_hidden_layers, t.num_key_value_heads, t.head_dim)
        else:
            return None
    except (KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{path / 'config.json'}: cannot read the model's shape: {type(e).__name__}: {e}") \
            from None
    return KVNeed(family=family, bytes_per_token=kv_bytes_per_token(*shape, dtype_bytes, kv_bits, kv_group_size),
                  unit_tokens=units.tokens, dtype_bytes=dtype_bytes)


def budget_problem(budget: int, need: KVNeed, *, reply_tokens: int = 0, reserve_pages: int = 2,
                   page: int = PAGE) -> str | None:
    """Why ``budget`` bytes cannot stream this model (None when they can, as far as the files tell): the slots it
    pays for (whole pages) must hold the system prompt (at least a page) next to one media unit, or a question's
    reply (``reply_tokens``: max tokens plus the closing tokens), and leave a high watermark of at least a page
    under the ceiling (``reserve_pages``, see engine.watermarks_for_budget)."""
    slots = budget // need.bytes_per_token // page * page
    unit = max(need.first_unit_tokens, reply_tokens + 1)
    required = max(page + reserve_pages * page, page + -(-unit // page) * page)
    if slots >= required:
        return None
    what = f"one media unit is {need.first_unit_tokens} tokens"
    if reply_tokens + 1 > need.first_unit_tokens:
        what = f"a question's reply needs {reply_tokens + 1} slots (--max-tokens plus the closing tokens)"
    return (f"a KV budget of {budget} bytes holds {slots} tokens of this model ({need.bytes_per_token} bytes per "
            f"token, whole pages of {page}); {what} and the system prompt takes at least a page: give at least "
            f"{required * need.bytes_per_token} bytes ({required * need.bytes_per_token / 2**20:.3g} MiB)")
