"""``omnitide bench speech --model-family minicpmo`` at tiny sizes, MLX side only: the rows come out with sane
fields (token counts, audio lengths that follow from the pushes, positive times), the PyTorch side is skipped with
a note when no interpreter is given, and the push schedule is MiniCPMVoicer's."""

import argparse
import json

import pytest

from omnitide_mlx.bench import speech
from omnitide_mlx.bench.speech_minicpmo import (LOOKAHEAD, SILENCE_PREFIX, SILENCE_TOKEN, T2W_CHUNK, markdown,
                                                stream_windows, torch_python_note)

SAMPLES_PER_TOKEN = 960  # 2 mel frames of 480 samples at 24 kHz
DELAY_SAMPLES = 8 * 480  # the causal vocoder's delay, sent as silence before the first streamed audio


def parse(*argv):
    p = argparse.ArgumentParser()
    speech.add_arguments(p)
    return p.parse_args(list(argv))


def test_qwen_stays_the_default():
    assert parse().model_family == "qwen2.5-omni"
    assert parse("--model-family", "minicpmo").model_family == "minicpmo"


def test_stream_windows_follow_the_voicer():
    tokens = list(range(60))
    windows = stream_windows(tokens)
    buf = [SILENCE_TOKEN] * SILENCE_PREFIX + tokens
    assert [last for _, last in windows] == [False, False, True]
    assert windows[0][0] == buf[:T2W_CHUNK + LOOKAHEAD]
    assert windows[1][0] == buf[T2W_CHUNK:2 * T2W_CHUNK + LOOKAHEAD]
    assert windows[2][0] == buf[2 * T2W_CHUNK:]
    assert stream_windows([1])[-1] == ([SILENCE_TOKEN] * SILENCE_PREFIX + [1], True)


def test_torch_side_is_skipped_with_a_note(tmp_path):
    assert "no --torch-python" in torch_python_note(None)
    assert "not an executable" in torch_python_note(str(tmp_path / "nope"))


def test_tiny_run_produces_sane_rows(tmp_path):
    out = tmp_path / "r.json"
    t2w_tokens, tts_tokens = 30, 26
    args = parse("--model-family", "minicpmo", "--size", "tiny", "--llm-dim", "64", "--tts-layers", "1",
                 "--tts-tokens", str(tts_tokens), "--t2w-tokens", str(t2w_tokens), "--voice-tokens", "6",
                 "--n-timesteps", "2", "--reps", "1", "--json", str(out))
    assert speech.run(args) == 0
    result = json.loads(out.read_text())
    assert result["model_family"] == "minicpmo" and "torch" not in result
    assert "PyTorch side skipped" in result["note"]
    assert result["config"]["tts_layers"] == 1 and result["versions"]["mlx"]
    m = result["mlx"]
    assert m["tts_tokens_generated"] == tts_tokens  # greedy, max_new_token: no eos within the chunk
    assert 0 < m["tts_prefill_s"] < m["tts_call_s"] and m["tts_tokens_per_s"] > 0
    pushed = SILENCE_PREFIX + t2w_tokens
    assert len(m["t2w_push_s"]) == len(stream_windows(list(range(t2w_tokens)))) == 2
    assert m["t2w_stream_samples"] == pushed * SAMPLES_PER_TOKEN + DELAY_SAMPLES
    assert m["t2w_offline_samples"] == t2w_tokens * SAMPLES_PER_TOKEN
    assert m["first_audio_samples"] == T2W_CHUNK * SAMPLES_PER_TOKEN  # 25 tokens' audio: delay out, silence in
    assert m["t2w_stream_rtf"] == pytest.approx(sum(m["t2w_push_s"]) / (pushed / 25), rel=0.02, abs=2e-3)
    assert m["t2w_push_rtf"] == pytest.approx(m["t2w_push_s"][0], rel=0.02, abs=2e-3)  # one 25-token window
    assert m["t2w_offline_rtf"] > 0 and m["t2w_stream_setup_s"] > 0
    assert m["time_to_first_audio_s"] > m["first_push_s"] > 0
    table = markdown(result)
    assert "| TTS tokens/s |" in table and "| time to first audio (s) |" in table
