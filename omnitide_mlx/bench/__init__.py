"""Benchmarks behind ``omnitide bench <name>``: one module each (attention, stream), sharing common.py.

A benchmark module provides ``HELP``, optionally ``DESCRIPTION``, ``add_arguments(parser)`` and ``run(args)``.
``omnitide bench`` imports it only when its benchmark is chosen, so ``omnitide --help`` stays instant and a torch
run loads no MLX; the listing's one-line help is therefore kept here (tests/test_cli.py checks it is each module's
``HELP``), and a benchmark whose flags must load without MLX names a lighter module for them in ``ARGUMENTS``.
"""

BENCHMARKS: dict[str, str] = {
    "attention": "omnitide_mlx.bench.attention",
    "stream": "omnitide_mlx.bench.stream",
    "speech": "omnitide_mlx.bench.speech",
    "conversation": "omnitide_mlx.bench.conversation",
    "vad": "omnitide_mlx.bench.vad",
}

# where a benchmark's HELP, DESCRIPTION and add_arguments live when not in its module (imports no array framework)
ARGUMENTS: dict[str, str] = {
    "attention": "omnitide_mlx.bench.attention_args",
}

HELP: dict[str, str] = {
    "attention": "time dense full-context attention against tile-skip attention on the OmniPick layouts "
                 "(native / OmniPage / eager)",
    "stream": "stream-loop benchmark: update latency, attention, maintenance, sessions and memory for every policy",
    "speech": "spoken answers: talker tokens/s, token2wav real-time factor and time to first audio, MLX vs PyTorch",
    "conversation": "spoken turns: end of speech to first reply audio, broken down (VAD, prefill, text, audio, "
                    "overhead)",
    "vad": "voice activity detection: Silero (MLX port) vs WebRTC vs pymicro-vad, accuracy per SNR, latency, cost",
}
