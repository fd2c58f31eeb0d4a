"""The byte-level BPE tokenizer embedded in a GGUF file, rebuilt with the ``tokenizers`` package.

GGUF stores the vocabulary (``tokenizer.ggml.tokens``), the merges and each token's type; the pre-tokenizer is
named (``tokenizer.ggml.pre``). ``smollm`` splits every digit on its own before the GPT-2 byte-level split (as
llama.cpp does for it); ``gpt2`` / ``default`` use the byte-level split alone. Control and user-defined tokens
(``<|im_start|>``, ``<|im_end|>``, ...) are special: they are matched whole in text and dropped when decoding.
"""

from __future__ import annotations

from .gguf_file import GGUFError, TokenizerFields

CONTROL, USER_DEFINED = 3, 4
SUPPORTED_PRE = ("smollm", "gpt2", "default")


class GGUFTokenizer:
    def __init__(self, fields: TokenizerFields):
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        if fields.model != "gpt2":
            raise GGUFError(f"tokenizer model {fields.model!r} is not supported (only byte-level BPE, 'gpt2')")
        if fields.pre not in SUPPORTED_PRE:
            raise GGUFError(f"pre-tokenizer {fields.pre!r} is not supported (supported: {', '.join(SUPPORTED_PRE)})")
        vocab = {tok: i for i, tok in enumerate(fields.tokens)}
        if len(vocab) != len(fields.tokens):
            raise GGUFError("the GGUF vocabulary holds duplicate tokens")
        merges = []
        for m in fields.merges:
            a, sep, b = m.partition(" ")
            if not sep:
                raise GGUFError(f"malformed merge {m!r} in the GGUF tokenizer")
            merges.append((a, b))
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if fields.pre == "smollm":
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:
            tok.pre_tokenizer = byte_level
        tok.decoder = decoders.ByteLevel()
        types = fields.token_types or [1] * len(fields.tokens)
        self.special_ids = frozenset(i for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED))
        tok.add_special_tokens([AddedToken(fields.tokens[i], special=True, normalized=False)
                                for i in sorted(self.special_ids)])
        self._tok = tok
        self.tokens = fields.tokens
        self.bos_id, self.eos_id = fields.bos_id, fields.eos_id
        self.chat_template = fields.chat_template

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (``<|im_start|>``) become their ids."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise GGUFError(f"token {token!r} is not in the vocabulary")
        return i
