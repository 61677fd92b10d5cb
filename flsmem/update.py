"""``update``: observe, smooth and evict query by query, the serving loop's step."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from flsmem.evict import evict, is_due
from flsmem.observe import observe_args, observe_one, scan_queries
from flsmem.smooth import smooth
from flsmem.state import MemoryState
from flsmem.typing import Array, Float

__all__ = ["update"]


def _step(state, attention, correctness, future):
    state = observe_one(state, attention, correctness, future)
    if state.config.policy.score_when_due:
        return lax.cond(jnp.any(is_due(state)), lambda s: evict(smooth(s)), lambda s: s, state)
    return evict(smooth(state))


def update(
    state: MemoryState,
    attention: Float[Array, "B K S"] | Float[Array, "B K Q S"],
    correctness: Float[Array, "B"] | Float[Array, "B Q"] | None = None,
    future: Float[Array, "B K S"] | Float[Array, "B K Q S"] | None = None,
) -> MemoryState:
    """``observe``, ``smooth`` and ``evict`` (when due) for each query in order.

    For one query this is the three calls in a row. For a chunk it gives exactly the
    kept set that one-query steps would give (items written as a chunk arrive one per
    query), so chunked teacher forcing and per-token decode agree.

    Args:
      state: the memory, after ``write`` of the items these queries see.
      attention: ``[B, K, S]`` or ``[B, K, Q, S]`` attention each query gave each slot,
        query heads already reduced (:func:`flsmem.reduce_query_heads`).
      correctness: ``[B]`` or ``[B, Q]`` weight in [0, 1] of each query's prediction
        (1 if None).
      future: shaped like ``attention``, each slot's future utility; required by the
        oracle policy, ignored by the others.

    Returns:
      The memory after the Q queries: evidence folded, scores committed (for a policy
      with ``score_when_due``, at the steps an eviction was due only), rows holding
      ``budget + evict_every`` present items evicted back to ``budget``, the clock
      advanced by Q.
    """
    attention, correctness, future, _ = observe_args(state, attention, correctness, future)
    return scan_queries(state, _step, attention, correctness, future)
