"""Both token2wav folder layouts, each run the way its own minicpmo-utils version runs it.

1.0.6 (``flow.yaml`` + ``flow`` + ``hift``, the layout the released MiniCPM-o 4.5 ships): golden data from the official
1.0.6 ``Token2wav.set_stream_cache`` / ``stream`` on tiny weights (scripts/golden/stepaudio2_token2wav_106.py): 80
tokens in windows of 12 + 3, priming with three 4218 tokens, the conformer cache trimmed (packed) three times, the
original HiFT with its cached source and cross-fade. 1.0.7 (``config.yaml``) is covered against its official code by
test_stepaudio2_flow.py / test_stepaudio2_vocoder.py / test_stepaudio2_token2wav.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from omnitide_mlx.models.loading import CheckpointError
from omnitide_mlx.models.stepaudio2 import weights as t2w_weights
from omnitide_mlx.models.stepaudio2.tiny import write_tiny_token2wav
from omnitide_mlx.models.stepaudio2.token2wav import Token2Wav, Voice, detect_version
from omnitide_mlx.models.stepaudio2.vocoder import BoundedVocoder, HiFTGenerator, OverlapVocoder

DATA = Path(__file__).resolve().parents[1] / "data" / "stepaudio2" / "t2w_106"


@pytest.fixture(scope="module")
def golden():
    g = dict(np.load(DATA / "golden.npz"))
    g["pushes"] = np.split(g["samples"], np.cumsum(g["lengths"])[:-1])
    return g


@pytest.fixture(scope="module")
def t2w(golden):
    return Token2Wav.load(DATA, n_timesteps=int(golden["n_timesteps"]))


def _replayed_noise(golden):
    rng = np.random.default_rng(int(golden["source_noise_seed"]))
    return lambda shape: rng.standard_normal(shape, dtype=np.float32)


def _stream(t2w, golden, folder=DATA):
    """Push the golden windows; returns (pushes, the flow's chunk mels)."""
    stream = t2w.start_stream(Voice.load(folder))
    stream.vocoder.noise = _replayed_noise(golden)
    mels, real = [], t2w.flow.inference_chunk

    def recording(*a, **k):
        mel, cache = real(*a, **k)
        mels.append(np.array(mel))
        return mel, cache

    t2w.flow.inference_chunk = recording
    try:
        pushes = [stream.push(golden["tokens"][a:b], last=bool(last)) for a, b, last in golden["windows"]]
    finally:
        del t2w.flow.inference_chunk
    return pushes, np.concatenate(mels, axis=2)[0], stream


def test_the_106_layout_is_detected_and_loads_the_original_hift(t2w):
    assert detect_version(DATA) == "1.0.6"
    assert t2w.version == "1.0.6" and isinstance(t2w.vocoder, HiFTGenerator) and t2w.offline_vocoder == "original"
    assert t2w.vocoder.args.base_channels == 16  # widths read from the weights (HiFTGenerator() defaults are 512)


def test_106_stream_matches_the_official_code(t2w, golden):
    """Flow mel per chunk through three packed conformer trims: float error (measured 1.9e-5 on values up to 6.4).
    Audio: the original HiFT turns ~1e-5 of mel into F0 differences that its phase (hop x harmonics x running sum)
    magnifies (test_stepaudio2_vocoder.py: 1.8e-4 on 20 frames from the same mel), so the vocoder is also checked on
    the official mel (measured 1.5e-3) and end to end more loosely (measured 1.9e-2 on samples up to 1.07)."""
    pushes, mels, stream = _stream(t2w, golden)
    assert np.abs(mels - golden["mels"]).max() < 1e-4
    assert stream.cache["conformer_att_cache"].shape[3] == int(golden["conformer_att_len"])
    assert [p.size for p in pushes] == [int(n) for n in golden["lengths"]]
    assert not pushes[0][:3840].any()  # the first chunk's silence
    worst = max(np.abs(p - r).max() for p, r in zip(pushes, golden["pushes"]))
    rms = np.sqrt(np.mean((np.concatenate(pushes) - golden["samples"]) ** 2))
    print(f"1.0.6 stream: mel {np.abs(mels - golden['mels']).max():.1e}, audio max {worst:.1e}, rms {rms:.1e}")
    assert worst < 5e-2 and rms < 5e-3

    vocoder = OverlapVocoder(t2w.vocoder, noise=_replayed_noise(golden))
    start = 0
    for (a, b, last), want in zip(golden["windows"], golden["pushes"]):
        frames = (b - a - (0 if last else 3)) * 2
        got = np.array(vocoder.stream(mx.array(golden["mels"][None, :, start:start + frames]), bool(last)))
        start += frames
        assert np.abs(got.reshape(-1) - want).max() < 3e-3


def test_106_and_107_ways_differ_on_the_same_weights(t2w, golden, monkeypatch):
    """Run the 1.0.6 folder with either of 1.0.7's rules and the mel leaves the official 1.0.6 one: the 1.0.7
    priming (prompt + its first 3 tokens) moves the first chunk (measured 2.1 on values up to 6.4), the unpacked
    trim every frame after the first trim (0.33 from frame 120 on)."""
    from omnitide_mlx.models.stepaudio2 import token2wav as module

    priming, trim = module.priming_tokens, module.trim_conformer_cache
    with monkeypatch.context() as m:
        m.setattr(module, "priming_tokens", lambda version, tokens, flow: priming("1.0.7", tokens, flow))
        _, mels, _ = _stream(t2w, golden)
    assert np.abs(mels[:, :24] - golden["mels"][:, :24]).max() > 0.5
    with monkeypatch.context() as m:
        m.setattr(module, "trim_packed_conformer_cache",
                  lambda cache, pf: trim(cache, pf, t2w.flow.cfg.encoder.num_blocks))
        _, mels, _ = _stream(t2w, golden)
    diff = np.abs(mels - golden["mels"]).max(axis=0)
    assert diff[:120].max() < 1e-4 and diff[120:].max() > 0.1


def test_released_pt_files_load_with_torch_only(tmp_path, t2w, golden):
    torch = pytest.importorskip("torch")
    folder = tmp_path / "pt"
    folder.mkdir()
    shutil.copy(DATA / "flow.yaml", folder)
    shutil.copy(DATA / "voice.safetensors", folder)
    for stem in ("flow", "hift"):
        state = {k: torch.from_numpy(np.array(v)) for k, v in mx.load(str(DATA / f"{stem}.safetensors")).items()
                 if v.dtype != mx.float16}
        state.update({k: torch.from_numpy(np.array(v.astype(mx.float32))).half()
                      for k, v in mx.load(str(DATA / f"{stem}.safetensors")).items() if v.dtype == mx.float16})
        torch.save(state, folder / f"{stem}.pt")
    loaded = Token2Wav.load(folder, n_timesteps=int(golden["n_timesteps"]))
    assert loaded.version == "1.0.6"
    pushes, _, _ = _stream(loaded, golden, folder)
    ref, _, _ = _stream(t2w, golden)
    assert all(np.array_equal(a, b) for a, b in zip(pushes, ref))

    torch.save({"flow": {"nested": torch.zeros(1)}}, folder / "flow.pt")  # not a flat tensor state dict
    with pytest.raises(CheckpointError, match="flow.pt"):
        Token2Wav.load(folder)


def test_pt_without_torch_is_a_clear_error(tmp_path, monkeypatch):
    folder = tmp_path / "pt"
    folder.mkdir()
    shutil.copy(DATA / "flow.yaml", folder)
    (folder / "flow.pt").write_bytes(b"not opened")
    monkeypatch.setattr(t2w_weights, "torch_available", lambda: False)
    with pytest.raises(CheckpointError, match="torch is not installed.*weights_only=True.*convert --token2wav"):
        Token2Wav.load(folder)


def test_version_override_and_errors(tmp_path, t2w):
    with pytest.raises(CheckpointError, match="config.yaml"):
        Token2Wav.load(DATA, version="1.0.7")  # 1.0.7 needs the causal vocoder's config
    with pytest.raises(ValueError, match="unknown token2wav version '2.0'"):
        Token2Wav.load(DATA, version="2.0")
    with pytest.raises(CheckpointError, match="no flow.yaml"):
        detect_version(tmp_path)
    tiny = write_tiny_token2wav(tmp_path / "t107")
    assert detect_version(tiny) == "1.0.7"
    t107 = Token2Wav.load(tiny, n_timesteps=1)
    assert t107.version == "1.0.7" and isinstance(t107.start_stream(Voice.load(tiny)).vocoder, BoundedVocoder)
    with pytest.raises(CheckpointError):  # 1.0.6 on a folder without hift_original: causal weights, original HiFT
        Token2Wav.load(tiny, version="1.0.6")
    with pytest.raises(ValueError, match="streams through the original HiFT"):
        Token2Wav(t2w.flow, t107.vocoder, version="1.0.6")
    stream = t2w.start_stream(Voice.load(DATA))  # a first chunk too short for 1.0.6's 3840-sample cross-fade
    stream.push([1, 2, 3, 4])
    with pytest.raises(ValueError, match="at least 8 mel frames"):
        stream.push([5, 6, 7, 8])
