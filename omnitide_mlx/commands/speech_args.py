"""``--speak``, ``--speaker`` and ``--audio-out`` for ``omnitide stream`` and ``omnitide generate``: spoken answers
written as one wav per answer (and played when ``--play`` and sounddevice are there)."""

from __future__ import annotations

import sys
from pathlib import Path

from .options import UsageError, check_output_dir, non_negative_float, positive_float, positive_int, probability

# --speech-* flag -> SpeechOptions.with_sampling keyword
SPEECH_SAMPLING_FLAGS = (("--speech-temp", "speech_temp", "temperature"), ("--speech-top-k", "speech_top_k", "top_k"),
                         ("--speech-top-p", "speech_top_p", "top_p"),
                         ("--speech-repetition-penalty", "speech_repetition_penalty", "repetition_penalty"))


def add_speech_arguments(p) -> None:
    p.add_argument("--speak", action="store_true",
                   help="also answer in speech (Qwen2.5-Omni with talker weights; MiniCPM-o 4.5 with its TTS and "
                        "assets/token2wav): one wav per answer")
    p.add_argument("--speaker", default=None, metavar="NAME",
                   help="the voice: Qwen2.5-Omni, a name in spk_dict.pt (Chelsie or Ethan in the released models); "
                        "MiniCPM-o, a voice in assets/token2wav (default: voice.safetensors) or a voice file's path")
    p.add_argument("--audio-out", default=None, metavar="DIR",
                   help="folder for the spoken answers' wav files (default: ./answers)")
    p.add_argument("--play", action="store_true", help="also play the spoken answers (needs sounddevice)")
    g = p.add_argument_group("speech sampling (separate from the text's --temp / --top-p / --top-k; unset: the "
                             "model's official defaults, Qwen2.5-Omni talker 0.9 / 40 / 0.8 / 1.05, MiniCPM-o TTS "
                             "0.8 / 25 / 0.85 / 1.05; --seed seeds the speech too)")
    g.add_argument("--speech-temp", type=non_negative_float, default=None, metavar="T",
                   help="temperature of the talker / TTS; 0 takes the arg-max (a greedy talker: the same audio "
                        "tokens every run)")
    g.add_argument("--speech-top-k", type=positive_int, default=None, metavar="K", help="top-k of the talker / TTS")
    g.add_argument("--speech-top-p", type=probability, default=None, metavar="P", help="top-p of the talker / TTS")
    g.add_argument("--speech-repetition-penalty", type=positive_float, default=None, metavar="R",
                   help="repetition penalty of the talker / TTS")


def check_speech_args(args) -> None:
    if not getattr(args, "speak", False):
        flags = [("--speaker", args.speaker), ("--audio-out", args.audio_out), ("--play", args.play)]
        flags += [(flag, getattr(args, dest, None)) for flag, dest, _ in SPEECH_SAMPLING_FLAGS]
        for flag, value in flags:
            if value is not None and value is not False:
                raise UsageError(f"{flag} needs --speak")
        return
    if getattr(args, "speech_top_p", None) == 0:
        raise UsageError("--speech-top-p must be in (0, 1]")
    if getattr(args, "backend", "mlx") == "torch":
        raise UsageError("--speak runs on the MLX backend only")
    out = check_output_dir("answers" if args.audio_out is None else args.audio_out, "--audio-out")
    args.audio_out = str(out)


class SpokenAnswers:
    """The CLI's side of spoken answers: checks the voice once the model is loaded, then turns each answer into
    text pieces (printed by the command) and a wav file."""

    def __init__(self, session, args, prog: str):
        self.session, self.prog = session, prog
        self.enabled = False
        self.count = 0
        self.files: list[dict] = []
        if not args.speak:
            return  # before importing the speech module: it needs MLX, which the torch path never imports
        from ..speech import SpeechOptions, SpeechUnavailable, speech_for

        try:
            speech = speech_for(session)
        except SpeechUnavailable as e:
            print(f"{prog}: --speak: {e}", file=sys.stderr)
            return
        speech.voice(args.speaker)  # ValueError naming the voices there are
        self.options = SpeechOptions(speaker=args.speaker).with_sampling(
            **{key: getattr(args, dest, None) for _, dest, key in SPEECH_SAMPLING_FLAGS})
        self.out = Path(args.audio_out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.play = args.play
        self.enabled = True

    def ask(self, question: str, label: str = "", **kwargs):
        """Text pieces of the answer; with speech on, its audio goes to ``answer_NN[_label].wav`` meanwhile."""
        if not self.enabled:
            yield from self.session.ask(question, **kwargs)
            return
        from ..speech import AudioChunk, Player, WavWriter

        self.count += 1
        path = self.out / f"answer_{self.count:02d}{('_' + label) if label else ''}.wav"
        writer = player = None
        note = ""
        try:
            for item in self.session.ask(question, speak=True, speech=self.options, **kwargs):
                if isinstance(item, AudioChunk):
                    if writer is None:
                        writer = WavWriter(path, item.sample_rate)
                        player = Player.open(item.sample_rate) if self.play else None
                    writer.write(item)
                    if player is not None:
                        player.play(item)
                    note = item.note or note
                else:
                    yield item
        finally:
            if player is not None:
                player.close()
            if writer is not None:
                writer.close()
        if writer is None or writer.samples == 0:
            if writer is not None:
                path.unlink(missing_ok=True)
            print(f"{self.prog}: {note or 'no speech for this answer'}", file=sys.stderr)
            self.files.append({"question": question, "wav": None, "note": note})
        else:
            print(f"{self.prog}: spoken answer {path} ({writer.seconds:.2f} s, {writer.sample_rate} Hz)",
                  file=sys.stderr)
            self.files.append({"question": question, "wav": str(path), "seconds": round(writer.seconds, 3)})
