"""Streaming evaluation: the official benchmark formats (StreamingBench, SVBench, LiveSports-3K CC) streamed
through OmniSession under any retention policy, and a retention study on real weights (study.py).

Heavy imports (MLX, models, media) stay inside functions: the readers and the scoring are plain Python.
"""
