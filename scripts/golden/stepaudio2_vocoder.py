"""Reference outputs of StepAudio2's causal vocoder (the official PyTorch code of minicpmo-utils 1.0.7) on the tiny
fixture, for tests/models/test_stepaudio2_vocoder.py.

Run with the reference environment (torch CPU, hyperpyyaml, scipy, safetensors):

    /work/refenv/bin/python scripts/golden/stepaudio2_vocoder.py [--src /tmp/dl/minicpmo_utils-1.0.7/src]

It builds the official CausalHiFTGenerator from the tiny config.yaml with hyperpyyaml (the object tags mapped to the
wheel's classes as its token2wav.py does), loads the tiny hift.safetensors with strict=True, replaces the source's
random noise table with a seeded NumPy table the test regenerates, and runs
  (a) CausalHiFTGenerator.inference on a whole mel (finalize=True), and once with finalize=False;
  (b) BoundedVocoder.stream over uneven chunks, finalize on the last (an empty chunk among them);
  (c) the original non-causal HiFTGenerator (flashcosyvoice, what Token2wav runs on whole utterances) at small
      widths with seeded random weights, its Gaussian source noise replaced by a seeded NumPy draw.
Writes tests/data/stepaudio2/vocoder_tiny/{config.yaml,hift.safetensors}, vocoder_golden.npz,
vocoder_original_tiny.safetensors and vocoder_original_golden.npz under tests/data/stepaudio2.
The official stepaudio2/__init__.py (which imports onnxruntime, s3tokenizer, torchaudio) is not run: a namespace
module stands in for the package.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import torch
import yaml

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "tests" / "data" / "stepaudio2"
MEL_FRAMES = 40
CHUNKS = [10, 5, 0, 17, 8]          # fresh mel frames per stream() call; the last call has finalize=True
NONFINAL_FRAMES = 30                 # inference(mel[:, :, :30], finalize=False)
NOISE_SEED = 1234
MEL_SEED = 7
WEIGHT_SEED = 0


def noise_table(frames: int, width: int = 9) -> np.ndarray:
    """The test's stand-in for the official torch.rand(1, 300 * 24000, 9) table (uniform [0, 1))."""
    return np.random.default_rng(NOISE_SEED).random((1, frames * 480, width), dtype=np.float32)


def import_official(src: Path):
    pkg = types.ModuleType("stepaudio2")
    pkg.__path__ = [str(src / "stepaudio2")]
    sys.modules["stepaudio2"] = pkg
    from stepaudio2.causal_vocoder import bounded_vocoder, f0_predictor, generator
    return generator, f0_predictor, bounded_vocoder


def load_official_model(folder: Path, generator, f0_predictor):
    """config.yaml -> model, the way the wheel's token2wav._load_config resolves the tags."""
    from hyperpyyaml import load_hyperpyyaml
    from safetensors.torch import load_file

    targets = {
        "cosyvoice.hifigan.generator.CausalHiFTGenerator": generator.CausalHiFTGenerator,
        "cosyvoice.hifigan.f0_predictor.CausalConvRNNF0Predictor": f0_predictor.CausalConvRNNF0Predictor,
    }
    with open(folder / "config.yaml") as f:
        root = yaml.compose(f)

    def localize(node):
        for prefix in ("!new:", "!name:"):
            if node.tag.startswith(prefix):
                name = node.tag[len(prefix):]
                if name in targets:
                    node.tag = prefix + targets[name].__module__ + "." + targets[name].__name__
                elif name == "matcha.utils.audio.mel_spectrogram":
                    node.tag = prefix + "builtins.dict"  # only its keywords are checked
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                localize(k)
                localize(v)
        elif isinstance(node, yaml.SequenceNode):
            for v in node.value:
                localize(v)

    localize(root)
    config = load_hyperpyyaml(yaml.serialize(root))
    model = config["hift"]
    expected = dict(n_fft=1920, num_mels=80, sampling_rate=24000, hop_size=480, win_size=1920, fmin=0, fmax=8000,
                    center=False)
    assert all(config["feat_extractor"].keywords.get(k) == v for k, v in expected.items())
    model.load_state_dict(load_file(str(folder / "hift.safetensors")), strict=True)
    return model.float().eval()


ORIGINAL_WIDTHS = dict(base_channels=16, cond_channels=16)
ORIGINAL_FRAMES = 20
ORIGINAL_NOISE_SEED = 99


def original_noise(frames: int, width: int = 9) -> np.ndarray:
    """The test's stand-in for the original source's torch.randn_like noise (standard normal)."""
    return np.random.default_rng(ORIGINAL_NOISE_SEED).standard_normal((1, frames * 480, width), dtype=np.float32)


def original_golden(src: Path, mel: np.ndarray):
    """The original HiFTGenerator on the first ORIGINAL_FRAMES mel frames."""
    from safetensors.torch import save_file
    from stepaudio2.flashcosyvoice.modules import hifigan

    model = hifigan.HiFTGenerator(base_channels=ORIGINAL_WIDTHS["base_channels"],
                                  f0_predictor=hifigan.ConvRNNF0Predictor(
                                      cond_channels=ORIGINAL_WIDTHS["cond_channels"]))
    rng = np.random.default_rng(11)
    state = {}
    for key, value in model.state_dict().items():
        shape = tuple(value.shape)
        if key.endswith("original0"):
            a = rng.uniform(0.5, 1.2, shape)
        elif key.endswith(("original1", ".weight")) and len(shape) == 3:
            a = rng.normal(0.0, 1.0 / np.sqrt(np.prod(shape[1:])), shape)
        elif key.endswith("alpha"):
            a = rng.uniform(0.5, 1.5, shape)
        elif key == "m_source.l_linear.weight":
            a = rng.normal(0.0, 0.5, shape)
        elif key == "f0_predictor.classifier.weight":
            a = rng.normal(0.0, 240.0 / np.sqrt(shape[1]), shape)
        elif key == "f0_predictor.classifier.bias":
            a = np.full(shape, 60.0)
        elif key.endswith("bias"):
            a = rng.normal(0.0, 0.1, shape)
        else:
            raise KeyError(key)
        state[key] = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
    model.load_state_dict(state, strict=True)
    model.eval()
    # hift_original.pt keys carry a "generator." prefix that Token2wav strips: store them that way
    save_file({"generator." + k: v for k, v in state.items()}, str(OUT / "vocoder_original_tiny.safetensors"))

    noise = torch.from_numpy(original_noise(ORIGINAL_FRAMES))
    real_randn_like, calls = torch.randn_like, []

    def randn_like(x, *a, **k):  # the first draw is SineGen2's (B, samples, 9) noise; the second is unused
        calls.append(tuple(x.shape))
        return noise.clone() if len(calls) == 1 else real_randn_like(x, *a, **k)

    torch.randn_like = randn_like
    try:
        with torch.inference_mode():
            speech, source = model(speech_feat=torch.from_numpy(mel[:, :, :ORIGINAL_FRAMES]))
    finally:
        torch.randn_like = real_randn_like
    assert calls[0] == tuple(noise.shape), calls
    with torch.inference_mode():
        f0 = model.f0_predictor(torch.from_numpy(mel[:, :, :ORIGINAL_FRAMES]))
    np.savez_compressed(OUT / "vocoder_original_golden.npz", mel=mel[:, :, :ORIGINAL_FRAMES], f0=f0[0].numpy(),
                        speech=speech[0].numpy(), source=source[0, 0].numpy(),
                        noise_seed=np.array(ORIGINAL_NOISE_SEED), noise_sum=np.array(float(noise.double().sum())),
                        base_channels=np.array(ORIGINAL_WIDTHS["base_channels"]),
                        cond_channels=np.array(ORIGINAL_WIDTHS["cond_channels"]))
    print("original HiFT: f0", f0[0, :6].numpy().round(1), "speech max", float(speech.abs().max()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", type=Path, default=Path("/tmp/dl/minicpmo_utils-1.0.7/src"))
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from omnitide_mlx.models.stepaudio2.tiny_vocoder import write_tiny_vocoder  # NumPy only: no MLX here

    generator, f0_predictor, bounded_vocoder = import_official(args.src)
    torch.manual_seed(0)
    tiny = OUT / "vocoder_tiny"
    if tiny.exists():
        shutil.rmtree(tiny)
    write_tiny_vocoder(tiny, seed=WEIGHT_SEED)
    model = load_official_model(tiny, generator, f0_predictor)
    delay = model.f0_predictor.condnet[0].causal_padding + model.conv_pre_look_right + 1
    assert delay == 8, delay

    table = torch.from_numpy(noise_table(MEL_FRAMES))
    model.m_source.l_sin_gen.sine_waves = table
    mel = np.random.default_rng(MEL_SEED).normal(-4.0, 2.0, (1, 80, MEL_FRAMES)).astype(np.float32)
    mel_t = torch.from_numpy(mel)

    with torch.inference_mode():
        f0 = model.f0_predictor.to(torch.float64)(mel_t.double(), finalize=True).float()
        offline, offline_source = model.inference(mel_t, finalize=True)
        nonfinal, _ = model.inference(mel_t[:, :, :NONFINAL_FRAMES], finalize=False)

    vocoder = bounded_vocoder.BoundedVocoder(model)
    assert vocoder.model.m_source.l_sin_gen.sine_waves is table
    pieces, start = [], 0
    for i, n in enumerate(CHUNKS):
        out = vocoder.stream(mel_t[:, :, start:start + n], finalize=i == len(CHUNKS) - 1)
        pieces.append(out[0].numpy())
        start += n
    assert start == MEL_FRAMES
    stream = np.concatenate(pieces)
    lens = np.array([len(p) for p in pieces])
    print("delay frames", vocoder.delay, "history", vocoder.history, "chunk samples", lens.tolist())
    print("official stream vs offline max |diff|", float(np.abs(stream - offline[0].numpy()).max()))
    n = nonfinal.shape[1]
    print("official finalize=False vs offline (first", n, "samples) max |diff|",
          float(np.abs(nonfinal[0].numpy() - offline[0, :n].numpy()).max()))
    # the reset path: a second utterance after reset() equals the first
    vocoder.reset()
    again = vocoder.stream(mel_t, finalize=True)[0].numpy()
    print("official after reset, whole mel in one call vs chunked max |diff|", float(np.abs(again - stream).max()))

    np.savez_compressed(
        OUT / "vocoder_golden.npz",
        mel=mel, f0=f0[0].numpy(), offline=offline[0].numpy(), offline_source=offline_source[0, 0].numpy(),
        nonfinal=nonfinal[0].numpy(), nonfinal_frames=np.array(NONFINAL_FRAMES),
        stream=stream, stream_chunk_frames=np.array(CHUNKS), stream_chunk_samples=lens, stream_one_call=again,
        noise_seed=np.array(NOISE_SEED), noise_sum=np.array(float(table.double().sum())),
        history=np.array(vocoder.history), delay=np.array(vocoder.delay),
        maxima=np.array([vocoder.maxima[k] for k in sorted(vocoder.maxima)]),
        maxima_keys=np.array(sorted(vocoder.maxima)),
    )
    original_golden(args.src, mel)
    total = sum(p.stat().st_size for p in OUT.rglob("vocoder*") if p.is_file())
    print(f"wrote {OUT} ({total / 1e3:.0f} kB)")


if __name__ == "__main__":
    main()
