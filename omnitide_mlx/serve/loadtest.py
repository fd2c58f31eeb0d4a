"""Load test for ``omnitide serve``: N concurrent sessions on loopback pushing units for a fixed time.

    python -m omnitide_mlx.serve.loadtest --model ./checkpoints/tiny --sessions 4 --seconds 30
    python -m omnitide_mlx.serve.loadtest --url http://127.0.0.1:8080 --sessions 2 --rate 0 --json out.json

Each session sends units from the bundled clip (a JPEG frame and one second of 16 kHz PCM) at ``--rate`` units a
second (0: as fast as the server answers, keeping ``--window`` units in flight), over one WebSocket, then waits
for every reply. It reports throughput, the latency from sending a unit to its ``pushed`` reply (percentiles),
the server's own update times, and the accounting: every unit sent must come back exactly once (pushed or a
named error), and the server's count of pushed units must match; anything else is reported as lost and fails the
run (exit 1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

from .decode import pack_binary

CLIP = Path(__file__).resolve().parents[2] / "assets" / "media" / "video_10s_av.mp4"


def clip_units(width: int, height: int, clip: Path = CLIP) -> list[tuple[bytes, bytes]]:
    """(JPEG frame, 1 s of 16 kHz s16le PCM) per second of the clip."""
    import cv2

    from ..media import iter_chunks

    out = []
    for c in iter_chunks(clip):
        frame = cv2.resize(c.frame, (width, height), interpolation=cv2.INTER_AREA)
        ok, jpg = cv2.imencode(".jpg", cv2.cvtColor(frame, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, 80])
        if not ok:
            raise RuntimeError("cannot encode a JPEG frame")
        pcm = (np.clip(c.audio, -1, 1) * 32767).astype("<i2").tobytes()
        out.append((jpg.tobytes(), pcm))
    return out


def http_json(method: str, url: str, body: dict | None = None, token: str | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=120) as r:
        raw = r.read()
    return json.loads(raw) if raw else {}


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    a = np.asarray(values)
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max()), "mean": float(a.mean())}


async def run_session(i: int, base: str, units, args, start_at: float) -> dict:
    from websockets.asyncio.client import connect

    token = args.token
    info = await asyncio.to_thread(http_json, "POST", f"{base}/v1/sessions", {}, token)
    sid = info["id"]
    ws_url = base.replace("http", "ws", 1) + info["websocket"] + (f"?token={token}" if token else "")
    sent: dict[int, float] = {}
    latencies: list[float] = []
    update_ms: list[float] = []
    replies: dict[int, str] = {}
    errors: dict[str, int] = {}
    window = asyncio.Semaphore(args.window)
    result = {"session": sid}
    async with connect(ws_url, max_size=None) as ws:
        ready = json.loads(await ws.recv())
        assert ready["type"] == "ready", ready
        done = asyncio.Event()

        async def receive():
            async for raw in ws:
                m = json.loads(raw)
                now = time.perf_counter()
                if m["type"] == "update":
                    update_ms.append(m["record"]["update_ms"])
                elif m["type"] in ("pushed", "error") and m.get("seq") in sent:
                    seq = m["seq"]
                    if seq in replies:
                        errors["duplicate_reply"] = errors.get("duplicate_reply", 0) + 1
                        continue
                    replies[seq] = m["type"]
                    if m["type"] == "pushed":
                        latencies.append((now - sent[seq]) * 1000)
                    else:
                        errors[m["code"]] = errors.get(m["code"], 0) + 1
                    window.release()
                    if sending_done and len(replies) == len(sent):
                        done.set()

        sending_done = False
        receiver = asyncio.create_task(receive())
        await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
        t0 = time.perf_counter()
        seq = 0
        while time.perf_counter() - t0 < args.seconds:
            if args.rate > 0:
                await asyncio.sleep(max(0.0, t0 + seq / args.rate - time.perf_counter()))
                if time.perf_counter() - t0 >= args.seconds:
                    break
            await window.acquire()
            jpeg, pcm = units[(seq + i) % len(units)]
            msg = pack_binary({"type": "unit", "seq": seq, "t": float(seq),
                               "frame": {"format": "jpeg", "bytes": len(jpeg)},
                               "audio": {"format": "pcm_s16le", "sample_rate": 16000, "bytes": len(pcm)}}, jpeg, pcm)
            sent[seq] = time.perf_counter()
            await ws.send(msg)
            seq += 1
        sending_done = True
        if len(replies) == len(sent):
            done.set()
        try:
            await asyncio.wait_for(done.wait(), timeout=args.drain_timeout)
        except asyncio.TimeoutError:
            pass
        t1 = time.perf_counter()
        receiver.cancel()
    server_info = await asyncio.to_thread(http_json, "GET", f"{base}/v1/sessions/{sid}", None, token)
    await asyncio.to_thread(http_json, "DELETE", f"{base}/v1/sessions/{sid}", None, token)
    pushed = sum(1 for v in replies.values() if v == "pushed")
    result.update(sent=len(sent), pushed=pushed, errors=errors, lost=len(sent) - len(replies),
                  server_pushed=server_info["counts"]["units_pushed"], elapsed_s=t1 - t0, latencies_ms=latencies,
                  update_ms=update_ms, retained_cells=server_info["stats"]["retained_cells"],
                  high=server_info["stats"]["high"])
    return result


async def run(base: str, args) -> dict:
    units = clip_units(*args.frame)
    start_at = time.perf_counter() + 0.5
    sessions = await asyncio.gather(*[run_session(i, base, units, args, start_at) for i in range(args.sessions)])
    lat = [x for s in sessions for x in s["latencies_ms"]]
    upd = [x for s in sessions for x in s["update_ms"]]
    errors: dict[str, int] = {}
    for s in sessions:
        for k, v in s["errors"].items():
            errors[k] = errors.get(k, 0) + v
    sent = sum(s["sent"] for s in sessions)
    pushed = sum(s["pushed"] for s in sessions)
    elapsed = max(s["elapsed_s"] for s in sessions)
    mismatched = [s["session"] for s in sessions if s["server_pushed"] != s["pushed"]]
    return {
        "url": base, "sessions": args.sessions, "seconds": args.seconds, "rate_per_session": args.rate,
        "window": args.window, "frame": f"{args.frame[0]}x{args.frame[1]}",
        "sent": sent, "pushed": pushed, "errors": errors, "lost": sum(s["lost"] for s in sessions),
        "server_count_mismatch": mismatched,
        "throughput_units_per_s": pushed / elapsed if elapsed else 0.0, "elapsed_s": elapsed,
        "latency_ms": percentiles(lat), "server_update_ms": percentiles(upd),
        "retained_cells_at_end": [s["retained_cells"] for s in sessions], "high": sessions[0]["high"],
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
    }


def start_server(model: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    """``omnitide serve --port 0`` on loopback; returns the process and its URL once it listens."""
    proc = subprocess.Popen([sys.executable, "-m", "omnitide_mlx", "serve", "--model", model, "--port", "0", *extra],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    log = []
    for line in proc.stderr:
        log.append(line)
        m = re.search(r"on (http://\S+?)/ ", line)
        if m:
            import threading

            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, m.group(1)
    proc.wait()
    raise SystemExit("loadtest: the server did not start:\n" + "".join(log))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m omnitide_mlx.serve.loadtest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8080")
    g.add_argument("--model", help="start `omnitide serve --model MODEL` on a free loopback port for the test")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for the started server (repeatable), e.g. --server-arg=--high=300")
    p.add_argument("--token", default=os.environ.get("OMNITIDE_TOKEN"))
    p.add_argument("--sessions", type=int, default=4, help="concurrent sessions (default 4)")
    p.add_argument("--seconds", type=float, default=30.0, help="how long each session sends (default 30)")
    p.add_argument("--rate", type=float, default=1.0,
                   help="units per second per session (default 1, the live rate; 0: as fast as replies come)")
    p.add_argument("--window", type=int, default=2, help="most units in flight per session (default 2)")
    p.add_argument("--frame", default="160x120", help="frame size WxH (default 160x120)")
    p.add_argument("--drain-timeout", type=float, default=120.0, help="seconds to wait for the last replies")
    p.add_argument("--json", default=None, metavar="PATH", help="write the report as JSON")
    args = p.parse_args(argv)
    m = re.fullmatch(r"(\d+)x(\d+)", args.frame)
    if not m or args.sessions < 1 or args.seconds <= 0 or args.rate < 0 or args.window < 1:
        p.error("--frame is WxH; --sessions, --seconds and --window must be positive, --rate at least 0")
    args.frame = (int(m.group(1)), int(m.group(2)))
    proc = None
    base = args.url.rstrip("/") if args.url else None
    if args.model:
        proc, base = start_server(args.model, [f"--max-sessions={args.sessions}", *args.server_arg])
    try:
        report = asyncio.run(run(base, args))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    lat, upd = report["latency_ms"], report["server_update_ms"]
    rate = f"{args.rate:g} units/s" if args.rate else f"full speed (window {args.window})"
    print(f"{report['sessions']} sessions x {report['seconds']:g} s at {rate} "
          f"(frame {report['frame']}): sent {report['sent']}, pushed {report['pushed']}, errors {report['errors']}, "
          f"lost {report['lost']}")
    print(f"throughput {report['throughput_units_per_s']:.2f} units/s; latency ms p50 {lat.get('p50', 0):.0f} "
          f"p90 {lat.get('p90', 0):.0f} p99 {lat.get('p99', 0):.0f} max {lat.get('max', 0):.0f}; server update ms "
          f"p50 {upd.get('p50', 0):.0f} p90 {upd.get('p90', 0):.0f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    bad = report["lost"] or report["server_count_mismatch"] or set(report["errors"]) - {"queue_full"}
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
