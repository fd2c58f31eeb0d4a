"""The MLX / NumPy Silero VAD port against the TorchScript model of the same ``silero-vad`` wheel.

The wheel's ``silero_vad_16k.safetensors`` holds another checkpoint than its TorchScript and ONNX files (same layout,
other values: conv1 differs by up to 4.0), and nothing in the wheel runs that file but a tinygrad sketch; so the
forward pass is checked by loading the TorchScript model's own weights into the port and comparing per-chunk
probabilities with the TorchScript model run as its users run it (one 512-sample chunk per call, state inside).
"""

from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf

from omnitide_mlx.vad import silero
from omnitide_mlx.vad.silero import CHUNK, SileroState, SileroVAD

torch = pytest.importorskip("torch")

# TorchScript parameter names -> the safetensors names the port reads (the same order in both files)
_NAMES = {
    "stft.forward_basis_buffer": "stft_conv.weight",
    **{f"encoder.{i}.reparam_conv.{p}": f"conv{i + 1}.{p}" for i in range(4) for p in ("weight", "bias")},
    **{f"decoder.rnn.{p}": f"lstm_cell.{p}" for p in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")},
    "decoder.decoder.2.weight": "final_conv.weight", "decoder.decoder.2.bias": "final_conv.bias",
}


@pytest.fixture(scope="module")
def jit_path():
    return silero.weights_path().parent / "silero_vad.jit"


@pytest.fixture(scope="module")
def port(jit_path):
    ts = torch.jit.load(str(jit_path))
    return SileroVAD({_NAMES[k]: v.numpy() for k, v in ts._model.state_dict().items()})


def _reference(ts, audio: np.ndarray) -> np.ndarray:
    """Per-chunk probabilities from the TorchScript model, streamed one chunk per call."""
    ts.reset_states()
    n = -(-audio.size // CHUNK)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one chunk at a time: threads only add hand-offs (30 ms a chunk with 2, 3 ms with 1)
    padded = np.zeros(n * CHUNK, np.float32)
    padded[:audio.size] = audio
    try:
        with torch.no_grad():
            return np.array([ts(torch.from_numpy(padded[i * CHUNK:(i + 1) * CHUNK]), 16000).item()
                             for i in range(n)])
    finally:
        torch.set_num_threads(threads)


def _signals(media_dir) -> dict[str, np.ndarray]:
    speech, sr = sf.read(media_dir / "speech_16k.wav", dtype="float32")
    assert sr == 16000
    rng = np.random.default_rng(0)
    white = rng.standard_normal(16000 * 2).astype(np.float32) * 0.1
    pink = np.cumsum(rng.standard_normal(16000 * 2)).astype(np.float32)
    pink = (pink - np.convolve(pink, np.ones(64) / 64, mode="same")) * 0.02  # a coloured, drifting noise
    noisy = speech[:16000 * 3] + 0.05 * rng.standard_normal(16000 * 3).astype(np.float32)
    return {"speech": speech, "white": white, "pink": pink.astype(np.float32), "speech+noise": noisy}


@pytest.fixture(scope="module")
def references(jit_path, media_dir):
    ts = torch.jit.load(str(jit_path)).eval()
    return {name: (audio, _reference(ts, audio)) for name, audio in _signals(media_dir).items()}


@pytest.mark.parametrize("route", ["numpy", "mlx"])
def test_port_matches_torchscript(port, references, route):
    for name, (audio, ref) in references.items():
        got = port.probs(audio, numpy=(route == "numpy"))
        assert got.shape == ref.shape
        assert np.abs(got - ref).max() < 1e-4, name
        if name == "speech":  # the comparison means something only if the reference finds both classes
            assert (ref > 0.9).mean() > 0.5 and (ref < 0.1).any()


def test_streaming_in_any_grouping_equals_batch(port, media_dir):
    speech, _ = sf.read(media_dir / "speech_16k.wav", dtype="float32")
    audio = speech[:CHUNK * 60]
    whole = port.probs(audio)
    state, got, i = SileroState.zeros(), [], 0
    for k in (1, 3, 7, 1, 20, 28):
        p, new = port.run(audio[i * CHUNK:(i + k) * CHUNK].reshape(k, CHUNK), state)
        assert not np.array_equal(new.h, state.h)  # the input state is left as it was
        got.append(p)
        state, i = new, i + k
    assert np.abs(np.concatenate(got) - whole).max() < 1e-6


def test_routes_agree_on_the_packaged_weights(media_dir):
    speech, _ = sf.read(media_dir / "speech_16k.wav", dtype="float32")
    model = SileroVAD.load()
    a, b = model.probs(speech, numpy=True), model.probs(speech, numpy=False)
    assert np.abs(a - b).max() < 1e-4
    assert (a > 0.5).mean() > 0.5 and (a < 0.2).any()  # the packaged checkpoint finds speech and pauses


def test_bad_input_and_missing_package(monkeypatch):
    model = SileroVAD.load()
    with pytest.raises(ValueError, match=r"\[N, 512\]"):
        model.run(np.zeros((2, 500), np.float32), SileroState.zeros())
    with pytest.raises(ValueError, match="not the Silero VAD 16 kHz layout"):
        SileroVAD({"stft_conv.weight": np.zeros((3, 1, 256), np.float32)})
    monkeypatch.setattr(silero.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps silero-vad"):
        silero.weights_path()
