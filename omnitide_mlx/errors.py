"""Errors that reach users: each says what was wrong with which input."""


class MediaError(ValueError):
    """Input media that cannot be used (missing or corrupt file, wrong shape, unusable sample rate). Raised before
    anything touches a session's cache, so a live session rejects the chunk and goes on."""
