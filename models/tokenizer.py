"""Tokenizers rebuilt from a GGUF file's metadata with Hugging Face's ``tokenizers``.

A GGUF file carries its tokenizer as metadata (``tokenizer.ggml.*``): the vocabulary in
id order, each token's type, and either

* ``model = "gpt2"``: byte-level BPE with its merges and the name of the pre-tokenizer
  (how text is split before BPE), for the families of :data:`PRE_TOKENIZERS` (SmolLM2,
  Llama 3, Qwen2); any other pre-tokenizer is refused by name, since a wrong one
  tokenizes silently wrong; or
* ``model = "llama"``: SentencePiece BPE (Gemma, Llama 2, TinyLlama): no merges, but a
  score per token; spaces are written ``▁`` and characters outside the vocabulary fall
  back to byte tokens ``<0xNN>``. SentencePiece merges, at each step, the adjacent pair
  whose joined piece has the highest score; a BPE whose merge list is every split of
  every piece, ranked by that piece's score, makes the same choices.
"""

from __future__ import annotations

import numpy as np

__all__ = ["MODELS", "PRE_TOKENIZERS", "Tokenizer"]

# GGUF token type of control tokens (<|im_start|>, <|endoftext|>, ...): llama.cpp's
# LLAMA_TOKEN_TYPE_CONTROL, gguf.TokenType.CONTROL.
_CONTROL = 3
# LLAMA_TOKEN_TYPE_USER_DEFINED: pieces matched literally in the raw text (Gemma's runs of
# newlines, spaces and tabs, HTML tags), before anything else.
_USER_DEFINED = 4
_SPACE = "\u2581"  # SentencePiece's visible space, ▁
MODELS = ("gpt2", "llama")

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
    """A tokenizer rebuilt from GGUF metadata: byte-level BPE or SentencePiece BPE.

    Control tokens (``<|im_start|>``, ``<start_of_turn>``, ...) are matched as single
    tokens where they appear literally in the text, as Hugging Face and llama.cpp do.
    :meth:`encode` adds no BOS token; ``add_bos`` says whether the model expects one at
    the start of a sequence (Gemma does), which callers place themselves.

    Attributes:
      vocab_size: tokens in the vocabulary.
      bos_id: id of the beginning-of-sequence token (None if the file names none).
      eos_id: id of the end-of-sequence token (None if the file names none).
      add_bos: the model expects ``bos_id`` first in every sequence.
    """

    def __init__(self, tokenizer, vocab_size: int, bos_id=None, eos_id=None, add_bos: bool = False):
        """Wraps a built ``tokenizers.Tokenizer``; use :meth:`byte_level`,
        :meth:`sentencepiece` or :meth:`from_gguf`."""
        self._tok = tokenizer
        self.vocab_size = int(vocab_size)
        self.bos_id = None if bos_id is None else int(bos_id)
        self.eos_id = None if eos_id is None else int(eos_id)
        self.add_bos = bool(add_bos) and self.bos_id is not None

    @classmethod
    def byte_level(cls, tokens: list[str], merges: list[str], token_types: list[int], bos_id=None, eos_id=None,
                   pre: str = "smollm", add_bos: bool = False) -> "Tokenizer":
        """Byte-level BPE (GGUF ``model = "gpt2"``).

        Args:
          tokens: the vocabulary, in id order, as byte-level strings (``Ġ`` for space).
          merges: BPE merges in priority order, each ``"left right"``.
          token_types: GGUF token type of each token (3 marks control tokens).
          bos_id: beginning-of-sequence id, or None.
          eos_id: end-of-sequence id, or None.
          pre: the pre-tokenizer, one of :data:`PRE_TOKENIZERS`.
          add_bos: the model expects BOS first.
        """
        hf = _hf()
        if pre not in PRE_TOKENIZERS:
            raise ValueError(f"pre-tokenizer {pre!r} is not supported; supported: {', '.join(PRE_TOKENIZERS)}")
        # Byte-level tokens never hold a literal space (it is mapped to "Ġ"), so one split is safe.
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        tok = hf.Tokenizer(hf.models.BPE(_vocabulary(tokens), pairs))
        digits, pattern = PRE_TOKENIZERS[pre]
        steps = [hf.pre_tokenizers.Digits(individual_digits=True)] if digits else []
        if pattern is None:
            steps.append(hf.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
        else:
            steps += [hf.pre_tokenizers.Split(hf.Regex(pattern), behavior="isolated"),
                      hf.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        tok.pre_tokenizer = hf.pre_tokenizers.Sequence(steps)
        tok.decoder = hf.decoders.ByteLevel()
        _add_literal_tokens(tok, tokens, token_types)
        return cls(tok, len(tokens), bos_id, eos_id, add_bos)

    @classmethod
    def sentencepiece(cls, tokens: list[str], scores: list[float], token_types: list[int], bos_id=None,
                      eos_id=None, add_space_prefix: bool = False, add_bos: bool = True) -> "Tokenizer":
        """SentencePiece BPE (GGUF ``model = "llama"``).

        Args:
          tokens: the pieces, in id order (``▁`` for space, ``<0xNN>`` byte tokens).
          scores: each piece's score; higher merges first.
          token_types: GGUF token type of each token (3 control, 4 user-defined, 6 byte).
          bos_id: beginning-of-sequence id, or None.
          eos_id: end-of-sequence id, or None.
          add_space_prefix: a ``▁`` is put before the text (Llama 2; not Gemma).
          add_bos: the model expects BOS first.
        """
        hf = _hf()
        vocab = _vocabulary(tokens)
        tok = hf.Tokenizer(hf.models.BPE(vocab, _merges_by_score(tokens, scores, token_types), byte_fallback=True,
                                         fuse_unk=True, unk_token=None))
        spaces = [hf.normalizers.Replace(" ", _SPACE)]
        tok.normalizer = hf.normalizers.Sequence(([hf.normalizers.Prepend(_SPACE)] if add_space_prefix else [])
                                                 + spaces)
        steps = [hf.decoders.Replace(_SPACE, " "), hf.decoders.ByteFallback(), hf.decoders.Fuse()]
        tok.decoder = hf.decoders.Sequence(steps + ([hf.decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
        _add_literal_tokens(tok, tokens, token_types)
        return cls(tok, len(tokens), bos_id, eos_id, add_bos)

    @classmethod
    def from_gguf(cls, reader) -> "Tokenizer":
        """The tokenizer described by a ``gguf.GGUFReader``'s ``tokenizer.ggml.*`` metadata.

        Raises:
          ValueError: a tokenizer model other than :data:`MODELS`, or a byte-level
            pre-tokenizer other than :data:`PRE_TOKENIZERS`, named with what is supported.
        """
        model = _field(reader, "tokenizer.ggml.model")
        pre = _field(reader, "tokenizer.ggml.pre", "default")
        if model not in MODELS or (model == "gpt2" and pre not in PRE_TOKENIZERS):
            raise ValueError(f"tokenizer {model!r} with pre-tokenizer {pre!r} is not supported; supported: "
                             f"SentencePiece BPE ('llama'), byte-level BPE ('gpt2') with {', '.join(PRE_TOKENIZERS)}")
        tokens = _field(reader, "tokenizer.ggml.tokens")
        optional = lambda key: reader.fields[key].contents() if key in reader.fields else None  # noqa: E731
        common = dict(token_types=_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)),
                      bos_id=optional("tokenizer.ggml.bos_token_id"), eos_id=optional("tokenizer.ggml.eos_token_id"))
        add_bos = optional("tokenizer.ggml.add_bos_token")
        if model == "gpt2":
            return cls.byte_level(tokens, _field(reader, "tokenizer.ggml.merges", []), pre=pre,
                                  add_bos=bool(add_bos), **common)
        return cls.sentencepiece(tokens, _field(reader, "tokenizer.ggml.scores"),
                                 add_space_prefix=bool(optional("tokenizer.ggml.add_space_prefix")),
                                 add_bos=True if add_bos is None else bool(add_bos), **common)

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` (no BOS), as an int32 vector."""
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

    def decode(self, ids) -> str:
        """Text of token ids; control tokens are kept, so ``decode(encode(s)) == s``."""
        return self._tok.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=False)

    def token(self, token_id: int) -> str:
        """The vocabulary entry (byte-level string or piece) of one id."""
        return self._tok.id_to_token(int(token_id))


def _hf():
    try:
        import tokenizers
    except ImportError:
        raise ImportError('GGUF tokenizers need "tokenizers": pip install -e ".[real]"') from None
    return tokenizers


def _vocabulary(tokens: list[str]) -> dict[str, int]:
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF vocabulary has duplicate tokens")
    return vocab


def _add_literal_tokens(tok, tokens: list[str], token_types: list[int]) -> None:
    """Control and user-defined tokens match as one token wherever they appear in the raw text."""
    hf = _hf()
    tok.add_special_tokens([hf.AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, token_types) if kind == _CONTROL])
    tok.add_tokens([hf.AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, token_types) if kind == _USER_DEFINED])


def _merges_by_score(tokens: list[str], scores: list[float], token_types: list[int]) -> list[tuple[str, str]]:
    """Every split ``(left, right)`` of every normal piece into two pieces of the
    vocabulary, ranked by the joined piece's score (higher first), then by the two
    halves' ids: the merge order that reproduces SentencePiece's score-greedy BPE."""
    _NORMAL = 1
    vocab = {t: i for i, t in enumerate(tokens) if token_types[i] == _NORMAL}
    ranked = []
    for piece, i in vocab.items():
        for cut in range(1, len(piece)):
            left, right = vocab.get(piece[:cut]), vocab.get(piece[cut:])
            if left is not None and right is not None:
                ranked.append((-scores[i], i, left, right))
    ranked.sort()
    return [(tokens[left], tokens[right]) for _, _, left, right in ranked]
