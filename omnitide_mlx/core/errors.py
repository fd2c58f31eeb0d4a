"""The base class of every public error in omnitide-mlx.

It lives in core (pure Python, no array framework) so core's own errors can derive from it; ``omnitide_mlx.errors``
re-exports it beside the session and media errors. Each public error keeps its builtin base as well (``ValueError``
for bad input, ``RuntimeError`` for a misuse or an unusable environment), so ``except ValueError`` clauses keep
working, and ``except OmniTideError`` catches anything the package raises on purpose.
"""


class OmniTideError(Exception):
    """Base of every error omnitide-mlx raises on purpose: each says what was wrong with which input."""
