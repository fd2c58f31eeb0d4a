"""Random tiny llama GGUF files in the layout llama.cpp writes, for tests without the real weights.

``write_tiny_gguf(path)`` writes a 2-layer llama (GQA, traditional-RoPE-permuted q / k as llama.cpp's converter
leaves them) with a byte-level BPE vocabulary trained on a few sentences, the ChatML markers as control tokens, and
its weights in a mix of types (F32, Q8_0, Q4_1: the real SmolLM2 file's), so the reader's dequantisation runs on
every type it meets there. llama.cpp (``llama-cpp-python``) loads the same file, which makes it the common input of
the parity test. Every parameter is random (norm weights too): no bug hides behind a default.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .gguf_file import GGUFError

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is the code?<|im_end|>\n"
    "<|im_start|>assistant\nThe code is 4172.<|im_end|>\n",
    "[00:12] The wifi password is falcon. The hallway lights flicker for a moment.",
    "[01:07] A delivery truck parks outside the main gate; two visitors sign in at the front desk.",
    "Question: what is the name of the office cat? Answer: the name of the office cat is maple.",
]
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")


def train_vocab(vocab_size: int = 400) -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary (specials first, then the 256 byte symbols and the merges) and its merges, with
    the ``smollm`` pre-tokenizer (digits one by one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    import json

    model = json.loads(tok.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def write_tiny_gguf(path: str | os.PathLike, *, seed: int = 0, layers: int = 2, hidden: int = 64, heads: int = 4,
                    kv_heads: int = 2, ffn: int = 128, rope_theta: float = 10000.0, quantized: bool = True) -> Path:
    """Write the tiny model to ``path`` and return it. ``quantized`` False keeps every tensor F32 (the parity test
    against llama.cpp: its CPU kernels quantise activations for quantised weights)."""
    try:
        import gguf
        from gguf import GGMLQuantizationType as Q
    except ImportError:
        raise GGUFError("writing GGUF files needs the `gguf` package (`pip install gguf`)") from None
    path = Path(path)
    rng = np.random.default_rng(seed)
    tokens, merges = train_vocab()
    vocab = len(tokens)
    head_dim = hidden // heads

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_block_count(layers)
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(rope_theta)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)

    def add(name: str, shape: tuple[int, ...], qtype=None, scale: float | None = None, norm: bool = False):
        if norm:
            x = (1.0 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
        else:
            x = (rng.standard_normal(shape) * (scale or shape[-1] ** -0.5)).astype(np.float32)
        if qtype is None or not quantized:
            w.add_tensor(name, x)
        else:
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)

    add("token_embd.weight", (vocab, hidden), Q.Q8_0, scale=1.0)
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", (hidden,), norm=True)
        add(f"blk.{i}.attn_q.weight", (heads * head_dim, hidden), Q.Q4_1)
        add(f"blk.{i}.attn_k.weight", (kv_heads * head_dim, hidden), Q.Q4_1)
        add(f"blk.{i}.attn_v.weight", (kv_heads * head_dim, hidden), Q.Q4_1)
        add(f"blk.{i}.attn_output.weight", (hidden, heads * head_dim), Q.Q4_1)
        add(f"blk.{i}.ffn_norm.weight", (hidden,), norm=True)
        add(f"blk.{i}.ffn_gate.weight", (ffn, hidden), Q.Q4_1)
        add(f"blk.{i}.ffn_up.weight", (ffn, hidden), Q.Q4_1)
        add(f"blk.{i}.ffn_down.weight", (hidden, ffn), Q.Q4_1)
    add("output_norm.weight", (hidden,), norm=True)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
