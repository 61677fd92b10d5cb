"""The two decode loops that the benchmarks compare, and caches to start them from.

* The flsmem loop is the library's own serving loop, :func:`flsmem.models.generate.decode_loop`
  (write, attend, observe, smooth, evict when due).
* The plain loop is the same decoder (same parameters, same modules) with a plain
  fixed-size cache: a ring of ``slots`` key/value slots per layer, the new token written
  at ``position % slots``, no scores, no eviction. With ``slots`` at least the context
  it is the full cache.

Both start from a cache filled with random keys and values (see
:func:`bench.common.random_kv`): filling it by prefill would cost minutes on CPU for
SmolLM2 at 8k positions and would not change what one decode step costs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

import flsmem
from bench.common import random_kv
from flsmem.models.decoder import Decoder, DecoderConfig, Memories, init_memories, rope
from flsmem.models.generate import decode_loop

__all__ = ["PlainCache", "plain_cache", "plain_step", "plain_loop", "steady_memories", "run_plain", "run_flsmem"]


def PlainCache(k, v, position):  # noqa: N802 - a plain dict is the whole cache
    """``{"k", "v": [L, B, K, S, D], "position": [S] int32 (-1 free)}``."""
    return {"k": k, "v": v, "position": position}


def plain_cache(cfg: DecoderConfig, batch: int, slots: int, filled: int, key) -> dict:
    """A ring cache of ``slots`` slots holding positions ``filled - slots .. filled - 1``
    (those that are >= 0) at slot ``position % slots``."""
    k, v = random_kv(key, (cfg.depth, batch, cfg.kv_heads, slots, cfg.head_dim))
    slot = jnp.arange(slots, dtype=jnp.int32)
    # The latest position stored in each slot: p = slot + slots * m, the largest < filled.
    newest = slot + slots * ((filled - 1 - slot) // slots)
    position = jnp.where(slot < filled, newest, -1).astype(jnp.int32)
    return PlainCache(k, v, position)


def plain_step(model: Decoder, cache: dict, logits, t):
    """One greedy decode step at position ``t`` with the plain ring cache.

    Built like the flsmem path of :class:`flsmem.models.decoder.Decoder`: the caches of all
    layers ride in the layer loop's carry and the new key and value are written in
    place at this layer's index; only the memory bookkeeping differs.
    """
    cfg = model.cfg
    b = logits.shape[0]
    slots = cache["position"].shape[0]
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    positions = jnp.full((b, 1), t, jnp.int32)
    slot = t % slots
    position = cache["position"].at[slot].set(t)
    visible = position >= 0  # [S]: a ring only holds the past
    scale = cfg.head_dim ** -0.5
    graphdef, stacked = nnx.split(model.blocks)
    zero = jnp.zeros((), jnp.int32)

    def layer(carry, per_layer):
        x, k_all, v_all = carry
        params, index = per_layer
        block = nnx.merge(graphdef, params)
        attn = block.attn
        h = block.attn_norm(x)
        q = rope(attn.q(h).reshape(b, 1, cfg.kv_heads, cfg.group, cfg.head_dim), positions, cfg.rope_theta)
        k = rope(attn.k(h).reshape(b, 1, cfg.kv_heads, cfg.head_dim), positions, cfg.rope_theta)
        v = attn.v(h).reshape(b, 1, cfg.kv_heads, cfg.head_dim)
        at = (index, zero, zero, slot, zero)
        k_all = jax.lax.dynamic_update_slice(k_all, jnp.swapaxes(k, 1, 2)[None].astype(k_all.dtype), at)
        v_all = jax.lax.dynamic_update_slice(v_all, jnp.swapaxes(v, 1, 2)[None].astype(v_all.dtype), at)
        # The products of flsmem.attend, in its layout (slots last, queries as [B, K, G, T, D]),
        # so that the two loops differ only in the memory's bookkeeping.
        queries = jnp.moveaxis(q, 1, 3)
        scores = jnp.einsum("BKGTD,BKSD->BKGTS", queries, k_all[index]) * scale
        probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
        out = jnp.moveaxis(jnp.einsum("BKGTS,BKSD->BKGTD", probs, v_all[index]), 3, 1)
        x = x + attn.o(out.reshape(b, 1, -1))
        return (x + block.mlp(block.mlp_norm(x)), k_all, v_all), None

    carry = (model.embed(token[:, None]), cache["k"], cache["v"])
    (x, k_all, v_all), _ = jax.lax.scan(layer, carry, (stacked, jnp.arange(cfg.depth)))
    x = model.norm(x)
    out = model.embed.attend(x) if model.head is None else model.head(x)
    return PlainCache(k_all, v_all, position), out[:, 0].astype(jnp.float32), token


def plain_loop(model: Decoder, cache: dict, logits, start, steps: int):
    """``steps`` plain decode steps from position ``start`` as a ``lax.scan``."""

    def decode(carry, t):
        cache, logits = carry
        cache, logits, token = plain_step(model, cache, logits, t)
        return (cache, logits), token

    return jax.lax.scan(decode, (cache, logits), start + jnp.arange(steps, dtype=jnp.int32))


def steady_memories(cfg: DecoderConfig, config: flsmem.MemoryConfig, batch: int, filled: int, key) -> Memories:
    """Stacked memories in steady state at step ``filled``: the ``min(budget, filled)``
    latest positions resident, random keys, values and evidence, so that eviction falls
    due every ``evict_every`` steps from here on."""
    memories = init_memories(cfg, config, batch).evictable  # the models timed here have no local layers
    depth, _, heads, slots = memories.valid.shape
    n = min(config.budget, filled, slots)
    slot = jnp.arange(slots, dtype=jnp.int32)
    rows = (depth, batch, heads, slots)
    valid = jnp.broadcast_to(slot < n, rows)
    position = jnp.broadcast_to(jnp.where(slot < n, filled - n + slot, -1), rows).astype(jnp.int32)
    k_key, e_key = jax.random.split(key)
    k, v = random_kv(k_key, rows + (cfg.head_dim,))
    e_keys = jax.random.split(e_key, len(memories.evidence))
    evidence = tuple(jax.random.uniform(e, array.shape, jnp.float32) for e, array in zip(e_keys, memories.evidence))
    return Memories(evictable=memories.replace(
        payload={"k": k, "v": v},
        position=position,
        valid=valid,
        birth=jnp.maximum(position, 0),  # one item per step from step 0: birth == position
        evidence=tuple(jnp.where(valid.reshape(rows + (1,) * (e.ndim - 4)), e, 0.0) for e in evidence),
        step=jnp.full((depth, batch), filled, jnp.int32),
    ))


# The cache is donated: the loop updates it in place, as a server would, rather than
# copying it once per call (a copy that would weigh more on the larger cache).
@functools.partial(jax.jit, static_argnames=("graphdef", "steps"), donate_argnums=(2,))
def run_plain(graphdef, params, cache, logits, start, *, steps):
    """The jitted plain loop; returns the final cache and logits."""
    return plain_loop(nnx.merge(graphdef, params), cache, logits, start, steps)[0]


@functools.partial(jax.jit, static_argnames=("graphdef", "steps"), donate_argnums=(2,))
def run_flsmem(graphdef, params, memories, logits, start, *, steps):
    """The jitted flsmem serving loop; returns the final memories and logits."""
    return decode_loop(nnx.merge(graphdef, params), memories, logits, start, steps)[0]
