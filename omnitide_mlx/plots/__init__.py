"""Figures drawn from result JSON (matplotlib, the ``plot`` extra, imported inside each function). Core and the
engine never draw; the commands call these after a run."""
