"""``OmniSession.ask(speak=True)`` on MiniCPM-o 4.5: the TTS reads the reply's hidden states as the engine streams
the text (no second pass) and StepAudio2's token2wav turns its audio tokens into 24 kHz chunks, the official
``streaming_generate`` way (text chunks of 10, audio windows of 25 + 3 behind 3 silence tokens)."""

import shutil

import mlx.core as mx
import numpy as np
import pytest

from omnitide_mlx import OmniSession
from omnitide_mlx.models.loading import CheckpointError
from omnitide_mlx.models.minicpmo.speech import TEXT_CHUNK, TOKEN2WAV_DIR
from omnitide_mlx.models.minicpmo.tts import TTSSampling
from omnitide_mlx.models.qwen2_5_omni.speech import SpeechUnavailable
from omnitide_mlx.speech import AudioChunk, MiniCPMVoicer, SpeechOptions, speech_for


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from omnitide_mlx.models.minicpmo.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("mcpm_speech") / "tiny", tts=True, seed=3)


def _session(path):
    s = OmniSession(str(path))
    s.push(text="A red ball rolls across the kitchen floor while a dog watches it.")
    return s


def _ask(session, stop=None, **kw):
    opts = SpeechOptions(seed=0, tts_sampling=TTSSampling(max_new_tokens_per_chunk=60), **kw)
    return list(session.ask("What is happening?", speak=True, max_tokens=32, speech=opts, stop=stop))


def test_spoken_reply_streams_audio_before_the_text_ends(ckpt):
    items = _ask(_session(ckpt))
    text = [i for i in items if isinstance(i, str)]
    audio = [i for i in items if isinstance(i, AudioChunk)]
    assert len(text) > TEXT_CHUNK and audio
    first_audio = next(k for k, i in enumerate(items) if isinstance(i, AudioChunk))
    assert first_audio < max(k for k, i in enumerate(items) if isinstance(i, str))  # speech starts mid-reply
    assert [a.index for a in audio] == list(range(len(audio)))
    assert audio[-1].final and not any(a.final for a in audio[:-1])
    for a in audio:
        assert a.sample_rate == 24000 and a.pcm.dtype == np.float32 and np.isfinite(a.pcm).all()
        assert a.pcm.size % 480 == 0  # whole mel frames
    # speaking does not change what is said: the same greedy text as a text-only ask
    plain = "".join(_session(ckpt).ask("What is happening?", max_tokens=32))
    assert "".join(text) == plain


def test_same_seed_same_audio(ckpt):
    a = np.concatenate([i.pcm for i in _ask(_session(ckpt)) if isinstance(i, AudioChunk)])
    b = np.concatenate([i.pcm for i in _ask(_session(ckpt)) if isinstance(i, AudioChunk)])
    np.testing.assert_array_equal(a, b)


def test_tts_reads_the_hidden_states_of_the_streamed_reply(ckpt):
    """The TTS gets, for each reply token, the final-norm hidden state of the forward that fed it back (no second
    pass): through the LM head each one gives back the greedy choice of the next reply token."""
    session = _session(ckpt)
    voicer = MiniCPMVoicer(speech_for(session), SpeechOptions(seed=0, tts_sampling=TTSSampling(
        greedy=True, max_new_tokens_per_chunk=30)))
    pieces = list(session.ask("What is happening?", max_tokens=16, on_forward=voicer.on_forward))
    assert pieces and len(voicer.ids) >= TEXT_CHUNK
    streamed = mx.concatenate(voicer.hidden, axis=0)
    assert streamed.shape == (len(voicer.ids), session.model.language_model.args.hidden_size)
    logits = session.model.language_model.logits(streamed[None])[0]
    assert np.array_equal(np.argmax(np.array(logits[:-1]), axis=-1), np.asarray(voicer.ids[1:]))
    chunks = voicer.pump(final=True)
    assert voicer.audio_tokens > 0 and sum(c.size for c in chunks) > 0


def test_unknown_speaker_fails_before_the_reply(ckpt):
    session = _session(ckpt)
    n = session.history.total_tokens
    with pytest.raises(ValueError, match="unknown speaker 'Nobody'.*default"):
        session.ask("Hi?", speak=True, speaker="Nobody")
    assert session.history.total_tokens == n  # nothing ran


def test_speaker_may_be_a_voice_file(ckpt, tmp_path):
    voice = tmp_path / "mine.safetensors"
    shutil.copy(ckpt / TOKEN2WAV_DIR / "voice.safetensors", voice)
    items = _ask(_session(ckpt), speaker=str(voice))
    assert any(isinstance(i, AudioChunk) and i.pcm.size for i in items)


def test_checkpoint_without_token2wav_or_unconverted_is_a_clear_error(ckpt, tmp_path, monkeypatch):
    bare = tmp_path / "bare"
    shutil.copytree(ckpt, bare, ignore=shutil.ignore_patterns("assets"))
    with pytest.raises(SpeechUnavailable, match="no token2wav folder"):
        OmniSession(str(bare)).ask("Hi?", speak=True)
    pt = tmp_path / "pt"
    shutil.copytree(ckpt, pt)
    for f in (pt / TOKEN2WAV_DIR).glob("*.safetensors"):
        if f.name != "voice.safetensors":
            f.unlink()
    (pt / TOKEN2WAV_DIR / "flow.pt").write_bytes(b"not a torch file")
    # with torch the .pt is read with the tensors-only loader, which refuses anything else
    with pytest.raises(CheckpointError, match="flow.pt is not a tensors-only torch state dict"):
        OmniSession(str(pt)).ask("Hi?", speak=True)
    from omnitide_mlx.models.stepaudio2 import weights

    monkeypatch.setattr(weights, "torch_available", lambda: False)  # without torch: convert or install torch
    with pytest.raises(SpeechUnavailable, match="torch is not installed.*omnitide convert --token2wav"):
        OmniSession(str(pt)).ask("Hi?", speak=True)


def test_checkpoint_without_tts_is_text_only(tiny_checkpoints):
    with pytest.raises(SpeechUnavailable, match="no TTS"):
        OmniSession(str(tiny_checkpoints["minicpmo"])).ask("Hi?", speak=True)


def test_reply_without_text_has_a_text_only_note(ckpt):
    """A stop string that cuts the whole reply leaves nothing to speak: a final empty chunk says so."""
    first = next(iter(_session(ckpt).ask("Hi?", max_tokens=1)))
    items = list(_session(ckpt).ask("Hi?", speak=True, max_tokens=4, stop=[first]))
    assert "".join(i for i in items if isinstance(i, str)) == ""
    audio = [i for i in items if isinstance(i, AudioChunk)]
    assert len(audio) == 1 and audio[0].final and audio[0].pcm.size == 0 and "text only" in audio[0].note


def test_released_106_layout_speaks_and_the_version_can_be_forced(tmp_path):
    """The released checkpoint's assets/token2wav layout (flow.yaml + flow + original-HiFT hift, no config.yaml)
    speaks through the 1.0.6 stream; asking for 1.0.7 there fails before the reply (no causal vocoder config)."""
    from omnitide_mlx.models.minicpmo.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "tiny106", tts=True, seed=3, token2wav_layout="1.0.6")
    assert not (ckpt / TOKEN2WAV_DIR / "config.yaml").exists()
    session = _session(ckpt)
    items = _ask(session)
    assert speech_for(session).token2wav.version == "1.0.6"
    audio = [i for i in items if isinstance(i, AudioChunk)]
    assert audio and audio[-1].final and sum(a.pcm.size for a in audio) > 0
    assert all(np.isfinite(a.pcm).all() for a in audio)
    with pytest.raises(CheckpointError, match="config.yaml"):
        _ask(_session(ckpt), token2wav_version="1.0.7")



def test_reply_cut_by_the_token_limit_is_flushed_not_ended(ckpt, monkeypatch):
    """At max_tokens the TTS gets no end-of-text chunk: its buffer is flushed with finish(), as the official
    streaming_generate does when the LLM runs out of chunks; a reply that stops earlier ends with the text eos."""
    from omnitide_mlx.models.minicpmo.tts import TTSReply

    calls, voicers = [], []
    real_feed, real_finish, real_pump = TTSReply.feed, TTSReply.finish, MiniCPMVoicer.pump
    monkeypatch.setattr(TTSReply, "feed", lambda self, ids, h, last=False: calls.append(("feed", last))
                        or real_feed(self, ids, h, last))
    monkeypatch.setattr(TTSReply, "finish", lambda self: calls.append(("finish", None)) or real_finish(self))
    monkeypatch.setattr(MiniCPMVoicer, "pump", lambda self, *a, **k: voicers.append(self) or real_pump(self, *a, **k))
    items = _ask(_session(ckpt))  # max_tokens=32
    assert len(voicers[-1].ids) == 32  # the tiny model ran to the limit
    assert ("feed", True) not in calls and calls[-1] == ("finish", None)
    assert [i for i in items if isinstance(i, AudioChunk)][-1].final
    calls.clear()
    text = "".join(_session(ckpt).ask("What is happening?", max_tokens=32))
    stop = text[len(text) // 2:len(text) // 2 + 4]
    assert text.find(stop) > 0 and text[:text.find(stop)].strip()
    _ask(_session(ckpt), stop=[stop])  # greedy text: the same reply, cut by the stop string
    assert len(voicers[-1].ids) < 32
    assert calls[-1] == ("feed", True) and ("finish", None) not in calls
