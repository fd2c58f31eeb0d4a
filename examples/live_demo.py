"""Live demo: webcam + microphone into an OmniSession, questions typed in the terminal while the stream runs.

    python examples/live_demo.py --model Qwen/Qwen2.5-Omni-3B            # camera 0 and the default microphone
    python examples/live_demo.py --model M --source clip.mp4 --seconds 10 --ask "5:What do you see?"   # headless

A capture thread pushes one chunk a second (a frame plus its second of audio) while the main thread reads
questions from the terminal (or takes them from --ask at their times) and prints the answers as they stream.
Answers go to stdout; the KV footprint after every update (retained KV and allocated capacity) goes to stderr,
never inside an answer: lines that arrive while an answer prints wait for its end, and a question's own update
prints before its `A:`. Microphone input needs the optional package sounddevice (``pip install sounddevice``).

``--speak`` answers in speech too (a Qwen2.5-Omni checkpoint with its talker): every answer is written to
``--audio-out`` as a wav, and played as it is generated when sounddevice and an output device are there
(``pip install 'omnitide-mlx[speech]'``; a headless run only writes the files).

``--voice`` is a conversation: a voice-activity detector hears each question spoken into the microphone (or in
the soundtrack of ``--source``), the model answers it when the speaker stops (aloud with ``--speak``), and
speaking while it answers interrupts it; typed questions still work. Use headphones, or the model may hear itself
(docs/usage.md, "Spoken turns").

    python examples/live_demo.py --model M --voice --speak                         # talk to it
    python examples/live_demo.py --model M --voice --source assets/media/video_10s_av.mp4 \\
        --source-audio assets/media/spoken_questions_10s.flac --no-realtime          # headless: prints each turn
"""

from __future__ import annotations

import argparse
import queue
import sys
import threading
import time

from omnitide_mlx.commands.options import (UsageError, add_kv_arguments, add_media_arguments, add_policy_arguments,
                                           add_sampling_arguments, check_output_dir, check_stop_strings, kv_kwargs,
                                           media_setting, parse_questions, positive_float, resolve_watermarks,
                                           sampling_kwargs)
from omnitide_mlx.errors import MediaError, OmniTideError


class Console:
    """Answers on stdout, updates on stderr, never interleaved: update lines that arrive while an answer is being
    printed are held and printed after it."""

    def __init__(self, bytes_per_token: int = 0):
        self.bytes_per_token = bytes_per_token
        self._lock = threading.Lock()
        self._answering = False
        self._held: list[str] = []

    def update(self, rec) -> None:
        t = f"{rec.t:5.0f}s" if rec.t is not None else "     -"
        line = (f"  [{t}] {rec.kind:<5} retained {rec.retained_cells:5d} tokens "
                f"{rec.retained_cells * self.bytes_per_token / 2**20:7.2f} MiB, capacity {rec.kv_bytes / 2**20:7.2f} "
                f"MiB, span {rec.physical_span:5d}, {rec.active_pages:3d} pages, update {rec.update_ms:7.1f} ms")
        with self._lock:
            if self._answering:
                self._held.append(line)
            else:
                print(line, file=sys.stderr, flush=True)

    def answer(self, question: str, pieces) -> str:
        """Print ``Q:``, then (after the question's own update) ``A:`` and the pieces as they come."""
        print(f"\nQ: {question}", flush=True)
        pieces = iter(pieces)
        first = next(pieces, "")  # the question's update is printed here, before "A:"
        with self._lock:
            self._answering = True
        out = [first]
        try:
            print(f"A: {first}", end="", flush=True)
            for piece in pieces:
                out.append(piece)
                print(piece, end="", flush=True)
            print(flush=True)
        finally:
            with self._lock:
                self._answering = False
                held, self._held = self._held, []
                for line in held:
                    print(line, file=sys.stderr, flush=True)
        return "".join(out)


def capture_loop(session, args, stop: threading.Event, clock: dict, capture=None) -> None:
    """Push a chunk a second from ``capture`` (the camera/microphone) or from --source, paced in real time."""
    from omnitide_mlx.media import MediaStream

    try:
        if args.source:
            start = time.monotonic()
            for chunk in MediaStream(args.source, args.source_audio, seconds=args.seconds):
                if stop.is_set():
                    break
                time.sleep(max(0.0, start + chunk.t - time.monotonic()) if args.realtime else 0.0)
                session.push(frame=chunk.frame, audio=chunk.audio, t=chunk.t)
                clock["t"] = chunk.t + 1
        else:
            with capture as cap:  # opened by main() before the model loaded
                for chunk in cap.chunks():
                    if stop.is_set() or (args.seconds and chunk.t >= args.seconds):
                        break
                    session.push(frame=chunk.frame, audio=chunk.audio, t=chunk.t)
                    clock["t"] = chunk.t + 1
    except MediaError as e:
        print(f"\ncapture stopped: {e}", file=sys.stderr)
        clock["error"] = str(e)
    finally:
        clock["done"] = True


def open_capture(args):
    """The camera (and microphone) opened before the model loads: a machine without them fails at once, with a
    way out, instead of after loading."""
    from omnitide_mlx.media import LiveCapture

    cap = LiveCapture(camera=args.camera, microphone=not args.no_mic)
    try:
        return cap.__enter__()
    except MediaError as e:
        cap.__exit__(None, None, None)
        raise MediaError(f"{e} (no camera here? stream a video file with --source FILE)") from None


def ask(session, q: str, args, n: int):
    """The answer's text pieces; with --speak its audio is written to a wav (and played) as it comes."""
    if not args.speak:
        yield from session.ask(q, **sampling_kwargs(args))
        return
    from pathlib import Path

    from omnitide_mlx.speech import AudioChunk, Player, SpeechOptions, WavWriter

    path = Path(args.audio_out) / f"answer_{n:02d}.wav"
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = player = None
    try:
        for item in session.ask(q, **sampling_kwargs(args), speak=True, speech=SpeechOptions(speaker=args.speaker)):
            if not isinstance(item, AudioChunk):
                yield item
                continue
            if item.note:
                print(f"\n({item.note})", file=sys.stderr)
            if writer is None and item.pcm.size:
                writer = WavWriter(path, item.sample_rate)
                player = Player.open(item.sample_rate) if not args.source else None  # headless: files only
            if writer is not None:
                writer.write(item)
            if player is not None:
                player.play(item)
    finally:
        if player is not None:
            player.close()
        if writer is not None:
            writer.close()
            print(f"\n(spoken answer: {path}, {writer.seconds:.2f} s)", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="local model folder or Hugging Face id")
    p.add_argument("--source", default=None, help="a video file instead of the camera and microphone")
    p.add_argument("--source-audio", default=None, metavar="FILE",
                   help="a soundtrack for --source instead of its own (e.g. spoken questions; wav, flac, mp3, ...)")
    p.add_argument("--camera", type=int, default=0)
    p.add_argument("--no-mic", action="store_true", help="camera only")
    p.add_argument("--seconds", type=positive_float, default=None, help="stop after this many seconds of input")
    p.add_argument("--realtime", action=argparse.BooleanOptionalAction, default=True,
                   help="pace --source at one chunk per second (default on)")
    add_media_arguments(p)
    add_policy_arguments(p)
    add_kv_arguments(p)
    add_sampling_arguments(p, max_tokens=96)
    p.add_argument("--speak", action="store_true", help="answer in speech too (wav files, played when possible)")
    p.add_argument("--speaker", default=None, help="the voice (Chelsie or Ethan in the released models)")
    p.add_argument("--audio-out", default="answers", help="folder for the spoken answers (default ./answers)")
    p.add_argument("--ask", action="append", default=[], metavar="T:QUESTION",
                   help="scripted question at T seconds (or m:ss) for headless runs; otherwise type questions")
    p.add_argument("--voice", action="store_true",
                   help="spoken questions: answer each utterance when the speaker stops; speech interrupts a reply")
    p.add_argument("--hangover", type=positive_float, default=None, metavar="S",
                   help="--voice: seconds of silence that end an utterance (default 0.5)")
    p.add_argument("--headphones", action="store_true",
                   help="--voice: the microphone cannot hear the answers (no echo gate: barge-in at any volume)")
    return p


class VoiceConsole:
    """--voice: prints the conversation's events as they come, writes (and plays) each spoken reply."""

    def __init__(self, console: Console, args):
        self.console, self.args = console, args
        self.writer = self.player = None
        self.turns = 0
        self.paused = False

    def on_event(self, ev) -> None:
        kind = ev.kind
        if kind == "speech_started":
            print(f"\n[{ev.t:6.2f}s] (you are speaking)", file=sys.stderr, flush=True)
        elif kind == "speech_ended":
            print(f"\nQ: (spoken, {ev.data['speech_start']:.2f}-{ev.data['speech_end']:.2f}s)", flush=True)
        elif kind == "reply_started":
            self.turns += 1
            print("A: ", end="", flush=True)
        elif kind == "reply_text":
            print(ev.text, end="", flush=True)
        elif kind == "reply_audio":
            self._audio(ev)
        elif kind in ("reply_paused", "reply_resumed"):  # a possible onset: stop playing until it is decided
            self.paused = kind == "reply_paused"
        elif kind in ("reply_done", "reply_interrupted", "turn_error"):
            self.paused = False
            self._end_audio()
            if kind == "reply_interrupted":
                print(f"\n[{ev.t:6.2f}s] (interrupted: {ev.data['voiced_tokens']} of {ev.data['tokens']} tokens "
                      "voiced)", file=sys.stderr, flush=True)
            elif kind == "turn_error":
                print(f"\n(turn {ev.turn} failed: {ev.data['error']})", file=sys.stderr, flush=True)
            else:
                print(flush=True)

    def _audio(self, ev) -> None:
        from pathlib import Path

        from omnitide_mlx.speech import Player, WavWriter

        chunk = ev.audio
        if chunk is None or not chunk.pcm.size:
            return
        if self.writer is None:
            path = Path(self.args.audio_out) / f"turn_{ev.turn:02d}.wav"
            path.parent.mkdir(parents=True, exist_ok=True)
            self.writer = WavWriter(path, chunk.sample_rate)
            self.player = Player.open(chunk.sample_rate) if not self.args.source else None  # headless: files only
        self.writer.write(chunk)
        if self.player is not None and not self.paused:
            self.player.play(chunk)

    def _end_audio(self) -> None:
        if self.player is not None:
            self.player.close()  # an interrupted reply stops at the chunk being played
        if self.writer is not None:
            self.writer.close()
            print(f"\n(spoken answer: {self.writer.path}, {self.writer.seconds:.2f} s)", file=sys.stderr)
        self.writer = self.player = None


def run_voice(session, args, console: Console, scripted, stop: threading.Event, capture=None) -> dict:
    """--voice: the capture loop pushes through a Conversation (replies on its worker thread); typed or scripted
    questions are turns too. Returns the capture loop's clock (its ``error`` when capture failed)."""
    from omnitide_mlx.conversation import Conversation
    from omnitide_mlx.vad import UtteranceDetector, VADConfig

    cfg = VADConfig() if args.hangover is None else VADConfig(hangover_s=args.hangover)
    speech = None
    if args.speak:
        from omnitide_mlx.speech import SpeechOptions

        speech = SpeechOptions(speaker=args.speaker)
    view = VoiceConsole(console, args)
    conv = Conversation(session, detector=UtteranceDetector(cfg, candidates=True), speak=args.speak, speech=speech, threaded=True,
                        echo_reference=not args.headphones and args.source is None,
                        on_event=view.on_event, **sampling_kwargs(args))
    clock = {"t": 0.0, "done": False, "error": None}
    producer = threading.Thread(target=capture_loop, args=(conv, args, stop, clock, capture), daemon=True)
    producer.start()
    if not scripted and sys.stdin.isatty():
        print("speak, or type a question and press Enter (Ctrl-D to stop)", file=sys.stderr)

        def read_stdin():
            for line in sys.stdin:
                if line.strip():
                    conv.ask(line.strip())
            stop.set()

        threading.Thread(target=read_stdin, daemon=True).start()
    try:
        while not stop.is_set() and not clock["done"]:
            while scripted and scripted[0][0] <= clock["t"]:
                conv.ask(scripted.pop(0)[1])
            time.sleep(0.05)
        for _, q in scripted:
            conv.ask(q)
        if clock["done"]:
            conv.flush()  # the end of the input: an utterance still open is answered
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
        producer.join(timeout=5)
        conv.close()
    return clock


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:  # every flag checked before the model loads
        scripted = parse_questions(args.ask)
        args.high, args.low = resolve_watermarks(args)
        check_stop_strings(args)
        if args.speaker is not None and not args.speak:
            raise UsageError("--speaker needs --speak")
        if args.speak:
            check_output_dir(args.audio_out, "--audio-out")  # before the model loads, not at the first answer
        from omnitide_mlx.commands.stream import check_kv_group

        check_kv_group(args)  # from config.json: a quantisation group that cannot divide the head
        kv = kv_kwargs(args)
        media = media_setting(args)
        if args.voice and args.no_mic and args.source is None:
            raise UsageError("--voice needs the microphone (or --source with a soundtrack): drop --no-mic")
        if args.source_audio is not None and args.source is None:
            raise UsageError("--source-audio needs --source")
        if args.hangover is not None and not args.voice:
            raise UsageError("--hangover needs --voice")
        if args.source is not None:
            from omnitide_mlx.media import MediaStream

            MediaStream(args.source, args.source_audio, seconds=args.seconds)  # the files open and decode
    except (UsageError, MediaError) as e:
        print(f"live_demo: {e}", file=sys.stderr)
        return 2
    except OmniTideError as e:  # a model path that does not resolve
        print(f"live_demo: {e}", file=sys.stderr)
        return 1
    capture = None
    if args.source is None:
        try:
            capture = open_capture(args)
        except MediaError as e:
            print(f"live_demo: {e}", file=sys.stderr)
            return 1

    from omnitide_mlx import OmniSession
    from omnitide_mlx.commands.stream import announce

    console = Console()
    try:
        with announce(f"loading {args.model}"):
            session = OmniSession(args.model, policy=args.policy, high=args.high, low=args.low,
                                  kv_budget=args.kv_budget, on_update=console.update,
                                  media=None if media == type(media)() else media, **kv)
    except ValueError as e:
        if capture is not None:
            capture.__exit__(None, None, None)
        print(f"live_demo: {e}", file=sys.stderr)
        return 1
    console.bytes_per_token = session.stats()["kv_bytes_per_token"]
    stop = threading.Event()
    if args.voice:
        try:
            clock = run_voice(session, args, console, scripted, stop, capture)
        except (ValueError, RuntimeError) as e:
            print(f"live_demo: {e}", file=sys.stderr)
            return 1
        return _summary(session, clock)
    clock = {"t": 0.0, "done": False, "error": None}
    producer = threading.Thread(target=capture_loop, args=(session, args, stop, clock, capture), daemon=True)
    producer.start()

    questions: queue.Queue[str] = queue.Queue()
    if not scripted and sys.stdin.isatty():
        print("type a question and press Enter (Ctrl-D to stop)", file=sys.stderr)

        def read_stdin():
            for line in sys.stdin:
                if line.strip():
                    questions.put(line.strip())
            stop.set()

        threading.Thread(target=read_stdin, daemon=True).start()

    answered = 0
    try:
        while not stop.is_set():
            while scripted and scripted[0][0] <= clock["t"]:
                questions.put(scripted.pop(0)[1])
            try:
                q = questions.get(timeout=0.1)
            except queue.Empty:
                if clock["done"] and not scripted and questions.empty() and not sys.stdin.isatty():
                    break
                if clock["done"] and scripted:
                    questions.put(scripted.pop(0)[1])
                continue
            answered += 1
            console.answer(q, ask(session, q, args, answered))
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
        producer.join(timeout=5)
    return _summary(session, clock)


def _summary(session, clock: dict) -> int:
    s = session.stats()
    print(f"\n{s['units']} units, {s['retained_cells']} tokens retained "
          f"({s['retained_cells'] * s['kv_bytes_per_token'] / 2**20:.2f} MiB; capacity {s['kv_bytes'] / 2**20:.2f} "
          f"MiB), {s['evictions']} evictions, {s['migrations']} migrations", file=sys.stderr)
    return 1 if clock["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
