"""Peak RSS of decoding a video for streaming, against the video's length: ``MediaStream`` (a frame and a second
of audio at a time, what ``omnitide stream`` / ``generate`` use) next to holding every chunk (what they did before:
``list(iter_chunks(...))`` before the first unit). Writes a JSON and prints a Markdown table.

    python scripts/media_rss.py --seconds 30,120,480 --json docs/img/media-rss.json

Each measurement runs in a fresh interpreter (peak RSS is per process); the videos are synthesised with PyAV
(H.264 1280x720 at 5 fps with an AAC track, different content each second) into a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, resource, sys, time
from omnitide_mlx.media import MediaStream
mode, path = sys.argv[1], sys.argv[2]
def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024
t0 = time.perf_counter()
stream = MediaStream(path)
base = rss_mib()
n, samples = 0, []
if mode == "stream":
    for chunk in stream:
        n += 1
        if n % 10 == 0:
            samples.append(round(rss_mib(), 1))
else:
    held = list(stream)
    n = len(held)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
print(json.dumps({"mode": mode, "units": n, "base_mib": round(base, 1), "peak_mib": round(peak, 1),
                  "rss_every_10_units": samples, "seconds": round(time.perf_counter() - t0, 2)}))
"""


def make_video(path: Path, seconds: int, width: int = 1280, height: int = 720, fps: int = 5) -> None:
    import av
    import numpy as np

    rng = np.random.default_rng(0)
    with av.open(str(path), "w") as out:
        v = out.add_stream("libx264", rate=fps)
        v.width, v.height, v.pix_fmt = width, height, "yuv420p"
        v.options = {"preset": "ultrafast"}
        a = out.add_stream("aac", rate=16000)
        a.layout = "mono"
        for s in range(seconds):
            colour = rng.integers(0, 256, 3, dtype=np.uint8)
            img = np.empty((height, width, 3), np.uint8)
            img[:] = colour
            img[::37] = 255 - colour  # some texture, so frames are not trivially compressible
            for _ in range(fps):
                for packet in v.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                    out.mux(packet)
            tone = (0.2 * np.sin(2 * np.pi * (200 + 10 * s) * np.arange(16000) / 16000)).astype(np.float32)
            frame = av.AudioFrame.from_ndarray(tone[None], format="flt", layout="mono")
            frame.sample_rate = 16000
            for packet in a.encode(frame):
                out.mux(packet)
        for stream in (v, a):
            for packet in stream.encode(None):
                out.mux(packet)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", default="30,120,480", help="video lengths in seconds (default 30,120,480)")
    p.add_argument("--modes", default="stream,hold", help="stream (MediaStream) and/or hold (every chunk held)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seconds in [int(s) for s in args.seconds.split(",")]:
            path = Path(tmp) / f"v{seconds}.mp4"
            make_video(path, seconds)
            for mode in args.modes.split(","):
                r = subprocess.run([sys.executable, "-c", CHILD, mode, str(path)], capture_output=True, text=True,
                                   check=True, env={**os.environ})
                row = {"video_seconds": seconds, "file_mib": round(path.stat().st_size / 2**20, 2),
                       **json.loads(r.stdout.strip().splitlines()[-1])}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
    import av
    import cv2
    import numpy

    result = {"command": "python scripts/media_rss.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": {"platform": platform.platform(), "python": platform.python_version(),
                          "cpus": os.cpu_count()},
              "versions": {"av": av.__version__, "opencv": cv2.__version__, "numpy": numpy.__version__},
              "video": "H.264 1280x720, 5 fps, AAC mono 16 kHz", "rows": rows,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print("| video s | mode | units | peak RSS MiB | RSS after opening MiB | decode s |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['video_seconds']} | {r['mode']} | {r['units']} | {r['peak_mib']} | {r['base_mib']} | "
              f"{r['seconds']} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
