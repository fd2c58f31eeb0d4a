"""Qwen3-Omni figures that need no weights: the 4-bit checkpoint's memory from the released layout's tensor shapes,
and what quantising the MoE routers does to expert choice at the released router shape.

``python -m omnitide_mlx.bench.qwen3_omni [--out FILE.json]`` (CPU is enough; the router study is a few seconds).

Memory: every thinker tensor of the released layout (models/qwen3_omni/tiny.py enumerates them from the config),
bf16 for what stays in float, and ``bits + 32 / group`` bits a weight (a bf16 scale and bias per group) for what
``Model.quant_predicate`` quantises. The talker, code predictor and Code2Wav are not counted (not ported yet).

Routers: a router is a ``[128, 2048]`` matrix whose softmax top-8 picks the experts. Trained routers are not at hand,
so the study draws Gaussian routers and RMS-normalised Gaussian hidden states; which experts rank top-8 depends only
on the ratio of the quantisation error to the logit spread, which does not depend on the weights' scale, so the
flip rate is a fair first estimate (a trained router's margins may be wider or narrower). A token-layer "flips"
when its set of 8 experts differs from the float router's.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

GIB = 1 << 30


def memory(bits: int = 4, group_size: int = 64) -> dict:
    """Bytes of the released thinker: float (bf16) and converted (``bits``, ``group_size``), by part."""
    import mlx.nn as nn  # noqa: F401  (thinker_weight_shapes builds MLX module shapes)

    from ..models.qwen3_omni.config import released_thinker_config
    from ..models.qwen3_omni.tiny import thinker_weight_shapes

    shapes = thinker_weight_shapes(released_thinker_config())

    def quantised(name: str, shape) -> bool:
        if name.startswith(("visual.", "audio_tower.")) or name.endswith("mlp.gate.weight"):
            return False
        return name.endswith(".weight") and len(shape) >= 2 and shape[-1] % group_size == 0 and "norm" not in name

    parts: dict[str, dict] = {}
    for name, shape in shapes.items():
        part = ("vision" if name.startswith("visual.") else "audio" if name.startswith("audio_tower.")
                else "experts" if ".mlp.experts." in name else "routers" if name.endswith("mlp.gate.weight")
                else "embeddings+head" if ("embed_tokens" in name or name.startswith("lm_head")) else "llm other")
        n = int(np.prod(shape))
        q = quantised(name, shape)
        p = parts.setdefault(part, {"params": 0, "bf16_bytes": 0, "converted_bytes": 0})
        p["params"] += n
        p["bf16_bytes"] += 2 * n
        p["converted_bytes"] += n * (bits + 32 / group_size) / 8 if q else 2 * n
    total = {k: sum(p[k] for p in parts.values()) for k in ("params", "bf16_bytes", "converted_bytes")}
    return {"bits": bits, "group_size": group_size, "parts": parts, "total": total,
            "total_gib": {k: round(v / GIB, 3) for k, v in total.items() if k.endswith("bytes")}}


def router_flips(tokens: int = 4096, layers: int = 8, hidden: int = 2048, experts: int = 128, top_k: int = 8,
                 seed: int = 0) -> dict:
    """Share of token-layers whose top-k expert set changes when the router is quantised (4 and 8 bits, group 64),
    and the largest change of a routing weight among the tokens that keep their set."""
    import mlx.core as mx

    rng = np.random.default_rng(seed)
    out = {}
    for bits in (4, 8):
        flips, worst = 0, 0.0
        for _ in range(layers):
            w = mx.array((rng.standard_normal((experts, hidden)) / np.sqrt(hidden)).astype(np.float32))
            x = rng.standard_normal((tokens, hidden)).astype(np.float32)
            x = mx.array(x / np.sqrt((x ** 2).mean(-1, keepdims=True)))
            wq = mx.dequantize(*mx.quantize(w, group_size=64, bits=bits), group_size=64, bits=bits)
            sets = []
            for m in (w, wq):
                p = np.array(mx.softmax(x @ m.T, axis=-1))
                top = np.argsort(-p, axis=-1)[:, :top_k]
                weights = np.take_along_axis(p, top, -1)
                sets.append((np.sort(top, -1), np.take_along_axis(weights / weights.sum(-1, keepdims=True),
                                                                  np.argsort(top, -1), -1)))
            same = (sets[0][0] == sets[1][0]).all(-1)
            flips += int((~same).sum())
            if same.any():
                worst = max(worst, float(np.abs(sets[0][1][same] - sets[1][1][same]).max()))
        out[f"{bits}bit"] = {"flip_share": flips / (tokens * layers), "max_weight_change_unflipped": worst}
    return {"tokens": tokens, "layers": layers, "shape": [experts, hidden], "top_k": top_k, **out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args(argv)
    from .common import versions

    res = {"command": "python -m omnitide_mlx.bench.qwen3_omni", "versions": versions(), "memory_4bit": memory(4),
           "memory_8bit": memory(8), "router_flips": router_flips()}
    text = json.dumps(res, indent=1)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
