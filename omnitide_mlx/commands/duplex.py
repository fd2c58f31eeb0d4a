"""``omnitide duplex``: a full-duplex session on a file, one unit a second; the model decides every second whether
to listen or to speak, and speaks while the stream goes on."""

from __future__ import annotations

import argparse
import json
import sys
import time

from .options import (UsageError, add_model_arguments, check_output_file, non_negative_int, positive_float,
                      positive_int)

RETENTION = ["omnitide", "omnipick", "fifo", "token", "streamingllm"]  # the policies that need no attention scores

HELP = "full duplex on a video/audio file: each second the model listens or speaks (MiniCPM-o 4.5)"
DESCRIPTION = """Run a model's full-duplex mode (MiniCPM-o 4.5: the official MiniCPMODuplex protocol) over a file,
one unit (a second of audio, plus a frame of the video) at a time. Every unit prints one line: its time, the
decision ("listen" or "speak") and, for a speaking unit, the text it said. --speak voices the speaking units through
the checkpoint's TTS and token2wav into one wav on the stream's timeline (a second of silence per listening unit).

Decisions and text go to stdout; the summary goes to stderr. Every flag and path is checked before the model loads.

examples:
  omnitide duplex --model ./MiniCPM-o-4_5 --audio talk.wav
  omnitide duplex --model ./MiniCPM-o-4_5 --video clip.mp4 --speak --audio-out reply.wav --json units.json
  omnitide duplex --model ./tiny-minicpmo --audio talk.wav --greedy --window 4000:3500
  omnitide duplex --model ./MiniCPM-o-4_5 --video clip.mp4 --policy omnitide --high 2500 --low 1800
"""

DEFAULT_PROMPT = "You are a helpful assistant."


def _window(text: str) -> tuple[int, int]:
    try:
        high, low = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes HIGH:LOW in tokens, e.g. 4000:3500 (got {text!r})") from None
    if not 0 < low <= high:
        raise argparse.ArgumentTypeError(f"needs 0 < LOW <= HIGH (got {text!r})")
    return high, low


def add_arguments(p) -> None:
    add_model_arguments(p)
    p.add_argument("--video", default=None, help="video file: a frame a second (and its audio unless --audio)")
    p.add_argument("--audio", default=None, help="audio file (wav/flac/ogg/mp3/m4a/...)")
    p.add_argument("--seconds", type=positive_float, default=None, help="stream at most this many seconds")
    p.add_argument("--ref-audio", default=None, metavar="FILE",
                   help="reference voice put in the system prompt as audio embeddings (official prepare)")
    p.add_argument("--greedy", action="store_true",
                   help="argmax decisions and TTS tokens (default: the official sampling)")
    p.add_argument("--seed", type=non_negative_int, default=None, help="seed of the sampling draws")
    p.add_argument("--window", type=_window, default=None, metavar="HIGH:LOW",
                   help="the official basic window: past HIGH cache tokens, drop the oldest units down to LOW "
                        "(default: no window, the cache grows)")
    p.add_argument("--policy", choices=RETENTION, default=None,
                   help="OmniTide retention instead of a window: trims the cache past --high tokens toward --low, "
                        "units keeping their classes (default: no retention, the cache grows)")
    p.add_argument("--high", type=positive_int, default=None, help="--policy: high watermark in tokens (2500)")
    p.add_argument("--low", type=positive_int, default=None, help="--policy: low watermark in tokens (1800)")
    p.add_argument("--speak", action="store_true",
                   help="voice the speaking units (the checkpoint's TTS and assets/token2wav) into --audio-out")
    p.add_argument("--speaker", default=None, metavar="NAME", help="the voice in assets/token2wav (with --speak)")
    p.add_argument("--audio-out", default=None, metavar="FILE",
                   help="wav of the session's speech at 24 kHz (with --speak; default duplex.wav)")
    p.add_argument("--json", default=None, metavar="FILE", help="write every unit's decision, text and timings")


def _check(args):
    from ..media import MediaStream

    if args.speak:
        args.audio_out = args.audio_out or "duplex.wav"
        check_output_file(args.audio_out, "--audio-out")
    elif args.speaker or args.audio_out:
        raise UsageError("--speaker and --audio-out need --speak")
    check_output_file(args.json, "--json")
    if args.policy is not None and args.window is not None:
        raise UsageError("--policy and --window are two ways to bound the cache: give one")
    if args.policy is None and (args.high is not None or args.low is not None):
        raise UsageError("--high and --low need --policy")
    if args.policy is not None:
        args.high = args.high or 2500
        args.low = args.low or min(1800, args.high)
        if args.low > args.high:
            raise UsageError(f"--low {args.low} is above --high {args.high}")
    if args.ref_audio is not None:
        from ..media_decode import check_file

        check_file(args.ref_audio, "--ref-audio file")
    return MediaStream(args.video, args.audio, seconds=args.seconds)


def run(args) -> int:
    from ..errors import MediaError
    from ..models.loading import CheckpointError, resolve_model_path

    prog = "omnitide duplex"
    try:
        media = _check(args)
        path = resolve_model_path(args.model)
    except UsageError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    except (MediaError, CheckpointError, ValueError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    import mlx.core as mx
    import numpy as np

    from ..media_decode import read_audio
    from ..models import load

    try:
        model, processor = load(path)
        if not hasattr(model, "duplex_session"):
            print(f"{prog}: {args.model} has no full-duplex mode (MiniCPM-o 4.5 has)", file=sys.stderr)
            return 1
        from ..speech import SpeechUnavailable

        try:
            retention = None
            if args.policy is not None:
                from ..core.pick import make_policy

                retention = make_policy(args.policy, high=args.high, low=args.low)
            session = model.duplex_session(processor, greedy=args.greedy, seed=args.seed, speak=args.speak,
                                           speaker=args.speaker, window=args.window, retention=retention)
        except SpeechUnavailable as e:
            print(f"{prog}: --speak: {e}", file=sys.stderr)
            return 1
        speech = session.speech
        prompt = args.system_prompt or DEFAULT_PROMPT
        if args.ref_audio is not None:
            session.prepare(f"<|im_start|>system\n{prompt}\n<|audio_start|>", "<|audio_end|><|im_end|>",
                            ref_audio=read_audio(args.ref_audio))
        else:
            session.prepare(f"<|im_start|>system\n{prompt}", "<|im_end|>")
    except (MediaError, CheckpointError, ValueError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    units, writer = [], None
    if speech is not None:
        from ..speech import AudioChunk, WavWriter

        writer = WavWriter(args.audio_out, speech.sample_rate)
    t_start = time.perf_counter()
    try:
        for chunk in media:
            t0 = time.perf_counter()
            frames = [chunk.frame] if chunk.frame is not None else None
            session.streaming_prefill(audio_waveform=chunk.audio, frame_list=frames)
            t1 = time.perf_counter()
            unit = session.streaming_generate()
            t2 = time.perf_counter()
            if writer is not None:  # the stream's timeline: a second of silence for a unit with no audio
                pcm = unit.audio if unit.audio is not None else np.zeros(speech.sample_rate, np.float32)
                writer.write(AudioChunk(pcm, speech.sample_rate, len(units)))
            line = f"[{chunk.t:7.1f}s] {unit.decision}"
            if not unit.is_listen:
                line += f"  {unit.text!r}" + ("  <turn end>" if unit.end_of_turn else "")
            print(line, flush=True)
            units.append({"t": chunk.t, "decision": unit.decision, "text": unit.text, "end_of_turn": unit.end_of_turn,
                          "ids": unit.ids, "tts_tokens": len(unit.tts_tokens),
                          "audio_seconds": 0.0 if unit.audio is None else unit.audio.size / speech.sample_rate,
                          "kv_length": unit.kv_length, "dropped_units": unit.dropped_units,
                          "evicted_tokens": unit.evicted_tokens,
                          "prefill_ms": round((t1 - t0) * 1000, 2), "generate_ms": round((t2 - t1) * 1000, 2)})
    except MediaError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    finally:
        wall = time.perf_counter() - t_start
        if writer is not None:
            writer.close()
        summary = {"units": len(units), "speaking_units": sum(u["decision"] == "speak" for u in units),
                   "kv_length": session.kv_length, "preserve_length": session.preserve_length,
                   "dropped_units": session.dropped_units, "evicted_tokens": session.dropped_tokens,
                   "whisper_resets": session.whisper_resets,
                   "wall_s": round(wall, 3), "peak_memory_mb": round(mx.get_peak_memory() / 2**20, 1)}
        print(f"{prog}: {summary['units']} units, {summary['speaking_units']} speaking, KV {summary['kv_length']} "
              f"tokens, {summary['dropped_units']} units dropped, {wall:.1f} s", file=sys.stderr)
        if args.json:
            from pathlib import Path

            out = Path(args.json).expanduser()
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"model": str(args.model), "summary": summary, "units": units}, indent=1),
                           encoding="utf-8")
    return 0
