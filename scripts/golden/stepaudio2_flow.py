"""Golden data for the MLX StepAudio2 token2wav flow (tests/models/test_stepaudio2_flow.py).

Reference: the official flow of ``minicpmo-utils`` 1.0.7 (PyPI; what ``pip install minicpmo-utils[all]`` installs and
MiniCPM-o 4.5 speaks through), modules ``stepaudio2.cosyvoice2.flow.{flow,flow_matching,decoder_dit}`` and
``stepaudio2.cosyvoice2.transformer.*``, plus ``Token2wav._trim_estimator_cache`` / ``_trim_conformer_cache`` from
``stepaudio2/token2wav.py`` (compiled alone from its source: that module imports onnxruntime, s3tokenizer and
torchaudio at the top). Generated with torch 2.13.0+cpu, HyperPyYAML 1.2.3, einops 0.8.2, float32, CPU.

Run (from the repository root, the sdist unpacked under /tmp/dl):

    /work/refenv/bin/python scripts/golden/stepaudio2_flow.py \
        --src /tmp/dl/minicpmo_utils-1.0.7/src --out tests/data/stepaudio2

What it does:
- loads the ``stepaudio2`` subpackages without running ``stepaudio2/__init__.py`` (a namespace-module shim in
  ``sys.modules``; ``flow_matching.py`` imports onnxruntime without using it, so an empty stand-in module is
  installed when onnxruntime is absent);
- builds the flow from a tiny ``flow.yaml`` in the official format through HyperPyYAML, as ``Token2wav`` does
  (the ``!new:cosyvoice2.`` tags localised to ``stepaudio2.cosyvoice2.``);
- draws every parameter from a seeded generator, rounded to float16 values (stored as float16, exact in float32);
- replaces the CFM's ``rand_noise`` buffer by a seeded draw of 200 frames (saved), and sizes the solver's scratch
  buffers for the tiny widths: the official ones are hard-coded for the released model (16 steps x 16 blocks x
  1024 channels; 8 heads x 128), their leading 16 (the most Euler steps) is kept, so cache rows past n_timesteps
  are stale scratch as in the release;
- runs ``inference`` (offline) and the streaming path as Token2wav does: ``setup_cache(prompt + prompt[:3])``,
  chunks of 12 fresh + 3 lookahead tokens each followed by both trims (prompt 20 frames + 100), then the rest with
  ``last_chunk=True``; the chunks reach the trim limits, so both trims act.

Outputs (tests/data/stepaudio2/, < 1 MB): flow.yaml, flow_weights.safetensors (official key names, float16),
flow_golden.safetensors (inputs, noise, offline mel, each chunk's mel, the final caches or slices of them),
flow_golden.json (settings, chunk windows, cache shapes after each trim, whole-cache sums).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import types
from pathlib import Path

import numpy as np
import torch

FLOW_YAML = """\
# A tiny StepAudio2 token2wav flow in the official flow.yaml format (HyperPyYAML tags), for the MLX port's tests.
flow: !new:cosyvoice2.flow.flow.CausalMaskedDiffWithXvec
    input_size: 32
    output_size: 80
    spk_embed_dim: 192
    output_type: mel
    vocab_size: 64
    encoder: !new:cosyvoice2.transformer.upsample_encoder_v2.UpsampleConformerEncoderV2
        input_size: 32
        output_size: 32
        input_layer: linear
        pre_lookahead_len: 3
        num_blocks: 2
        num_up_blocks: 2
        up_stride: 2
        up_scale_factor: 2
        attention_heads: 2
        pos_enc_layer_type: rel_pos_espnet
        selfattention_layer_type: rel_selfattn
        key_bias: true
        linear_units: 64
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.1
        normalize_before: true
    decoder: !new:cosyvoice2.flow.flow_matching.CausalConditionalCFM
        inference_cfg_rate: 0.7
        estimator: !new:cosyvoice2.flow.decoder_dit.DiT
            in_channels: 320
            out_channels: 80
            mlp_ratio: 2.0
            depth: 2
            num_heads: 2
            head_dim: 16
            hidden_size: 32
"""

PROMPT_TOKENS = 10
GEN_TOKENS = 80
CHUNK = 12  # fresh tokens per non-final chunk (the release uses 25)
N_TIMESTEPS = 5
NOISE_FRAMES = 200
HISTORY = 100  # Token2wav.CONFORMER_HISTORY_FRAMES and the estimator's 100


def import_official(src: Path):
    from importlib.machinery import ModuleSpec

    pkg = types.ModuleType("stepaudio2")
    pkg.__path__ = [str(src / "stepaudio2")]
    pkg.__spec__ = ModuleSpec("stepaudio2", None, is_package=True)
    pkg.__spec__.submodule_search_locations = pkg.__path__
    sys.modules["stepaudio2"] = pkg
    try:
        import onnxruntime  # noqa: F401
    except ImportError:  # torch._dynamo looks modules up by spec: give the stand-in one
        stub = types.ModuleType("onnxruntime")
        stub.__spec__ = ModuleSpec("onnxruntime", None)
        sys.modules["onnxruntime"] = stub
    from stepaudio2.cosyvoice2.flow.flow import CausalMaskedDiffWithXvec  # noqa: F401

    return CausalMaskedDiffWithXvec


def official_trims(src: Path):
    """``Token2wav._trim_estimator_cache`` and ``_trim_conformer_cache``, compiled from token2wav.py alone."""
    tree = ast.parse((src / "stepaudio2" / "token2wav.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Token2wav")
    wanted = [n for n in cls.body if isinstance(n, ast.FunctionDef)
              and n.name in ("_trim_estimator_cache", "_trim_conformer_cache")]
    ns = {"torch": torch}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), "token2wav.py", "exec"), ns)
    return ns["_trim_estimator_cache"], ns["_trim_conformer_cache"]


def build_flow(text: str):
    from hyperpyyaml import load_hyperpyyaml

    return load_hyperpyyaml(text.replace("!new:cosyvoice2.", "!new:stepaudio2.cosyvoice2."))["flow"]


def randomize(model: torch.nn.Module, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Every parameter drawn at random (norm gains 1 + 0.1 N, biases 0.05 N, the rest N / sqrt(fan_in)), rounded to
    float16 values so that the float16 file holds them exactly."""
    state = {}
    for name, p in sorted(model.state_dict().items()):
        if p.ndim == 1 and ("norm" in name or ".out.1." in name) and name.endswith("weight"):
            v = 1 + 0.1 * torch.randn(p.shape, generator=gen)
        elif name.endswith("bias") or "pos_bias" in name:
            v = 0.05 * torch.randn(p.shape, generator=gen)
        elif name == "input_embedding.weight":
            v = torch.randn(p.shape, generator=gen)
        else:
            v = torch.randn(p.shape, generator=gen) / np.sqrt(np.prod(p.shape[1:]))
        state[name] = v.half().float()
    model.load_state_dict(state, strict=True)
    return state


def size_scratch(flow, noise: torch.Tensor):
    cfm, est = flow.decoder, flow.decoder.estimator
    depth, hidden = len(est.blocks), est.in_proj.out_features
    heads, head_dim = est.blocks[0].attn.num_heads, est.blocks[0].attn.head_dim
    cfm.rand_noise = noise
    cfm.cnn_cache_buffer = torch.zeros(16, depth, 2, 2 * hidden, 2)
    cfm.att_cache_buffer = torch.zeros(16, depth, 2, heads, 1000, 2 * head_dim)
    est.cnn_cache_buffer = torch.zeros(depth, 2, 2 * hidden, 2)
    est.att_cache_buffer = torch.zeros(depth, 2, heads, 1000, 2 * head_dim)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", type=Path, default=Path("/tmp/dl/minicpmo_utils-1.0.7/src"))
    ap.add_argument("--out", type=Path, default=Path("tests/data/stepaudio2"))
    args = ap.parse_args()
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    import_official(args.src)
    trim_est, trim_conf = official_trims(args.src)
    flow = build_flow(FLOW_YAML).eval()
    gen = torch.Generator().manual_seed(20260512)
    state = randomize(flow, gen)
    noise = torch.randn(1, 80, NOISE_FRAMES, generator=gen)
    size_scratch(flow, noise)

    prompt = torch.randint(0, 64, (1, PROMPT_TOKENS), generator=gen, dtype=torch.int64).int()
    tokens = torch.randint(0, 64, (1, GEN_TOKENS), generator=gen, dtype=torch.int64).int()
    prompt_mel = torch.randn(1, PROMPT_TOKENS * 2, 80, generator=gen)
    spk = torch.randn(1, 192, generator=gen)
    prompt_frames = prompt_mel.shape[1]

    with torch.inference_mode():
        offline = flow.inference(tokens, torch.tensor([GEN_TOKENS]), prompt, torch.tensor([PROMPT_TOKENS]),
                                 prompt_mel, torch.tensor([prompt_frames]), spk, N_TIMESTEPS)

        class Holder:  # what the trims read from Token2wav: stream_cache, flow.encoder.encoders, the history
            CONFORMER_HISTORY_FRAMES = HISTORY

        holder = Holder()
        holder.flow = flow
        holder.stream_cache = flow.setup_cache(torch.cat([prompt, prompt[:, :3]], dim=1), prompt_mel, spk,
                                               n_timesteps=N_TIMESTEPS)
        holder.stream_cache = {k: v.clone() for k, v in holder.stream_cache.items()}
        shapes = [{k: list(v.shape) for k, v in holder.stream_cache.items()}]
        windows, chunk_mels = [], []
        offset = 0
        while True:
            last = GEN_TOKENS - offset <= CHUNK + 3
            window = tokens[:, offset:] if last else tokens[:, offset: offset + CHUNK + 3]
            mel, cache = flow.inference_chunk(token=window, spk=spk, cache=holder.stream_cache, last_chunk=last,
                                              n_timesteps=N_TIMESTEPS)
            holder.stream_cache = {k: v.clone() for k, v in cache.items()}  # they are views of scratch buffers
            trim_est(holder, prompt_frames)
            trim_conf(holder, prompt_frames)
            windows.append([offset, offset + window.shape[1], bool(last)])
            chunk_mels.append(mel.clone())
            shapes.append({k: list(v.shape) for k, v in holder.stream_cache.items()})
            if last:
                break
            offset += CHUNK

    cache = holder.stream_cache
    n = N_TIMESTEPS
    golden = {
        "prompt_tokens": prompt, "tokens": tokens, "prompt_mel": prompt_mel, "spk": spk, "noise": noise,
        "offline_mel": offline, "stream_mel": torch.cat(chunk_mels, dim=2),
        "conformer_cnn_cache": cache["conformer_cnn_cache"], "conformer_att_cache": cache["conformer_att_cache"],
        "estimator_cnn_cache": cache["estimator_cnn_cache"][:n],
        "estimator_att_cache_last_step": cache["estimator_att_cache"][n - 1],
    }
    sums = {k: [float(v.double().sum()), float(v.double().abs().sum())] for k, v in
            {"conformer_att_cache": cache["conformer_att_cache"],
             "estimator_att_cache": cache["estimator_att_cache"][:n]}.items()}
    meta = {
        "reference": "minicpmo-utils 1.0.7 stepaudio2.cosyvoice2 (CausalMaskedDiffWithXvec), torch "
                     + torch.__version__,
        "n_timesteps": N_TIMESTEPS, "prompt_frames": prompt_frames, "chunk": CHUNK, "history": HISTORY,
        "windows": windows, "chunk_frames": [int(m.shape[2]) for m in chunk_mels],
        "cache_shapes_after_each_call": shapes, "cache_sums": sums,
        "note": "official estimator caches have 16 leading rows (scratch buffers); rows >= n_timesteps are stale",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "flow.yaml").write_text(FLOW_YAML)
    save_file({k: v.half().contiguous() for k, v in state.items()}, str(args.out / "flow_weights.safetensors"))
    save_file({k: v.contiguous() for k, v in golden.items()}, str(args.out / "flow_golden.safetensors"))
    (args.out / "flow_golden.json").write_text(json.dumps(meta, indent=1))
    total = sum(f.stat().st_size for f in args.out.iterdir())
    print(f"offline mel {tuple(offline.shape)}, {len(chunk_mels)} chunks {meta['chunk_frames']}, "
          f"final caches { {k: tuple(v.shape) for k, v in cache.items()} }, {total / 1e6:.2f} MB in {args.out}")


if __name__ == "__main__":
    main()
