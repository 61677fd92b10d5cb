"""Policies that keep one value per query of the last E queries, in a ring buffer per
slot: Scissorhands (below-average steps) and SnapKV (pooled attention votes)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from flsmem import validate
from flsmem.policies.base import Policy, weight

__all__ = ["scissorhands", "snapkv"]


def _fold_ring(value_fn):
    """Store this query's per-slot value in a ring buffer of the last E queries."""

    def fold(policy, view, obs, aux):
        value = value_fn(policy, view, obs)
        width = policy.num_evidence
        column = jax.nn.one_hot(view.step % width, width, dtype=jnp.bool_)  # [B, E]
        write_here = view.present[..., None] & column[:, None, None, :]
        return jnp.where(write_here, value[..., None], view.evidence), aux

    return fold


def _snapkv_value(policy, view, obs):
    return weight(policy, obs) * obs.attention


def _scissorhands_value(policy, view, obs):
    n = jnp.sum(view.present, axis=-1, keepdims=True).astype(jnp.float32)
    return (obs.attention * n < 1.0).astype(jnp.float32)


_fold_snapkv = _fold_ring(_snapkv_value)
_fold_scissorhands = _fold_ring(_scissorhands_value)


def _score_unimportance(policy, view, aux):
    return -jnp.sum(view.evidence, axis=-1)


def _score_snapkv(policy, view, aux):
    votes = jnp.sum(view.evidence, axis=-1)
    return _pool_by_position(
        votes, view.position, view.present, policy.p["kernel_size"], policy.p["pooling"]
    )


def _pool_by_position(x, position, present, kernel_size, pooling):
    """Pool x over each slot's neighbours in position order (SnapKV's 1-D pooling)."""
    if kernel_size == 1:
        return x
    big = jnp.iinfo(jnp.int32).max
    order = jnp.argsort(jnp.where(present, position, big), axis=-1, stable=True)
    xs = jnp.take_along_axis(x, order, axis=-1)
    ps = jnp.take_along_axis(present, order, axis=-1)
    pad = [(0, 0)] * (x.ndim - 1) + [(kernel_size // 2, (kernel_size - 1) // 2)]
    window = (1,) * (x.ndim - 1) + (kernel_size,)
    strides = (1,) * x.ndim
    if pooling == "max":
        xs = jnp.where(ps, xs, -jnp.inf)
        pooled = lax.reduce_window(xs, -jnp.inf, lax.max, window, strides, pad)
    else:  # zero padding, divided by the full kernel size, as avg_pool1d does
        xs = jnp.where(ps, xs, 0.0)
        pooled = lax.reduce_window(xs, 0.0, lax.add, window, strides, pad) / kernel_size
    inverse = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(pooled, inverse, axis=-1)


def scissorhands(history: int = 32, *, recent: int = 0) -> Policy:
    """Scissorhands (Liu et al., 2023, arXiv 2305.17118).

    Rule: over the last ``history`` queries, count the steps in which the item got less
    than average attention (``a < 1/n``, n the tokens the query could attend); evict the
    highest counts (score = -count). For items that have seen the whole history window
    this ranks exactly as the count of above-uniform steps.
    """
    validate.require(isinstance(history, int) and history >= 1, f"history must be an int >= 1, got {history!r}")
    return Policy(
        name="scissorhands", score=_score_unimportance, fold=_fold_scissorhands,
        num_evidence=history, recent=recent,
    )


def snapkv(window: int = 32, *, kernel_size: int = 5, pooling: str = "avg") -> Policy:
    """SnapKV (Li et al., 2024, arXiv 2404.14469).

    Rule: score = attention summed over the last ``window`` queries (the observation
    window at the end of the prompt), pooled ("avg" or "max", zero padded) over the
    ``kernel_size`` neighbouring items held, in position order (at prefill, before
    anything is evicted, the neighbouring positions); the window's own tokens are
    protected. Built for prefill
    compression: write and observe the prompt, then ``evict(state, budget=...)``.
    """
    validate.require(isinstance(window, int) and window >= 1, f"window must be an int >= 1, got {window!r}")
    validate.require(
        isinstance(kernel_size, int) and kernel_size >= 1,
        f"kernel_size must be an int >= 1, got {kernel_size!r}",
    )
    validate.require(pooling in ("avg", "max"), f"pooling must be 'avg' or 'max', got {pooling!r}")
    return Policy(
        name="snapkv", score=_score_snapkv, fold=_fold_snapkv, num_evidence=window,
        recent=window,
        params=(("kernel_size", kernel_size), ("pooling", pooling), ("weighted", False)),
    )
