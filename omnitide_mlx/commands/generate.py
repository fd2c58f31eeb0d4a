"""``omnitide generate``: one prompt, optional images / audio / video, one answer (like ``mlx_lm.generate``)."""

from __future__ import annotations

import sys
import time

from .options import (UsageError, add_kv_arguments, add_media_arguments, add_model_arguments, add_progress_argument,
                      add_sampling_arguments, check_stop_strings, sampling_kwargs)
from .speech_args import SpokenAnswers, add_speech_arguments, check_speech_args
from .stream import check_kv_group, check_model, session_from_args

HELP = "answer one prompt about optional images, audio or a video (like mlx_lm.generate)"
DESCRIPTION = """Answer one prompt, optionally about images, an audio file or a video, and print the answer as it
streams (stdout), with prompt / generation speed and peak memory (stderr, as mlx_lm.generate does).

examples:
  omnitide generate --model Qwen/Qwen2.5-Omni-3B --image photo.jpg --prompt "What is in this picture?"
  omnitide generate --model ./checkpoints/tiny-qwen2.5-omni --audio speech.wav --prompt "Transcribe this."
"""


def add_arguments(p) -> None:
    add_model_arguments(p)
    add_media_arguments(p)
    p.add_argument("--prompt", "-p", required=True, help="the question or instruction")
    p.add_argument("--image", action="append", default=[], help="image file (repeatable)")
    p.add_argument("--audio", default=None, help="audio file")
    p.add_argument("--video", default=None, help="video file (a frame a second with its audio)")
    add_kv_arguments(p)
    add_sampling_arguments(p)
    add_progress_argument(p)
    add_speech_arguments(p)
    p.add_argument("--verbose", action="store_true", help="print per-unit details")


def run(args) -> int:
    import mlx.core as mx

    from ..errors import MediaError
    from ..media import MediaStream
    from ..models.loading import CheckpointError

    if not args.prompt.strip():
        print("omnitide generate: --prompt is empty", file=sys.stderr)
        return 2
    try:
        check_stop_strings(args)
        check_speech_args(args)
    except UsageError as e:
        print(f"omnitide generate: {e}", file=sys.stderr)
        return 2
    try:
        check_model(args)
        check_kv_group(args)
        images = [_read_image(path) for path in args.image]
        media = MediaStream(args.video, args.audio) if (args.video or args.audio) else None
        args.policy, args.high, args.low, args.kv_budget = "full", None, None, None
        session = session_from_args(args)
        t0 = time.perf_counter()
        for img in images:
            session.push(frame=img)
        if media is not None:
            from tqdm import tqdm

            with tqdm(total=media.units, unit="s", desc="reading media", file=sys.stderr, leave=False,
                      disable=args.no_progress or media.units < 2 or not sys.stderr.isatty()) as bar:
                for chunk in media:
                    session.push(frame=chunk.frame, audio=chunk.audio, t=chunk.t)
                    bar.update(1)
        session.flush()
        speaker = SpokenAnswers(session, args, "omnitide generate")
    except UsageError as e:
        print(f"omnitide generate: {e}", file=sys.stderr)
        return 2
    except (MediaError, CheckpointError, ValueError) as e:
        print(f"omnitide generate: {e}", file=sys.stderr)
        return 1
    media_s = time.perf_counter() - t0
    tokens_before = session.history.total_tokens
    t1 = time.perf_counter()
    first = None
    for piece in speaker.ask(args.prompt, **sampling_kwargs(args)):
        if first is None:
            first = time.perf_counter()
        print(piece, end="", flush=True)
    print(flush=True)
    s = session.stats()
    prompt_tokens = session.history.total_tokens - tokens_before
    print("=" * 10, file=sys.stderr)
    if media is not None:
        print(f"Media: {media.summary()}", file=sys.stderr)
    print(f"Prompt: {tokens_before} tokens of media and system prompt in {media_s:.2f} s", file=sys.stderr)
    if first is not None:
        print(f"Time to first piece: {first - t1:.3f} s", file=sys.stderr)
    print(f"Generation: {s['timings']['decode_tokens_per_s']:.1f} tokens-per-sec; answer and question "
          f"{prompt_tokens} tokens", file=sys.stderr)
    print(f"Peak memory: {mx.get_peak_memory() / 1e9:.3f} GB", file=sys.stderr)
    return 0


def _read_image(path: str):
    from pathlib import Path

    import cv2

    from ..errors import MediaError

    p = Path(path).expanduser()
    if not p.is_file():
        raise MediaError(f"image {p} does not exist")
    bgr = cv2.imread(str(p), cv2.IMREAD_COLOR)
    if bgr is None:
        raise MediaError(f"cannot read image {p}: corrupt or unsupported format")
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
