"""What a KV budget has to hold, read from a checkpoint's files without loading it: the KV bytes per token from
config.json (layers, KV heads, head dim), the safetensors headers (the dtype the weights, and so the K/V, are held
in) and ``--kv-bits``; the media unit from the model's own unit layout (``models/<family>/layout.py``, the code the
adapters build units with) at the stream's frame size, both through the family record's ``checkpoint_units``. No
MLX, no weights: the CLI checks ``--kv-budget`` with it before the "loading" line.
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from ..core.shapes import kv_bytes_per_token  # noqa: F401  (the one definition, re-exported for callers of the budget)
from ..core.stream_units import MediaSetting
from .family import family_for_model_type
from .loading import CheckpointError, load_config

PAGE = 64  # the session's default page size (slots)
SAFETENSORS_FLOAT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
CONFIG_FLOAT_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class KVNeed:
    family: str
    bytes_per_token: int
    unit_tokens: int  # one media unit at the stream's frame size and tracks, inside an open user turn
    dtype_bytes: int
    head_dim: int = 0  # the K/V head size (quantised KV groups must divide it)
    turn_open_tokens: int = 0  # the tokens that open a user turn (the family's ChatFraming.turn_open)

    @property
    def first_unit_tokens(self) -> int:
        """The unit that opens a user turn (the first one, and the first after each reply): the largest."""
        return self.unit_tokens + self.turn_open_tokens


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
    family = family_for_model_type(model_type)
    if family is None or family.checkpoint_units is None:
        return None
    dtype_bytes = weight_float_bytes(path, config)
    try:
        shape, units = family.checkpoint_units(path, config, media, frame=frame, audio=audio)
    except (KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{path / 'config.json'}: cannot read the model's shape: {type(e).__name__}: {e}") \
            from None
    if kv_bits is not None and shape.head_dim % kv_group_size:  # the quantised row below would be wrong
        kv_bits = None
    return KVNeed(family=family.name, bytes_per_token=shape.kv_bytes_per_token(dtype_bytes, kv_bits, kv_group_size),
                  unit_tokens=units.tokens, dtype_bytes=dtype_bytes, head_dim=shape.head_dim,
                  turn_open_tokens=len(family.framing.turn_open))


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
