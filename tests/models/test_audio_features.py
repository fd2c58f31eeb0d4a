"""The shared audio front end against Whisper's extractor (transformers) and MiniCPM-o's official mel."""

import numpy as np
import pytest

from omnitide_mlx.models.audio_features import log_mel, resample


def test_log_mel_matches_official_minicpmo_fixture(data_dir):
    d = np.load(data_dir / "fixtures/minicpmo45-tiny/official_mel.npz")
    for key in ["sine2.5s", "noise1.3s_odd"]:
        ref = d[f"{key}_feat"][0]
        out = log_mel(d[f"{key}_sig"], 80)
        assert out.shape == ref.shape
        np.testing.assert_allclose(out, ref, atol=2e-5)


@pytest.mark.parametrize("n", [1123, 16000, 20850, 23700])
def test_log_mel_matches_whisper_extractor_padded_to_300s(n):
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(feature_size=128, chunk_length=300, sampling_rate=16000, n_fft=400, hop_length=160)
    sig = (np.random.default_rng(n).standard_normal(n) * 0.1).astype(np.float32)
    r = fe(sig, sampling_rate=16000, return_tensors="np", padding="max_length", return_attention_mask=True)
    frames = int(r["attention_mask"].sum())
    out = log_mel(sig, 128)
    assert out.shape == (128, frames)
    np.testing.assert_allclose(out, r["input_features"][0, :, :frames], atol=2e-5)


def test_resample_keeps_a_tone_and_length():
    for sr in (8000, 22050, 44100, 48000):
        t = np.arange(sr * 2) / sr
        x = np.sin(2 * np.pi * 440 * t).astype(np.float32)
        y = resample(x, sr, 16000)
        assert y.shape == (32000,)
        ref = np.sin(2 * np.pi * 440 * np.arange(32000) / 16000)
        assert np.abs(y[400:-400] - ref[400:-400]).max() < 1e-3


def test_resample_removes_content_above_the_new_nyquist():
    sr = 48000
    x = np.sin(2 * np.pi * 12000 * np.arange(sr) / sr).astype(np.float32)  # above 8 kHz
    y = resample(x, sr, 16000)
    assert np.sqrt(np.mean(y[400:-400] ** 2)) < 0.01


def test_resample_rejects_bad_rates():
    with pytest.raises(ValueError):
        resample(np.zeros(10), 0, 16000)
