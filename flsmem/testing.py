"""Small builders for tests, examples and notebooks (in the spirit of ``gm.testing``).

Attention in these helpers comes from a *table* ``[B, K, T, T]``: entry ``[b, k, t, p]``
is what query ``t`` gives the item at position ``p``. Reading the table through the
memory's current slots gives every schedule (chunked or per step, any slot layout)
the same evidence for the same item, which is what equivalence tests need. The oracle's
table of future attention is :func:`flsmem.oracle_future.discounted_future` of it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flsmem import policies
from flsmem.config import MemoryConfig
from flsmem.state import MemoryState, init
from flsmem.typing import Array, Float

__all__ = ["tiny_config", "tiny_memory", "attention_table", "gather_attention", "kept_positions"]

HEAD_DIM = 4


def tiny_config(policy: policies.Policy | None = None, budget: int = 8, **kwargs) -> MemoryConfig:
    """A small config (H2O with a 2-item recent window unless told otherwise)."""
    return MemoryConfig(policy=policy or policies.h2o(recent=2), budget=budget, **kwargs)


def tiny_memory(config: MemoryConfig | None = None, batch: int = 2, kv_heads: int = 2) -> MemoryState:
    """An empty KV-cache memory with ``{"k", "v"}`` payloads of ``HEAD_DIM``."""
    spec = {"k": (HEAD_DIM,), "v": (HEAD_DIM,)}
    return init(config or tiny_config(), batch, kv_heads, spec)


def attention_table(key: jax.Array, batch: int, kv_heads: int, steps: int) -> Float[Array, "B K T T"]:
    """Causal softmax attention of ``steps`` queries over ``steps`` positions, with a
    few heavy-hitter positions so that policies disagree."""
    k1, k2 = jax.random.split(key)
    logits = jax.random.normal(k1, (batch, kv_heads, steps, steps))
    heavy = 3.0 * jax.random.bernoulli(k2, 0.15, (batch, kv_heads, 1, steps))
    causal = jnp.tril(jnp.ones((steps, steps), jnp.bool_))
    return jax.nn.softmax(jnp.where(causal, logits + heavy, -jnp.inf), axis=-1)


def gather_attention(table: Float[Array, "B K T T"], state: MemoryState, queries: int = 1) -> Float[Array, "B K Q S"]:
    """Rows ``step .. step + queries - 1`` of the table, read at each slot's position
    (0 for free slots and positions the query cannot see)."""
    t = state.step[:, None, None, None] + jnp.arange(queries)[None, None, :, None]  # [B,1,Q,1]
    pos = jnp.clip(state.position, 0, table.shape[-1] - 1)[:, :, None, :]  # [B,K,1,S]
    t = jnp.clip(t, 0, table.shape[2] - 1)
    b, k, _, _ = table.shape
    bi = jnp.arange(b)[:, None, None, None]
    ki = jnp.arange(k)[None, :, None, None]
    values = table[bi, ki, t, pos]
    return jnp.where(state.valid[:, :, None, :], values, 0.0)


def kept_positions(state: MemoryState) -> list[list[set[int]]]:
    """The positions each row holds, as Python sets (for asserting kept sets)."""
    valid = jax.device_get(state.valid)
    pos = jax.device_get(state.position)
    b, k, _ = valid.shape
    return [[set(int(p) for p in pos[i, j][valid[i, j]]) for j in range(k)] for i in range(b)]
