"""Reading a llama-architecture GGUF file: its config, its weights dequantised to float32, its tokenizer fields.

The ``gguf`` package (pure numpy, a test / bench dependency) parses the file and dequantises every tensor type
into the Hugging Face ``(out, in)`` layout. Two facts matter downstream:

- llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` inside each head so that the rotary pairs are
  interleaved (GGML's ``rope`` rotates channels ``(2i, 2i+1)``). We keep the weights as they are and rotate with
  *traditional* RoPE (``RopeSpec(traditional=True)``): q and k are permuted the same way, so every attention score
  equals the Hugging Face model's, and the cache re-rotates the stored keys with the same interleaved pairs.
- A tied output projection has no ``output.weight``; the token embedding serves as both.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...errors import OmniTideError


class GGUFError(OmniTideError, ValueError):
    """A GGUF file that cannot be used here: says which file and why."""


@dataclass(frozen=True)
class LlamaConfig:
    """The decoder's shape, from the ``llama.*`` metadata."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    context_length: int
    tie_word_embeddings: bool

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class TokenizerFields:
    """What the file says about its tokenizer (``tokenizer.ggml.*``)."""

    model: str  # "gpt2" (byte-level BPE) is the one supported here
    pre: str  # pre-tokenizer name, e.g. "smollm" (digits split one by one) or "gpt2"
    tokens: list[str]
    token_types: list[int]  # 1 normal, 3 control, 4 user defined, ...
    merges: list[str]
    bos_id: int | None
    eos_id: int | None
    chat_template: str | None


def _field(reader, key: str, default=None, required: bool = True):
    f = reader.fields.get(key)
    if f is None:
        if required:
            raise GGUFError(f"{reader.path}: metadata {key!r} is missing (not a llama GGUF file?)")
        return default
    return f.contents()


def open_gguf(path: str | os.PathLike):
    """A ``gguf.GGUFReader`` for ``path``, with clear errors for a missing package or a bad file."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise GGUFError(f"GGUF file {p} does not exist")
    try:
        import gguf
    except ImportError:
        raise GGUFError("reading GGUF files needs the `gguf` package (`pip install gguf`, part of the dev extra)"
                        ) from None
    try:
        reader = gguf.GGUFReader(str(p))
    except Exception as e:  # the reader raises ValueError / struct errors / numpy errors on a bad file
        raise GGUFError(f"{p} is not a readable GGUF file: {e}") from None
    reader.path = p
    return reader


def read_config(reader) -> LlamaConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise GGUFError(f"{reader.path}: architecture {arch!r} is not supported here (only 'llama')")
    heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    names = {t.name for t in reader.tensors}
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise GGUFError(f"{reader.path}: no token_embd.weight tensor")
    vocab = int(_field(reader, "llama.vocab_size", default=int(embd.shape[1]), required=False))
    head_dim = int(_field(reader, "llama.rope.dimension_count", default=hidden // heads, required=False))
    if head_dim * heads != hidden:
        raise GGUFError(f"{reader.path}: rope dimension {head_dim} x {heads} heads != hidden size {hidden} "
                        "(partial RoPE is not supported)")
    return LlamaConfig(
        vocab_size=vocab, hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_hidden_layers=int(_field(reader, "llama.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, "llama.attention.head_count_kv", default=heads, required=False)),
        head_dim=head_dim,
        rope_theta=float(_field(reader, "llama.rope.freq_base", default=10000.0, required=False)),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        context_length=int(_field(reader, "llama.context_length", default=2048, required=False)),
        tie_word_embeddings="output.weight" not in names,
    )


def read_tokenizer_fields(reader) -> TokenizerFields:
    def opt_int(key):
        v = _field(reader, key, required=False)
        return None if v is None else int(v)

    return TokenizerFields(
        model=str(_field(reader, "tokenizer.ggml.model")),
        pre=str(_field(reader, "tokenizer.ggml.pre", default="default", required=False)),
        tokens=list(_field(reader, "tokenizer.ggml.tokens")),
        token_types=[int(x) for x in _field(reader, "tokenizer.ggml.token_type", default=[], required=False)],
        merges=list(_field(reader, "tokenizer.ggml.merges", default=[], required=False)),
        bos_id=opt_int("tokenizer.ggml.bos_token_id"),
        eos_id=opt_int("tokenizer.ggml.eos_token_id"),
        chat_template=_field(reader, "tokenizer.chat_template", required=False),
    )


# GGUF tensor name -> the model's parameter name (blk.N.* per layer)
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def parameter_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (and the top-level tensors)."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES and parts[3] == "weight":
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
    raise GGUFError(f"unexpected tensor {gguf_name!r} in a llama GGUF file")


def read_weights(reader) -> dict[str, np.ndarray]:
    """Every tensor dequantised to float32 in the ``(out, in)`` layout, under the model's parameter names."""
    from gguf.quants import dequantize

    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            raise GGUFError(f"{reader.path}: rope_freqs (scaled RoPE) is not supported")
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise GGUFError(f"{reader.path}: cannot dequantise {t.name} ({t.tensor_type.name}): {e}") from None
        out[parameter_name(t.name)] = np.ascontiguousarray(w, dtype=np.float32)
    return out
