"""The echo part of ``omnitide bench vad``: false and true barge-ins with the reply's own voice in the microphone.

A simulated room: the reply (espeak-ng, played at 24 kHz as the Qwen2.5-Omni talker's audio is) reaches the
microphone after ``delay`` at ``gain`` through a short room response (the direct path plus a decaying noise tail
10 dB below it, RT60 about 0.15 s), over a pink noise floor 45 dB below the reply. Every delay in 20, 50, 100,
150 ms and gain in -20, -12, -6 dB, two replies each:

- echo only (the user silent while the reply plays): any utterance start is a false barge-in;
- barge-in: the user asks a question 2.5 s into the reply, at the reply's level or 6 dB below it (at the
  microphone); detected when a start is decided within 1 s of the question's voiced onset (the delay reported).

Setups, all through ``UtteranceDetector`` with ``VADConfig`` defaults unless said:

- ``headphones``: no echo reaches the microphone (the baseline);
- ``speakers, no reference``: echo, nothing told of the playback;
- ``speakers, threshold 0.95``: the same, with the speech threshold raised (0.95 / 0.8) as a gate that only
  looks at the VAD's own probability would;
- ``speakers, echo gate``: the player's audio given to ``push_reference`` (vad/echo.py), at the default margin
  (1.5 dB) and at 0 and 6 dB beside it.
"""

from __future__ import annotations

import statistics

import numpy as np

SR = 16000
PLAY_RATE = 24000
REPLIES = [("Paris is the capital of France. It lies on the Seine, and about two million people live in the city "
            "itself. The metropolitan area is much larger.", "en-gb", 165),
           ("The sky looks blue because air scatters short wavelengths of sunlight more than long ones. At sunset "
            "the light crosses more air, so the sky turns red.", "en-us+f3", 160)]
QUESTION = ("Wait, what about the weather tomorrow?", "en-us", 155)
DELAYS = (0.02, 0.05, 0.1, 0.15)
GAINS_DB = (-20.0, -12.0, -6.0)
USER_DB = (0.0, -6.0)
REPLY_AT, USER_AFTER = 1.0, 2.5


def _room(rng: np.random.Generator, delay_s: float, gain_db: float) -> np.ndarray:
    n_tail = int(0.15 * SR)
    tail = rng.standard_normal(n_tail) * np.exp(-np.arange(n_tail) / (0.15 * SR / 6.9))
    tail *= np.sqrt(0.1 / (tail ** 2).sum())  # 10 dB below the direct path
    h = np.zeros(int(round(delay_s * SR)) + n_tail + 1)
    d = int(round(delay_s * SR))
    h[d] = 1.0
    h[d + 1:d + 1 + n_tail] += tail
    return h * 10 ** (gain_db / 20)


def _speech():
    from ..vad.resample import Resampler
    from ..vad.testaudio import speak

    replies16 = [speak(t, voice=v, wpm=w) for t, v, w in REPLIES]
    played = []
    for r16 in replies16:  # what the player sends: the reply at 24 kHz (resampled up from espeak's 16 kHz copy)
        t = np.arange(int(r16.size * PLAY_RATE / SR)) * SR / PLAY_RATE
        played.append(np.interp(t, np.arange(r16.size), r16).astype(np.float32))
    back = []
    for p in played:  # and what the loudspeaker then emits, on the 16 kHz microphone clock
        r = Resampler(PLAY_RATE)
        back.append(np.concatenate([r.push(p), r.drain()]))
    q, v, w = QUESTION
    return played, back, speak(q, voice=v, wpm=w)


def _voiced_power(x: np.ndarray) -> float:
    from ..vad.testaudio import speech_labels

    lab = speech_labels(x)
    return float((x[:lab.size * 160][lab.repeat(160)] ** 2).mean())


def _trial(detector_factory, mic: np.ndarray, reference: np.ndarray | None, block: int = 8000):
    d = detector_factory()
    if reference is not None:
        d.push_reference(reference, PLAY_RATE, REPLY_AT)
    events = []
    for i in range(0, mic.size, block):
        events += d.feed(mic[i:i + block], SR)
    return events + d.flush()


def measure_echo(model, gate=None, only: tuple[str, ...] | None = None) -> dict:
    """The table's figures; ``gate`` is the VADConfig of the echo-gate setup (default: the defaults), ``only``
    limits the setups run (exploring a setting)."""
    from ..vad.detector import UtteranceDetector, VADConfig
    from ..vad.testaudio import background, speech_labels

    played, back, question = _speech()
    q_lab = speech_labels(question)
    q_onset = np.flatnonzero(q_lab)[0] * 160 / SR
    setups = {
        "headphones": (VADConfig(), False, False),
        "speakers, no reference": (VADConfig(), True, False),
        "speakers, threshold 0.95": (VADConfig(threshold=0.95, neg_threshold=0.8), True, False),
        "speakers, echo gate": (gate or VADConfig(), True, True),
        "speakers, echo gate, margin 0 dB": (VADConfig(echo_margin_db=0.0), True, True),
        "speakers, echo gate, margin 6 dB": (VADConfig(echo_margin_db=6.0), True, True),
    }
    setups = {k: v for k, v in setups.items() if only is None or k in only}
    rows = {name: {"echo_trials": 0, "false_barge_ins": 0, "trials_with_false": 0, "barge_in_trials": 0,
                   "detected": 0, "delays": [], "by_gain": {}, "by_user": {}} for name in setups}
    rng = np.random.default_rng(5)
    for k, (p24, p16) in enumerate(zip(played, back)):
        total = REPLY_AT + p16.size / SR + 1.5
        n = int(total * SR)
        floor = background("pink", total, seed=k) * (np.sqrt((p16 ** 2).mean()) / 0.1) * 10 ** (-45 / 20)
        for delay in DELAYS:
            for gain in GAINS_DB:
                echo = np.convolve(p16, _room(rng, delay, gain))
                e = np.zeros(n, np.float32)
                i0 = int(REPLY_AT * SR)
                e[i0:i0 + echo.size] = echo[:n - i0]
                for user_db in (None, *USER_DB):
                    mic_user = np.zeros(n, np.float32)
                    if user_db is not None:
                        u0 = int((REPLY_AT + USER_AFTER) * SR)
                        level = np.sqrt(_voiced_power(p16) / _voiced_power(question)) * 10 ** (user_db / 20)
                        mic_user[u0:u0 + question.size] = question * level
                    for name, (cfg, speakers, gate) in setups.items():
                        mic = floor[:n] + mic_user + (e if speakers else 0)
                        events = _trial(lambda: UtteranceDetector(cfg, model=model), mic.astype(np.float32),
                                        p24 if gate else None)
                        starts = [ev for ev in events if ev.kind == "start"]
                        row = rows[name]
                        g = row["by_gain"].setdefault(f"{gain:g} dB", {"false_barge_ins": 0, "echo_trials": 0,
                                                                       "detected": 0, "barge_in_trials": 0})
                        if user_db is None:
                            row["echo_trials"] += 1
                            g["echo_trials"] += 1
                            row["false_barge_ins"] += len(starts)
                            g["false_barge_ins"] += len(starts)
                            row["trials_with_false"] += bool(starts)
                        else:
                            t_user = REPLY_AT + USER_AFTER + q_onset
                            hit = [s for s in starts if t_user - 0.2 <= s.decided_at <= t_user + 1.0]
                            row["barge_in_trials"] += 1
                            g["barge_in_trials"] += 1
                            u = row["by_user"].setdefault(f"user {user_db:g} dB, echo {gain:g} dB",
                                                          {"detected": 0, "barge_in_trials": 0})
                            u["barge_in_trials"] += 1
                            if hit:
                                row["detected"] += 1
                                g["detected"] += 1
                                u["detected"] += 1
                                row["delays"].append(hit[0].decided_at - t_user)
    for row in rows.values():
        d = row.pop("delays")
        row["detect_delay_median_s"] = round(statistics.median(d), 3) if d else None
    return {"delays_s": list(DELAYS), "gains_db": list(GAINS_DB), "user_db": list(USER_DB),
            "play_rate": PLAY_RATE, "setups": rows}


def markdown(echo: dict) -> str:
    lines = ["Echo (speakers simulated: delays " + ", ".join(f"{1000 * d:g}" for d in echo["delays_s"])
             + " ms, gains " + ", ".join(f"{g:g}" for g in echo["gains_db"]) + " dB; user at 0 and -6 dB of the "
             "reply):", "", "| setup | false barge-ins (trials with one) | barge-ins detected | detection delay "
             "median (s) | false / detected at -20, -12, -6 dB |", "|---|---:|---:|---:|---|"]
    for name, r in echo["setups"].items():
        per = ", ".join(f"{v['false_barge_ins']}/{v['detected']}" for v in r["by_gain"].values())
        lines.append(f"| {name} | {r['false_barge_ins']} ({r['trials_with_false']} of {r['echo_trials']}) | "
                     f"{r['detected']} of {r['barge_in_trials']} | {r['detect_delay_median_s']} | {per} |")
    gate = echo["setups"].get("speakers, echo gate")
    if gate:
        lines += ["", "Barge-ins detected with the echo gate (default margin), by the user's level and the echo's "
                  "(relative to the reply as played):", "", "| | " + " | ".join(gate["by_user"]) + " |",
                  "|---|" + "---:|" * len(gate["by_user"]),
                  "| detected | " + " | ".join(f"{v['detected']} of {v['barge_in_trials']}"
                                              for v in gate["by_user"].values()) + " |"]
    return "\n".join(lines)
