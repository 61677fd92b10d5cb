"""The oracle's look-ahead: the attention each position gets from the queries to come.

:func:`flsmem.policies.oracle` ranks items by what the future will ask of them. That
evidence is a table built once from a full-cache run, read through the memory's slots
at every step; its row ``t`` is the future as seen right after query ``t``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from flsmem.typing import Array, Float
from flsmem.validate import require, unit

__all__ = ["discounted_future"]


@functools.partial(jax.jit, static_argnames=("discount",))
def discounted_future(attention: Float[Array, "... T T"], discount: float = 1.0) -> Float[Array, "... T T"]:
    """The discounted attention each position gets from the queries after each step.

    With ``A = attention``, entry ``[..., t, p]`` is
    ``f[t, p] = sum_{s > t} discount^(s - t - 1) A[s, p]``, computed backwards as
    ``f[t] = A[t + 1] + discount * f[t + 1]`` with ``f[T - 1] = 0``. A discount below 1
    ranks what the next queries need above what every later query only glances at.

    Args:
      attention: ``[..., T, T]``, entry ``[..., t, p]`` the attention query ``t`` gives
        position ``p`` (leading axes: batch, KV heads, layers, ... in any number).
      discount: weight per step ahead, in ``[0, 1]``; 1 sums the future undiscounted.

    Returns:
      The table ``f``, shaped and typed like ``attention``.

    Raises:
      ValueError: ``attention`` has fewer than two axes, or ``discount`` is not in ``[0, 1]``.
    """
    require(attention.ndim >= 2, f"attention must be [..., T, T], got shape {attention.shape}")
    discount = unit("discount", discount)
    rows = jnp.moveaxis(attention, -2, 0)

    def step(later, row):
        now = row + discount * later
        return now, now

    # A sequential scan, not a reversed cumsum: it adds in the same order for every
    # discount and every backend.
    _, f = jax.lax.scan(step, jnp.zeros_like(rows[0]), rows[1:], reverse=True)
    return jnp.moveaxis(jnp.concatenate([f, jnp.zeros_like(rows[:1])], axis=0), 0, -2)
