"""Subcommands of the ``omnitide`` CLI (see cli.py)."""
