"""Writes tiny random checkpoints of both models, in the released Hugging Face layout, into checkpoints/.

They let the engine, the CLI and the demo run end to end on a machine without real weights: the answers are
noise (random weights), the token layouts, KV sizes per unit and cache behaviour are the real ones. Both use the
real tokenizers (tests/data/tokenizers), so text round-trips.

    .venv/bin/python scripts/make_tiny_checkpoints.py [--out checkpoints] [--force] [--minicpmo-tts]

``--minicpmo-tts`` gives the MiniCPM-o checkpoint a tiny random TTS (``tts.*`` weights, official layout) so that
speech output can run on it (about 25 MB more: the TTS text table has the real 152,064 rows).
"""

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(REPO / "checkpoints"))
    p.add_argument("--force", action="store_true", help="rewrite existing checkpoints")
    p.add_argument("--minicpmo-tts", action="store_true", help="include a tiny random TTS in the MiniCPM-o one")
    args = p.parse_args()
    out = Path(args.out)
    from omnitide_mlx.models.minicpmo.tiny import make_tiny_checkpoint as make_minicpmo
    from omnitide_mlx.models.qwen2_5_omni.tiny import make_tiny_checkpoint as make_qwen

    jobs = {
        # two heads of 32 (the test suite's tiny Qwen has four of 16): MLX quantises KV in groups of 32 or more
        "tiny-qwen2.5-omni": lambda d: make_qwen(d, tokenizer_dir=REPO / "tests/data/tokenizers/qwen2", vocab="real",
                                                text_heads=2),
        "tiny-minicpm-o-4.5": lambda d: make_minicpmo(d, tokenizer_dir=REPO / "tests/data/tokenizers/minicpm-o-4_5",
                                                    tts=args.minicpmo_tts),
    }
    for name, make in jobs.items():
        dst = out / name
        if (dst / "config.json").exists() and not args.force:
            print(f"{dst}: exists")
            continue
        make(dst)
        print(f"{dst}: written (random weights, released layout)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
