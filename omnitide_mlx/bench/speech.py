"""``omnitide bench speech``: the spoken-answer pipeline on shape-true random weights, MLX against transformers'
PyTorch implementation in one run, on the same CPU and the same weights.

The talker has the released width (hidden 896, codec vocabulary 8448, thinker width 2048 of the 3B or 3584 of the
7B) with few layers (``--talker-layers``, 24 released: per-layer time scales linearly); token2wav is at its released
size (DiT 22 layers x 1024, BigVGAN from 1536 channels). Measured, each side in turn on the same input:

- talker: prefill of a ``--prompt`` token prompt, then decode steps (greedy, the cache growing): tokens/s;
- token2wav: the DiT's 10 RK4 steps with guidance (40 model evaluations) and BigVGAN, for ``--codes`` codes
  (50 codes = 1 s of audio): real-time factor (compute seconds per audio second);
- time to first audio, speech side: talker prefill + the codes of the first chunk and its look-ahead block
  (24 at the released block size) + token2wav of that window, as ``OmniSession.ask(speak=True)`` does it (the
  thinker's own token time, which the talker runs in lockstep with, is not included).
"""

from __future__ import annotations

import gc
import statistics
import time

import numpy as np

HELP = "spoken answers: talker tokens/s, token2wav real-time factor and time to first audio, MLX vs PyTorch"
DESCRIPTION = __doc__ + """
example:
  omnitide bench speech --thinker-width 2048 --talker-layers 4 --codes 50 --json docs/img/speech.json \\
      --plot docs/img/speech.png
  omnitide bench speech --model-family minicpmo --tts-layers 2 --torch-python /work/refenv/bin/python \\
      --json docs/img/speech-minicpmo.json   # MiniCPM-o 4.5 (bench/speech_minicpmo.py)
"""


def add_arguments(p) -> None:
    from .speech_minicpmo import add_arguments as minicpmo_arguments

    p.add_argument("--model-family", choices=("qwen2.5-omni", "minicpmo"), default="qwen2.5-omni",
                   help="qwen2.5-omni: talker + token2wav (default); minicpmo: MiniCPM-o 4.5's TTS + StepAudio2 "
                        "token2wav against the official PyTorch code (bench/speech_minicpmo.py)")
    p.add_argument("--thinker-width", type=int, default=2048, help="thinker hidden size (2048: 3B, 3584: 7B)")
    p.add_argument("--talker-layers", type=int, default=4, help="talker layers (24 released)")
    p.add_argument("--prompt", type=int, default=64, help="talker prompt tokens")
    p.add_argument("--steps", type=int, default=32, help="talker decode steps timed")
    p.add_argument("--codes", type=int, default=50, help="codes for the token2wav timing (50 = 1 s)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of each timed call (median)")
    p.add_argument("--no-torch", action="store_true", help="MLX only")
    p.add_argument("--json", dest="json_path", default=None, help="write the result as JSON")
    p.add_argument("--plot", default=None, help="write a bar chart (PNG)")
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    minicpmo_arguments(p)


def released_speech_config(thinker_width: int, talker_layers: int) -> dict:
    """``talker_config`` / ``token2wav_config`` at the released sizes (transformers' defaults for token2wav; the
    talker's published shape: 896 wide, 12 heads of 64, 4 KV heads, MLP 18944, M-RoPE [16, 16, 0])."""
    return {
        "talker_config": {
            "vocab_size": 8448, "embedding_size": thinker_width, "hidden_size": 896, "intermediate_size": 18944,
            "num_hidden_layers": talker_layers, "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "rope_scaling": {"mrope_section": [16, 16, 0], "rope_type": "default", "type": "default"},
        },
        "token2wav_config": {"dit_config": {}, "bigvgan_config": {}},
    }


def _weights(config: dict, seed: int = 0) -> tuple[dict, dict]:
    from ..models.qwen2_5_omni.tiny import draw_speech, talker_weight_shapes, token2wav_weight_shapes

    rng = np.random.default_rng(seed)
    talker = {k: draw_speech(k, s, rng) for k, s in talker_weight_shapes(config["talker_config"]).items()}
    t2w = {k: draw_speech(k, s, rng) for k, s in token2wav_weight_shapes(config["token2wav_config"]).items()}
    return talker, t2w


def _median_s(fn, reps: int) -> float:
    """Median wall time of ``fn`` over ``reps`` calls after a warm-up call; a first call over 20 s is the only
    sample (the full-size DiT on a shared 2-core machine: a warm-up would double the run)."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    if first > 20:
        return first
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


# --- MLX -----------------------------------------------------------------------------------------------------------

def _mlx_side(config, talker_w, t2w_w, args, prompt, tracks, codes, noise, cond, ref) -> dict:
    import mlx.core as mx

    from ..models.qwen2_5_omni.talker import CodecSampling, Talker, TalkerConfig, TalkerStream
    from ..models.qwen2_5_omni.token2wav import Token2Wav, sanitize_token2wav

    talker = Talker(TalkerConfig.from_dict(config["talker_config"]))
    talker.load_weights([(k, mx.array(v)) for k, v in talker_w.items()], strict=True)
    t2w = Token2Wav.from_dict(config["token2wav_config"])
    t2w.load_weights(list(sanitize_token2wav({k: mx.array(v) for k, v in t2w_w.items()}).items()), strict=True)
    mx.eval(talker.parameters(), t2w.parameters())
    e = talker.config.embedding_size
    zero = mx.zeros((e,))
    greedy = CodecSampling(greedy=True, repetition_penalty=1.0)

    def new_stream(n):
        return TalkerStream(talker, mx.array(prompt[:n]), np.broadcast_to(np.arange(n), (3, n)), zero, zero, zero,
                            sampling=greedy, max_codes=10 ** 6)

    def talk(steps):
        s = new_stream(prompt.shape[0])
        s.start(mx.array(tracks[0]))
        for i in range(steps):
            s.done = False
            s.step(mx.array(tracks[1 + i % (len(tracks) - 1)]))
        return s

    prefill = _median_s(lambda: talk(0), args.reps)
    full = _median_s(lambda: talk(args.steps), args.reps)
    c = mx.array(codes[None].astype(np.int32))
    nz = mx.array(noise)
    cnd, rf = mx.array(cond[None]), mx.array(ref[None])

    def dit():
        m = t2w.dit.sample(c, cnd, rf, nz)
        mx.eval(m)
        return m

    mel = dit()
    dit_s = _median_s(dit, args.reps)
    voc_s = _median_s(lambda: mx.eval(t2w.vocoder(mel)), args.reps)
    first = 2 * t2w.dit.config.block_size // t2w.dit.config.repeats

    def first_audio():
        talk(first - 1)
        m = t2w.dit.sample(c[:, :first], cnd, rf, nz[:, :2 * first])
        mx.eval(t2w.vocoder(m))

    ttfa = _median_s(first_audio, args.reps)
    return _result(prefill, full, dit_s, voc_s, ttfa, args, first)


# --- PyTorch -------------------------------------------------------------------------------------------------------

def _torch_side(config, talker_w, t2w_w, args, prompt, tracks, codes, noise, cond, ref) -> dict:
    import torch
    from transformers import DynamicCache
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import (Qwen2_5OmniTalkerConfig,
                                                                             Qwen2_5OmniToken2WavConfig)
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (Qwen2_5OmniTalkerForConditionalGeneration,
                                                                        Qwen2_5OmniToken2WavModel)

    tc = Qwen2_5OmniTalkerConfig(**config["talker_config"])
    talker = Qwen2_5OmniTalkerForConditionalGeneration(tc).eval()
    missing = talker.load_state_dict({k: torch.from_numpy(v) for k, v in talker_w.items()}, strict=False)
    assert not missing.unexpected_keys and not [k for k in missing.missing_keys if "inv_freq" not in k], missing
    t2w = Qwen2_5OmniToken2WavModel(Qwen2_5OmniToken2WavConfig(**config["token2wav_config"])).eval().float()
    missing = t2w.load_state_dict({k: torch.from_numpy(v) for k, v in t2w_w.items()}, strict=False)
    assert not missing.unexpected_keys, missing
    n = prompt.shape[0]
    p = torch.from_numpy(prompt)[None]
    tr = torch.from_numpy(tracks)

    @torch.no_grad()
    def talk(steps):
        cache = DynamicCache()
        pos = torch.arange(n).view(1, 1, -1).expand(3, 1, -1)
        x = torch.cat([p, tr[None, :1]], 1)
        pos = torch.arange(n + 1).view(1, 1, -1).expand(3, 1, -1)
        h = talker.model(inputs_embeds=talker.thinker_to_talker_proj(x), position_ids=pos, cache=cache,
                         use_cache=True).last_hidden_state
        code = int(talker.codec_head(h[:, -1]).argmax())
        for i in range(steps):
            x = talker.model.embed_tokens(torch.tensor([[code]])) + tr[None, 1 + i % (len(tracks) - 1)][:, None]
            pos = torch.full((3, 1, 1), n + 1 + i)
            h = talker.model(inputs_embeds=talker.thinker_to_talker_proj(x), position_ids=pos, cache=cache,
                             use_cache=True).last_hidden_state
            code = int(talker.codec_head(h[:, -1]).argmax())

    prefill = _median_s(lambda: talk(0), args.reps)
    full = _median_s(lambda: talk(args.steps), args.reps)
    c = torch.from_numpy(codes[None].astype(np.int64))
    cnd, rf = torch.from_numpy(cond[None]), torch.from_numpy(ref[None])
    dit_model, voc = t2w.code2wav_dit_model, t2w.code2wav_bigvgan_model

    @torch.no_grad()
    def dit():
        torch.manual_seed(0)
        return dit_model.sample(cnd, rf, c)

    mel = dit()
    dit_s = _median_s(dit, args.reps)
    with torch.no_grad():
        voc_s = _median_s(lambda: voc(mel), args.reps)
    first = 2 * dit_model.config.block_size // dit_model.config.repeats

    @torch.no_grad()
    def first_audio():
        talk(first - 1)
        voc(dit_model.sample(cnd, rf, c[:, :first]))

    ttfa = _median_s(first_audio, args.reps)
    return _result(prefill, full, dit_s, voc_s, ttfa, args, first)


def _result(prefill, full, dit_s, voc_s, ttfa, args, first) -> dict:
    audio_s = args.codes / 50
    return {"talker_prefill_s": round(prefill, 4), "talker_tokens_per_s": round(args.steps / max(full - prefill, 1e-9), 2),
            "dit_s": round(dit_s, 3), "bigvgan_s": round(voc_s, 3), "token2wav_rtf": round((dit_s + voc_s) / audio_s, 3),
            "dit_rtf": round(dit_s / audio_s, 3), "bigvgan_rtf": round(voc_s / audio_s, 3),
            "time_to_first_audio_s": round(ttfa, 3), "first_window_codes": first}


def run(args) -> int:
    if getattr(args, "model_family", "qwen2.5-omni") == "minicpmo":
        from .speech_minicpmo import run as run_minicpmo

        return run_minicpmo(args)
    from ..models.qwen2_5_omni.token2wav import DiTConfig
    from .common import load_average, versions
    from .report import write_outputs

    config = released_speech_config(args.thinker_width, args.talker_layers)
    talker_w, t2w_w = _weights(config)
    rng = np.random.default_rng(1)
    e = args.thinker_width
    prompt = rng.standard_normal((args.prompt, e)).astype(np.float32)
    tracks = rng.standard_normal((64, e)).astype(np.float32)
    dit = DiTConfig()
    codes = rng.integers(0, 8192, size=args.codes)
    noise = rng.standard_normal((1, 2 * args.codes, dit.mel_dim)).astype(np.float32)
    cond = rng.standard_normal(dit.enc_emb_dim).astype(np.float32)
    ref = (-5 + rng.standard_normal((300, dit.mel_dim))).astype(np.float32)
    inputs = (prompt, tracks, codes, noise, cond, ref)
    result = {"benchmark": "speech", "config": {k: getattr(args, k) for k in
                                                ("thinker_width", "talker_layers", "prompt", "steps", "codes",
                                                 "reps")},
              "versions": versions(), "load_average_before": load_average()}
    print("MLX ...", flush=True)
    result["mlx"] = _mlx_side(config, talker_w, t2w_w, args, *inputs)
    print(result["mlx"], flush=True)
    gc.collect()
    if not args.no_torch:
        import torch
        import transformers

        result["versions"].update(torch=torch.__version__, transformers=transformers.__version__,
                                  torch_threads=torch.get_num_threads())
        print("PyTorch ...", flush=True)
        result["torch"] = _torch_side(config, talker_w, t2w_w, args, *inputs)
        print(result["torch"], flush=True)
    result["load_average_after"] = load_average()
    write_outputs(result, args, markdown=markdown, plot=plot)
    return 0


ROWS = (("talker tokens/s", "talker_tokens_per_s", True), ("talker prefill (s)", "talker_prefill_s", False),
        ("DiT RTF", "dit_rtf", False), ("BigVGAN RTF", "bigvgan_rtf", False),
        ("token2wav RTF", "token2wav_rtf", False), ("time to first audio (s)", "time_to_first_audio_s", False))


def markdown(result: dict) -> str:
    lines = ["| | MLX | PyTorch | MLX faster by |", "|---|---:|---:|---:|"]
    for label, key, higher in ROWS:
        m = result["mlx"][key]
        t = result.get("torch", {}).get(key)
        ratio = "" if t is None else f"{(m / t if higher else t / m):.2f}x"
        lines.append(f"| {label} | {m} | {'' if t is None else t} | {ratio} |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    from .report import bar_plot

    c, v = result["config"], result["versions"]
    bar_plot(result, [r for r in ROWS if r[1] != "talker_prefill_s"],
             f"speech, shape-true random weights (talker {c['talker_layers']} layers, thinker width "
             f"{c['thinker_width']}, {c['codes']} codes); {v.get('cpu', '')}", path)
