"""Qwen3-Omni figures that need no weights: the 4-bit checkpoint's memory from the released layout's tensor shapes,
and what quantising the MoE routers does to expert choice at the released router shape.

``python -m omnitide_mlx.bench.qwen3_omni [--out FILE.json]`` (CPU is enough; the router study is a few seconds).
``python -m omnitide_mlx.bench.qwen3_omni --speed [--layers 1] [--out FILE.json]``: the MoE thinker's prefill and
decode at the released layer shape (hidden 2048, 32 / 4 heads of 128, 128 experts of 768, top 8), this port against
transformers' float32 and mlx-vlm's ``qwen3_omni_moe`` on the same random weights, timed side by side (interleaved
rounds, medians). A whole 48-layer thinker does not fit this machine in float32, so it times ``--layers`` layers
and reports per-layer figures (no embedding or LM head: those are the same matmuls in every port).

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


def speed(layers: int = 1, prefill: tuple[int, ...] = (134, 512), seed: int = 0) -> dict:
    """Prefill of ``prefill`` tokens and one decode step after the longest, per port (see the module docstring)."""
    import mlx.core as mx
    import torch
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import KVCache
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTextConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextModel

    from ..models.qwen3_omni.config import TextConfig, released_thinker_config
    from ..models.qwen3_omni.language import LanguageModel, stack_experts
    from .common import time_interleaved, versions

    text = dict(released_thinker_config()["text_config"], num_hidden_layers=layers, vocab_size=1024)
    torch.manual_seed(seed)
    hf_cfg = Qwen3OmniMoeTextConfig(**{k: v for k, v in text.items() if k != "tie_word_embeddings"})
    hf = Qwen3OmniMoeThinkerTextModel(hf_cfg).float().eval()
    with torch.no_grad():
        for p in hf.parameters():  # init's 0.02 std leaves every token on the same experts: draw per-fan-in
            p.copy_(torch.randn_like(p) / (p.shape[-1] ** 0.5) if p.ndim > 1 else 1 + 0.1 * torch.randn_like(p))
    ours = LanguageModel(TextConfig.from_dict(text), tie_word_embeddings=True)
    w = {"model." + k: mx.array(v.numpy()) for k, v in hf.state_dict().items()}
    ours.load_weights(list(stack_experts(w).items()), strict=True)
    mx.eval(ours.parameters())
    rows = {"layers": layers, "threads": torch.get_num_threads(), "experts_implementation":
            getattr(hf.config, "_experts_implementation", None), "prefill": {}, "versions": versions()}
    vlm = None
    try:
        from mlx_vlm.models.qwen3_omni_moe.config import TextConfig as VlmText
        from mlx_vlm.models.qwen3_omni_moe.language import Qwen3VLMoEModel

        vcfg = dict(text, rope_scaling=dict(text["rope_scaling"]), rope_theta=text["rope_scaling"].get(
            "rope_theta", 1000000), use_qk_norm=True)
        vlm = Qwen3VLMoEModel(VlmText.from_dict(vcfg))
        vlm.update(ours.model.parameters())
        assert {k for k, _ in tree_flatten(vlm.parameters())} == {k for k, _ in tree_flatten(ours.model.parameters())}
        import mlx_vlm

        rows["mlx_vlm"] = mlx_vlm.__version__
    except Exception as e:  # noqa: BLE001 (report why it did not run)
        rows["mlx_vlm_error"] = f"{type(e).__name__}: {e}"
        vlm = None
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, 64, 2048)).astype(np.float32)  # the three compute the same layer
    with torch.no_grad():
        ref = hf(inputs_embeds=torch.tensor(x), position_ids=torch.arange(64)[None, None].expand(3, 1, 64))
    ref = ref.last_hidden_state.numpy()
    got = np.array(ours.hidden_states(mx.array(x), None, np.broadcast_to(np.arange(64), (3, 64))))
    rows["max_abs_diff_vs_transformers"] = {"omnitide_mlx": float(np.abs(got - ref).max())}
    if vlm is not None:
        got = np.array(vlm(None, inputs_embeds=mx.array(x), position_ids=mx.array(np.broadcast_to(np.arange(64),
                                                                                                  (3, 1, 64)))))
        rows["max_abs_diff_vs_transformers"]["mlx_vlm"] = float(np.abs(got - ref).max())

    def mx_pos(t0, n):
        return np.broadcast_to(np.arange(t0, t0 + n), (3, n))

    for n in prefill:
        x = rng.standard_normal((1, n, 2048)).astype(np.float32)
        xm, xt = mx.array(x), torch.tensor(x)
        pos_t = torch.arange(n)[None, None].expand(3, 1, n)
        fns = {"omnitide_mlx": lambda: ours.hidden_states(xm, None, mx_pos(0, n)),
               "transformers_f32": lambda: _torch_eval(hf, xt, pos_t)}
        if vlm is not None:
            pos_v = mx.array(np.broadcast_to(np.arange(n), (3, 1, n)))
            fns["mlx_vlm"] = lambda: vlm(None, inputs_embeds=xm, position_ids=pos_v)
        rows["prefill"][n] = {k: v.to_json() for k, v in time_interleaved(fns).items()}
    n = max(prefill)
    x = rng.standard_normal((1, n, 2048)).astype(np.float32)
    step = rng.standard_normal((1, 1, 2048)).astype(np.float32)
    cache = [KVCache() for _ in range(layers)]
    mx.eval(ours.hidden_states(mx.array(x), cache, mx_pos(0, n)))
    from transformers import DynamicCache

    hcache = DynamicCache(config=hf_cfg)
    with torch.no_grad():
        hf(inputs_embeds=torch.tensor(x), position_ids=torch.arange(n)[None, None].expand(3, 1, n), cache=hcache,
           use_cache=True)

    def ours_step():
        out = ours.hidden_states(mx.array(step), cache, mx_pos(cache[0].offset, 1))
        return out

    def hf_step():
        t = hcache.get_seq_length()
        with torch.no_grad():
            hf(inputs_embeds=torch.tensor(step), position_ids=torch.tensor([[[t]]]).expand(3, 1, 1), cache=hcache,
               use_cache=True)
        return mx.array(0)

    fns = {"omnitide_mlx": ours_step, "transformers_f32": hf_step}
    if vlm is not None:
        from mlx_vlm.models.cache import KVCache as VlmCache

        vcache = [VlmCache() for _ in range(layers)]
        mx.eval(vlm(None, inputs_embeds=mx.array(x), cache=vcache,
                    position_ids=mx.array(np.broadcast_to(np.arange(n), (3, 1, n)))))

        def vlm_step():
            t = vcache[0].offset
            return vlm(None, inputs_embeds=mx.array(step), cache=vcache,
                       position_ids=mx.array(np.full((3, 1, 1), t)))

        fns["mlx_vlm"] = vlm_step
    rows["decode_after"] = n
    rows["decode"] = {k: v.to_json() for k, v in time_interleaved(fns, reps=9).items()}
    return rows


def _torch_eval(model, x, pos):
    import mlx.core as mx
    import torch

    with torch.no_grad():
        model(inputs_embeds=x, position_ids=pos)
    return mx.array(0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the figures as JSON here")
    ap.add_argument("--speed", action="store_true", help="time the MoE thinker against transformers and mlx-vlm")
    ap.add_argument("--layers", type=int, default=1, help="--speed: decoder layers at the released shape (1)")
    args = ap.parse_args(argv)
    from .common import versions

    if args.speed:
        res = {"command": f"python -m omnitide_mlx.bench.qwen3_omni --speed --layers {args.layers}",
               **speed(args.layers)}
        text = json.dumps(res, indent=1)
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                f.write(text + "\n")
        print(text)
        return 0

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
