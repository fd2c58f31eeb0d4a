"""The PyTorch side of ``omnitide bench speech --model-family minicpmo``: the official MiniCPM-o 4.5 TTS and StepAudio2
token2wav on the weights and inputs the MLX side wrote, timed the same way; prints one JSON line.

Run by the bench (``--torch-python /work/refenv/bin/python``), or by hand on a folder it wrote:

    /work/refenv/bin/python scripts/bench_minicpmo_speech_official.py --folder DIR \
        [--official /work/.mirror/OpenBMB+MiniCPM-o-Demo/repo] [--src /tmp/dl/minicpmo_utils-1.0.7/src]

Needs torch, transformers 4.51 (the official modeling code's), hyperpyyaml, einops, safetensors. Never imports MLX.

- TTS: ``MiniCPMTTS`` of MiniCPM-o-Demo ``MiniCPMO45/`` at 28b60cf (read from the git mirror into a temporary
  package, built as ``scripts/golden/minicpmo_tts.py`` does: eager attention, float32), ``tts.safetensors`` loaded
  strictly; the condition as ``streaming_generate`` computes it inline, then ``TTSStreamingGenerator
  .generate_with_buffer(max_new_token=n)`` with the ``TTSSamplingParams()`` processors and its multinomial draw
  replaced by an argmax (greedy).
- token2wav: the flow from ``flow.yaml`` through HyperPyYAML and the causal ``CausalHiFTGenerator`` from
  ``config.yaml`` (minicpmo-utils 1.0.7, loaded as scripts/golden/stepaudio2_flow.py / stepaudio2_vocoder.py do,
  without running ``stepaudio2/__init__.py``); streaming through the official ``Token2wav.set_stream_cache`` /
  ``stream`` / ``_stream_vocode`` / both trims, compiled from ``stepaudio2/token2wav.py`` alone (that module imports
  onnxruntime, s3tokenizer and torchaudio at the top) and run on a holder whose prompt cache holds the voice file's
  tokens, mel and speaker embedding (what ``_prepare_prompt`` would compute from a wav); offline: ``flow.inference``
  + the causal vocoder's ``inference(finalize=True)`` in one pass, as the MLX side does.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts" / "golden"))

from omnitide_mlx.bench.speech_minicpmo import (LOOKAHEAD, SILENCE_PREFIX, SILENCE_TOKEN, T2W_CHUNK,  # noqa: E402
                                                median_s, rows, stream_windows, time_stream)

STREAM_METHODS = ("set_stream_cache", "stream", "_stream_vocode", "_trim_estimator_cache", "_trim_conformer_cache")


def official_token2wav_methods(src: Path) -> dict:
    """The streaming methods of the official ``Token2wav``, compiled from token2wav.py alone."""
    tree = ast.parse((src / "stepaudio2" / "token2wav.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Token2wav")
    wanted = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in STREAM_METHODS]
    if len(wanted) != len(STREAM_METHODS):
        raise RuntimeError(f"token2wav.py lacks some of {STREAM_METHODS}")
    ns = {"torch": torch, "np": np}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), "token2wav.py", "exec"), ns)
    return {name: ns[name] for name in STREAM_METHODS}


def fit_scratch(flow) -> None:
    """The official solver's scratch buffers are hard-coded for the released DiT (16 steps x 16 blocks x 1024
    channels; 8 heads x 128): at other widths (the tests' tiny flow) they are resized as
    scripts/golden/stepaudio2_flow.py does; at the released size nothing changes."""
    cfm, est = flow.decoder, flow.decoder.estimator
    depth, hidden = len(est.blocks), est.in_proj.out_features
    heads, head_dim = est.blocks[0].attn.num_heads, est.blocks[0].attn.head_dim
    if tuple(est.cnn_cache_buffer.shape) == (depth, 2, 2 * hidden, 2) and \
            tuple(est.att_cache_buffer.shape[2:4]) == (heads, est.att_cache_buffer.shape[3]) and \
            est.att_cache_buffer.shape[-1] == 2 * head_dim and est.att_cache_buffer.shape[2] == heads:
        return
    cfm.cnn_cache_buffer = torch.zeros(16, depth, 2, 2 * hidden, 2)
    cfm.att_cache_buffer = torch.zeros(16, depth, 2, heads, 1000, 2 * head_dim)
    est.cnn_cache_buffer = torch.zeros(depth, 2, 2 * hidden, 2)
    est.att_cache_buffer = torch.zeros(depth, 2, heads, 1000, 2 * head_dim)


def build_token2wav(folder: Path, src: Path, n_timesteps: int):
    from safetensors.torch import load_file
    from stepaudio2_flow import build_flow, import_official
    from stepaudio2_vocoder import load_official_model

    import_official(src)
    from stepaudio2.causal_vocoder import f0_predictor, generator
    from stepaudio2.causal_vocoder.bounded_vocoder import BoundedVocoder

    flow = build_flow((folder / "flow.yaml").read_text()).eval()
    flow.load_state_dict(load_file(str(folder / "flow.safetensors")), strict=True)
    fit_scratch(flow)
    hift = load_official_model(folder, generator, f0_predictor)
    voice = load_file(str(folder / "voice.safetensors"))
    prompt = voice["prompt_tokens"].reshape(1, -1).int()
    mel = voice["prompt_mel"].float()[None]
    frames = prompt.shape[1] * flow.up_rate
    mel = torch.nn.functional.pad(mel, (0, 0, 0, frames - mel.shape[1]), mode="replicate") \
        if mel.shape[1] < frames else mel[:, :frames]
    spk = voice["speaker_embedding"].float().reshape(1, -1)

    methods = official_token2wav_methods(src)
    holder_cls = type("Token2wavHolder", (), {"CONFORMER_HISTORY_FRAMES": 100, **methods})
    t2w = holder_cls()
    t2w.flow, t2w.hift, t2w.float16, t2w.n_timesteps = flow, hift, False, n_timesteps
    t2w.device = torch.device("cpu")
    t2w.bounded_vocoder = BoundedVocoder(hift)
    t2w.source_cache_len = 8 * 480  # vocoder_delay_frames (checked by load_official_model's config) x hop
    t2w.cache = {"voice": (prompt, torch.tensor([prompt.shape[1]]), spk, mel, torch.tensor([mel.shape[1]]))}
    t2w.stream_cache, t2w.hift_cache_dict, t2w._stream_prompt = None, {}, None
    return t2w


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--folder", type=Path, required=True, help="the folder the MLX side wrote")
    ap.add_argument("--official", type=Path, default=Path("/work/.mirror/OpenBMB+MiniCPM-o-Demo/repo"))
    ap.add_argument("--src", type=Path, default=Path("/tmp/dl/minicpmo_utils-1.0.7/src"))
    args = ap.parse_args()
    import transformers
    from minicpmo_tts import build, import_official, patched_multinomial
    from safetensors.torch import load_file

    spec = json.loads((args.folder / "spec.json").read_text())
    reps = spec["reps"]
    inputs = load_file(str(args.folder / "inputs.safetensors"))
    ids, hidden = inputs["text_ids"], inputs["hidden"]
    tokens = inputs["audio_tokens"].tolist()

    tmp = tempfile.TemporaryDirectory()  # the official package's files, kept for the whole run
    modeling, utils = import_official(args.official, Path(tmp.name))
    tts = build(modeling, spec["tts_config"])
    state = load_file(str(args.folder / "tts.safetensors"))
    tts.load_state_dict({k[4:]: v for k, v in state.items()}, strict=True)
    del state
    params = utils.TTSSamplingParams()
    warpers, processors = modeling.gen_logits(num_code=tts.config.num_audio_tokens,
                                              repetition_penalty=params.repetition_penalty, top_p=params.top_p,
                                              top_k=params.top_k)

    @torch.inference_mode()
    def tts_call(n):
        """streaming_generate's condition for one text chunk, then generate_with_buffer (greedy)."""
        gen = utils.TTSStreamingGenerator(model=tts, temperature=params.temperature,
                                          eos_token=torch.tensor([tts.config.num_audio_tokens - 1]),
                                          chunk_size=T2W_CHUNK, tts_last_turn_tokens=None,
                                          logits_processors=processors, logits_warpers=warpers)
        gen.spk_emb = torch.empty((1, 0, tts.config.hidden_size))
        cond = tts.emb_text(ids[None]) + (torch.nn.functional.normalize(
            tts.projector_semantic(hidden[None]), p=2, dim=-1) if tts.config.normalize_projected_hidden
            else tts.projector_semantic(hidden[None]))
        with patched_multinomial(None, greedy=True):
            chunks = [t.reshape(-1).tolist() for t, _ in
                      gen.generate_with_buffer(condition=cond, text_finished=False, max_new_token=n)]
        return gen, chunks

    prefill, _ = median_s(lambda: tts_call(1), reps)
    n = spec["tts_tokens"]
    decode, (gen, chunks) = median_s(lambda: tts_call(n), reps)
    generated = sum(len(c) for c in chunks) + sum(int(t.numel()) for t in gen._token_buffer)

    t2w = build_token2wav(args.folder / "token2wav", args.src, spec["n_timesteps"])
    windows = stream_windows(tokens)

    def stream_all():
        t2w.set_stream_cache("voice")
        times, samples = [], 0
        for window, last in windows:
            t0 = time.perf_counter()
            pcm = t2w.stream(window, last_chunk=last, return_waveform=True)
            times.append((time.perf_counter() - t0, last))
            samples += pcm.size
        return times, samples

    first_stream, push_times, push_samples = time_stream(stream_all, reps)
    setup, _ = median_s(lambda: t2w.set_stream_cache("voice"), reps)
    prompt_tokens, prompt_lens, spk, prompt_mel, mel_lens = t2w.cache["voice"]

    @torch.inference_mode()
    def offline():
        tok = torch.tensor([tokens], dtype=torch.int32)
        mel = t2w.flow.inference(tok, torch.tensor([tok.shape[1]]), prompt_tokens, prompt_lens, prompt_mel,
                                 mel_lens, spk, spec["n_timesteps"])
        wav, _ = t2w.hift.inference(mel.float(), finalize=True)
        return wav

    offline_s, wav = median_s(offline, reps)

    def first_audio():
        t2w.set_stream_cache("voice")
        _, chunks = tts_call(T2W_CHUNK)
        first = [SILENCE_TOKEN] * SILENCE_PREFIX + chunks[0]
        t0 = time.perf_counter()
        pcm = t2w.stream(first[:T2W_CHUNK + LOOKAHEAD], return_waveform=True)
        return time.perf_counter() - t0, pcm.size

    ttfa, (first_push, first_samples) = median_s(first_audio, reps)
    out = rows(prefill, decode, n, generated, setup, push_times, push_samples,
               offline_s, wav.numel(), len(tokens), ttfa, first_push, first_samples, first_stream)
    out["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                       "torch_threads": torch.get_num_threads(), "torch_python": sys.executable,
                       "official_tts": "OpenBMB/MiniCPM-o-Demo MiniCPMO45 @ 28b60cf",
                       "official_token2wav": "minicpmo-utils 1.0.7 (stepaudio2)"}
    assert "mlx" not in sys.modules, "the torch side imported MLX"
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
