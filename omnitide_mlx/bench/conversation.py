"""``omnitide bench conversation``: end of user speech to first reply audio, broken down, for spoken turns.

A soundtrack of spoken questions (espeak-ng, or the bundled ``assets/media/spoken_questions_10s.flac`` without it)
streams through a :class:`~omnitide_mlx.conversation.Conversation` on speech-capable tiny checkpoints of both models
(Qwen2.5-Omni with its talker, MiniCPM-o 4.5 with its TTS), built in the released layout, and every turn's
latency is taken apart:

- **VAD hangover**: stream seconds from the end of speech to the detector's decision (``--hangover``: a setting);
- **queueing**: the decision to the reply's start (a thread hand-off in threaded mode, none inline);
- **last unit**: the prefill of the utterance's last part second (``session.flush``);
- **first text**: the question's prefill and the first reply token(s) that make text;
- **first audio**: the speech models' first codes and the first waveform chunk, after the first text;
- **overhead**: wall time to the first audio outside model steps (events, hand-offs, copies): the goal is < 50 ms.

The detector's own cost (Silero in MLX) is timed per second of audio. Beside the measured tiny models, a roofline
prediction for the released 3B / 7B on Apple GPUs (``kernels/cost.MACHINES``) gives the first audio from the same
steps: memory-bound decode (weights read once per token), compute-bound prefill (``MMA_EFF`` of peak).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

HELP = "spoken turns: end of speech to first reply audio, broken down (VAD, prefill, text, audio, overhead)"
DESCRIPTION = __doc__ + """
example:
  omnitide bench conversation --turns 3 --json docs/img/conversation.json --plot docs/img/conversation.png
"""

SR = 16000
QUESTIONS = ("What colour is the background?", "Which word is written on the screen?",
             "How many people can you see?", "What did the speaker just say?", "Is the light on or off?")

# Released sizes for the roofline (parameters; the language models' and the speech stacks' weights read per step).
# Sources: the Qwen2.5-Omni 3B / 7B config.json (docs/models/qwen2_5_omni.md), the talker's published shape
# (bench/speech.py: 24 layers, 896 wide, MLP 18944), token2wav's DiT (22 x 1024) and BigVGAN.
RELEASED = {
    "qwen2.5-omni-3b": {"thinker": 3.09e9, "talker": 1.35e9, "dit": 0.19e9, "unit_tokens": 146,
                        "codes_first_chunk": 24, "dit_evals": 20, "dit_frames": 72},
    "qwen2.5-omni-7b": {"thinker": 7.6e9, "talker": 1.35e9, "dit": 0.19e9, "unit_tokens": 146,
                        "codes_first_chunk": 24, "dit_evals": 20, "dit_frames": 72},
}


def add_arguments(p) -> None:
    p.add_argument("--families", default="qwen2_5_omni,minicpmo",
                   help="model families (registry names) whose speaking tiny checkpoints run (comma-separated)")
    p.add_argument("--turns", type=int, default=3, help="spoken questions per model")
    p.add_argument("--hangover", type=float, default=0.5,
                   help="seconds of silence that end an utterance (the detector's default)")
    p.add_argument("--max-tokens", type=int, default=24, help="reply tokens")
    p.add_argument("--threaded", action="store_true", help="replies on the worker thread (as apps run them)")
    p.add_argument("--json", dest="json_path", default=None, help="write the result as JSON")
    p.add_argument("--plot", default=None, help="write a stacked bar chart (PNG)")
    p.add_argument("--markdown", action="store_true", help="print a markdown table")


def soundtrack(turns: int, workdir: Path) -> tuple[np.ndarray, list[float]]:
    """Spoken questions 3 s apart over quiet noise (espeak-ng), or the bundled two-question clip."""
    import soundfile as sf

    espeak = shutil.which("espeak-ng")
    if espeak is None:
        path = Path(__file__).resolve().parents[2] / "assets/media/spoken_questions_10s.flac"
        audio, rate = sf.read(path, dtype="float32")
        return audio, [0.8, 5.2]
    import subprocess

    rng = np.random.default_rng(0)
    pieces, starts, t = [], [], 0.7
    for i in range(turns):
        wav = workdir / f"q{i}.wav"
        subprocess.run([espeak, "-v", "en-us", "-s", "160", "-w", str(wav), QUESTIONS[i % len(QUESTIONS)]], check=True)
        a, r = sf.read(wav, dtype="float32")
        a = np.interp(np.arange(int(a.size * SR / r)) * r / SR, np.arange(a.size), a).astype(np.float32)
        pieces.append((t, a))
        starts.append(t)
        t += a.size / SR + 3.0
    out = (rng.standard_normal(int((t + 1.0) * SR)) * 1e-3).astype(np.float32)
    for at, a in pieces:
        i = int(at * SR)
        out[i:i + a.size] += a
    return out, starts


def _checkpoint(family: str, root: Path) -> Path:
    """A speaking tiny checkpoint of ``family`` (a registry name), written by its record."""
    from ..models.family import families

    record = families().get(family)
    if record is None or record.voicer is None or record.write_tiny is None:
        speaking = [n for n, f in families().items() if f.voicer is not None and f.write_tiny is not None]
        raise ValueError(f"no speaking tiny checkpoint for {family!r}; families that speak: {', '.join(speaking)}")
    return record.write_tiny(root / family, speech=True)


def run_family(family: str, audio: np.ndarray, args, root: Path) -> dict:
    from ..conversation import Conversation
    from ..session import OmniSession
    from ..vad import UtteranceDetector, VADConfig

    session = OmniSession(str(_checkpoint(family, root)), policy="omnitide")
    detector = UtteranceDetector(VADConfig(hangover_s=args.hangover), candidates=True)
    conv = Conversation(session, detector=detector, speak=True, threaded=args.threaded,
                        max_tokens=args.max_tokens, seed=0)
    rng = np.random.default_rng(0)
    step = SR // 4  # the page's cadence: audio every 250 ms, a frame every second
    for i in range(0, audio.size, step):
        frame = rng.integers(0, 255, (56, 56, 3), dtype=np.uint8) if i % SR == 0 else None
        conv.push(frame=frame, audio=audio[i:i + step])
        if args.threaded:
            conv.wait()
    conv.flush()
    conv.close()
    turns = []
    for t in conv.turns:
        if t.source != "voice" or t.reply_start is None:
            continue
        lat = dict(t.latency_ms)
        lat["vad_hangover_ms"] = round((t.decided_at - t.speech_end) * 1000, 2)
        turns.append({"speech_start": t.speech_start, "speech_end": t.speech_end, "tokens": t.tokens,
                      "audio_seconds": round(t.audio_seconds, 3), **lat})
    barge = barge_in(session, audio, args)
    # the detector's own cost per second of audio, on this soundtrack
    fresh = UtteranceDetector(VADConfig(hangover_s=args.hangover))
    t0 = time.perf_counter()
    for i in range(0, audio.size, step):
        fresh.feed(audio[i:i + step], SR)
    vad_ms_per_s = (time.perf_counter() - t0) * 1000 / (audio.size / SR)
    return {"family": family, "turns": turns, "vad_ms_per_audio_second": round(vad_ms_per_s, 3),
            "median": _medians(turns), "barge_in": barge}


def barge_in(session, audio: np.ndarray, args, repeats: int = 3) -> dict:
    """Speech over a reply being generated (threaded, as apps run it): stream ms from the speech's first sound to
    ``reply_paused`` (the player stops: one detector chunk over the threshold), the detector's confirmed-onset
    delay, and the wall time from that confirmation to the reply's stop (the decode step under way ends it). The
    speech is the soundtrack's first question, pushed in 50 ms pieces."""
    import threading

    from ..conversation import Conversation
    from ..vad import UtteranceDetector, VADConfig

    start = int(0.3 * SR)
    speech = audio[start:start + 2 * SR]
    rows = []
    for _ in range(repeats):
        marks = {}
        seen = threading.Event()

        def on_event(ev, marks=marks, seen=seen):
            now = time.perf_counter()
            if ev.kind == "reply_text":
                seen.set()
            elif ev.kind == "reply_paused" and "pause_ms" not in marks:
                marks["pause_ms"] = (ev.t - ev.data["onset"]) * 1000
            elif ev.kind == "speech_started" and "started" not in marks:
                marks["started"], marks["onset_ms"] = now, (ev.t - ev.data["speech_start"]) * 1000
            elif ev.kind == "reply_interrupted":
                marks["stopped"] = now

        conv = Conversation(session, detector=UtteranceDetector(VADConfig(hangover_s=args.hangover), candidates=True),
                            threaded=True, on_event=on_event, max_tokens=100_000, stop=["\x00never"])
        conv.ask("Tell me everything.")
        seen.wait(120)
        for i in range(0, speech.size, 800):
            conv.push(audio=speech[i:i + 800])
            if "stopped" in marks:
                break
        deadline = time.monotonic() + 60
        while "stopped" not in marks and time.monotonic() < deadline:
            time.sleep(0.001)
        conv.close()
        if "stopped" in marks and "started" in marks:
            rows.append({"onset_ms": round(marks["onset_ms"], 2),
                         "stop_ms": round((marks["stopped"] - marks["started"]) * 1000, 2),
                         "pause_ms": round(marks.get("pause_ms", float("nan")), 2)})
    med = (lambda k: round(statistics.median(r[k] for r in rows), 2) if rows else None)  # noqa: E731
    return {"runs": rows, "onset_ms": med("onset_ms"), "stop_ms": med("stop_ms"), "pause_ms": med("pause_ms"),
            "total_ms": round(med("onset_ms") + med("stop_ms"), 2) if rows else None}


def _medians(turns: list[dict]) -> dict:
    keys = ("vad_hangover_ms", "queue_ms", "last_unit_ms", "first_text_ms", "first_audio_ms", "overhead_ms")
    out = {}
    for k in keys:
        vals = [t[k] for t in turns if t.get(k) is not None]
        out[k] = round(statistics.median(vals), 2) if vals else None
    return out


def mac_prediction(hangover_s: float, bits: int = 4) -> list[dict]:
    """First audio after the end of speech on Apple GPUs for the released shapes, from a roofline: every decode
    step reads the weights once (bandwidth-bound), the unit prefill and the DiT are compute-bound at ``MMA_EFF``
    of peak; the thinker and talker run in lockstep for the first chunk's codes. Weights at ``bits`` (4-bit
    thinker / talker as ``omnitide convert`` writes them; token2wav in float16)."""
    from ..kernels.cost import MACHINES, MMA_EFF

    rows = []
    for shape, r in RELEASED.items():
        for key in ("m2-max-38", "m4-max-40", "m2-10"):
            m = MACHINES[key]
            bw = m.bandwidth_gbs * 1e9
            flops = m.peak_flops * MMA_EFF
            wbytes = bits / 8
            prefill = max(2 * r["thinker"] * r["unit_tokens"] / flops, r["thinker"] * wbytes / bw)
            question = max(2 * r["thinker"] * 8 / flops, r["thinker"] * wbytes / bw)
            lockstep = r["codes_first_chunk"] * (r["thinker"] + r["talker"]) * wbytes / bw
            dit = r["dit_evals"] * max(2 * r["dit"] * r["dit_frames"] / flops, r["dit"] * 2 / bw)
            first_audio = prefill + question + lockstep + dit
            rows.append({"shape": shape, "machine": m.name, "bits": bits,
                         "last_unit_ms": round(prefill * 1000, 1), "question_ms": round(question * 1000, 1),
                         "codes_ms": round(lockstep * 1000, 1), "token2wav_ms": round(dit * 1000, 1),
                         "first_audio_ms": round(first_audio * 1000, 1),
                         "with_hangover_ms": round((first_audio + hangover_s) * 1000, 1)})
    return rows


def markdown(result: dict) -> str:
    lines = ["| model | turns | VAD hangover ms | queue ms | last unit ms | first text ms | first audio ms | "
             "overhead ms | VAD ms / audio s | barge-in: audio paused ms | barge-in: onset + stop ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for f in result["families"]:
        m, b = f["median"], f.get("barge_in", {})
        lines.append(f"| tiny {f['family']} | {len(f['turns'])} | {m['vad_hangover_ms']} | {m['queue_ms']} | "
                     f"{m['last_unit_ms']} | {m['first_text_ms']} | {m['first_audio_ms']} | {m['overhead_ms']} | "
                     f"{f['vad_ms_per_audio_second']} | {b.get('pause_ms')} | {b.get('onset_ms')} + {b.get('stop_ms')} = "
                     f"{b.get('total_ms')} |")
    lines += ["", "| shape | machine | last unit ms | question ms | first chunk's codes ms | token2wav ms | "
                  "first audio ms | + hangover ms |", "|---|---|---|---|---|---|---|---|"]
    for r in result["mac_prediction"]:
        lines.append(f"| {r['shape']} ({r['bits']}-bit) | {r['machine']} | {r['last_unit_ms']} | {r['question_ms']} | "
                     f"{r['codes_ms']} | {r['token2wav_ms']} | {r['first_audio_ms']} | {r['with_hangover_ms']} |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [("vad_hangover_ms", "VAD hangover"), ("queue_ms", "queueing"), ("last_unit_ms", "last unit"),
             ("text_ms", "first text"), ("audio_ms", "first audio")]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = []
    for i, f in enumerate(result["families"]):
        m = dict(f["median"])
        m["text_ms"] = (m["first_text_ms"] or 0) - (m["queue_ms"] or 0) - (m["last_unit_ms"] or 0)
        m["audio_ms"] = (m["first_audio_ms"] or 0) - (m["first_text_ms"] or 0)
        left = 0.0
        for j, (k, label) in enumerate(parts):
            v = max(0.0, m.get(k) or 0.0)
            ax.barh(i, v, left=left, color=f"C{j}", label=label if i == 0 else None)
            left += v
        names.append(f"tiny {f['family']}")
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel("ms from the end of speech to the first reply audio (median over turns, this CPU)")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> int:
    from .common import load_average, versions
    from .report import write_outputs

    if args.turns < 1:
        raise SystemExit("omnitide bench conversation: --turns must be at least 1")
    result = {"benchmark": "conversation", "config": {"turns": args.turns, "hangover": args.hangover,
                                                      "max_tokens": args.max_tokens, "threaded": args.threaded},
              "versions": versions(), "load_average_before": load_average(), "families": []}
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        audio, starts = soundtrack(args.turns, root)
        result["questions_at"] = starts
        for family in [f.strip() for f in args.families.split(",") if f.strip()]:
            print(f"{family} ...", flush=True)
            result["families"].append(run_family(family, audio, args, root))
            print(result["families"][-1]["median"], flush=True)
    result["mac_prediction"] = mac_prediction(args.hangover)
    write_outputs(result, args, markdown=markdown, plot=plot)
    if not args.json_path and not args.markdown:
        print(markdown(result))
    return 0
