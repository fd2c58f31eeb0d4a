"""``omnitide serve``: a local server (OpenAI-compatible chat completions, streaming sessions over WebSockets, and a
live camera-and-microphone page) over one model."""

from __future__ import annotations

import argparse
import os
import socket
import sys

from .options import (
    add_model_arguments,
    add_policy_arguments,
    positive_float,
    positive_int,
    resolve_watermarks,
)

HELP = "serve a model over HTTP / WebSocket (OpenAI-compatible API, streaming sessions, a live page)"
DESCRIPTION = """Serve one model to apps and browsers: POST /v1/chat/completions (OpenAI-compatible, SSE with
stream: true), streaming sessions (POST /v1/sessions, then a WebSocket per session), and a page at / that streams
the camera and microphone into a session and draws the KV live. Loopback only unless --host and --token are given.

examples:
  omnitide serve --model Qwen/Qwen2.5-Omni-3B                      # http://127.0.0.1:8080/
  omnitide serve --model openbmb/MiniCPM-o-4_5 --policy fifo --kv-budget 512MiB --port 9000
  omnitide serve --model M --host 0.0.0.0 --token "$(python -c 'import secrets; print(secrets.token_urlsafe())')"
"""


def port_number(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535 (0 picks a free one), got {v}")
    return v


def add_arguments(p) -> None:
    add_model_arguments(p)
    add_policy_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; any non-loopback "
                                                        "address needs --token)")
    p.add_argument("--port", type=port_number, default=8080, help="port (default 8080; 0 picks a free one)")
    p.add_argument("--token", default=os.environ.get("OMNITIDE_TOKEN"),
                   help="require 'Authorization: Bearer TOKEN' on the API (default: $OMNITIDE_TOKEN)")
    p.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="let pages from ORIGIN (e.g. https://app.example.com) call the API (repeatable)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="accept requests addressed to host NAME besides loopback names (repeatable)")
    p.add_argument("--session-dir", default=None, metavar="DIR",
                   help="folder where sessions are saved and restored by name (default: saving off)")
    p.add_argument("--voice", action="append", default=[], metavar="NAME=FILE",
                   help="let clients pick the voice file FILE (a voice .safetensors, MiniCPM-o) as speaker NAME "
                        "(repeatable); otherwise a speaker names one of the checkpoint's voices, never a file")
    p.add_argument("--max-tokens", type=positive_int, default=256, help="default answer length (default 256)")
    g = p.add_argument_group("limits")
    g.add_argument("--max-sessions", type=positive_int, default=4, help="sessions and requests at once (default 4)")
    g.add_argument("--max-message-bytes", default="8MiB", help="largest WebSocket message / request body "
                                                                "(default 8MiB)")
    g.add_argument("--max-frame-pixels", type=positive_int, default=1920 * 1080,
                   help="largest frame (default 1920x1080)")
    g.add_argument("--max-queued", type=positive_int, default=8,
                   help="units / questions waiting per session (default 8)")
    g.add_argument("--max-tokens-limit", type=positive_int, default=2048, help="most tokens a client may ask for "
                                                                      "(default 2048)")
    g.add_argument("--max-prompt-tokens", type=positive_int, default=16384,
                   help="most tokens one prompt may hold: a request's messages and media, a session's question "
                        "(default 16384)")
    g.add_argument("--idle-timeout", type=positive_float, default=600.0,
                   help="seconds a session may stay without a WebSocket before it is deleted (default 600)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])


def config_from_args(args):
    from ..engine import parse_bytes
    from ..serve.config import Limits, ServeConfig

    limits = Limits(max_sessions=args.max_sessions, max_message_bytes=parse_bytes(args.max_message_bytes),
                    max_frame_pixels=args.max_frame_pixels, max_queued=args.max_queued,
                    max_tokens=args.max_tokens_limit, max_prompt_tokens=args.max_prompt_tokens,
                    idle_timeout_s=args.idle_timeout)
    high, low = resolve_watermarks(args)
    voices = {}
    for v in args.voice:
        name, sep, path = v.partition("=")
        if not sep or not path:
            raise ValueError(f"--voice {v!r}: give NAME=FILE (a voice .safetensors)")
        voices[name] = os.path.abspath(os.path.expanduser(path))
    cfg = ServeConfig(model=args.model, host=args.host, port=args.port, token=args.token,
                      allow_origins=args.allow_origin, allow_hosts=args.allow_host, session_dir=args.session_dir,
                      policy=args.policy, high=high, low=low, kv_budget=args.kv_budget,
                      system_prompt=args.system_prompt, default_max_tokens=args.max_tokens, voices=voices,
                      limits=limits)
    cfg.check()
    if args.max_tokens < 1 or args.max_tokens > args.max_tokens_limit:
        raise ValueError(f"--max-tokens {args.max_tokens} must lie in [1, --max-tokens-limit {args.max_tokens_limit}]")
    return cfg


def run(args) -> int:
    try:
        import uvicorn

        from ..serve.app import create_app
    except ImportError as e:
        print(f"omnitide serve: {e.name or e} is missing; install the serve extra: pip install 'omnitide-mlx[serve]'",
              file=sys.stderr)
        return 1
    from ..models.loading import CheckpointError

    try:
        cfg = config_from_args(args)
        if cfg.session_dir:
            os.makedirs(cfg.session_dir, exist_ok=True)
        family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((cfg.host, cfg.port))
        except OSError as e:
            raise ValueError(f"cannot listen on {cfg.host}:{cfg.port}: {e.strerror or e}") from None
        from ..models import load

        print(f"loading {args.model} ...", file=sys.stderr, flush=True)
        model, processor = load(args.model)
        # check the policy flags against the model once, before anyone connects, and warm up: the first answer
        # builds MLX's compiled sampling kernels (8.5 s of the tiny test model's first request, 0.2 s after)
        from ..session import OmniSession

        OmniSession((model, processor), policy=cfg.policy, high=cfg.high, low=cfg.low, kv_budget=cfg.kv_budget,
                    system_prompt=cfg.system_prompt).answer("Hello.", max_tokens=1)
    except (CheckpointError, ValueError, OSError) as e:
        print(f"omnitide serve: {e}", file=sys.stderr)
        return 1
    app = create_app(cfg, model, processor)
    # listening before the address is announced: a client that connects at once waits in the backlog until uvicorn
    # accepts, instead of being refused (uvicorn calls listen() itself only once its loop runs: the serve tests'
    # clients raced it, "Connection refused" on the first request)
    sock.listen(2048)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"omnitide serve: {args.model} on http://{shown}:{port}/ (Ctrl-C stops)", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, ws_max_size=cfg.limits.max_message_bytes
                                           + (1 << 20), ws_ping_interval=20.0, timeout_graceful_shutdown=5))
    server.run(sockets=[sock])
    return 0
