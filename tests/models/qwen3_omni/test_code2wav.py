"""Code2Wav parity with transformers' Qwen3OmniMoeCode2Wav on the tiny checkpoint's random ``code2wav.*`` tensors:
the whole decode and transformers' chunked decode within 1e-5 (the brief's bound is 1e-3), and the hole-free
streamed decode (``decode_stream``) against the whole decode."""

import json

import numpy as np
import pytest

from omnitide_mlx.models.qwen3_omni.code2wav import Code2WavConfig, load_code2wav

torch = pytest.importorskip("torch")
TOL = 1e-5


@pytest.fixture(scope="module")
def pair(q3_ckpt):
    from safetensors.torch import load_file
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    cfg = json.loads((q3_ckpt / "config.json").read_text())
    ours = load_code2wav(q3_ckpt, cfg)
    hc = Qwen3OmniMoeCode2WavConfig(**{k: v for k, v in cfg["code2wav_config"].items() if k != "model_type"})
    ref = Qwen3OmniMoeCode2Wav(hc).eval()
    sd = {k[len("code2wav."):]: v for k, v in load_file(str(q3_ckpt / "model.safetensors")).items()
          if k.startswith("code2wav.")}
    ref.load_state_dict(sd, strict=True)
    return ours, ref


def codes(frames, seed=0):
    return np.random.default_rng(seed).integers(0, 32, (1, 4, frames))


def test_whole_decode_matches(pair):
    ours, ref = pair
    c = codes(70)
    with torch.no_grad():
        want = ref(torch.tensor(c)).numpy()
    got = np.array(ours(c))
    assert got.shape == want.shape == (1, 1, 70 * 24 - 9)
    assert 0.1 < np.abs(want).mean() and (np.abs(want) >= 0.999).mean() < 0.01  # no saturation hides errors
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL)


def test_transformers_chunked_decode_matches(pair):
    ours, ref = pair
    c = codes(70, 1)
    with torch.no_grad():
        want = ref.chunked_decode(torch.tensor(c), chunk_size=12, left_context_size=5).numpy()
    np.testing.assert_allclose(np.array(ours.chunked_decode(c, 12, 5)), want, rtol=0, atol=TOL)


def test_stream_decode_has_no_holes(pair):
    """transformers' chunked decode loses ``tail_samples`` at every join (9 here, 555 = 23 ms released); the streamed
    decode does not, and with a left context past the receptive field it is the whole decode."""
    ours, _ = pair
    c = codes(70, 2)
    whole = np.array(ours(c))
    chunked = np.array(ours.chunked_decode(c, 12, 40))
    assert whole.shape[-1] - chunked.shape[-1] == 5 * ours.config.tail_samples == 45
    pieces = [np.array(p) for p in ours.decode_stream(c, 12, 40)]
    assert len(pieces) == 6
    np.testing.assert_allclose(np.concatenate(pieces, axis=-1), whole, rtol=0, atol=TOL)
    with pytest.raises(ValueError, match="left_context_size"):
        next(ours.decode_stream(c, 12, 0))


def test_released_sizes():
    c = Code2WavConfig()
    assert (c.total_upsample, c.tail_samples, c.num_quantizers, c.sliding_window) == (1920, 555, 16, 72)


def test_bad_codes_shape_is_refused(pair):
    ours, _ = pair
    with pytest.raises(ValueError, match=r"\[batch, 4, frames\]"):
        ours(np.zeros((1, 3, 5), np.int64))
