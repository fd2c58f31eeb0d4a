"""``omnitide stream|generate --speak`` as a user runs them: one wav per answer from the bundled clip on a tiny
speaking checkpoint (noise, but the right length, rate and format), and the ways speech is refused."""

import os
import subprocess
import sys
import wave

import pytest

from conftest import REPO


def omnitide(*args, timeout=300):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "omnitide_mlx", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


@pytest.fixture(scope="module")
def speaking(tmp_path_factory, data_dir):
    from omnitide_mlx.models.qwen2_5_omni.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("speaking_cli") / "tiny",
                                tokenizer_dir=data_dir / "tokenizers/qwen2", vocab="real", speech=True, seed=1)


def test_stream_speak_writes_one_wav_per_answer(speaking, media_dir, tmp_path):
    out = tmp_path / "answers"
    r = omnitide("stream", "--model", speaking, "--video", media_dir / "video_10s_av.mp4", "--seconds", 2,
                 "--ask", "1:What do you hear?", "--ask", "2:And now?", "--max-tokens", 24, "--speak",
                 "--speaker", "Ethan", "--audio-out", out, "--no-progress")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("A: ") == 2
    wavs = sorted(out.glob("*.wav"))
    notes = [line for line in r.stderr.splitlines() if "spoken answer" in line or "speech" in line]
    assert wavs, r.stderr
    assert len(wavs) + sum("no speech" in n or "text only" in n for n in notes) == 2
    for w in wavs:
        with wave.open(str(w)) as f:
            assert (f.getframerate(), f.getnchannels(), f.getsampwidth()) == (24000, 1, 2)
            assert f.getnframes() > 0 and f.getnframes() % 480 == 0  # 480 samples (20 ms) per codec token
        assert f"{w}" in r.stderr


def test_unknown_speaker_is_a_clear_error(speaking, media_dir, tmp_path):
    r = omnitide("generate", "--model", speaking, "--prompt", "Hello", "--speak", "--speaker", "Nobody",
                 "--audio-out", tmp_path / "a", "-m", 2)
    assert r.returncode == 1
    assert "unknown speaker 'Nobody'" in r.stderr and "Chelsie, Ethan" in r.stderr


def test_speak_on_a_checkpoint_without_talker_answers_in_text(tiny_checkpoints, tmp_path):
    r = omnitide("generate", "--model", tiny_checkpoints["qwen"], "--prompt", "Hello", "--speak",
                 "--audio-out", tmp_path / "a", "-m", 3)
    assert r.returncode == 0, r.stderr
    assert "text only" in r.stderr and r.stdout.strip()
    assert not list((tmp_path / "a").glob("*.wav")) if (tmp_path / "a").exists() else True


def test_speech_flags_need_speak(tiny_checkpoints):
    r = omnitide("generate", "--model", tiny_checkpoints["qwen"], "--prompt", "Hello", "--speaker", "Ethan")
    assert r.returncode == 2 and "--speaker needs --speak" in r.stderr


def test_convert_keeps_speech_as_safetensors(speaking, tmp_path):
    import numpy as np

    from omnitide_mlx.models.qwen2_5_omni.speech import load_speech

    dst = tmp_path / "converted"
    r = omnitide("convert", "--model", speaking, "--mlx-path", dst, "-q")
    assert r.returncode == 0, r.stderr
    assert (dst / "speech" / "speakers.safetensors").exists() and not (dst / "spk_dict.pt").exists()
    a, b = load_speech(speaking), load_speech(dst)
    assert set(a.speakers) == set(b.speakers)
    codes = [1, 5, 9, 2, 7, 3]
    noise = a.noise(len(codes), seed=0)
    np.testing.assert_array_equal(a.wav(codes, "Ethan", noise, num_steps=2), b.wav(codes, "Ethan", noise, num_steps=2))


@pytest.fixture(scope="module")
def speaking_minicpmo(tmp_path_factory):
    from omnitide_mlx.models.minicpmo.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("speaking_cli_mcpm") / "tiny", tts=True, seed=3)


def test_stream_speak_on_minicpmo_writes_24khz_answers(speaking_minicpmo, media_dir, tmp_path):
    out = tmp_path / "answers"
    r = omnitide("stream", "--model", speaking_minicpmo, "--video", media_dir / "video_10s_av.mp4", "--seconds", 2,
                 "--ask", "2:What do you see?", "--max-tokens", 24, "--speak", "--audio-out", out, "--no-progress")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("A: ") == 1
    wavs = sorted(out.glob("*.wav"))
    assert len(wavs) == 1, r.stderr
    with wave.open(str(wavs[0])) as f:
        assert (f.getframerate(), f.getnchannels(), f.getsampwidth()) == (24000, 1, 2)
        assert f.getnframes() > 0 and f.getnframes() % 480 == 0  # 480 samples a mel frame, 2 frames a token


def test_generate_speak_on_minicpmo_and_unknown_voice(speaking_minicpmo, tmp_path):
    r = omnitide("generate", "--model", speaking_minicpmo, "--prompt", "Say something.", "--speak",
                 "--audio-out", tmp_path / "a", "-m", 16)
    assert r.returncode == 0, r.stderr
    assert len(list((tmp_path / "a").glob("*.wav"))) == 1, r.stderr
    r = omnitide("generate", "--model", speaking_minicpmo, "--prompt", "Hi", "--speak", "--speaker", "Nobody",
                 "--audio-out", tmp_path / "b", "-m", 2)
    assert r.returncode == 1 and "unknown speaker 'Nobody'" in r.stderr and "default" in r.stderr


def _wav(path):
    with wave.open(str(path)) as f:
        return f.readframes(f.getnframes())


def test_speech_sampling_flags_and_seed_reproduce_the_audio(speaking, tmp_path):
    """--seed reproduces a sampled spoken answer byte for byte (the talker sampling at --speech-temp 1.2 with
    top-k / top-p opened up, and the DiT noise); that another seed gives other samples is checked in process
    (test_speech_session.py), to keep this file's CLI runs few."""
    def run(name, *flags):
        out = tmp_path / name
        r = omnitide("generate", "--model", speaking, "--prompt", "Tell me a story.", "-m", 16, "--speak",
                     "--audio-out", out, *flags)
        assert r.returncode == 0, r.stderr
        wavs = sorted(out.glob("*.wav"))
        assert len(wavs) == 1, r.stderr
        return _wav(wavs[0])

    sampled = ("--seed", 3, "--speech-temp", "1.2", "--speech-top-k", "200", "--speech-top-p", "1.0",
               "--speech-repetition-penalty", "1.1")
    assert run("a", *sampled) == run("b", *sampled)


def test_speech_sampling_flags_are_checked(speaking, tmp_path):
    r = omnitide("generate", "--model", speaking, "--prompt", "Hi", "--speech-temp", "0.5")
    assert r.returncode == 2 and "--speech-temp needs --speak" in r.stderr
    r = omnitide("generate", "--model", speaking, "--prompt", "Hi", "--speak", "--speech-top-p", "0",
                 "--audio-out", tmp_path / "a")
    assert r.returncode == 2 and "--speech-top-p must be in (0, 1]" in r.stderr
    r = omnitide("generate", "--model", speaking, "--prompt", "Hi", "--speak", "--speech-top-k", "0",
                 "--audio-out", tmp_path / "a")
    assert r.returncode == 2 and "--speech-top-k" in r.stderr
