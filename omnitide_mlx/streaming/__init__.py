"""The streaming engine's parts, composed in engine.py's StreamingSession (records, retention settings,
persistence, the inbox and its lock, the retention step, replies). Import the engine from omnitide_mlx.engine."""
