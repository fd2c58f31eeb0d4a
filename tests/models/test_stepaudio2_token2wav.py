"""Token2Wav (flow + causal vocoder) on the tiny token2wav folder: the official streaming rules and the errors."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from omnitide_mlx.models.loading import CheckpointError
from omnitide_mlx.models.stepaudio2.flow import trim_conformer_cache, trim_estimator_cache
from omnitide_mlx.models.stepaudio2.tiny import write_tiny_token2wav
from omnitide_mlx.models.stepaudio2.token2wav import Token2Wav, Voice
from omnitide_mlx.models.stepaudio2.vocoder import BoundedVocoder

N_STEPS = 2
CHUNK = 12


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_token2wav(tmp_path_factory.mktemp("t2w"))


@pytest.fixture(scope="module")
def t2w(folder):
    return Token2Wav.load(folder, n_timesteps=N_STEPS)


@pytest.fixture(scope="module")
def voice(folder):
    return Voice.load(folder)


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(7).integers(0, 6561, 40)


def _windows(n):
    """The official example's windows: fresh + 3 lookahead while more than that remains, then the rest."""
    out, offset = [], 0
    while n - offset > CHUNK + 3:
        out.append((offset, offset + CHUNK + 3, False))
        offset += CHUNK
    out.append((offset, n, True))
    return out


def test_stream_matches_flow_chunks_through_the_bounded_vocoder(t2w, voice, tokens):
    stream = t2w.start_stream(voice)
    pushed = [stream.push(tokens[a:b], last=last) for a, b, last in _windows(len(tokens))]

    # by hand: the flow's chunks, both trims, the bounded vocoder, the first-chunk silence
    flow = t2w.flow
    pt = mx.array(voice.prompt_tokens.astype(np.int32))[None]
    mel_p, spk = mx.array(voice.prompt_mel)[None], mx.array(voice.speaker_embedding)[None]
    cache = flow.setup_cache(mx.concatenate([pt, pt[:, :3]], axis=1), mel_p, spk, N_STEPS)
    voc = BoundedVocoder(t2w.vocoder)
    expected = []
    for a, b, last in _windows(len(tokens)):
        mel, cache = flow.inference_chunk(tokens[a:b], spk, cache, last, N_STEPS)
        cache = trim_conformer_cache(trim_estimator_cache(cache, mel_p.shape[1]), mel_p.shape[1], 2)
        expected.append(np.asarray(voc.stream(mel, finalize=last)).reshape(-1))
    silence = voc.delay * voc.hop
    assert voc.delay == 8 and silence == 3840
    assert len(pushed[0]) == silence + len(expected[0]) and not pushed[0][:silence].any()
    assert np.array_equal(pushed[0][silence:], expected[0])
    for got, want in zip(pushed[1:], expected[1:]):
        assert np.array_equal(got, want)
    total = sum(len(p) for p in pushed)
    assert total == silence + 2 * len(tokens) * 480  # every token's two mel frames, 480 samples each
    assert all(p.dtype == np.float32 and np.isfinite(p).all() for p in pushed)


def test_empty_final_push_flushes_and_official_names_agree(t2w, voice, tokens):
    windows = _windows(len(tokens))
    a = t2w.start_stream(voice)
    first = [a.push(tokens[s:e], last=last) for s, e, last in windows]
    t2w.set_stream_cache(voice)
    second = [t2w.stream(tokens[s:e], last_chunk=last) for s, e, last in windows]
    assert all(np.array_equal(x, y) for x, y in zip(first, second))

    # the same tokens, the final chunk sent as a non-final window then an empty final push
    n = len(tokens)
    b = t2w.start_stream(voice)
    pushed = [b.push(tokens[s:e]) for s, e, _ in windows[:-1]]
    s = windows[-1][0]
    pushed.append(b.push(tokens[s:]))  # fresh tokens plus the 3 last as "lookahead": non-final
    tail = b.push([], last=True)
    assert len(tail) > 0  # the vocoder's withheld frames
    assert sum(len(p) for p in pushed) + len(tail) == 3840 + 2 * (n - 3) * 480


def test_offline_call(t2w, voice, tokens):
    assert t2w.offline_vocoder == "causal"  # the tiny folder has no hift_original.safetensors
    wav = t2w(tokens[:20], voice)
    assert wav.dtype == np.float32 and np.isfinite(wav).all() and len(wav) == 2 * 20 * 480


def test_offline_call_uses_the_original_hift_when_given(t2w, voice, tokens):
    import dataclasses

    from omnitide_mlx.models.stepaudio2.vocoder import ORIGINAL_HIFT, HiFTGenerator

    original = HiFTGenerator(dataclasses.replace(ORIGINAL_HIFT, base_channels=16))
    both = Token2Wav(t2w.flow, t2w.vocoder, N_STEPS, original_vocoder=original)
    assert both.offline_vocoder == "original"
    wav = both(tokens[:10], voice)
    assert len(wav) == 2 * 10 * 480 and np.isfinite(wav).all()
    assert not np.array_equal(wav, t2w(tokens[:10], voice))


def test_stream_errors(t2w, voice, folder, tmp_path):
    fresh = Token2Wav(t2w.flow, t2w.vocoder, n_timesteps=1)
    with pytest.raises(ValueError, match="set_stream_cache"):
        fresh.stream([1, 2, 3, 4])
    s = fresh.start_stream(voice)
    with pytest.raises(ValueError, match="more than 3"):
        s.push([1, 2, 3])
    s.push([1, 2], last=True)
    with pytest.raises(ValueError, match="final push"):
        s.push([1, 2, 3, 4])
    with pytest.raises(ValueError, match="speaker_embedding"):
        fresh.start_stream(Voice(voice.prompt_tokens, voice.prompt_mel, np.zeros(10)))
    with pytest.raises(ValueError, match="at least 3"):
        fresh.start_stream(Voice(voice.prompt_tokens[:2], voice.prompt_mel[:4], voice.speaker_embedding))
    with pytest.raises(ValueError, match="at least one"):
        fresh([], voice)

    for name in ("flow.yaml", "flow.safetensors", "voice.safetensors"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    (tmp_path / "config.yaml").write_text((folder / "config.yaml").read_text())
    (tmp_path / "hift.pt").write_bytes(b"not a torch file")  # read with torch's tensors-only loader: refused
    with pytest.raises(CheckpointError, match="hift"):
        Token2Wav.load(tmp_path)
    (tmp_path / "hift.safetensors").write_bytes((folder / "hift.safetensors").read_bytes())
    (tmp_path / "hift_original.pt").write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match="hift_original.pt"):
        Token2Wav.load(tmp_path)
    with pytest.raises(CheckpointError, match="lacks"):
        from safetensors.numpy import save_file

        save_file({"prompt_tokens": np.zeros(3, np.int32)}, str(tmp_path / "v.safetensors"))
        Voice.load(tmp_path / "v.safetensors")


def test_voice_mel_is_padded_or_cut_to_twice_the_tokens(t2w, voice):
    """Token2wav pads the prompt mel (repeating its last frame) or cuts it to up_rate x prompt tokens."""
    longer = Voice(voice.prompt_tokens, np.concatenate([voice.prompt_mel, voice.prompt_mel[:5]]),
                   voice.speaker_embedding)
    shorter = Voice(voice.prompt_tokens, voice.prompt_mel[:-3], voice.speaker_embedding)
    for v in (longer, shorter):
        s = t2w.start_stream(v)
        assert s.prompt_mel.shape[1] == 2 * len(voice.prompt_tokens)
    padded = np.asarray(t2w.start_stream(shorter).prompt_mel[0])
    assert np.array_equal(padded[-3:], np.repeat(voice.prompt_mel[-4:-3], 3, axis=0))
