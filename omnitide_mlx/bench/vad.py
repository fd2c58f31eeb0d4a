"""``omnitide bench vad``: voice-activity detectors compared on generated audio with known speech.

Detectors (each skipped, and said so in the JSON, when its package is missing):

- ``silero``: the MLX port of Silero VAD 16 kHz with the ``silero-vad`` wheel's safetensors (``vad/silero.py``),
  probability >= 0.5 per 32 ms chunk;
- ``silero-jit-ckpt``: the same port with the weights of the wheel's TorchScript model (a newer checkpoint than its
  safetensors; needs torch to read them), to show what the checkpoint changes;
- ``webrtc-N``: ``webrtcvad-wheels`` (the WebRTC GMM detector) at aggressiveness N, 30 ms frames, speech or not;
- ``micro``: ``pymicro-vad`` (a small self-contained model), probability >= 0.5 per 10 ms frame (its first frames,
  which return -1 while it fills its window, count as non-speech).

Audio (``vad/testaudio.py``): questions spoken by espeak-ng in several voices and rates, 3 per clip, over silence,
white, pink and babble noise and generated music at SNRs of 20, 10, 5 and 0 dB; plus the backgrounds alone (no
speech). Labels: 10 ms frames where the clean speech is within 40 dB of its loudest frame, gaps under 100 ms filled.

Measured:

- frame level, per condition: accuracy, precision, recall, F1 of each detector's frame decisions on the 10 ms grid
  (a backgrounds-only condition has no speech: its false-positive rate is the figure);
- utterances: every detector's frames through the same ``UtteranceRules`` (``VADConfig`` defaults: 0.1 s of speech
  to start, 0.5 s of silence to end), matched to the questions: onset delay (start decision - voiced start),
  end delay (end decision - voiced end), missed questions, false starts (starts overlapping no question), pooled
  over clean speech and the noise / music conditions at 20 and 10 dB (babble is other talkers: every detector
  here hears it as speech, so its utterances are reported per condition only);
- cost: CPU seconds per second of audio, one detector after another in turn (medians), streaming as a microphone
  would (one frame per call: Silero one 512-sample chunk, WebRTC 30 ms, micro 10 ms) and, for Silero, a whole
  signal in one call (the batch path), NumPy and MLX routes.
"""

from __future__ import annotations

import statistics
import subprocess
import time
from importlib import metadata

import numpy as np

HELP = "voice activity detection: Silero (MLX port) vs WebRTC vs pymicro-vad, accuracy per SNR, latency, cost"
DESCRIPTION = __doc__ + """
example:
  omnitide bench vad --json docs/img/vad.json --plot docs/img/vad.png --markdown
  omnitide bench vad --clips 1 --snr 10 --backgrounds pink --no-echo   # a quick look

The echo / barge-in simulation (with ``--no-echo`` skipped): see bench/vad_echo.py.
"""

SR = 16000
QUESTIONS = [
    "What colour is the sky today?", "How many legs does a spider have?", "Can you tell me what is on the table?",
    "Where did I leave my keys?", "Is it going to rain this afternoon?", "What is the capital of France?",
    "Please describe the picture in front of you.", "Who wrote this book?", "How far away is the moon?",
]
VOICES = [("en-us", 150), ("en-gb", 165), ("en-us+f3", 140), ("en-gb+m3", 175), ("en-us+f2", 155),
          ("en-us+m7", 145)]


def add_arguments(p) -> None:
    p.add_argument("--clips", type=int, default=3, help="clips per condition, 3 questions each (default 3)")
    p.add_argument("--snr", default="20,10,5,0", help="SNRs in dB, comma-separated")
    p.add_argument("--backgrounds", default="white,pink,babble,music",
                   help="noises / music, comma-separated (silence is always included)")
    p.add_argument("--cost-seconds", type=float, default=20.0, help="audio seconds each cost timing runs over")
    p.add_argument("--reps", type=int, default=5, help="repetitions of each cost timing (median)")
    p.add_argument("--no-echo", action="store_true", help="skip the echo / barge-in simulation (bench/vad_echo.py)")
    p.add_argument("--json", dest="json_path", default=None, help="write the result as JSON")
    p.add_argument("--plot", default=None, help="write the figure (PNG)")
    p.add_argument("--markdown", action="store_true", help="print the tables as markdown")


# --- detectors: audio (16 kHz float32) -> (frame length in samples, per-frame speech probability) ----------------
def _silero(model):
    def frames(audio):
        return 512, model.probs(audio)
    return frames


def _webrtc(mode: int):
    import webrtcvad

    def frames(audio):
        vad = webrtcvad.Vad(mode)
        pcm = _pcm16(audio)
        n = pcm.size // 480
        return 480, np.array([float(vad.is_speech(pcm[i * 480:(i + 1) * 480].tobytes(), SR)) for i in range(n)])
    return frames


def _micro():
    import pymicro_vad

    def frames(audio):
        vad = pymicro_vad.MicroVad()
        pcm = _pcm16(audio)
        n = pcm.size // 160
        return 160, np.array([max(vad.process_10ms(pcm[i * 160:(i + 1) * 160].tobytes()), 0.0) for i in range(n)])
    return frames


def _pcm16(audio: np.ndarray) -> np.ndarray:
    return (np.clip(audio, -1, 1) * 32767).astype(np.int16)


def _jit_weights():
    import torch

    from ..vad.silero import weights_path

    ts = torch.jit.load(str(weights_path().parent / "silero_vad.jit"))
    names = {"stft.forward_basis_buffer": "stft_conv.weight",
             **{f"encoder.{i}.reparam_conv.{p}": f"conv{i + 1}.{p}" for i in range(4) for p in ("weight", "bias")},
             **{f"decoder.rnn.{p}": f"lstm_cell.{p}" for p in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")},
             "decoder.decoder.2.weight": "final_conv.weight", "decoder.decoder.2.bias": "final_conv.bias"}
    return {names[k]: v.numpy() for k, v in ts._model.state_dict().items()}


def detectors() -> tuple[dict, dict]:
    """The detectors available here, and why the others are not."""
    from ..vad.silero import SileroVAD

    found, missing = {"silero": _silero(SileroVAD.load())}, {}
    try:
        found["silero-jit-ckpt"] = _silero(SileroVAD(_jit_weights()))
    except ImportError as e:
        missing["silero-jit-ckpt"] = f"needs torch ({e})"
    try:
        import webrtcvad  # noqa: F401

        for mode in range(4):
            found[f"webrtc-{mode}"] = _webrtc(mode)
    except ImportError:
        missing["webrtc"] = "pip install webrtcvad-wheels"
    try:
        import pymicro_vad  # noqa: F401

        found["micro"] = _micro()
    except ImportError:
        missing["micro"] = "pip install pymicro-vad"
    return found, missing


# --- audio ----------------------------------------------------------------------------------------------------
def conditions(args) -> list[dict]:
    """The test clips: name, background, SNR, clips (with spans and labels)."""
    from ..vad.testaudio import speak, spoken_clip

    snrs = [float(s) for s in str(args.snr).split(",") if s.strip()]
    bgs = [b.strip() for b in str(args.backgrounds).split(",") if b.strip()]
    cache: dict = {}

    def voiced(i: int, j: int) -> np.ndarray:
        k = (3 * i + j) % len(QUESTIONS)
        v, wpm = VOICES[(i + j) % len(VOICES)]
        if (k, v) not in cache:
            cache[(k, v)] = speak(QUESTIONS[k], voice=v, wpm=wpm)
        return cache[(k, v)]

    def clips(bg: str, snr: float | None, speech: bool) -> list:
        out = []
        for i in range(args.clips):
            if speech:
                audio = [voiced(i, j) for j in range(3)]
                t, times = 1.0 + 0.3 * i, []
                for a in audio:
                    times.append(t)
                    t += a.size / SR + 1.5 + 0.5 * ((i + len(times)) % 3)
                out.append(spoken_clip([(t0, "") for t0 in times], duration_s=t + 0.5, background_kind=bg,
                                       snr_db=snr, seed=100 * i + 7, speech=audio))
            else:
                out.append(spoken_clip([], duration_s=15.0, background_kind=bg, seed=100 * i + 11))
        return out

    conds = [{"name": "clean speech", "background": "silence", "snr_db": None, "speech": True,
              "clips": clips("silence", None, True)},
             {"name": "silence", "background": "silence", "snr_db": None, "speech": False,
              "clips": clips("silence", None, False)}]
    for bg in bgs:
        conds.append({"name": f"{bg} only", "background": bg, "snr_db": None, "speech": False,
                      "clips": clips(bg, None, False)})
    for bg in bgs:
        for snr in snrs:
            conds.append({"name": f"speech + {bg} {snr:g} dB", "background": bg, "snr_db": snr, "speech": True,
                          "clips": clips(bg, snr, True)})
    return conds


# --- scoring --------------------------------------------------------------------------------------------------
def on_label_grid(frame: int, probs: np.ndarray, n_labels: int, threshold: float = 0.5) -> np.ndarray:
    """A detector's decisions on the 10 ms label grid: each label frame takes the frame covering its centre."""
    centres = np.arange(n_labels) * 160 + 80
    idx = np.minimum(centres // frame, max(probs.size - 1, 0))
    out = probs[idx] >= threshold if probs.size else np.zeros(n_labels, bool)
    out[centres >= probs.size * frame] = False
    return out


def frame_scores(truth: np.ndarray, pred: np.ndarray) -> dict:
    tp, fp = int((truth & pred).sum()), int((~truth & pred).sum())
    fn, tn = int((truth & ~pred).sum()), int((~truth & ~pred).sum())
    precision = tp / (tp + fp) if tp + fp else None
    recall = tp / (tp + fn) if tp + fn else None
    f1 = 2 * tp / (2 * tp + fp + fn) if tp else (0.0 if fn else None)
    return {"accuracy": round((tp + tn) / max(tp + fp + fn + tn, 1), 4),
            "precision": None if precision is None else round(precision, 4),
            "recall": None if recall is None else round(recall, 4), "f1": None if f1 is None else round(f1, 4),
            "false_positive_rate": round(fp / (fp + tn), 4) if fp + tn else None}


def utterances(frame: int, probs: np.ndarray, config) -> list:
    from ..vad.detector import UtteranceRules

    rules, events = UtteranceRules(config), []
    for i, p in enumerate(probs):
        events += rules.step(float(p), i * frame, (i + 1) * frame)
    return events + rules.close(probs.size * frame)


def match(events: list, spans: list[tuple[float, float]]) -> dict:
    """Onset / end delays of each question's utterance, misses, and starts that overlap no question."""
    pairs, i = [], 0
    while i < len(events):
        start = events[i]
        end = events[i + 1] if i + 1 < len(events) else None
        pairs.append((start, end))
        i += 2
    onset, ends, missed, used = [], [], 0, set()
    for a, b in spans:
        hit = [k for k, (s, e) in enumerate(pairs) if k not in used and s.t_start < b and
               (e is None or e.t_end > a)]
        if not hit:
            missed += 1
            continue
        first, last = hit[0], hit[-1]
        used.update(hit)
        onset.append(pairs[first][0].decided_at - a)
        if pairs[last][1] is not None:
            ends.append(pairs[last][1].decided_at - b)
    false = sum(1 for k in range(len(pairs)) if k not in used)
    return {"onset": onset, "end": ends, "missed": missed, "false_starts": false, "questions": len(spans)}


# --- cost -----------------------------------------------------------------------------------------------------
def cost(args, audio: np.ndarray) -> dict:
    """CPU ms per second of audio, streaming (one frame per call) and, for Silero, batch; detectors in turn."""
    from ..vad.silero import CHUNK, SileroState, SileroVAD

    model = SileroVAD.load()
    seconds = audio.size / SR
    chunks = audio[:audio.size // CHUNK * CHUNK].reshape(-1, CHUNK)

    def silero_stream(numpy: bool):
        def go():
            state = SileroState.zeros()
            for c in chunks:
                _, state = model.run(c[None], state, numpy=numpy)
        return go

    fns = {"silero stream (NumPy route)": silero_stream(True), "silero stream (MLX route)": silero_stream(False),
           "silero batch (NumPy route)": lambda: model.probs(audio, numpy=True),
           "silero batch (MLX route)": lambda: model.probs(audio, numpy=False)}
    try:
        import webrtcvad

        pcm = _pcm16(audio)

        def webrtc():
            vad = webrtcvad.Vad(3)
            for i in range(pcm.size // 480):
                vad.is_speech(pcm[i * 480:(i + 1) * 480].tobytes(), SR)
        fns["webrtc stream"] = webrtc
    except ImportError:
        pass
    try:
        import pymicro_vad

        pcm = _pcm16(audio)

        def micro():
            vad = pymicro_vad.MicroVad()
            for i in range(pcm.size // 160):
                vad.process_10ms(pcm[i * 160:(i + 1) * 160].tobytes())
        fns["micro stream"] = micro
    except ImportError:
        pass
    samples: dict = {k: [] for k in fns}
    for fn in fns.values():  # warm-up
        fn()
    names = list(fns)
    for r in range(args.reps):  # in turn, the order rotating: load changes hit every detector alike
        for name in names[r % len(names):] + names[:r % len(names)]:
            c0, t0 = time.process_time(), time.perf_counter()
            fns[name]()
            samples[name].append(((time.process_time() - c0) * 1000, (time.perf_counter() - t0) * 1000))
    out = {}
    for name, v in samples.items():
        cpu, wall = statistics.median(c for c, _ in v), statistics.median(w for _, w in v)
        out[name] = {"cpu_ms_per_audio_s": round(cpu / seconds, 4), "wall_ms_per_audio_s": round(wall / seconds, 4),
                     "reps": len(v)}
    return {"audio_seconds": round(seconds, 3), "rows": out}


# --- the run --------------------------------------------------------------------------------------------------
def measure(args) -> dict:
    from ..vad.detector import VADConfig
    from .common import load_average, versions

    load0 = load_average()
    found, missing = detectors()
    conds = conditions(args)
    config = VADConfig()
    per_condition, pooled = [], {name: {"onset": [], "end": [], "missed": 0, "false_starts": 0, "questions": 0}
                                 for name in found}
    noise_false = {name: {"starts": 0, "minutes": 0.0} for name in found}
    for cond in conds:
        row = {k: cond[k] for k in ("name", "background", "snr_db", "speech")}
        row["audio_seconds"] = round(sum(c.audio.size for c in cond["clips"]) / SR, 2)
        row["speech_fraction"] = round(float(np.mean(np.concatenate([c.labels for c in cond["clips"]]))), 4)
        row["detectors"] = {}
        for name, fn in found.items():
            truth, pred, events = [], [], []
            m = {"onset": [], "end": [], "missed": 0, "false_starts": 0, "questions": 0}
            for clip in cond["clips"]:
                frame, probs = fn(clip.audio)
                truth.append(clip.labels)
                pred.append(on_label_grid(frame, probs, clip.labels.size))
                got = match(utterances(frame, probs, config), clip.spans)
                for k in m:
                    m[k] += got[k]
            scores = frame_scores(np.concatenate(truth), np.concatenate(pred))
            scores["utterances"] = {
                "missed": m["missed"], "false_starts": m["false_starts"], "questions": m["questions"],
                "onset_delay_median_s": round(statistics.median(m["onset"]), 3) if m["onset"] else None,
                "end_delay_median_s": round(statistics.median(m["end"]), 3) if m["end"] else None}
            row["detectors"][name] = scores
            if not cond["speech"]:
                noise_false[name]["starts"] += m["false_starts"]
                noise_false[name]["minutes"] += row["audio_seconds"] / 60
            elif cond["background"] != "babble" and (cond["snr_db"] is None or cond["snr_db"] >= 10):
                for k in m:
                    pooled[name][k] += m[k]
        per_condition.append(row)
    latency = {}
    for name, m in pooled.items():
        latency[name] = {
            "onset_delay_median_s": round(statistics.median(m["onset"]), 3) if m["onset"] else None,
            "onset_delay_max_s": round(max(m["onset"]), 3) if m["onset"] else None,
            "end_delay_median_s": round(statistics.median(m["end"]), 3) if m["end"] else None,
            "end_delay_max_s": round(max(m["end"]), 3) if m["end"] else None,
            "missed": m["missed"], "false_starts": m["false_starts"], "questions": m["questions"],
            "false_starts_per_min_without_speech": round(noise_false[name]["starts"] / noise_false[name]["minutes"],
                                                         3) if noise_false[name]["minutes"] else None,
        }
    echo = None
    if not args.no_echo:
        from ..vad.silero import SileroVAD
        from .vad_echo import measure_echo

        echo = measure_echo(SileroVAD.load())
    clean = np.concatenate([c.audio for c in conds[0]["clips"]])
    reps = max(1, int(np.ceil(args.cost_seconds * SR / clean.size)))
    cost_audio = np.tile(clean, reps)[:int(args.cost_seconds * SR)]
    return {
        "benchmark": "vad", "config": {k: getattr(args, k) for k in ("clips", "snr", "backgrounds", "cost_seconds",
                                                                    "reps", "no_echo")},
        "vad_config": {"threshold": config.threshold, "neg_threshold": config.off_threshold,
                       "min_speech_s": config.min_speech_s, "hangover_s": config.hangover_s,
                       "speech_pad_s": config.speech_pad_s},
        "detectors": list(found), "missing": missing,
        "conditions": per_condition, "latency": latency, "echo": echo, "cost": cost(args, cost_audio),
        "versions": {**versions(), **_package_versions()}, "load_average": {"before": load0, "after": load_average()},
    }


def _package_versions() -> dict:
    out = {}
    for pkg in ("silero-vad", "webrtcvad-wheels", "pymicro-vad", "torch"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    try:
        r = subprocess.run(["espeak-ng", "--version"], capture_output=True, text=True, timeout=10)
        out["espeak-ng"] = r.stdout.split("NG text-to-speech:")[-1].split()[0] if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, IndexError):
        out["espeak-ng"] = None
    return out


TABLE_DETECTORS = ("silero", "silero-jit-ckpt", "webrtc-1", "webrtc-3", "micro")


def markdown(result: dict) -> str:
    names = [n for n in TABLE_DETECTORS if n in result["detectors"]]
    lines = ["Frame-level F1 (speech conditions) / false-positive rate (no-speech conditions), 10 ms frames:", "",
             "| condition | speech % | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]
    for row in result["conditions"]:
        key = "f1" if row["speech"] else "false_positive_rate"
        cells = []
        for n in names:
            v = row["detectors"][n][key]
            cells.append("-" if v is None else (f"{v:.3f}" if row["speech"] else f"FPR {v:.3f}"))
        lines.append(f"| {row['name']} | {100 * row['speech_fraction']:.0f} | " + " | ".join(cells) + " |")
    lines += ["", "Utterances (VADConfig defaults on every detector's frames; clean, and white / pink / music at "
              "20 and 10 dB, pooled):", "",
              "| detector | onset delay median / max (s) | end delay median / max (s) | missed | false starts | "
              "false starts / min, no speech |", "|---|---:|---:|---:|---:|---:|"]
    for n in result["detectors"]:
        lat = result["latency"][n]
        lines.append(f"| {n} | {lat['onset_delay_median_s']} / {lat['onset_delay_max_s']} | "
                     f"{lat['end_delay_median_s']} / {lat['end_delay_max_s']} | {lat['missed']} of "
                     f"{lat['questions']} | {lat['false_starts']} | {lat['false_starts_per_min_without_speech']} |")
    lines += ["", f"Cost ({result['cost']['audio_seconds']} s of speech, medians of {result['config']['reps']}):", "",
              "| detector | CPU ms per audio second | wall ms per audio second |", "|---|---:|---:|"]
    for n, v in result["cost"]["rows"].items():
        lines.append(f"| {n} | {v['cpu_ms_per_audio_s']} | {v['wall_ms_per_audio_s']} |")
    if result.get("echo"):
        from .vad_echo import markdown as echo_markdown

        lines += ["", echo_markdown(result["echo"])]
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in TABLE_DETECTORS if n in result["detectors"]]
    speech = [r for r in result["conditions"] if r["speech"]]
    quiet = [r for r in result["conditions"] if not r["speech"]]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.6), gridspec_kw={"width_ratios": [4, 1.6, 1.4]})
    width = 0.8 / len(names)
    for k, n in enumerate(names):
        axes[0].bar(np.arange(len(speech)) + k * width, [r["detectors"][n]["f1"] or 0 for r in speech], width,
                    label=n)
        axes[1].bar(np.arange(len(quiet)) + k * width, [r["detectors"][n]["false_positive_rate"] or 0
                                                        for r in quiet], width, label=n)
    axes[0].set_xticks(np.arange(len(speech)) + 0.4 - width / 2, [r["name"].replace("speech + ", "")
                                                                  for r in speech], rotation=60, fontsize=7)
    axes[0].set_ylabel("frame F1 (higher is better)")
    axes[0].set_ylim(0, 1)
    axes[0].legend(fontsize=7, ncol=len(names), loc="lower left")
    axes[1].set_xticks(np.arange(len(quiet)) + 0.4 - width / 2, [r["name"] for r in quiet], rotation=60,
                       fontsize=7)
    axes[1].set_ylabel("false-positive rate, no speech (lower is better)")
    rows = result["cost"]["rows"]
    axes[2].barh(list(rows), [v["cpu_ms_per_audio_s"] for v in rows.values()], color="#888")
    axes[2].set_xscale("log")
    axes[2].set_xlabel("CPU ms per audio second (log)")
    axes[2].tick_params(axis="y", labelsize=7)
    v = result["versions"]
    fig.suptitle(f"omnitide bench vad: {v.get('cpu')}, silero-vad {v.get('silero-vad')}, webrtcvad-wheels "
                 f"{v.get('webrtcvad-wheels')}, pymicro-vad {v.get('pymicro-vad')}, espeak-ng {v.get('espeak-ng')}",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> int:
    from .report import write_outputs

    if args.clips < 1 or args.reps < 1 or args.cost_seconds <= 0:
        raise SystemExit("error: --clips and --reps must be >= 1 and --cost-seconds > 0")
    result = measure(args)
    write_outputs(result, args, markdown=markdown, plot=plot)
    if not (args.json_path or args.plot or args.markdown):
        print(markdown(result))
    return 0
