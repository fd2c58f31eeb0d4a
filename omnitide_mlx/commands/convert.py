"""``omnitide convert``: a Hugging Face checkpoint -> an MLX folder (optionally quantised) that ``load`` reads back.

Generic over the supported models: the checkpoint is loaded through ``omnitide_mlx.load`` (so it is checked against
its config first), then written with ``models.loading.save_converted``. With ``-q`` the weights are quantised as
``mlx_lm.convert -q`` does (affine, 4 bits, group 64 by default); a model may restrict quantisation to some layers
with a ``quant_predicate(path, module)`` method (Qwen2.5-Omni quantises its language model and keeps the vision and
audio encoders in float).

``omnitide convert --token2wav DIR`` instead converts a StepAudio2 token2wav folder (MiniCPM-o 4.5's
``assets/token2wav``) in place: ``flow.pt``, ``hift.pt`` and ``hift_original.pt`` (torch state dicts, read with
``weights_only=True``) become ``.safetensors`` files next to them, which is what the MLX speech decoder loads.
Needs torch (the ``torch`` extra); nothing else in the folder changes.
"""

from __future__ import annotations

import argparse

HELP = "convert a Hugging Face checkpoint to MLX safetensors, optionally quantised"
DESCRIPTION = __doc__

DTYPES = ("float16", "bfloat16", "float32")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", "--hf-path", dest="model",
                        help="local model folder or Hugging Face id (org/name); --hf-path as mlx_lm.convert names it "
                             "(required unless --token2wav)")
    parser.add_argument("--mlx-path", help="output folder for the converted model (required unless --token2wav)")
    parser.add_argument("--token2wav", metavar="DIR",
                        help="convert a StepAudio2 token2wav folder in place instead: flow.pt, hift.pt, "
                             "hift_original.pt -> .safetensors next to them")
    parser.add_argument("--overwrite", action="store_true",
                        help="with --token2wav: rewrite .safetensors files that already exist")
    parser.add_argument("-q", "--quantize", action="store_true", help="quantise the weights")
    parser.add_argument("--q-bits", type=int, default=4, choices=(2, 3, 4, 5, 6, 8), help="bits per weight (4)")
    parser.add_argument("--q-group-size", type=int, default=64, choices=(32, 64, 128),
                        help="quantisation group size (64)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="cast floating weights before saving (default: keep the checkpoint's)")


def run(args: argparse.Namespace) -> int:
    import sys
    from pathlib import Path

    import mlx.core as mx

    from ..models import load
    from ..models.loading import CheckpointError, load_config, resolve_model_path, save_converted
    from .stream import announce

    if args.token2wav:
        return _convert_token2wav(args)
    if not args.model or not args.mlx_path:
        print("error: --model (--hf-path) and --mlx-path are required (or --token2wav DIR)", file=sys.stderr)
        return 2
    from .options import UsageError, check_output_dir

    try:
        dst = check_output_dir(args.mlx_path, "--mlx-path")
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        src = resolve_model_path(args.model)
        if dst.resolve() == src.resolve():
            print(f"error: --mlx-path {dst} is the source folder", file=sys.stderr)
            return 2
        if dst.exists() and any(dst.iterdir()):
            print(f"error: {dst} exists and is not empty", file=sys.stderr)
            return 2
        config = load_config(src)
        if config.get("quantization"):
            print(f"error: {src} is already quantised", file=sys.stderr)
            return 2
        with announce(f"loading {src}"):
            model, _ = load(src)
        from ..models.family import family_for_model_type

        family = family_for_model_type(config.get("model_type"))  # its extra parts (Qwen: talker, token2wav, voices)
        extra = family.convert_extra(src, config) if family and family.convert_extra else None
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    dtype = getattr(mx, args.dtype) if args.dtype else None
    what = f"{args.q_bits}-bit (group {args.q_group_size})" if args.quantize else (args.dtype or "unquantised")
    with announce(f"{'quantising and ' if args.quantize else ''}writing {what} weights to {dst}"):
        written = save_converted(model, config, src, dst, bits=args.q_bits if args.quantize else None,
                                 group_size=args.q_group_size, dtype=dtype,
                                 quant_predicate=getattr(model, "quant_predicate", None))
    if extra is not None:
        print(extra(dst))
    what = (f"{written['quantization']['bits']}-bit (group {written['quantization']['group_size']})"
            if args.quantize else (args.dtype or "unquantised"))
    print(f"wrote {what} MLX model to {dst}")
    return 0


def _convert_token2wav(args: argparse.Namespace) -> int:
    import sys

    if args.model or args.mlx_path or args.quantize or args.dtype:
        print("error: --token2wav converts a folder in place; it takes no --model, --mlx-path, -q or --dtype",
              file=sys.stderr)
        return 2
    try:
        from ..torch.token2wav_convert import Token2wavConvertError, convert_token2wav
    except ImportError as e:
        print(f"error: --token2wav needs torch and safetensors (pip install 'omnitide-mlx[torch]'): {e}",
              file=sys.stderr)
        return 1
    try:
        written = convert_token2wav(args.token2wav, overwrite=args.overwrite)
    except ImportError as e:
        print(f"error: --token2wav needs torch and safetensors (pip install 'omnitide-mlx[torch]'): {e}",
              file=sys.stderr)
        return 1
    except Token2wavConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for path, n in written:
        print(f"wrote {path} ({n} tensors)")
    if not written:
        print(f"nothing to do in {args.token2wav}: the .safetensors files exist (--overwrite rewrites them)")
    return 0
