"""Speech sampling settings (``SpeechOptions.with_sampling``): one set of knobs for whichever model speaks, the
official defaults where unset, ``temperature=0`` for a greedy talker / TTS, and a clear error for bad values."""

import numpy as np
import pytest

from omnitide_mlx import OmniSession
from omnitide_mlx.models.minicpmo.tts import TTSSampling
from omnitide_mlx.models.qwen2_5_omni.talker import CodecSampling
from omnitide_mlx.models.qwen2_5_omni.tiny import make_tiny_checkpoint
from omnitide_mlx.speech import AudioChunk, SpeechOptions


def test_unset_keeps_each_models_official_defaults():
    o = SpeechOptions().with_sampling()
    assert o.sampling == CodecSampling() and o.tts_sampling is None
    assert (CodecSampling().temperature, CodecSampling().top_k, CodecSampling().top_p) == (0.9, 40, 0.8)
    assert (TTSSampling().temperature, TTSSampling().top_k, TTSSampling().top_p) == (0.8, 25, 0.85)
    o = SpeechOptions().with_sampling(top_k=7)
    assert o.sampling.top_k == o.tts_sampling.top_k == 7
    assert o.sampling.temperature == 0.9 and o.tts_sampling.temperature == 0.8  # each model's own default
    assert not o.sampling.greedy and not o.tts_sampling.greedy


def test_temperature_zero_is_greedy_and_a_temperature_samples_again():
    o = SpeechOptions().with_sampling(temperature=0)
    assert o.sampling.greedy and o.tts_sampling.greedy
    o = o.with_sampling(temperature=1.1, repetition_penalty=1.2, top_p=0.5)
    assert not o.sampling.greedy and not o.tts_sampling.greedy
    assert o.sampling.temperature == o.tts_sampling.temperature == 1.1
    assert o.sampling.repetition_penalty == o.tts_sampling.repetition_penalty == 1.2
    assert o.sampling.top_p == o.tts_sampling.top_p == 0.5


@pytest.mark.parametrize("kw,why", [({"temperature": -1}, "temperature"), ({"top_k": 0}, "top_k"),
                                    ({"top_k": 2.5}, "top_k"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
                                    ({"repetition_penalty": 0}, "repetition_penalty"), ({"greedy": "yes"}, "greedy"),
                                    ({"temperature": True}, "temperature")])
def test_bad_values_are_clear_errors(kw, why):
    with pytest.raises(ValueError, match=f"speech sampling: {why}"):
        SpeechOptions().with_sampling(**kw)


@pytest.mark.slow
def test_text_greedy_does_not_make_the_talker_greedy_speech_temp_zero_does(tmp_path, data_dir):
    """ask(temp=0) makes the text greedy only; ``with_sampling(temperature=0)`` makes the talker greedy: its reply
    is the greedy talker's (the DiT noise seeded so the waveforms compare), while a sampling talker's is not."""
    ckpt = make_tiny_checkpoint(tmp_path / "tiny", tokenizer_dir=data_dir / "tokenizers/qwen2", speech=True, seed=1)

    def spoken(options):
        s = OmniSession(str(ckpt), policy="full")
        audio = [x for x in s.ask("Tell me about the sea.", speak=True, max_tokens=5, temp=0, speech=options)
                 if isinstance(x, AudioChunk)]
        return np.concatenate([a.pcm for a in audio])

    greedy = spoken(SpeechOptions(num_steps=1, seed=0, sampling=CodecSampling(greedy=True)))
    assert greedy.size > 0
    assert np.array_equal(spoken(SpeechOptions(num_steps=1, seed=0).with_sampling(temperature=0)), greedy)
    sampled = spoken(SpeechOptions(num_steps=1, seed=0, sampling=CodecSampling(seed=1)))
    assert sampled.size != greedy.size or not np.array_equal(sampled, greedy)
