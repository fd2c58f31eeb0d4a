"""``omnitide serve``: a local HTTP / WebSocket server over OmniSession, for apps that cannot import Python.

- ``POST /v1/chat/completions``: OpenAI-compatible one-shot requests (text, image and audio parts; SSE streaming),
  as ``mlx_lm.server`` offers (spoken answers as OpenAI audio output), and ``POST /v1/completions``;
- ``/v1/sessions``: streaming sessions, each driven over one WebSocket (units in; answer pieces and per-update KV
  figures out; save / restore);
- ``GET /``: a page that streams the browser's camera and microphone into a session and draws the KV live.

Built on Starlette + uvicorn (see ``app.py`` for why). Loopback by default; any other address needs a token, and
origins and hosts are checked so that a random web page cannot drive a local model (``guards.py``).
"""

from .config import Limits, ServeConfig  # noqa: F401
