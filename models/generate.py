"""Serving with a bounded memory: chunked prefill, then decode.

* :func:`generate`: greedy decode as one compiled ``lax.scan`` (what bench/ times);
* :func:`stream`: greedy or sampled (temperature, top-p) decode of a batch of prompts
  of any lengths, yielding the tokens as they come (what ``flsmem generate`` prints).

With no ground truth at serving time the correctness weight of each prediction comes
from the model itself: by default the probability of the emitted (greedy) token.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import flsmem
from flsmem.models.decoder import Decoder, Memories, init_memories

__all__ = ["generate", "decode_step", "decode_loop", "confidence", "sample", "stream", "Step"]


def confidence(logits: jax.Array) -> jax.Array:
    """The probability of the greedy token under ``softmax(logits)`` (last axis), the
    serving proxy of a prediction's correctness: ``1 / sum(exp(logits - max))``, one
    reduction over the vocabulary after its maximum, where ``exp(max(log_softmax))``
    would write the log-probabilities out and reduce them again, every decode step."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    return 1.0 / jnp.sum(jnp.exp(logits - top), axis=-1)


def _prefill(model, memories, prompt, start, correctness):
    b, q = prompt.shape
    positions = jnp.broadcast_to(start + jnp.arange(q, dtype=jnp.int32)[None, :], (b, q))
    logits, memories, attention = model(prompt, positions, memories)
    weight = confidence(logits) if correctness == "confidence" else jnp.ones((b, q))
    return memories.fold(attention, weight), logits[:, -1]


def _prefill_all(model, memories, prompt, chunk, correctness):
    """The whole prompt in chunks of ``chunk`` tokens (a scan, then the remainder);
    returns the memories and the logits at its last token."""
    b, length = prompt.shape
    full, rest = divmod(length, chunk)
    if full:
        chunks = jnp.moveaxis(prompt[:, :full * chunk].reshape(b, full, chunk), 1, 0)

        def prefill_chunk(memories, xs):
            i, tokens = xs
            return _prefill(model, memories, tokens, i * chunk, correctness)

        memories, lasts = jax.lax.scan(prefill_chunk, memories, (jnp.arange(full), chunks))
        last = lasts[-1]
    if rest:
        memories, last = _prefill(model, memories, prompt[:, full * chunk:], full * chunk, correctness)
    return memories, last


@functools.partial(jax.jit, static_argnames=("graphdef", "config", "steps", "correctness"))
def _generate(graphdef, params, prompt, *, config, steps, correctness):
    model = nnx.merge(graphdef, params)
    memories = init_memories(model.cfg, config, prompt.shape[0])
    memories, last = _prefill_all(model, memories, prompt, config.max_chunk, correctness)
    (memories, _), tokens = decode_loop(model, memories, last, prompt.shape[1], steps, correctness)
    return jnp.moveaxis(tokens, 0, 1), memories


def decode_step(model, memories, logits, t, correctness="confidence"):
    """One greedy decode step at position ``t``: emit the argmax of ``logits``, run it
    through the model (writing its keys and values), fold the step into the memories
    and evict when due. Returns ``(memories, next_logits [B, V], token [B])``."""
    b = logits.shape[0]
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B]
    out, memories, attention = model(token[:, None], jnp.full((b, 1), t, jnp.int32), memories)
    weight = confidence(out[:, 0]) if correctness == "confidence" else jnp.ones((b,))
    memories = memories.fold(attention[:, :, :, 0], weight)
    return memories, out[:, 0], token


def decode_loop(model, memories, logits, start, steps, correctness="confidence"):
    """``steps`` decode steps from position ``start`` as a ``lax.scan`` (the serving
    loop, also what bench/ times). Returns ``((memories, logits), tokens [steps, B])``."""

    def decode(carry, t):
        memories, logits = carry
        memories, logits, token = decode_step(model, memories, logits, t, correctness)
        return (memories, logits), token

    return jax.lax.scan(decode, (memories, logits), start + jnp.arange(steps, dtype=jnp.int32))


def generate(
    model: Decoder,
    config: flsmem.MemoryConfig,
    prompt: jax.Array,
    steps: int,
    correctness: str = "confidence",
) -> tuple[jax.Array, Memories]:
    """Greedy continuation of ``prompt`` under a bounded memory.

    The prompt is prefilled ``config.max_chunk`` tokens at a time; each decode step
    writes one token, evicts when due, and emits the argmax. One compilation per
    (config, prompt shape, steps).

    Args:
      model: the decoder.
      config: memory settings (its ``max_chunk`` is the prefill chunk).
      prompt: ``[B, P]`` int token ids, ``P >= 1``.
      steps: tokens to generate.
      correctness: "confidence" (probability of the emitted token) or "none" (1).

    Returns:
      ``(tokens [B, steps], memories)``: the continuation and the final memories.
    """
    if not isinstance(config, flsmem.MemoryConfig):
        raise ValueError(f"config must be a flsmem.MemoryConfig, got {type(config).__name__}")
    prompt = jnp.asarray(prompt)
    if prompt.ndim != 2 or prompt.shape[1] < 1 or not jnp.issubdtype(prompt.dtype, jnp.integer):
        raise ValueError(f"prompt must be an int array [B, P] with P >= 1, got {prompt.dtype}{list(prompt.shape)}")
    if not (isinstance(steps, int) and steps >= 1):
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if correctness not in ("confidence", "none"):
        raise ValueError(f"correctness must be 'confidence' or 'none', got {correctness!r}")
    graphdef, params = nnx.split(model)
    return _generate(graphdef, params, prompt.astype(jnp.int32), config=config, steps=steps, correctness=correctness)


def sample(logits: jax.Array, key: jax.Array, temperature: float = 0.0, top_p: float = 1.0) -> jax.Array:
    """Next tokens ``[B]`` from ``logits [B, V]``: the argmax at temperature 0, else a draw
    at ``temperature`` from the smallest set of tokens whose probability reaches ``top_p``
    (nucleus sampling; the most likely token is always in the set)."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_p < 1.0:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        # Probability mass strictly above each token in the ordering: keep while < top_p.
        above = jnp.cumsum(probs, axis=-1) - probs
        cutoff = jnp.min(jnp.where(above < top_p, ordered, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits >= cutoff, logits, -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Step:
    """One position of :func:`stream`.

    Attributes:
      position: the position the tokens were emitted for.
      tokens: ``[B]`` the token of each prompt at this position.
      emitted: ``[B]`` bool, the token is generated (not the prompt's own) and within
        the prompt's ``steps``.
      held: most items any layer's memory row held after the step.
      evictions: items evicted so far, over all layers, rows and prompts.
    """

    position: int
    tokens: np.ndarray
    emitted: np.ndarray
    held: int
    evictions: int


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature", "top_p"))
def _decode(graphdef, params, memories, logits, forced, use_forced, position, key, *, temperature, top_p):
    """Pick each row's token at ``position`` (its prompt's, or sampled), run it through
    the model, fold the step in and evict when due."""
    model = nnx.merge(graphdef, params)
    token = jnp.where(use_forced, forced, sample(logits, key, temperature, top_p))
    b = token.shape[0]
    out, memories, attention = model(token[:, None], jnp.full((b, 1), position, jnp.int32), memories)
    weight = confidence(out[:, 0])
    memories = memories.fold(attention[:, :, :, 0], weight)
    held = jnp.max(jnp.sum(memories.evictable.valid, axis=-1))
    return memories, out[:, 0], token, held, jnp.sum(memories.evictable.stats.evictions)


@functools.partial(jax.jit, static_argnames=("graphdef", "config"))
def _start(graphdef, params, prompt, *, config):
    """Memories after every prompt's first ``P`` tokens, and the logits at the last."""
    model = nnx.merge(graphdef, params)
    memories = init_memories(model.cfg, config, prompt.shape[0])
    return _prefill_all(model, memories, prompt, config.max_chunk, "confidence")


def stream(
    model: Decoder,
    config: flsmem.MemoryConfig,
    prompts: Sequence[Sequence[int]],
    steps: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
) -> Iterator[Step]:
    """Continue every prompt by ``steps`` tokens under a bounded memory, position by position.

    The prompts may differ in length: all of them are prefilled up to the shortest one's
    length in chunks of ``config.max_chunk``; from there each decode step feeds every
    row its own prompt's next token while it has one, then its sampled token. No row
    ever sees padding, so each row generates what it would alone.

    Args:
      model: the decoder.
      config: memory settings (``max_chunk`` is the prefill chunk).
      prompts: token ids of each prompt (at least one token each).
      steps: tokens to generate for each prompt.
      temperature: 0 for greedy decoding, else the sampling temperature.
      top_p: nucleus sampling mass in (0, 1].
      seed: seed of the sampling key.

    Yields:
      A :class:`Step` per position, from the shortest prompt's end on.
    """
    if not (isinstance(steps, int) and steps >= 1):
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if not (isinstance(temperature, (int, float)) and temperature >= 0):
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    lengths = np.array([len(p) for p in prompts])
    if len(prompts) < 1 or lengths.min() < 1:
        raise ValueError("prompts must be one or more non-empty token lists")
    end = int(lengths.max()) + steps
    padded = np.zeros((len(prompts), end), np.int32)
    for row, ids in zip(padded, prompts):
        row[:len(ids)] = ids
    graphdef, params = nnx.split(model)
    first = int(lengths.min())
    memories, logits = _start(graphdef, params, jnp.asarray(padded[:, :first]), config=config)
    key = jax.random.key(seed)
    for position in range(first, end):
        use_forced = position < lengths
        memories, logits, token, held, evictions = _decode(
            graphdef, params, memories, logits, jnp.asarray(padded[:, position]), jnp.asarray(use_forced),
            position, jax.random.fold_in(key, position), temperature=float(temperature), top_p=float(top_p))
        emitted = ~use_forced & (position < lengths + steps)
        yield Step(position, np.asarray(token), emitted, int(held), int(evictions))
