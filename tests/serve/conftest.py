"""A real ``omnitide serve`` process on loopback over a tiny checkpoint, shared by the tests of one module."""

import os
import pathlib
import re
import subprocess
import sys
import threading
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]

pytest.importorskip("starlette", reason="the serve extra is not installed (pip install -e '.[serve]')")
pytest.importorskip("uvicorn", reason="the serve extra is not installed (pip install -e '.[serve]')")


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory) -> pathlib.Path:
    from omnitide_mlx.models.qwen2_5_omni.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("serve_ckpt")
    return make_tiny_checkpoint(root / "tiny-qwen2.5-omni", tokenizer_dir=REPO / "tests/data/tokenizers/qwen2",
                                vocab="real")


class Server:
    """``omnitide serve`` as a user starts it; ``url`` once it listens."""

    def __init__(self, args: list[str], env: dict | None = None):
        e = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                 HF_HUB_OFFLINE="1")
        e.update(env or {})
        self.proc = subprocess.Popen([sys.executable, "-m", "omnitide_mlx", "serve", "--port", "0", *args],
                                     stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=e, cwd=REPO)
        self.log: list[str] = []
        deadline = time.monotonic() + 120
        self.url = None
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            self.log.append(line)
            m = re.search(r"on (http://\S+?)/ ", line)
            if m:
                self.url = m.group(1)
                break
        if self.url is None:
            self.stop()
            raise RuntimeError("omnitide serve did not start:\n" + "".join(self.log))
        self.ws_url = self.url.replace("http://", "ws://")
        # keep reading its log so that a chatty server never blocks on a full pipe
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="session")
def server(tiny_qwen, tmp_path_factory):
    """One server for all the serve tests (starting one costs seconds): small limits so that each is reachable."""
    s = Server(["--model", str(tiny_qwen), "--max-sessions", "3", "--max-queued", "3", "--max-message-bytes",
                "256KiB", "--max-frame-pixels", "20000", "--max-tokens-limit", "4000", "--max-prompt-tokens", "2000",
                "--session-dir", str(tmp_path_factory.mktemp("saved")), "--high", "150", "--low", "100"])
    yield s
    s.stop()


@pytest.fixture
def http(server):
    import httpx

    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="session")
def clip_units(media_dir):
    """The bundled clip as (jpeg bytes of a small frame, 16 kHz int16 audio of its second), one per second."""
    import cv2

    from omnitide_mlx.media import iter_chunks

    out = []
    for c in iter_chunks(media_dir / "video_10s_av.mp4"):
        small = cv2.resize(c.frame, (64, 48), interpolation=cv2.INTER_AREA)
        ok, jpg = cv2.imencode(".jpg", cv2.cvtColor(small, cv2.COLOR_RGB2BGR))
        assert ok
        pcm = (c.audio * 32767).clip(-32768, 32767).astype("<i2")
        out.append((jpg.tobytes(), pcm.tobytes(), small))
    return out


@pytest.fixture
def make_server():
    """Start another server (its own model or flags); stopped after the test."""
    started = []

    def make(*args: str) -> Server:
        started.append(Server(list(args)))
        return started[-1]

    yield make
    for s in started:
        s.stop()
