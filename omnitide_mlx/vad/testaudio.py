"""Test audio with known speech: espeak-ng questions at given times over silence, noise or music (16 kHz).

``spoken_clip([(1.0, "What colour is the sky?"), (6.0, "How many legs has a spider?")], duration_s=10,
background="pink", snr_db=10)`` returns the mixed signal with the true speech spans (where each question's voice
starts and stops) and a 10 ms frame labelling; the VAD benchmark (``omnitide bench vad``) and the spoken-turn tests
build their clips with it. From the shell::

    python -m omnitide_mlx.vad.testaudio clip.wav --question "1.0:What colour is the sky?" \\
        --question "6:How many legs has a spider?" --duration 10 --background pink --snr 10

writes ``clip.wav`` (16 kHz mono PCM) and prints the spans as JSON. Needs Debian's ``espeak-ng``
(``scripts/setup.sh --dev`` installs it). Backgrounds are generated here from a seed: ``silence``, ``white``,
``pink`` (1/f), ``babble`` (several espeak-ng voices reading unrelated text, overlapped), ``music`` (chords and a
melody of decaying harmonic tones).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

from omnitide_mlx.vad.resample import Resampler

SR = 16000
FRAME = 160  # 10 ms label frames
BACKGROUNDS = ("silence", "white", "pink", "babble", "music")
_BABBLE_TEXT = [
    "the committee will meet again on thursday to discuss the budget for next year",
    "she bought three apples, a loaf of bread and some cheese at the market",
    "trains to the airport leave every twenty minutes from platform four",
    "the weather tomorrow will be cloudy with a chance of rain in the afternoon",
    "please remember to switch off the lights when you leave the building",
    "our football team won the match by two goals to one last saturday",
]


def _espeak() -> str:
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise FileNotFoundError("espeak-ng is not installed: apt-get install espeak-ng (Debian; scripts/setup.sh "
                                "--dev does it), brew install espeak-ng (macOS)")
    return exe


def speak(text: str, *, voice: str = "en-us", wpm: int = 150, pitch: int = 50) -> np.ndarray:
    """``text`` spoken by espeak-ng, 16 kHz float32, peak-normalised to 0.5, leading / trailing silence trimmed."""
    if not text.strip():
        raise ValueError("nothing to speak: empty text")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "s.wav"
        subprocess.run([_espeak(), "-v", voice, "-s", str(int(wpm)), "-p", str(int(pitch)), "-w", str(out), text],
                       check=True, capture_output=True, timeout=60)
        audio, rate = sf.read(out, dtype="float32")
    if audio.ndim == 2:
        audio = audio.mean(axis=1)
    r = Resampler(rate)
    audio = np.concatenate([r.push(audio), r.drain()])
    loud = np.flatnonzero(np.abs(audio) > 1e-3)
    if loud.size == 0:
        raise RuntimeError(f"espeak-ng produced silence for {text!r} (voice {voice!r})")
    audio = audio[loud[0]:loud[-1] + 1]
    return (0.5 * audio / np.abs(audio).max()).astype(np.float32)


def speech_labels(clean: np.ndarray, *, floor_db: float = -40.0, bridge_s: float = 0.1) -> np.ndarray:
    """10 ms frames where ``clean`` (speech alone) is voiced: frame energy within ``floor_db`` of its loudest
    frame, gaps shorter than ``bridge_s`` (stop closures, the breaks between words) filled."""
    n = clean.size // FRAME
    energy = (clean[:n * FRAME].reshape(n, FRAME).astype(np.float64) ** 2).mean(axis=1)
    if n == 0 or energy.max() == 0:
        return np.zeros(n, bool)
    voiced = energy > energy.max() * 10 ** (floor_db / 10)
    idx = np.flatnonzero(voiced)
    bridge = int(round(bridge_s * SR / FRAME))
    for a, b in zip(idx[:-1], idx[1:]):
        if 1 < b - a <= bridge + 1:
            voiced[a:b] = True
    return voiced


def background(kind: str, seconds: float, *, seed: int = 0) -> np.ndarray:
    """A generated background at RMS 0.1 (silence: zeros)."""
    n = int(round(seconds * SR))
    rng = np.random.default_rng(seed)
    if kind == "silence":
        return np.zeros(n, np.float32)
    if kind == "white":
        x = rng.standard_normal(n)
    elif kind == "pink":  # 1/f power: white noise shaped in the frequency domain
        spec = np.fft.rfft(rng.standard_normal(n))
        f = np.fft.rfftfreq(n, 1 / SR)
        spec[1:] /= np.sqrt(f[1:])
        spec[0] = 0
        x = np.fft.irfft(spec, n)
    elif kind == "babble":
        x = np.zeros(n)
        voices = ["en-us", "en-gb", "en-us+f3", "en-gb+m3", "en-us+f2", "en-us+m7"]
        for i in range(6):
            pos = int(rng.integers(0, SR))
            while pos < n:
                s = speak(_BABBLE_TEXT[int(rng.integers(len(_BABBLE_TEXT)))], voice=voices[i],
                          wpm=int(rng.integers(140, 190)))
                m = min(s.size, n - pos)
                x[pos:pos + m] += s[:m]
                pos += s.size + int(rng.integers(0, SR // 4))
    elif kind == "music":
        x = _music(n, rng)
    else:
        raise ValueError(f"unknown background {kind!r}; one of {', '.join(BACKGROUNDS)}")
    x = x - x.mean()
    return (0.1 * x / max(np.sqrt((x ** 2).mean()), 1e-12)).astype(np.float32)


def _tone(freq: float, n: int, decay_s: float) -> np.ndarray:
    t = np.arange(n) / SR
    wave = sum(np.sin(2 * np.pi * freq * k * t) / k ** 1.5 for k in range(1, 7) if freq * k < SR / 2)
    return wave * np.exp(-t / decay_s) * np.minimum(1, t / 0.01)


def _music(n: int, rng: np.random.Generator) -> np.ndarray:
    """Piano-like chords (I-V-vi-IV in a random key) every 0.5 s and a melody on the scale over them."""
    x = np.zeros(n)
    root = 48 + int(rng.integers(0, 12))  # MIDI note
    progression = [(0, 4, 7), (7, 11, 14), (9, 12, 16), (5, 9, 12)]
    scale = [0, 2, 4, 5, 7, 9, 11, 12, 14, 16]
    beat = SR // 2
    for i, pos in enumerate(range(0, n, beat)):
        m = min(n - pos, 2 * beat)
        for step in progression[(i // 2) % 4]:
            x[pos:pos + m] += 0.5 * _tone(440 * 2 ** ((root + step - 69) / 12), m, 0.6)
        for j in range(2):  # two melody notes per beat, an octave up
            p = pos + j * beat // 2
            if p < n:
                note = root + 12 + scale[int(rng.integers(len(scale)))]
                k = min(n - p, beat)
                x[p:p + k] += 0.7 * _tone(440 * 2 ** ((note - 69) / 12), k, 0.25)
    return x


@dataclass
class Clip:
    audio: np.ndarray  # 16 kHz float32
    spans: list[tuple[float, float]]  # each question's voiced start / end, seconds
    labels: np.ndarray  # 10 ms frames with speech (bool)
    texts: list[str]


def spoken_clip(questions: list[tuple[float, str]], *, duration_s: float | None = None,
                background_kind: str = "silence", snr_db: float | None = None, seed: int = 0,
                voice: str = "en-us", wpm: int = 150, speech: list[np.ndarray] | None = None) -> Clip:
    """Questions spoken at the given times (seconds) over a background. ``snr_db`` sets the speech-to-background
    power ratio, speech power measured over its voiced frames (default: background at RMS 0.1 as generated;
    ignored for silence). ``speech`` gives the questions' audio instead of speaking them (16 kHz)."""
    if background_kind not in BACKGROUNDS:
        raise ValueError(f"unknown background {background_kind!r}; one of {', '.join(BACKGROUNDS)}")
    voiced = speech if speech is not None else [speak(text, voice=voice, wpm=wpm) for _, text in questions]
    ends = [t + s.size / SR for (t, _), s in zip(questions, voiced)]
    if any(t < 0 for t, _ in questions) or any(b[0] < a for a, b in zip(ends, questions[1:])):
        raise ValueError("questions must start at >= 0 s, in order, each after the previous one has ended")
    total = duration_s if duration_s is not None else (max(ends) + 1.0 if ends else 1.0)
    n = int(round(total * SR))
    if ends and max(ends) * SR > n:
        raise ValueError(f"the last question ends at {max(ends):.2f} s, after the clip's {total} s")
    clean = np.zeros(n, np.float32)
    for (t, _), s in zip(questions, voiced):
        i = int(round(t * SR))
        clean[i:i + s.size] += s
    labels = speech_labels(clean)
    bg = background(background_kind, total, seed=seed)
    if snr_db is not None and background_kind != "silence" and labels.any():
        speech_power = (clean[:labels.size * FRAME].reshape(-1, FRAME)[labels] ** 2).mean()
        bg *= np.sqrt(speech_power / 10 ** (snr_db / 10) / (bg ** 2).mean())
    audio = clean + bg
    peak = np.abs(audio).max()
    if peak > 0.99:  # never clip: scale the mix (labels and SNR unchanged)
        audio *= 0.99 / peak
    spans = []
    for (t, _), s in zip(questions, voiced):
        a, b = int(round(t * SR)) // FRAME, (int(round(t * SR)) + s.size) // FRAME
        on = np.flatnonzero(labels[a:b + 1])
        spans.append(((a + on[0]) * FRAME / SR, (a + on[-1] + 1) * FRAME / SR) if on.size else (t, t))
    return Clip(audio.astype(np.float32), spans, labels, [q for _, q in questions])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m omnitide_mlx.vad.testaudio", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="the wav to write (16 kHz mono, 16-bit PCM)")
    p.add_argument("--question", action="append", default=[], metavar="T:TEXT",
                   help="a question TEXT spoken from T seconds (repeatable)")
    p.add_argument("--duration", type=float, default=None, help="clip length in seconds (default: last + 1 s)")
    p.add_argument("--background", choices=BACKGROUNDS, default="silence")
    p.add_argument("--snr", type=float, default=None, help="speech-to-background ratio in dB")
    p.add_argument("--voice", default="en-us", help="espeak-ng voice (en-us, en-gb, de, ...)")
    p.add_argument("--wpm", type=int, default=150, help="speaking rate, words per minute")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    questions = []
    for q in args.question:
        t, sep, text = q.partition(":")
        try:
            questions.append((float(t), text))
        except ValueError:
            sep = ""
        if not sep or not text.strip():
            p.error(f"--question takes T:TEXT (seconds, then the words), got {q!r}")
    try:
        clip = spoken_clip(questions, duration_s=args.duration, background_kind=args.background, snr_db=args.snr,
                           seed=args.seed, voice=args.voice, wpm=args.wpm)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sf.write(args.out, clip.audio, SR, subtype="PCM_16")
    print(json.dumps({"path": args.out, "sample_rate": SR, "seconds": clip.audio.size / SR,
                      "questions": [{"text": t, "start": round(a, 3), "end": round(b, 3)}
                                    for t, (a, b) in zip(clip.texts, clip.spans)]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
