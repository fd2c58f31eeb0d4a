"""What a server allows: addresses, origins, the token and the limits, each with the reason for its default."""

from __future__ import annotations

import ipaddress
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path


# a voice a client may name: a checkpoint's voice or an operator's --voice, never a path
VOICE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


@dataclass
class Limits:
    """Every bound a client can hit; each is reported with a specific error naming the limit."""

    max_sessions: int = 4  # sessions share one model and one compute gate: more only queue behind each other
    max_message_bytes: int = 8 << 20  # one WebSocket message or HTTP body (a 1080p raw RGB frame is 6.2 MB)
    max_frame_pixels: int = 1920 * 1080  # checked from the image header, before decoding (no decompression bombs)
    max_audio_seconds: float = 10.0  # audio in one message (a unit is one second)
    max_queued: int = 8  # units and questions waiting per session: a client that outruns the model hears so
    max_tokens: int = 2048  # the most tokens one answer may ask for
    # the most tokens one prompt may hold (a one-shot request's system prompt, media, turns and question; a
    # session's question): a 500 KB question held the compute gate for 7 minutes and grew the server by 5 GB
    max_prompt_tokens: int = 16384
    idle_timeout_s: float = 600.0  # a session without a WebSocket for this long is deleted


@dataclass
class ServeConfig:
    model: str = ""
    host: str = "127.0.0.1"
    port: int = 8080
    token: str | None = None
    allow_origins: list[str] = field(default_factory=list)  # extra origins allowed to call the API from a browser
    allow_hosts: list[str] = field(default_factory=list)  # extra Host header names (besides loopback names)
    session_dir: str | None = None  # where save / restore keep sessions (None: saving is off)
    policy: str = "omnitide"
    high: int | None = None
    low: int | None = None
    kv_budget: str | int | None = None  # bytes, or a size such as '512MiB'
    system_prompt: str | None = None
    default_max_tokens: int = 256
    voices: dict[str, str] = field(default_factory=dict)  # --voice NAME=FILE: voice files clients may name
    limits: Limits = field(default_factory=Limits)

    @property
    def model_ref(self) -> str:
        """The model's identity: a local folder resolved (relative, symlinked and 'dir/' spellings are one model,
        as saved sessions record it), a Hub id as given."""
        return model_ref(self.model)

    @property
    def model_id(self) -> str:
        """The name clients see (``/v1/models``, replies): a local folder's name, never its path on this machine."""
        p = Path(self.model).expanduser()
        return p.resolve().name if self.model and p.exists() else self.model

    def check(self) -> None:
        """Refuse a configuration that would expose a model unprotected, before anything is loaded."""
        if not is_loopback(self.host) and not self.token:
            raise ValueError(f"--host {self.host} is not a loopback address: anyone who can reach it could drive the "
                             "model, so it needs --token (or set OMNITIDE_TOKEN)")
        if self.token is not None and len(self.token) < 16:
            raise ValueError("--token must be at least 16 characters (e.g. python -c 'import secrets; "
                             "print(secrets.token_urlsafe())')")
        for o in self.allow_origins:
            problem = origin_flag_problem(o)
            if problem is not None:
                raise ValueError(problem)
        if self.session_dir and os.path.exists(self.session_dir) and not os.path.isdir(self.session_dir):
            raise ValueError(f"--session-dir {self.session_dir} is not a folder (a file is there): give a folder "
                             "where sessions are saved")
        for name, path in self.voices.items():
            if not VOICE_NAME.match(name):
                raise ValueError(f"--voice {name}=...: a voice name is 1-64 letters, digits, '_', '-' or '.', "
                                 "starting with a letter or digit")
            if not path.endswith(".safetensors") or not os.path.isfile(path):
                raise ValueError(f"--voice {name}={path}: no voice .safetensors file there")
        lim = self.limits
        if not (math.isfinite(lim.idle_timeout_s) and lim.idle_timeout_s > 0):
            raise ValueError(f"--idle-timeout must be a positive number of seconds, got {lim.idle_timeout_s}")
        for name in ("max_sessions", "max_message_bytes", "max_frame_pixels", "max_queued", "max_tokens",
                     "max_prompt_tokens"):
            if getattr(lim, name) < 1:
                raise ValueError(f"limit {name} must be at least 1")


def origin_flag_problem(origin: str) -> str | None:
    """Why ``--allow-origin ORIGIN`` is refused (None: it is taken); the Origin guard suggests only taken ones."""
    if origin == "*" or not origin.startswith(("http://", "https://")) or origin.endswith("/") or " " in origin:
        return (f"--allow-origin {origin!r}: give a full origin such as https://app.example.com (http or https; "
                "no '*', no trailing slash)")
    return None


def model_ref(model: str) -> str:
    p = Path(model).expanduser()
    return str(p.resolve()) if model and p.exists() else model


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
