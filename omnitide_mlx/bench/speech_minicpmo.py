"""``omnitide bench speech --model-family minicpmo``: MiniCPM-o 4.5's spoken-answer pipeline (the TTS + StepAudio2
token2wav) on shape-true random weights, MLX against the official PyTorch code on the same CPU and the same weights.

Sizes: the TTS at the released width (a Llama of hidden 768, 12 heads of 64, MLP 3072, 6562 audio tokens, 152064
text tokens; the semantic projector from ``--llm-dim`` 4096, Qwen3-8B's width) with ``--tts-layers`` layers
(per-layer time scales linearly; the released layer count is not checked here, the class default is 20); token2wav
at its released size (``stepaudio2.config.released_config()``: conformer encoder 512 wide, 6 + 4 blocks, DiT 16 x
512; the causal CosyVoice3 vocoder from 512 channels, F0 predictor 512). Random weights, float32, CPU.

The MLX side writes the weights once into a temporary folder (``tts.safetensors`` in the official ``tts.*`` names,
``token2wav/`` in the released layout with its voice, ``inputs.safetensors``, ``spec.json``); the PyTorch side is
``scripts/bench_minicpmo_speech_official.py`` run by ``--torch-python`` (an interpreter with transformers 4.51 and
the official sources: MiniCPM-o-Demo ``MiniCPMO45/`` at 28b60cf, minicpmo-utils 1.0.7), which reads the same folder
and prints its timings as JSON. Measured, each side in turn, medians of ``--reps`` (MLX after ``mx.eval``):

- TTS: a text chunk of 10 tokens (ids + LLM hidden states) -> condition -> prefill -> greedy audio-token decode with
  the streaming generator's logits processors (MLX ``TTSReply.feed``; official ``generate_with_buffer`` with its
  multinomial draw replaced by an argmax): prefill time (``max_new_token=1``) and tokens/s over ``--tts-tokens``;
- token2wav streaming: ``start_stream(voice)`` (the flow's prompt cache; official ``set_stream_cache``), then
  pushes of 25 fresh + 3 lookahead tokens behind 3 silence tokens as ``MiniCPMVoicer`` sends them, and the final
  push: real-time factor = push compute seconds / audio seconds (pushed tokens / 25);
- token2wav offline: the flow on the whole utterance + the causal vocoder in one pass (the release's offline path
  vocodes with the original non-causal HiFT instead; not timed here);
- time to first audio (speech side): ``start_stream`` + the TTS on the first text chunk until 25 audio tokens +
  the first token2wav push (3 silence + 25 tokens + 3 lookahead... the window of 28), as ``MiniCPMVoicer`` schedules
  it; the LLM's own token time is not included.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

TEXT_CHUNK = 10
SILENCE_TOKEN = 4218  # models/minicpmo/speech.py: the official silence token put before a reply's speech
SILENCE_PREFIX = 3
T2W_CHUNK = 25
LOOKAHEAD = 3
TOKENS_PER_S = 25
OFFICIAL_MIRROR = "/work/.mirror/OpenBMB+MiniCPM-o-Demo/repo"
UTILS_SRC = "/tmp/dl/minicpmo_utils-1.0.7/src"
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_minicpmo_speech_official.py"

# the released causal vocoder (Token2wav's config.yaml): the tiny fixture's structure at the official widths
RELEASED_HIFT_WIDTH = 512
RELEASED_F0_WIDTH = 512


def add_arguments(p) -> None:
    g = p.add_argument_group("MiniCPM-o 4.5 (--model-family minicpmo)")
    g.add_argument("--tts-layers", type=int, default=2, help="TTS layers (the class default is 20)")
    g.add_argument("--llm-dim", type=int, default=4096, help="LLM hidden size the TTS projects from (Qwen3-8B: 4096)")
    g.add_argument("--tts-tokens", type=int, default=25, help="audio tokens decoded per timed TTS call")
    g.add_argument("--t2w-tokens", type=int, default=50, help="audio tokens streamed through token2wav (25 = 1 s)")
    g.add_argument("--voice-tokens", type=int, default=50, help="voice prompt tokens (25 = 1 s)")
    g.add_argument("--n-timesteps", type=int, default=10, help="flow ODE steps (released: 10)")
    g.add_argument("--size", choices=("released", "tiny"), default="released",
                   help="TTS width, flow and vocoder sizes (tiny: the test fixtures' sizes, for tests only)")
    g.add_argument("--torch-python", default=None,
                   help="interpreter for the official PyTorch side (transformers 4.51, e.g. /work/refenv/bin/python);"
                        " without it the PyTorch rows are skipped")
    g.add_argument("--weights-dir", default=None,
                   help="write the shared weights and inputs here and keep them (default: a temporary folder)")
    g.add_argument("--official", default=OFFICIAL_MIRROR, help="git dir of OpenBMB/MiniCPM-o-Demo (28b60cf)")
    g.add_argument("--stepaudio2-src", default=UTILS_SRC, help="minicpmo-utils 1.0.7 src folder (stepaudio2)")


def tts_config(args) -> dict:
    from ..models.minicpmo.tiny import tiny_tts_config

    if args.size == "tiny":
        return tiny_tts_config(llm_dim=args.llm_dim, num_hidden_layers=args.tts_layers)
    return tiny_tts_config(llm_dim=args.llm_dim, llm_intermediate_size=768, hidden_size=768,
                           intermediate_size=3072, num_attention_heads=12, num_key_value_heads=12,
                           num_hidden_layers=args.tts_layers)


def flow_config(args):
    from ..models.stepaudio2.config import released_config
    from ..models.stepaudio2.tiny import tiny_flow_config

    return released_config() if args.size == "released" else tiny_flow_config()


def write_bench_folder(folder: Path, args) -> dict:
    """The shared weights and inputs (see the module docstring); returns the run's spec (also in spec.json)."""
    from safetensors.numpy import save_file

    from ..models.minicpmo.tiny import random_tts_weights
    from ..models.stepaudio2.config import flow_yaml_text
    from ..models.stepaudio2.tiny import random_flow_state, tiny_voice
    from ..models.stepaudio2.tiny_vocoder import TINY_F0, TINY_HIFT, config_text, random_state

    folder.mkdir(parents=True, exist_ok=True)
    cfg = tts_config(args)
    save_file(random_tts_weights(cfg, seed=0), str(folder / "tts.safetensors"))
    t2w = folder / "token2wav"
    t2w.mkdir(exist_ok=True)
    fcfg = flow_config(args)
    (t2w / "flow.yaml").write_text(flow_yaml_text(fcfg), encoding="utf-8")
    save_file(random_flow_state(fcfg, seed=1), str(t2w / "flow.safetensors"))
    tiny = args.size == "tiny"
    hift = {**TINY_HIFT, "base_channels": TINY_HIFT["base_channels"] if tiny else RELEASED_HIFT_WIDTH}
    f0 = {**TINY_F0, "cond_channels": TINY_F0["cond_channels"] if tiny else RELEASED_F0_WIDTH}
    (t2w / "config.yaml").write_text(config_text(hift, f0), encoding="utf-8")
    save_file(random_state(2, hift, f0), str(t2w / "hift.safetensors"))
    tiny_voice(fcfg, seed=3, prompt_tokens=args.voice_tokens).save(t2w / "voice.safetensors")
    rng = np.random.default_rng(4)
    save_file({"text_ids": rng.integers(0, 151000, TEXT_CHUNK).astype(np.int64),
               "hidden": rng.standard_normal((TEXT_CHUNK, args.llm_dim)).astype(np.float32),
               "audio_tokens": rng.integers(0, fcfg.vocab_size, args.t2w_tokens).astype(np.int64)},
              str(folder / "inputs.safetensors"))
    spec = {"tts_config": cfg, "tts_tokens": args.tts_tokens, "t2w_tokens": args.t2w_tokens,
            "voice_tokens": args.voice_tokens, "n_timesteps": args.n_timesteps, "reps": args.reps,
            "text_chunk": TEXT_CHUNK, "silence_token": SILENCE_TOKEN, "silence_prefix": SILENCE_PREFIX,
            "t2w_chunk": T2W_CHUNK, "lookahead": LOOKAHEAD, "vocoder": {"hift": hift, "f0": f0}}
    (folder / "spec.json").write_text(json.dumps(spec, indent=1), encoding="utf-8")
    return spec


def stream_windows(tokens: list[int]) -> list[tuple[list[int], bool]]:
    """The pushes ``MiniCPMVoicer`` makes for a reply's audio tokens: 3 silence tokens first, windows of 25 fresh +
    3 lookahead moving by 25, then the rest as the final push."""
    buf = [SILENCE_TOKEN] * SILENCE_PREFIX + [int(t) for t in tokens]
    out = []
    while len(buf) >= T2W_CHUNK + LOOKAHEAD:
        out.append((buf[:T2W_CHUNK + LOOKAHEAD], False))
        buf = buf[T2W_CHUNK:]
    out.append((buf, True))
    return out


def median_s(fn, reps: int, long_s: float = 20.0) -> tuple[float, object]:
    """Median wall time of ``fn`` over ``reps`` calls after a warm-up call, and the last call's result; a first
    call over ``long_s`` seconds is the only sample (the released-size token2wav on a shared 2-core machine)."""
    t0 = time.perf_counter()
    out = fn()
    first = time.perf_counter() - t0
    if first > long_s or reps < 1:
        return first, out
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples), out


def rows(prefill_s, decode_s, tts_tokens, generated, setup_s, push_s, push_samples, offline_s, offline_samples,
         t2w_tokens, ttfa_s, first_push_s, first_samples, first_stream_s) -> dict:
    """One side's result (both sides build it from the same measurements)."""
    audio_s = (SILENCE_PREFIX + t2w_tokens) / TOKENS_PER_S
    steady = [t for t, last in push_s if not last]
    return {
        "tts_prefill_s": round(prefill_s, 4),
        "tts_tokens_per_s": round((tts_tokens - 1) / max(decode_s - prefill_s, 1e-9), 2),
        "tts_call_s": round(decode_s, 4), "tts_tokens_generated": generated,
        "t2w_stream_setup_s": round(setup_s, 3), "t2w_warmup_stream_s": round(first_stream_s, 3),
        "t2w_push_s": [round(t, 3) for t, _ in push_s],
        "t2w_stream_rtf": round(sum(t for t, _ in push_s) / audio_s, 3),
        "t2w_push_rtf": round(statistics.median(steady) / (T2W_CHUNK / TOKENS_PER_S), 3) if steady else None,
        "t2w_stream_samples": int(push_samples),
        "t2w_offline_s": round(offline_s, 3), "t2w_offline_rtf": round(offline_s / (t2w_tokens / TOKENS_PER_S), 3),
        "t2w_offline_samples": int(offline_samples),
        "time_to_first_audio_s": round(ttfa_s, 3), "first_push_s": round(first_push_s, 3),
        "first_audio_samples": int(first_samples),
    }


# --- MLX -----------------------------------------------------------------------------------------------------------

def mlx_side(folder: Path, spec: dict) -> dict:
    import mlx.core as mx

    from ..models.minicpmo.tts import MiniCPMTTS, TTSArgs, TTSSampling
    from ..models.stepaudio2.token2wav import Token2Wav, Voice

    reps = spec["reps"]
    tts = MiniCPMTTS(TTSArgs.from_dict(spec["tts_config"]))
    raw = mx.load(str(folder / "tts.safetensors"))
    tts.load_weights(list(MiniCPMTTS.sanitize({k[4:]: v for k, v in raw.items()}).items()), strict=True)
    mx.eval(tts.parameters())
    del raw
    t2w = Token2Wav.load(folder / "token2wav", n_timesteps=spec["n_timesteps"])
    voice = Voice.load(folder / "token2wav")
    inputs = mx.load(str(folder / "inputs.safetensors"))
    ids = np.array(inputs["text_ids"])
    hidden = inputs["hidden"]
    tokens = np.array(inputs["audio_tokens"]).tolist()

    def tts_call(n):
        reply = tts.start_reply(TTSSampling(greedy=True, max_new_tokens_per_chunk=n))
        chunks = reply.feed(ids, hidden)
        return reply, chunks

    prefill, _ = median_s(lambda: tts_call(1), reps)
    n = spec["tts_tokens"]
    decode, (reply, _) = median_s(lambda: tts_call(n), reps)
    generated = len(reply.generated)

    windows = stream_windows(tokens)

    def stream_all():
        s = t2w.start_stream(voice)
        times, samples = [], 0
        for window, last in windows:
            t0 = time.perf_counter()
            pcm = s.push(window, last=last)
            times.append((time.perf_counter() - t0, last))
            samples += pcm.size
        return times, samples

    first_stream, push_times, push_samples = time_stream(stream_all, reps)
    setup, _ = median_s(lambda: t2w.start_stream(voice), reps)
    offline_s, wav = median_s(lambda: t2w(tokens, voice), reps)

    def first_audio():
        s = t2w.start_stream(voice)
        _, chunks = tts_call(T2W_CHUNK)
        first = [SILENCE_TOKEN] * SILENCE_PREFIX + chunks[0]
        t0 = time.perf_counter()
        pcm = s.push(first[:T2W_CHUNK + LOOKAHEAD])
        return time.perf_counter() - t0, pcm.size

    ttfa, (first_push, first_samples) = median_s(first_audio, reps)
    return rows(prefill, decode, n, generated, setup, push_times, push_samples, offline_s, wav.size,
                len(tokens), ttfa, first_push, first_samples, first_stream)


def time_stream(stream_all, reps: int) -> tuple[float, list, int]:
    """``stream_all`` -> (the first stream's seconds, per-push (median seconds, last), samples). The first stream
    is always a warm-up, whatever its length: the official encoder's ``forward_chunk`` is ``torch.compile``d
    (dynamic, eager backend), so its first calls pay the tracing; then ``reps`` timed streams (at least one)."""
    t0 = time.perf_counter()
    stream_all()
    first = time.perf_counter() - t0
    runs = [stream_all() for _ in range(max(1, reps))]
    times = [(statistics.median(r[0][i][0] for r in runs), runs[0][0][i][1]) for i in range(len(runs[0][0]))]
    return first, times, runs[-1][1]


# --- PyTorch (a subprocess) ------------------------------------------------------------------------------------------

def torch_side(python: str, folder: Path, args) -> dict:
    """The official code's timings from ``scripts/bench_minicpmo_speech_official.py`` (its last stdout line)."""
    cmd = [python, str(SCRIPT), "--folder", str(folder), "--official", args.official, "--src", args.stepaudio2_src]
    env = {**os.environ, "PYTHONPATH": ""}
    env.pop("LD_PRELOAD", None)  # the MLX side's OpenBLAS preload is not the reference environment's
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"the PyTorch side failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def torch_python_note(python: str | None) -> str | None:
    """Why the PyTorch side cannot run (None when it can)."""
    if not python:
        return "PyTorch side skipped: no --torch-python (the official code needs transformers 4.51, e.g. " \
               "/work/refenv/bin/python)"
    if not (Path(python).is_file() and os.access(python, os.X_OK)):
        return f"PyTorch side skipped: --torch-python {python} is not an executable file"
    r = subprocess.run([python, "-c", "import torch, transformers; print(transformers.__version__)"],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""})
    if r.returncode != 0:
        return f"PyTorch side skipped: {python} cannot import torch and transformers ({r.stderr.strip()[-300:]})"
    return None


def run(args) -> int:
    from .common import load_average, versions
    from .report import write_outputs

    if args.tts_tokens < 2 or args.t2w_tokens < 1 or args.voice_tokens < LOOKAHEAD:
        raise SystemExit("--tts-tokens must be >= 2, --t2w-tokens >= 1 and --voice-tokens >= 3")
    note = None if args.no_torch else torch_python_note(args.torch_python)
    result = {"benchmark": "speech", "model_family": "minicpmo",
              "config": {k: getattr(args, k) for k in ("tts_layers", "llm_dim", "tts_tokens", "t2w_tokens",
                                                       "voice_tokens", "n_timesteps", "size",
                                                       "reps")},
              "versions": versions(), "load_average_before": load_average()}
    with tempfile.TemporaryDirectory(prefix="omnitide-bench-minicpmo-") as tmp:
        folder = Path(args.weights_dir) if args.weights_dir else Path(tmp)
        print("writing random weights ...", flush=True)
        spec = write_bench_folder(folder, args)
        print("MLX ...", flush=True)
        result["mlx"] = mlx_side(folder, spec)
        print(result["mlx"], flush=True)
        gc.collect()
        if not args.no_torch and note is None:
            print("PyTorch (official code) ...", flush=True)
            official = torch_side(args.torch_python, folder, args)
            result["versions"].update(official.pop("versions"))
            result["torch"] = official
            print(result["torch"], flush=True)
    if note:
        result["note"] = note
        print(note, flush=True)
    result["load_average_after"] = load_average()
    write_outputs(result, args, markdown=markdown, plot=plot)
    return 0


ROWS = (("TTS tokens/s", "tts_tokens_per_s", True), ("TTS prefill, 10 text tokens (s)", "tts_prefill_s", False),
        ("token2wav stream setup (s)", "t2w_stream_setup_s", False),
        ("token2wav streaming RTF", "t2w_stream_rtf", False),
        ("token2wav RTF of a 25+3 push", "t2w_push_rtf", False),
        ("token2wav offline RTF", "t2w_offline_rtf", False),
        ("first token2wav push (s)", "first_push_s", False),
        ("time to first audio (s)", "time_to_first_audio_s", False))


def markdown(result: dict) -> str:
    lines = ["| | MLX | PyTorch (official) | MLX faster by |", "|---|---:|---:|---:|"]
    for label, key, higher in ROWS:
        m = result["mlx"].get(key)
        t = result.get("torch", {}).get(key)
        ratio = "" if t is None or not m else f"{(m / t if higher else t / m):.2f}x"
        lines.append(f"| {label} | {'' if m is None else m} | {'' if t is None else t} | {ratio} |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    from .report import bar_plot

    c, v = result["config"], result["versions"]
    shown = ("tts_tokens_per_s", "t2w_stream_rtf", "t2w_offline_rtf", "time_to_first_audio_s")
    keys = [r for r in ROWS if r[1] in shown]
    bar_plot(result, keys, f"MiniCPM-o 4.5 speech, shape-true random weights (TTS {c['tts_layers']} layers, token2wav "
             f"{c['size']}, {c['t2w_tokens']} audio tokens); {v.get('cpu', '')}", path)
