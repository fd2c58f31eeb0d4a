"""Golden data for the 1.0.6 token2wav layout (tests/models/test_stepaudio2_token2wav_versions.py).

Reference: ``stepaudio2/token2wav.py`` of ``minicpmo-utils`` 1.0.6 (PyPI sdist; what OpenBMB's MiniCPM-o 4.5 demo
pins): ``Token2wav.set_stream_cache`` (prompt + three 4218 tokens) and ``Token2wav.stream`` (flow chunk, the estimator
trim, the packed conformer trim, the original ``HiFTGenerator`` over 8 cached mel frames with the cached source and a
Hamming cross-fade), run as the official MiniCPM-o ``streaming_generate`` drives it (the two caches returned by
``set_stream_cache`` assigned to ``stream_cache`` / ``hift_cache_dict``). Generated with torch 2.13.0+cpu,
HyperPyYAML 1.2.3, einops 0.8.2, float32, CPU.

    pip download --no-deps minicpmo-utils==1.0.6 -d /tmp/mu && tar xzf /tmp/mu/minicpmo_utils-1.0.6.tar.gz -C /tmp/mu
    pip install --target /tmp/refpkgs hyperpyyaml einops
    PYTHONPATH=/tmp/refpkgs python scripts/golden/stepaudio2_token2wav_106.py --src /tmp/mu/minicpmo_utils-1.0.6/src

How the official module is run on a CPU without its model files: ``token2wav.py`` is executed from its source with
``.cuda()`` / ``device='cuda'`` replaced by the CPU, and stand-in modules for the imports only ``_prepare_prompt``
and ``__call__`` use (s3tokenizer, onnxruntime, torchaudio); the instance is built without ``__init__`` (which loads
the ONNX models) and given the tiny flow, the tiny original HiFT and the 1.0.6 stream settings its ``__init__`` sets;
``_prepare_prompt`` returns the saved voice prompt. The flow is a tiny ``flow.yaml`` in the official format with a
vocabulary of 4224 (4218 must be a token), float16-exact random weights and a seeded ``rand_noise``; the HiFT is
``HiFTGenerator(base_channels=16, f0_predictor=ConvRNNF0Predictor(cond_channels=16))`` with random weights. The
source's Gaussian noise (``torch.randn_like`` in SineGen2) is drawn per vocoder call from a seeded NumPy generator
that the test replays.

Writes tests/data/stepaudio2/t2w_106/: flow.yaml, flow.safetensors (official names, incl. decoder.rand_noise),
hift.safetensors (``generator.``-prefixed official names), voice.safetensors, golden.npz (windows, every push's
samples, each chunk's mel and each vocoder call's F0, the noise seed).
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stepaudio2_flow import FLOW_YAML, import_official, randomize, size_scratch  # noqa: E402

VOCAB = 4224
PROMPT_TOKENS = 10
GEN_TOKENS = 80
CHUNK = 12
N_TIMESTEPS = 3
NOISE_FRAMES = 400
SOURCE_NOISE_SEED = 606
HIFT_WIDTH = 16


def official_token2wav(src: Path):
    """The 1.0.6 token2wav module, executed on the CPU (see the module docstring)."""
    for name in ("s3tokenizer", "onnxruntime", "torchaudio", "torchaudio.compliance", "torchaudio.compliance.kaldi"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["torchaudio"].compliance = sys.modules["torchaudio.compliance"]
    sys.modules["torchaudio.compliance"].kaldi = sys.modules["torchaudio.compliance.kaldi"]
    audio = types.ModuleType("stepaudio2.flashcosyvoice.utils.audio")
    audio.mel_spectrogram = None  # used by _prepare_prompt only
    sys.modules["stepaudio2.flashcosyvoice.utils.audio"] = audio
    hp = types.ModuleType("hyperpyyaml")
    from hyperpyyaml import load_hyperpyyaml
    hp.load_hyperpyyaml = load_hyperpyyaml
    text = (src / "stepaudio2" / "token2wav.py").read_text()
    text = text.replace(".cuda()", ".cpu()").replace("device='cuda'", "device='cpu'")
    module = types.ModuleType("stepaudio2.token2wav")
    exec(compile(text, str(src / "stepaudio2" / "token2wav.py"), "exec"), module.__dict__)
    return module


def tiny_hift(gen: np.random.Generator):
    from stepaudio2.flashcosyvoice.modules import hifigan

    model = hifigan.HiFTGenerator(base_channels=HIFT_WIDTH,
                                  f0_predictor=hifigan.ConvRNNF0Predictor(cond_channels=HIFT_WIDTH))
    state = {}
    for key, value in model.state_dict().items():
        shape = tuple(value.shape)
        if key.endswith("original0"):
            a = gen.uniform(0.5, 1.2, shape)
        elif key.endswith(("original1", ".weight")) and len(shape) == 3:
            a = gen.normal(0.0, 1.0 / np.sqrt(np.prod(shape[1:])), shape)
        elif key.endswith("alpha"):
            a = gen.uniform(0.5, 1.5, shape)
        elif key == "m_source.l_linear.weight":
            a = gen.normal(0.0, 0.5, shape)
        elif key == "f0_predictor.classifier.weight":
            a = gen.normal(0.0, 240.0 / np.sqrt(shape[1]), shape)
        elif key == "f0_predictor.classifier.bias":
            a = np.full(shape, 60.0)
        elif key.endswith("bias"):
            a = gen.normal(0.0, 0.1, shape)
        else:
            raise KeyError(key)
        state[key] = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
    model.load_state_dict(state, strict=True)
    return model.eval(), state


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", type=Path, default=Path("/tmp/mu/minicpmo_utils-1.0.6/src"))
    ap.add_argument("--out", type=Path, default=Path("tests/data/stepaudio2/t2w_106"))
    args = ap.parse_args()
    from hyperpyyaml import load_hyperpyyaml
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    import_official(args.src)
    t2w_module = official_token2wav(args.src)
    flow_yaml = FLOW_YAML.replace("vocab_size: 64", f"vocab_size: {VOCAB}")
    assert f"vocab_size: {VOCAB}" in flow_yaml
    flow = load_hyperpyyaml(flow_yaml.replace("!new:cosyvoice2.", "!new:stepaudio2.cosyvoice2."))["flow"].eval()
    gen = torch.Generator().manual_seed(20261203)
    state = randomize(flow, gen)
    noise = torch.randn(1, 80, NOISE_FRAMES, generator=gen)
    size_scratch(flow, noise)  # the official scratch buffers are sized for the release's widths
    hift, hift_state = tiny_hift(np.random.default_rng(5))

    prompt = torch.randint(0, VOCAB, (1, PROMPT_TOKENS), generator=gen, dtype=torch.int64).int()
    tokens = torch.randint(0, VOCAB, (1, GEN_TOKENS), generator=gen, dtype=torch.int64).int()
    prompt_mel = torch.randn(1, PROMPT_TOKENS * 2, 80, generator=gen)
    spk = torch.randn(1, 192, generator=gen)

    t2w = object.__new__(t2w_module.Token2wav)
    t2w.float16, t2w.n_timesteps, t2w.flow, t2w.hift = False, N_TIMESTEPS, flow, hift
    t2w.mel_cache_len = 8
    t2w.source_cache_len = 8 * 480
    t2w.speech_window = torch.from_numpy(np.hamming(2 * t2w.source_cache_len))
    t2w.hift_cache_dict = {}
    prepared = (prompt, torch.tensor([PROMPT_TOKENS]), spk, prompt_mel, torch.tensor([PROMPT_TOKENS * 2]))
    t2w._prepare_prompt = lambda wav: prepared
    t2w.cache = None

    source_noise = np.random.default_rng(SOURCE_NOISE_SEED)
    real_randn_like, shapes = torch.randn_like, []

    def randn_like(x, *a, **k):  # SineGen2's noise is (1, samples, 9); SourceModuleHnNSF's second draw is unused
        if x.ndim == 3 and x.shape[-1] == 9:
            shapes.append(tuple(x.shape))
            return torch.from_numpy(source_noise.standard_normal(tuple(x.shape), dtype=np.float32))
        return real_randn_like(x, *a, **k)

    mels, f0s = [], []
    real_chunk, real_f0 = flow.inference_chunk, hift.f0_predictor.forward

    def inference_chunk(*a, **k):  # record each chunk's mel (the vocoder's input)
        mel, cache = real_chunk(*a, **k)
        mels.append(mel.detach().clone().numpy())
        return mel, cache

    def f0_forward(x):
        f0 = real_f0(x)
        f0s.append(f0.detach().clone().numpy().reshape(-1))
        return f0

    flow.inference_chunk, hift.f0_predictor.forward = inference_chunk, f0_forward
    torch.randn_like = randn_like
    windows, pushes = [], []
    try:
        with torch.inference_mode():
            t2w.stream_cache, t2w.hift_cache_dict = t2w.set_stream_cache("prompt.wav")
            offset = 0
            while True:
                last = GEN_TOKENS - offset <= CHUNK + 3
                window = tokens[0, offset:] if last else tokens[0, offset:offset + CHUNK + 3]
                wav = t2w.stream(window.tolist(), None, last_chunk=last, return_waveform=True)
                windows.append([offset, offset + window.shape[0], int(last)])
                pushes.append(np.asarray(wav, dtype=np.float32).reshape(-1))
                if last:
                    break
                offset += CHUNK
    finally:
        torch.randn_like = real_randn_like
    conformer_len = int(t2w.stream_cache["conformer_att_cache"].shape[3])

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "flow.yaml").write_text(flow_yaml)
    flow_state = {k: v.half().contiguous() for k, v in state.items()}
    flow_state["decoder.rand_noise"] = noise.contiguous()
    save_file(flow_state, str(out / "flow.safetensors"))
    save_file({"generator." + k: v.contiguous() for k, v in hift_state.items()}, str(out / "hift.safetensors"))
    save_file({"prompt_tokens": prompt[0].contiguous(), "prompt_mel": prompt_mel[0].contiguous(),
               "speaker_embedding": spk[0].contiguous()}, str(out / "voice.safetensors"))
    np.savez_compressed(out / "golden.npz", tokens=tokens[0].numpy(), windows=np.array(windows),
                        lengths=np.array([p.size for p in pushes]), samples=np.concatenate(pushes),
                        source_noise_seed=np.array(SOURCE_NOISE_SEED), n_timesteps=np.array(N_TIMESTEPS),
                        noise_shapes=np.array(shapes), conformer_att_len=np.array(conformer_len),
                        mels=np.concatenate(mels, axis=2)[0], f0=np.concatenate(f0s))
    total = sum(f.stat().st_size for f in out.iterdir())
    print(f"{len(pushes)} pushes {[p.size for p in pushes]}, final conformer cache {conformer_len} frames, "
          f"max |wav| {max(np.abs(p).max() for p in pushes):.3f}, {total / 1e6:.2f} MB in {out}")


if __name__ == "__main__":
    main()
