"""Policies that keep one value per query of the last E queries, in a ring buffer per
slot: Scissorhands (below-average steps) and SnapKV (pooled attention votes)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from flsmem import validate
from flsmem.policies.base import Observation, Params, Policy, SlotView, weight
from flsmem.typing import Array, Float, PyTree

__all__ = ["SnapKVParams", "scissorhands", "snapkv"]

POOLINGS = ("avg", "max")


@dataclasses.dataclass(frozen=True)
class SnapKVParams(Params):
    """Parameters of SnapKV's scoring (:func:`snapkv`); the window is the ring's width.

    Attributes:
      kernel_size: neighbouring items, in position order, the votes are pooled over.
      pooling: "avg" (zero padded, divided by the kernel size) or "max".
      weighted: weight each query's attention by its correctness.
    """

    kernel_size: int = 5
    pooling: str = "avg"
    weighted: bool = False

    def __post_init__(self):
        object.__setattr__(self, "kernel_size", validate.positive_int("kernel_size", self.kernel_size))
        validate.one_of("pooling", self.pooling, POOLINGS)
        validate.boolean("weighted", self.weighted)


def _fold_ring(value_fn):
    """Store this query's per-slot value in a ring buffer of the last W queries (one
    evidence array ``[B, K, S, W]``)."""

    def fold(policy: Policy, view: SlotView, obs: Observation, aux: PyTree):
        value = value_fn(policy, view, obs)
        (ring,) = view.evidence
        width = ring.shape[-1]
        column = jax.nn.one_hot(view.step % width, width, dtype=jnp.bool_)  # [B, W]
        write_here = view.present[..., None] & column[:, None, None, :]
        return (jnp.where(write_here, value[..., None], ring),), aux

    return fold


def _snapkv_value(policy: Policy, view: SlotView, obs: Observation):
    return weight(policy.params.weighted, obs) * obs.attention


def _scissorhands_value(policy: Policy, view: SlotView, obs: Observation):
    n = jnp.sum(view.present, axis=-1, keepdims=True).astype(jnp.float32)
    return (obs.attention * n < 1.0).astype(jnp.float32)


_fold_snapkv = _fold_ring(_snapkv_value)
_fold_scissorhands = _fold_ring(_scissorhands_value)


def _score_unimportance(policy: Policy, view: SlotView, aux: PyTree) -> Float[Array, "B K S"]:
    return -jnp.sum(view.evidence[0], axis=-1)


def _score_snapkv(policy: Policy, view: SlotView, aux: PyTree) -> Float[Array, "B K S"]:
    votes = jnp.sum(view.evidence[0], axis=-1)
    return _pool_by_position(votes, view.position, view.present, policy.params.kernel_size, policy.params.pooling)


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
    history = validate.positive_int("history", history)
    return Policy(
        name="scissorhands", score=_score_unimportance, fold=_fold_scissorhands,
        evidence_shapes=((history,),), recent=recent,
    )


def snapkv(window: int = 32, *, kernel_size: int = 5, pooling: str = "avg") -> Policy:
    """SnapKV (Li et al., 2024, arXiv 2404.14469).

    Rule: score = attention summed over the last ``window`` queries (the observation
    window at the end of the prompt), pooled ("avg" or "max", zero padded) over the
    ``kernel_size`` neighbouring items held, in position order (at prefill, before
    anything is evicted, the neighbouring positions); the window's own tokens are
    protected. Built for prefill compression: write and observe the prompt, then
    ``evict(state, budget=...)``.
    """
    window = validate.positive_int("window", window)
    return Policy(
        name="snapkv", score=_score_snapkv, fold=_fold_snapkv, evidence_shapes=((window,),),
        recent=window, params=SnapKVParams(kernel_size=kernel_size, pooling=pooling),
    )
