"""Policies whose score is drawn once, when the item is written, and never changes:
key-norm eviction and random eviction."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from flsmem import validate
from flsmem.policies.base import Params, Policy, score_first
from flsmem.typing import Array, PyTree

__all__ = ["KeyNormParams", "RandomParams", "key_norm", "random"]


@dataclasses.dataclass(frozen=True)
class KeyNormParams(Params):
    """Parameters of key-norm eviction (:func:`key_norm`).

    Attributes:
      leaf: the payload entry holding the keys.
    """

    leaf: str = "k"

    def __post_init__(self):
        validate.require(isinstance(self.leaf, str), f"leaf must be a str, got {self.leaf!r}")


@dataclasses.dataclass(frozen=True)
class RandomParams(Params):
    """Parameters of random eviction (:func:`random`).

    Attributes:
      seed: non-negative int mixed into every item's hash.
    """

    seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "seed", validate.nonneg_int("seed", self.seed))


def _init_key_norm(policy: Policy, payload: PyTree, position: Array, birth: Array) -> tuple[Array]:
    leaf = policy.params.leaf
    if not isinstance(payload, dict) or leaf not in payload:
        raise ValueError(
            f"key_norm(leaf={leaf!r}) needs a payload dict with a {leaf!r} entry, "
            f"got {jax.tree_util.tree_structure(payload)}"
        )
    keys = payload[leaf].astype(jnp.float32)
    norm = jnp.sqrt(jnp.sum(keys * keys, axis=tuple(range(3, keys.ndim))))
    return (-norm,)


def _hash32(x: Array) -> Array:
    """A 32-bit integer mixer (lowbias32): cheap, well spread, deterministic."""
    x = x.astype(jnp.uint32)
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def _init_random(policy: Policy, payload: PyTree, position: Array, birth: Array) -> tuple[Array]:
    b, k, q = position.shape
    row = lax.broadcasted_iota(jnp.uint32, (b, k, q), 0) * jnp.uint32(k) + lax.broadcasted_iota(
        jnp.uint32, (b, k, q), 1
    )
    h = _hash32(jnp.uint32(policy.params.seed) ^ _hash32(row))
    h = _hash32(h ^ position.astype(jnp.uint32))
    return ((h >> 8).astype(jnp.float32) * (1.0 / (1 << 24)),)


def key_norm(leaf: str = "k") -> Policy:
    """Key-norm eviction (Devoto et al., 2024, arXiv 2406.11430).

    Rule: keep the keys with the smallest L2 norm (score = -||k||), read from the
    payload entry ``leaf`` when the item is written.
    """
    return Policy(name="key_norm", score=score_first, init_evidence=_init_key_norm,
                  params=KeyNormParams(leaf=leaf))


def random(seed: int = 0) -> Policy:
    """Random eviction: each item draws a fixed uniform score from a hash of
    (seed, batch row, KV head, position), so runs are reproducible."""
    return Policy(name="random", score=score_first, init_evidence=_init_random,
                  params=RandomParams(seed=seed))
