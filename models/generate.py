"""Serving with a bounded memory: chunked prefill, then greedy decode as a ``lax.scan``.

With no ground truth at serving time the correctness weight of each prediction comes
from the model itself: by default the probability of the emitted (greedy) token.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

import flsmem
from flsmem.models.decoder import Decoder, init_memories

__all__ = ["generate", "decode_step", "decode_loop"]


def _prefill(model, memories, prompt, start, correctness):
    b, q = prompt.shape
    positions = jnp.broadcast_to(start + jnp.arange(q, dtype=jnp.int32)[None, :], (b, q))
    logits, memories, attention = model(prompt, positions, memories)
    logp = jax.nn.log_softmax(logits, axis=-1)
    weight = jnp.exp(jnp.max(logp, axis=-1)) if correctness == "confidence" else jnp.ones((b, q))
    return flsmem.update_layers(memories, attention, weight), logits[:, -1]


@functools.partial(jax.jit, static_argnames=("graphdef", "config", "steps", "correctness"))
def _generate(graphdef, params, prompt, *, config, steps, correctness):
    model = nnx.merge(graphdef, params)
    b, length = prompt.shape
    chunk = config.max_chunk
    memories = init_memories(model.cfg, config, b)
    full, rest = divmod(length, chunk)
    if full:
        chunks = jnp.moveaxis(prompt[:, :full * chunk].reshape(b, full, chunk), 1, 0)

        def prefill_chunk(memories, xs):
            i, tokens = xs
            memories, last = _prefill(model, memories, tokens, i * chunk, correctness)
            return memories, last

        memories, lasts = jax.lax.scan(prefill_chunk, memories, (jnp.arange(full), chunks))
        last = lasts[-1]
    if rest:
        memories, last = _prefill(model, memories, prompt[:, full * chunk:], full * chunk, correctness)

    (memories, _), tokens = decode_loop(model, memories, last, length, steps, correctness)
    return jnp.moveaxis(tokens, 0, 1), memories


def decode_step(model, memories, logits, t, correctness="confidence"):
    """One greedy decode step at position ``t``: emit the argmax of ``logits``, run it
    through the model (writing its keys and values), fold the step into the memories
    and evict when due. Returns ``(memories, next_logits [B, V], token [B])``."""
    b = logits.shape[0]
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B]
    out, memories, attention = model(token[:, None], jnp.full((b, 1), t, jnp.int32), memories)
    logp = jax.nn.log_softmax(out[:, 0], axis=-1)
    weight = jnp.exp(jnp.max(logp, axis=-1)) if correctness == "confidence" else jnp.ones((b,))
    memories = flsmem.update_layers(memories, attention[:, :, :, 0], weight)
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
) -> tuple[jax.Array, flsmem.MemoryState]:
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
