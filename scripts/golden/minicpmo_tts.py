"""Golden outputs of the official MiniCPM-o 4.5 TTS (``MiniCPMTTS``) on a tiny random config, for
tests/models/test_minicpmo_tts.py.

How it was run (the files in tests/data/minicpmo_tts/ come from this exact command):

    /work/refenv/bin/python scripts/golden/minicpmo_tts.py \
        --official /work/.mirror/OpenBMB+MiniCPM-o-Demo/repo --out tests/data/minicpmo_tts

with torch 2.13.0+cpu, transformers 4.51.0, float32, eager attention, on the official code of GitHub
``OpenBMB/MiniCPM-o-Demo`` folder ``MiniCPMO45/`` at commit 28b60cf (read from the git mirror with ``git show``
into a temporary package, so its relative imports resolve; nothing of it is kept in this repository).

What it does:
- builds ``MiniCPMTTS(MiniCPMTTSConfig(**TTS_CONFIG), audio_tokenizer=None)`` as ``MiniCPMO.init_tts_module`` does
  (``attn_implementation="eager"``), re-draws every parameter with numpy ``default_rng(0)`` (sorted state-dict
  order; norm gains 1 + 0.1 N, biases 0.02 N, weight_norm gains g = 0.5 + |N|, the rest N / sqrt(fan_in)), then
  multiplies the audio-eos row's gain by EOS_GAIN so that greedy decoding ends its chunks (with unscaled random
  weights greedy decoding never picks eos);
- saves the weights under the official names (``tts.`` + state-dict key, weight_norm as ``original0`` / ``original1``)
  except ``tts.model.embed_tokens.weight`` (LlamaConfig's 32000 x hidden table, never used: the TTS is fed
  embeddings only; 4 MB), in ``tts_weights.safetensors``;
- draws fake LLM text chunks (ids < num_text_tokens, hidden states [n, llm_dim]) with ``default_rng(1)``;
- computes the condition exactly as ``streaming_generate`` writes it inline
  (``emb_text(ids) + F.normalize(projector_semantic(h), p=2, dim=-1)``);
- drives ``utils.TTSStreamingGenerator.generate_with_buffer`` chunk by chunk with the ``gen_logits`` processors of
  ``TTSSamplingParams()`` and the eos ``num_audio_tokens - 1``, then flushes the buffer, as ``streaming_generate``
  does; records every yielded (tokens, is_last) per text chunk and the head_code logits of the first steps.
  Greedy = the official path with ``torch.multinomial`` replaced by an argmax over the same scores; one run per
  ``attention_type``; one run where the LLM stops without a terminator (last chunk fed with text_finished=False,
  then the flush);
- sampled runs: torch's multinomial RNG cannot be reproduced in MLX, so the official multinomial is wrapped to
  record, per step, the probability vector it draws from and the token it drew (``torch.manual_seed(1234)``); the
  test replays the drawn tokens and compares the distributions.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

COMMIT = "28b60cf"
FILES = ("modeling_minicpmo.py", "configuration_minicpmo.py", "utils.py", "processing_minicpmo.py",
         "modeling_navit_siglip.py", "tokenization_minicpmo_fast.py")

TTS_CONFIG = {
    "llm_dim": 64, "llm_intermediate_size": 48, "projector_type": "mlp", "hidden_act": "silu",
    "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "max_position_embeddings": 4096, "num_audio_tokens": 48, "num_text_tokens": 160,
    "num_vq": 1, "audio_bos_token_id": 150, "text_eos_token_id": 151, "condition_type": "hidden_text_merge",
    "backbone_model": "llama", "normalize_projected_hidden": True, "attention_type": "sliding_recompute",
    "recomputed_chunks": 1, "window_size": 2, "streaming_sliding_window_audio_window_size": 40,
    # MiniCPMTTS.__init__ reads these three from the config (the class does not define them)
    "top_p": 0.85, "top_k": 25, "repetition_penalty": 1.05,
}
CHUNK_SIZES = (10, 10, 5)  # the LLM's text chunks (10 tokens each after the first chunk's extra token)
ATTENTION_TYPES = ("full_attention", "sliding_window", "sliding_recompute", "reindex")
N_LOGIT_STEPS = 40
EOS_GAIN = 5.25


def import_official(mirror: Path, tmp: Path):
    pkg = tmp / "MiniCPMO45"
    pkg.mkdir()
    for f in FILES:
        text = subprocess.run(["git", "-C", str(mirror), "show", f"{COMMIT}:MiniCPMO45/{f}"], check=True,
                              capture_output=True, text=True).stdout
        (pkg / f).write_text(text, encoding="utf-8")
    (pkg / "__init__.py").write_text("", encoding="utf-8")
    sys.path.insert(0, str(tmp))
    import MiniCPMO45.modeling_minicpmo as modeling
    import MiniCPMO45.utils as utils

    return modeling, utils


def build(modeling, cfg: dict):
    import torch

    config = modeling.MiniCPMTTSConfig(**cfg)
    config.attn_implementation = "eager"  # MiniCPMO.init_tts_module on a non-flash-attention model
    tts = modeling.MiniCPMTTS(config=config, audio_tokenizer=None)
    return tts.to(torch.float32).eval()


def random_state(tts, seed: int, eos_gain: float) -> dict:
    import torch

    rng = np.random.default_rng(seed)
    out = {}
    for name in sorted(tts.state_dict()):
        shape = tuple(tts.state_dict()[name].shape)
        if name.endswith("norm.weight"):
            a = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith("bias"):
            a = 0.02 * rng.standard_normal(shape)
        elif name.endswith("original0"):
            a = 0.5 + np.abs(rng.standard_normal(shape))
        else:
            a = rng.standard_normal(shape) / np.sqrt(shape[-1])
        out[name] = torch.tensor(a.astype(np.float32))
    eos = TTS_CONFIG["num_audio_tokens"] - 1
    out["head_code.0.parametrizations.weight.original0"][eos] *= eos_gain
    return out


@contextlib.contextmanager
def patched_multinomial(record: list | None, greedy: bool):
    import torch

    real = torch.multinomial

    def fake(scores, num_samples=1, *a, **kw):
        idx = scores.argmax(-1, keepdim=True) if greedy else real(scores, num_samples, *a, **kw)
        if record is not None:
            record.append((scores[0].detach().numpy().copy(), int(idx[0, 0])))
        return idx

    torch.multinomial = fake
    try:
        yield
    finally:
        torch.multinomial = real


def conditions(tts, chunks):
    import torch
    import torch.nn.functional as F

    out = []
    with torch.no_grad():
        for ids, h in chunks:
            llm_embeds = tts.emb_text(torch.tensor(ids)[None])
            hidden = tts.projector_semantic(torch.tensor(h)[None])
            if tts.config.normalize_projected_hidden:
                hidden = F.normalize(hidden, p=2, dim=-1)
            out.append(llm_embeds + hidden)
    return out


def run(modeling, utils, tts, conds, greedy: bool, finished_last: bool = True, record=None, logits=None):
    """streaming_generate's TTS part: one generate_with_buffer per text chunk, then the buffer flush."""
    import torch

    params = utils.TTSSamplingParams()
    warpers, processors = modeling.gen_logits(num_code=tts.config.num_audio_tokens,
                                              repetition_penalty=params.repetition_penalty, top_p=params.top_p,
                                              top_k=params.top_k)
    gen = utils.TTSStreamingGenerator(model=tts, temperature=params.temperature,
                                      eos_token=torch.tensor([tts.config.num_audio_tokens - 1], dtype=torch.long),
                                      chunk_size=25, tts_last_turn_tokens=None, logits_processors=processors,
                                      logits_warpers=warpers)
    gen.spk_emb = torch.empty((1, 0, tts.config.hidden_size))
    hook = None
    if logits is not None:
        hook = tts.head_code[0].register_forward_hook(lambda m, i, o: logits.append(o[0, -1].detach().numpy().copy()))
    feeds = []
    try:
        with patched_multinomial(record, greedy):
            for i, cond in enumerate(conds):
                last = finished_last and i == len(conds) - 1
                feeds.append([[t.reshape(-1).tolist(), bool(f)] for t, f in
                              gen.generate_with_buffer(condition=cond, text_finished=last)])
            flush = []
            if len(gen._token_buffer) > 0:
                flush.append([torch.cat(gen._token_buffer, dim=1).reshape(-1).tolist(), True])
                gen._token_buffer = []
    finally:
        if hook is not None:
            hook.remove()
    return {"feeds": feeds, "flush": flush}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--official", required=True, help="git dir of OpenBMB/MiniCPM-o-Demo")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch
    from safetensors.numpy import save_file

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        modeling, utils = import_official(Path(args.official), Path(tmp))
        rng = np.random.default_rng(1)
        chunks = []
        for n in CHUNK_SIZES:
            ids = rng.integers(0, 150, size=n).astype(np.int64)
            h = (2.0 * rng.standard_normal((n, TTS_CONFIG["llm_dim"]))).astype(np.float32)
            chunks.append((ids, h))

        # EOS_GAIN was picked by hand on a grid (1.0 .. 8.0): with it greedy full attention ends every text chunk
        # with an eos (12, 38 and 18 tokens), so the run has a buffered carry-over, full chunks and a short tail
        gain = EOS_GAIN
        cfg_full = {**TTS_CONFIG, "attention_type": "full_attention"}
        tts = build(modeling, cfg_full)
        state = random_state(tts, 0, gain)
        tts.load_state_dict(state)
        conds = conditions(tts, chunks)
        res = run(modeling, utils, tts, conds, greedy=True)
        lens = [sum(len(t) for t, _ in f) for f in res["feeds"]]
        print(f"eos gain {gain}: audio tokens per text chunk {lens}")

        weights = {f"tts.{k}": v.numpy() for k, v in state.items() if k != "model.embed_tokens.weight"}
        save_file(weights, str(out / "tts_weights.safetensors"), metadata={"format": "pt"})

        arrays = {}
        for i, (ids, h) in enumerate(chunks):
            arrays[f"ids_{i}"] = ids
            arrays[f"hidden_{i}"] = h
            arrays[f"condition_{i}"] = conds[i][0].detach().numpy()
        with torch.no_grad():  # weight_norm materialised by torch: g * v / ||v||
            arrays["head_code_weight"] = tts.head_code[0].weight.detach().numpy().copy()
        runs = {}
        for kind in ATTENTION_TYPES:
            model = build(modeling, {**TTS_CONFIG, "attention_type": kind})
            model.load_state_dict(state)
            conds = conditions(model, chunks)
            logits: list = []
            runs[f"greedy_{kind}"] = run(modeling, utils, model, conds, greedy=True, logits=logits)
            arrays[f"logits_greedy_{kind}"] = np.stack(logits[:N_LOGIT_STEPS])
            print(kind, [sum(len(t) for t, _ in f) for f in runs[f"greedy_{kind}"]["feeds"]])
        model = build(modeling, cfg_full)
        model.load_state_dict(state)
        conds = conditions(model, chunks)
        runs["greedy_full_attention_no_terminator"] = run(modeling, utils, model, conds, greedy=True,
                                                          finished_last=False)
        for kind in ("full_attention", "sliding_recompute"):
            model = build(modeling, {**TTS_CONFIG, "attention_type": kind})
            model.load_state_dict(state)
            conds = conditions(model, chunks)
            torch.manual_seed(1234)
            record: list = []
            runs[f"sampled_{kind}"] = run(modeling, utils, model, conds, greedy=False, record=record)
            arrays[f"probs_sampled_{kind}"] = np.stack([r[0] for r in record])
            runs[f"sampled_{kind}"]["draws"] = [r[1] for r in record]
            print("sampled", kind, [sum(len(t) for t, _ in f) for f in runs[f"sampled_{kind}"]["feeds"]])
        np.savez_compressed(out / "golden.npz", **arrays)
        meta = {"tts_config": TTS_CONFIG, "eos_gain": float(gain), "chunk_sizes": list(CHUNK_SIZES),
                "sampling": vars(utils.TTSSamplingParams()), "official_commit": COMMIT,
                "torch": torch.__version__, "transformers": __import__("transformers").__version__, "runs": runs}
        (out / "golden.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
