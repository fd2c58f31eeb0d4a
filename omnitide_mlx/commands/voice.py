"""``--voice`` for ``omnitide stream``: spoken questions in the file's soundtrack are detected and answered in turn
(conversation.py), printed as they happen and recorded in ``--json`` as ``turns``."""

from __future__ import annotations

import sys
from pathlib import Path

from .options import UsageError, positive_float


def add_voice_arguments(p) -> None:
    p.add_argument("--voice", action="store_true",
                   help="answer spoken questions: a voice-activity detector (Silero VAD) finds each utterance in the "
                        "audio and the model answers it when it ends (with --speak, aloud; speech during a spoken "
                        "answer interrupts it)")
    p.add_argument("--hangover", type=positive_float, default=None, metavar="S",
                   help="--voice: seconds of silence that end an utterance (default 0.5: shorter answers sooner, "
                        "longer cuts fewer pauses)")
    p.add_argument("--vad-threshold", type=float, default=None, metavar="P",
                   help="--voice: speech probability that starts an utterance (default 0.5)")
    p.add_argument("--max-utterance", type=positive_float, default=None, metavar="S",
                   help="--voice: an utterance longer than this is answered at this length (default 30)")
    p.add_argument("--no-barge-in", action="store_true", help="--voice: speech during a reply does not interrupt it")


def check_voice_args(args) -> None:
    if not getattr(args, "voice", False):
        for flag, value in (("--hangover", args.hangover), ("--vad-threshold", args.vad_threshold),
                            ("--max-utterance", args.max_utterance), ("--no-barge-in", args.no_barge_in)):
            if value not in (None, False):
                raise UsageError(f"{flag} needs --voice")
        return
    if args.vad_threshold is not None and not 0.0 < args.vad_threshold < 1.0:
        raise UsageError(f"--vad-threshold must be between 0 and 1, got {args.vad_threshold}")
    if getattr(args, "audio", None) is None and getattr(args, "video", None) is None:
        raise UsageError("--voice needs a soundtrack: give --video with audio or --audio")
    vad_config(args)  # the detector's own checks (hangover against the rest), before the model loads


def vad_config(args):
    from dataclasses import replace

    from ..vad import VADConfig

    cfg = VADConfig()
    kw = {}
    if args.hangover is not None:
        kw["hangover_s"] = args.hangover
    if args.vad_threshold is not None:
        kw["threshold"] = args.vad_threshold
        kw["neg_threshold"] = min(cfg.neg_threshold, max(0.01, args.vad_threshold - 0.15))
    if args.max_utterance is not None:
        kw["max_utterance_s"] = args.max_utterance
    try:
        return replace(cfg, **kw)
    except ValueError as e:
        raise UsageError(str(e)) from None


class VoiceTurns:
    """The CLI's conversation: pushes go through a Conversation; its events print as they happen (questions and
    answers to stdout, utterance times to stderr) and spoken replies go to one wav per turn."""

    def __init__(self, session, args, prog: str, speech_options=None, audio_out: str | None = None):
        from ..conversation import Conversation
        from ..vad import UtteranceDetector

        self.prog = prog
        self.out = Path(audio_out) if audio_out else None
        self._writer = None
        self.files: dict[int, dict] = {}
        self._kw = {k: v for k, v in (("max_tokens", args.max_tokens), ("temp", args.temp), ("top_p", args.top_p),
                                      ("seed", getattr(args, "seed", None))) if v is not None}
        speak = speech_options is not None
        self.conv = Conversation(session, detector=UtteranceDetector(vad_config(args), candidates=True), speak=speak,
                                 speech=speech_options, barge_in=not args.no_barge_in, threaded=False,
                                 echo_reference=False,  # a file's soundtrack never holds the reply
                                 on_event=self._show, **self._kw)

    def push(self, frame, audio, t) -> None:
        self.conv.push(frame=frame, audio=audio, t=t)

    def ask(self, t: float, question: str) -> None:
        print(f"\n[{t:g}s] Q: {question}", flush=True)
        self.conv.ask(question)

    def finish(self) -> None:
        self.conv.flush()
        self.conv.close()
        self._close_wav()

    def turns_json(self) -> list[dict]:
        out = self.conv.to_json()
        for turn in out:
            if turn["index"] in self.files:
                turn["speech"] = self.files[turn["index"]]
        return out

    # --- events -----------------------------------------------------------------------------------------------
    def _show(self, ev) -> None:
        if ev.kind == "speech_started":
            print(f"[{ev.t:.2f}s] (speech started at {ev.data['speech_start']:.2f}s)", file=sys.stderr, flush=True)
        elif ev.kind == "speech_ended":
            print(f"\n[{ev.t:.2f}s] Q: (spoken, {ev.data['speech_start']:.2f}-{ev.data['speech_end']:.2f}s)",
                  flush=True)
        elif ev.kind == "reply_started":
            print("A: ", end="", flush=True)
        elif ev.kind == "reply_text":
            print(ev.text, end="", flush=True)
        elif ev.kind == "reply_audio":
            self._write(ev)
        elif ev.kind in ("reply_done", "reply_interrupted"):
            print(flush=True)
            self._close_wav()
            if ev.kind == "reply_interrupted":
                print(f"[{ev.t:.2f}s] (interrupted: {ev.data['voiced_tokens']} of {ev.data['tokens']} tokens "
                      f"voiced)", file=sys.stderr, flush=True)
        elif ev.kind == "turn_error":
            print(f"\n{self.prog}: turn {ev.turn}: {ev.data['error']}", file=sys.stderr, flush=True)

    def _write(self, ev) -> None:
        if self.out is None or ev.audio is None:
            return
        from ..speech import WavWriter

        if ev.audio.pcm.size == 0:
            return
        if self._writer is None:
            self.out.mkdir(parents=True, exist_ok=True)
            path = self.out / f"turn_{ev.turn:02d}.wav"
            self._writer = (ev.turn, path, WavWriter(path, ev.audio.sample_rate))
        self._writer[2].write(ev.audio)

    def _close_wav(self) -> None:
        if self._writer is None:
            return
        turn, path, writer = self._writer
        writer.close()
        self._writer = None
        self.files[turn] = {"wav": str(path), "seconds": round(writer.seconds, 3)}
        print(f"{self.prog}: spoken answer {path} ({writer.seconds:.2f} s)", file=sys.stderr, flush=True)
