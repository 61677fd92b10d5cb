"""Byte-level BPE tokenizers rebuilt from a GGUF file's vocabulary and merges.

A GGUF file carries its tokenizer as metadata (``tokenizer.ggml.*``): the vocabulary in
id order, the merges, each token's type, and the name of the pre-tokenizer (how text is
split before BPE). :class:`Tokenizer` rebuilds it with Hugging Face's ``tokenizers``
for the byte-level BPE families of :data:`PRE_TOKENIZERS`; any other is refused by
name, since a wrong pre-tokenizer tokenizes silently wrong.
"""

from __future__ import annotations

import numpy as np

__all__ = ["PRE_TOKENIZERS", "Tokenizer"]

# GGUF token type of control tokens (<|im_start|>, <|endoftext|>, ...): llama.cpp's
# LLAMA_TOKEN_TYPE_CONTROL, gguf.TokenType.CONTROL.
_CONTROL = 3

# Split patterns of llama.cpp's pre-tokenizers (tokenizer.ggml.pre), before byte-level BPE.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# pre-tokenizer name -> (digits split one by one first, regex or None for GPT-2's own).
PRE_TOKENIZERS = {
    "smollm": (True, None),
    "gpt2": (False, None),
    "default": (False, None),
    "llama-bpe": (False, _LLAMA3),
    "qwen2": (False, _QWEN2),
}


def _field(reader, key: str, default=None):
    if key in reader.fields:
        return reader.fields[key].contents()
    if default is None:
        raise ValueError(f"GGUF metadata has no {key!r}")
    return default


class Tokenizer:
    """A byte-level BPE tokenizer with llama.cpp's pre-tokenizer of the same name.

    Control tokens (``<|im_start|>``, ...) are matched as single tokens where they
    appear literally in the text, as Hugging Face does. No BOS token is added.

    Attributes:
      vocab_size: tokens in the vocabulary.
      bos_id: id of the beginning-of-sequence token (None if the file names none).
      eos_id: id of the end-of-sequence token (None if the file names none).
    """

    def __init__(self, tokens: list[str], merges: list[str], token_types: list[int], bos_id, eos_id,
                 pre: str = "smollm"):
        """Builds the tokenizer.

        Args:
          tokens: the vocabulary, in id order, as byte-level strings (``Ġ`` for space).
          merges: BPE merges in priority order, each ``"left right"``.
          token_types: GGUF token type of each token (3 marks control tokens).
          bos_id: beginning-of-sequence id, or None.
          eos_id: end-of-sequence id, or None.
          pre: the pre-tokenizer, one of :data:`PRE_TOKENIZERS`.
        """
        try:
            from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise ImportError('GGUF tokenizers need "tokenizers": pip install -e ".[real]"') from None
        if pre not in PRE_TOKENIZERS:
            raise ValueError(f"pre-tokenizer {pre!r} is not supported; supported: {', '.join(PRE_TOKENIZERS)}")
        vocab = {t: i for i, t in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise ValueError("GGUF vocabulary has duplicate tokens")
        # Byte-level tokens never hold a literal space (it is mapped to "Ġ"), so one split is safe.
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        tok = HFTokenizer(models.BPE(vocab, pairs))
        digits, pattern = PRE_TOKENIZERS[pre]
        steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
        if pattern is None:
            steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
        else:
            steps += [pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([
            AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, token_types) if kind == _CONTROL
        ])
        self._tok = tok
        self.vocab_size = len(tokens)
        self.bos_id = None if bos_id is None else int(bos_id)
        self.eos_id = None if eos_id is None else int(eos_id)

    @classmethod
    def from_gguf(cls, reader) -> "Tokenizer":
        """The tokenizer described by a ``gguf.GGUFReader``'s ``tokenizer.ggml.*`` metadata."""
        model = _field(reader, "tokenizer.ggml.model")
        pre = _field(reader, "tokenizer.ggml.pre", "default")
        if model != "gpt2" or pre not in PRE_TOKENIZERS:
            raise ValueError(f"tokenizer {model!r} with pre-tokenizer {pre!r} is not supported; supported: "
                             f"byte-level BPE ('gpt2') with {', '.join(PRE_TOKENIZERS)}")
        tokens = _field(reader, "tokenizer.ggml.tokens")
        return cls(
            tokens=tokens,
            merges=_field(reader, "tokenizer.ggml.merges", []),
            token_types=_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)),
            bos_id=reader.fields["tokenizer.ggml.bos_token_id"].contents()
            if "tokenizer.ggml.bos_token_id" in reader.fields else None,
            eos_id=reader.fields["tokenizer.ggml.eos_token_id"].contents()
            if "tokenizer.ggml.eos_token_id" in reader.fields else None,
            pre=pre,
        )

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` (no BOS), as an int32 vector."""
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

    def decode(self, ids) -> str:
        """Text of token ids; control tokens are kept, so ``decode(encode(s)) == s``."""
        return self._tok.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=False)

    def token(self, token_id: int) -> str:
        """The vocabulary entry (byte-level string) of one id."""
        return self._tok.id_to_token(int(token_id))
