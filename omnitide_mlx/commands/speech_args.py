"""``--speak``, ``--speaker`` and ``--audio-out`` for ``omnitide stream`` and ``omnitide generate``: spoken answers
written as one wav per answer (and played when ``--play`` and sounddevice are there)."""

from __future__ import annotations

import sys
from pathlib import Path

from .options import UsageError, check_output_dir


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


def check_speech_args(args) -> None:
    if not getattr(args, "speak", False):
        for flag, value in (("--speaker", args.speaker), ("--audio-out", args.audio_out), ("--play", args.play)):
            if value not in (None, False):
                raise UsageError(f"{flag} needs --speak")
        return
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
        self.options = SpeechOptions(speaker=args.speaker)
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
