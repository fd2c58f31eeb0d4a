"""BigVGAN (Qwen2.5-Omni token2wav's vocoder) alone, MLX against transformers on the same weights and mel, with the
MLX anti-aliased Snake through its NumPy CPU route (what runs now) and through MLX ops (the route before it, which
the Metal path still takes). Released width (1536 channels, upsampling 5*3*2*2*2*2), random weights drawn as
``omnitide bench speech`` draws them, a random mel of ``--frames`` frames (100 = 1 s of audio); each side warmed
up, then the median of ``--reps`` calls. Run under the shared cpu lock:

    flock /work/helpers/cpu.lock python scripts/bench_bigvgan_stage.py --frames 100 --reps 3 \
        --json docs/img/bigvgan-stage.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time

import numpy as np


def median_s(fn, reps: int) -> float:
    fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--frames", type=int, default=100)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import mlx.core as mx
    import torch
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniBigVGANConfig
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavBigVGANModel

    from omnitide_mlx.bench.speech import _weights, released_speech_config
    from omnitide_mlx.models.qwen2_5_omni.token2wav import AntiAliasedSnake, Token2Wav, sanitize_token2wav

    config = released_speech_config(2048, 1)
    _, t2w_w = _weights(config)
    voc_w = {k: v for k, v in t2w_w.items() if k.startswith("code2wav_bigvgan_model.")}
    t2w = Token2Wav.from_dict(config["token2wav_config"])
    t2w.load_weights(list(sanitize_token2wav({k: mx.array(v) for k, v in t2w_w.items()}).items()), strict=True)
    mx.eval(t2w.parameters())
    mel = np.random.default_rng(0).standard_normal((1, args.frames, 80)).astype(np.float32) - 5
    x = mx.array(mel)

    def mlx_numpy_route():
        mx.eval(t2w.vocoder(x))

    real_cpu = AntiAliasedSnake._cpu

    def mlx_ops_route():
        AntiAliasedSnake._cpu = lambda self, y: AntiAliasedSnake.__call__.__wrapped__(self, y)
        try:
            mx.eval(t2w.vocoder(x))
        finally:
            AntiAliasedSnake._cpu = real_cpu

    def mlx_ops_call(self, y):  # the MLX-op route of AntiAliasedSnake.__call__
        y = self._upsample(y)
        a, b = mx.exp(self.alpha), mx.exp(self.beta)
        return self._downsample(y + (1.0 / (b + 1e-9)) * mx.sin(y * a) ** 2)

    AntiAliasedSnake.__call__.__wrapped__ = mlx_ops_call
    out_new = np.array(t2w.vocoder(x))
    mlx_new = median_s(mlx_numpy_route, args.reps)
    mlx_old = median_s(mlx_ops_route, args.reps)
    AntiAliasedSnake._cpu = lambda self, y: mlx_ops_call(self, y)
    out_old = np.array(t2w.vocoder(x))
    AntiAliasedSnake._cpu = real_cpu

    voc = Qwen2_5OmniToken2WavBigVGANModel(Qwen2_5OmniBigVGANConfig(**config["token2wav_config"]["bigvgan_config"]))
    missing = voc.load_state_dict({k[len("code2wav_bigvgan_model."):]: torch.from_numpy(v) for k, v in voc_w.items()},
                                  strict=False)
    assert not missing.unexpected_keys, missing
    voc.eval().float()
    tm = torch.from_numpy(mel).transpose(1, 2).contiguous()
    with torch.no_grad():
        out_torch = voc(tm).numpy().reshape(-1)
        torch_s = median_s(lambda: voc(tm), args.reps)
    audio_s = args.frames * 240 / 24000
    result = {
        "command": "python scripts/bench_bigvgan_stage.py " + f"--frames {args.frames} --reps {args.reps}"
                   + (f" --json {args.json}" if args.json else ""),
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "load_average": list(os.getloadavg()), "mlx": mx.__version__, "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "git": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "frames": args.frames, "audio_s": audio_s, "reps": args.reps,
        "mlx_numpy_snake_s": round(mlx_new, 3), "mlx_mlx_ops_snake_s": round(mlx_old, 3), "torch_s": round(torch_s, 3),
        "rtf": {"mlx": round(mlx_new / audio_s, 3), "mlx_before": round(mlx_old / audio_s, 3),
                "torch": round(torch_s / audio_s, 3)},
        "mlx_vs_torch_speed": round(torch_s / mlx_new, 3), "mlx_before_vs_torch_speed": round(torch_s / mlx_old, 3),
        "max_abs_diff_routes": float(np.abs(out_new - out_old).max()),
        "max_abs_diff_vs_torch": float(np.abs(out_new.reshape(-1) - out_torch).max()),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
