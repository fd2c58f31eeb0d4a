"""A long full-duplex session on a tiny MiniCPM-o 4.5 checkpoint (simulated media, real decisions): is every piece of
state bounded, and does every unit meet its one-second deadline?

    flock /work/helpers/cpu.lock python scripts/duplex_soak.py --units 3600 --policy omnitide --out docs/img/duplex_soak.json

Each unit is a second of audio (a sine whose pitch changes every unit plus noise) and a 60x80 frame through
``DuplexSession`` with the TTS on (token2wav off: its cost is the flow model's, measured in docs/benchmarks.md).
Per unit it records the wall time of ``streaming_prefill`` and ``streaming_generate``, the decision, the LLM cache
length, the streaming Whisper cache length, the mel buffer, the audio buffer, the history's units, the decoder's
repetition history, the process RSS and MLX's active memory. The JSON is rewritten every 60 units (an interrupted
run keeps what it measured).
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    import os

    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--units", type=int, default=3600)
    ap.add_argument("--policy", default="omnitide", help="omnitide / omnipick / fifo ... or 'window' (official basic)")
    ap.add_argument("--high", type=int, default=2500)
    ap.add_argument("--low", type=int, default=1800)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    import mlx.core as mx

    from omnitide_mlx.core.pick import make_policy
    from omnitide_mlx.models import load
    from omnitide_mlx.models.minicpmo.duplex import BasicWindow
    from omnitide_mlx.models.minicpmo.tiny import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as td:
        ckpt = make_tiny_checkpoint(Path(td) / "tiny", seed=6, tts=True, duplex_bias=True)
        model, processor = load(ckpt, dtype=mx.float32)
    kw = {"window": BasicWindow(args.high, args.low)} if args.policy == "window" else \
        {"retention": make_policy(args.policy, high=args.high, low=args.low)}
    s = model.duplex_session(processor, seed=0, **kw)
    s.prepare("<|im_start|>system\nYou are a helpful assistant.", "<|im_end|>")
    rng = np.random.default_rng(0)
    t = np.arange(16000) / 16000
    rows = []
    meta = {"command": "python scripts/duplex_soak.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
            "machine": platform.platform(), "processor": platform.processor(), "mlx": mx.__version__,
            "device": str(mx.default_device()), "checkpoint": "make_tiny_checkpoint(seed=6, tts=True, duplex_bias=True)",
            "policy": args.policy, "high": args.high, "low": args.low}

    def dump():
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "units": rows}), encoding="utf-8")

    for u in range(args.units):
        audio = (0.1 * np.sin(2 * np.pi * (150 + 25 * (u % 37)) * t) + 0.02 * rng.standard_normal(16000))
        frame = rng.integers(0, 256, (60, 80, 3), dtype=np.uint8)
        t0 = time.perf_counter()
        s.streaming_prefill(audio_waveform=audio.astype(np.float32), frame_list=[frame])
        t1 = time.perf_counter()
        r = s.streaming_generate()
        t2 = time.perf_counter()
        rows.append({"u": u, "decision": r.decision, "end_of_turn": r.end_of_turn, "n_ids": len(r.ids),
                     "tts_tokens": len(r.tts_tokens), "prefill_ms": round((t1 - t0) * 1e3, 2),
                     "generate_ms": round((t2 - t1) * 1e3, 2), "kv": s.kv_length,
                     "whisper": s.audio_cache.length, "mel_buffer": int(len(s.mel.buffer)),
                     "audio_buffer": int(len(s.audio_buffer)), "history_units": len(s.history),
                     "decoder_history": len(s.decoder.history), "evicted": r.evicted_tokens,
                     "dropped_units": r.dropped_units, "rss_mb": round(rss_mb(), 1),
                     "mlx_active_mb": round(mx.get_active_memory() / 2**20, 1)})
        if u % 60 == 59:
            dump()
            w = [x["prefill_ms"] + x["generate_ms"] for x in rows[-60:]]
            print(f"unit {u + 1}: kv {s.kv_length} whisper {s.audio_cache.length} rss {rows[-1]['rss_mb']} MB "
                  f"median unit {np.median(w):.0f} ms max {max(w):.0f} ms "
                  f"speaking {sum(x['decision'] == 'speak' for x in rows[-60:])}/60", flush=True)
    dump()


if __name__ == "__main__":
    main()
