"""Errors that reach users: each says what was wrong with which input.

Every public error of the package derives from :class:`OmniTideError` (defined in ``core/errors.py`` so the
framework-free core can use it too) and keeps its builtin base (``ValueError`` / ``RuntimeError``).
"""

from .core.errors import OmniTideError


class MediaError(OmniTideError, ValueError):
    """Input media that cannot be used (missing or corrupt file, wrong shape, unusable sample rate). Raised before
    anything touches a session's cache, so a live session rejects the chunk and goes on."""


class SessionError(OmniTideError, RuntimeError):
    """A session used in a way it cannot serve (a call from inside its own ``on_update`` callback, a restore into
    the wrong model, ...). Raised before the session's state is touched."""


class SessionBusyError(SessionError):
    """An operation that needs the session idle (``save``) while a reply's iterator is still open: finish it, or
    ``close()`` it, first."""


class InputTooLargeError(MediaError):
    """One input (a question, a piece of text, a media unit) larger than the session can keep: over the KV budget,
    or (text) over the high watermark. Rejected before it is computed; the session goes on unchanged."""


class RestoreError(SessionError, ValueError):
    """A saved session that cannot be restored: a missing, truncated or malformed file (the message names it), an
    unknown format version, or a model of another family or size than the one it was saved with."""


class SamplingError(OmniTideError, ValueError):
    """A sampling option out of its range (``temp`` < 0, ``top_p`` outside [0, 1], ``max_tokens`` < 1, a ``stop`` that is
    not strings, ...). Raised by ``ask`` before anything is computed."""


__all__ = ["OmniTideError", "MediaError", "SessionError", "SessionBusyError", "InputTooLargeError", "RestoreError",
           "SamplingError"]
