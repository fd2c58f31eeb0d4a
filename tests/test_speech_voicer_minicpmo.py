"""MiniCPMVoicer's end of reply and its token2wav windows against the official code on tiny weights.

The TTS yields are the official ``TTSStreamingGenerator`` run's (tests/data/minicpmo_tts, scripts/golden/
minicpmo_tts.py: a reply that ends at a terminator, and one cut by the token limit whose buffer is flushed). The
windows token2wav gets are those of the official ``streaming_generate`` audio loop (modeling_minicpmo.py at 28b60cf,
the ``s3tokenizer_step_audio`` branch), applied here to the official yields: 3 silence tokens, a window of 25 + 3
pushed whenever the buffer holds 28 (marked last only with a last chunk), the buffer moving by 25, then the rest
pushed marked last.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from omnitide_mlx.models.minicpmo.speech import MiniCPMSpeech
from omnitide_mlx.models.minicpmo.tts import MiniCPMTTS, TTSArgs, TTSSampling
from omnitide_mlx.models.stepaudio2.tiny import write_tiny_token2wav
from omnitide_mlx.models.stepaudio2.token2wav import Token2Wav
from omnitide_mlx.speech import MiniCPMVoicer, SpeechOptions

DATA = Path(__file__).resolve().parent / "data" / "minicpmo_tts"


@pytest.fixture(scope="module")
def golden():
    return json.loads((DATA / "golden.json").read_text()), dict(np.load(DATA / "golden.npz"))


@pytest.fixture(scope="module")
def token2wav_folder(tmp_path_factory):
    return write_tiny_token2wav(tmp_path_factory.mktemp("t2w"))


@pytest.fixture(scope="module")
def token2wav(token2wav_folder):
    return Token2Wav.load(token2wav_folder, n_timesteps=1)


def _tts(golden, attention_type):
    meta, _ = golden
    tts = MiniCPMTTS(TTSArgs.from_dict({**meta["tts_config"], "attention_type": attention_type}))
    weights = mx.load(str(DATA / "tts_weights.safetensors"))
    tts.load_weights(list(MiniCPMTTS.sanitize({k[4:]: v for k, v in weights.items()}).items()), strict=True)
    return tts


def official_windows(yields: list[tuple[list[int], bool]]) -> list[tuple[list[int], bool]]:
    """What the official streaming_generate loop hands token2wav.stream for these (audio tokens, is_last) yields."""
    buffer, pushes = [4218] * 3, []
    for chunk, is_last in yields:
        buffer += chunk
        if len(buffer) >= 25 + 3:
            pushes.append((buffer[:28], is_last))
            buffer = buffer[25:]
    if buffer:  # "flush rest"
        pushes.append((buffer, True))
    return pushes


def _speak(golden, token2wav, token2wav_folder, run: str, attention_type: str, terminated: bool):
    meta, arrays = golden
    speech = MiniCPMSpeech(_tts(golden, attention_type), token2wav, token2wav_folder)
    voicer = MiniCPMVoicer(speech, SpeechOptions(tts_sampling=TTSSampling(greedy=True), num_steps=1))
    pushes, real_push = [], voicer.stream.push

    def recording(tokens, last=False):
        pushes.append(([int(t) for t in tokens], bool(last)))
        return real_push(tokens, last=last)

    voicer.stream.push = recording
    voicer.on_forward(np.zeros(4, np.int64), None, mx.zeros((1, 4, 8)))  # the question unit: not spoken
    for i in range(len(meta["chunk_sizes"])):
        ids, hidden = arrays[f"ids_{i}"], arrays[f"hidden_{i}"]
        for t in range(len(ids)):
            voicer.on_forward(ids[t:t + 1], None, mx.array(hidden[t:t + 1])[None])
            voicer.pump(final=False)
    voicer.pump(final=True, terminated=terminated)
    yields = [(c, flag) for feed in meta["runs"][run]["feeds"] for c, flag in feed] + \
        [(c, flag) for c, flag in meta["runs"][run]["flush"]]
    return pushes, official_windows(yields)


def test_reply_with_a_terminator_keeps_the_official_windows(golden, token2wav, token2wav_folder):
    """The last text chunk's full TTS chunks get ordinary windows; only the rest is pushed last (before the fix the
    whole tail went to token2wav in one final push)."""
    pushes, official = _speak(golden, token2wav, token2wav_folder, "greedy_sliding_recompute",
                              "sliding_recompute", terminated=True)
    assert any(len(t) == 28 and not last for t, last in official[-3:-1])  # the tail has a full window
    assert pushes == official


def test_reply_cut_by_the_token_limit_flushes_without_end_of_text(golden, token2wav, token2wav_folder):
    """No text eos and no extra TTS chunk: the TTS's buffer as finish() hands it out (before the fix the rest of
    the reply was fed with the text eos, which made the TTS decode another chunk)."""
    pushes, official = _speak(golden, token2wav, token2wav_folder, "greedy_full_attention_no_terminator",
                              "full_attention", terminated=False)
    assert pushes == official
