"""ExpectedAttention (Devoto et al., 2025, arXiv 2510.00636; kvpress's
``ExpectedAttentionPress``): score each item by the attention that future queries are
expected to give it.

The queries seen so far are summarised per query head by their mean and covariance,
taken before the position encoding. The next ``future`` positions' rotations are
averaged into one matrix R, so a future query is modelled as Gaussian with mean
``R mu`` and covariance ``R Sigma R^T``; for a key k its expected logit is
``(R mu) . k / sqrt(D) + k^T R Sigma R^T k / (2 D)``. These are turned into a
distribution over the held items (softmax per query head, the sinks left out), averaged
over the query heads of the KV group and multiplied by the value's norm, as kvpress
0.5.5 does. Here the statistics are folded from the queries :func:`flsmem.attend`
hands over (un-rotated with the model's RoPE settings, which the policy is given), so
the rule works for a model with query-key norms too.

Items keep a float32 copy of their key and their value's norm as evidence (the score
reads keys, and a policy sees its evidence, not the cache). The score is computed only
when an eviction is due (``score_when_due``): on the stream protocol the estimate is
renewed every ``evict_every`` steps from all queries seen so far.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from flsmem import validate
from flsmem.policies.base import Params, Policy, SlotView
from flsmem.typing import Array, Float, Int, PyTree

__all__ = ["ExpectedAttentionParams", "expected_attention", "mean_rotation", "rotate"]


@dataclasses.dataclass(frozen=True)
class ExpectedAttentionParams(Params):
    """Parameters of :func:`expected_attention`.

    Attributes:
      head_dim: D, the keys' and queries' width.
      group: G, query heads per KV head.
      rope_theta: the model's RoPE base (half-split pairs ``(i, i + D/2)``).
      rope_factors: per-frequency divisors of long-context RoPE scaling, or None.
      future: the future positions whose rotations are averaged.
      covariance: use the queries' covariance (else the mean only).
      value_norm: multiply by the value's norm.
      epsilon: added to the expected attention before the value norm multiplies it.
    """

    head_dim: int
    group: int = 1
    rope_theta: float = 10000.0
    rope_factors: tuple[float, ...] | None = None
    future: int = 512
    covariance: bool = True
    value_norm: bool = True
    epsilon: float = 0.0

    def __post_init__(self):
        d = validate.positive_int("head_dim", self.head_dim)
        validate.require(d % 2 == 0, f"head_dim must be even (RoPE rotates pairs), got {d}")
        validate.positive_int("group", self.group)
        validate.positive("rope_theta", self.rope_theta)
        if self.rope_factors is not None:
            factors = tuple(float(f) for f in self.rope_factors)
            validate.require(len(factors) == d // 2 and all(f > 0 for f in factors),
                             f"rope_factors must be {d // 2} positive numbers (one per frequency), got {len(factors)}")
            object.__setattr__(self, "rope_factors", factors)
        validate.positive_int("future", self.future)
        validate.boolean("covariance", self.covariance)
        validate.boolean("value_norm", self.value_norm)
        validate.require(isinstance(self.epsilon, (int, float)) and self.epsilon >= 0,
                         f"epsilon must be a number >= 0, got {self.epsilon!r}")


def _frequencies(params: ExpectedAttentionParams) -> Float[Array, "D2"]:
    d = params.head_dim
    freq = params.rope_theta ** (-jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d)
    if params.rope_factors is not None:
        freq = freq / jnp.asarray(params.rope_factors, jnp.float32)
    return freq


def rotate(x: Float[Array, "... D"], cos: Float[Array, "... D2"], sin: Float[Array, "... D2"]) -> Float[Array, "... D"]:
    """``R x`` for the half-split rotation ``R = [[C, -S], [S, C]]`` with diagonal
    ``C = diag(cos)``, ``S = diag(sin)`` (one RoPE rotation, or an average of them)."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([cos * x1 - sin * x2, sin * x1 + cos * x2], axis=-1)


def mean_rotation(params: ExpectedAttentionParams, start: Int[Array, "*R"]) -> tuple[Array, Array]:
    """``(cos, sin)`` ``[*R, D/2]`` of the mean of the RoPE rotations at positions
    ``start .. start + future - 1``."""
    offsets = jnp.arange(params.future, dtype=jnp.float32)
    positions = start.astype(jnp.float32)[..., None] + offsets.reshape((1,) * jnp.ndim(start) + (-1,))  # [*R, F]
    angle = positions[..., None] * _frequencies(params).reshape((1,) * positions.ndim + (-1,))  # [*R, F, D/2]
    return jnp.mean(jnp.cos(angle), axis=-2), jnp.mean(jnp.sin(angle), axis=-2)


def _init_aux(policy: Policy, batch: int, kv_heads: int, slots: int) -> PyTree:
    p = policy.params
    rows = (batch, kv_heads)
    return {
        "count": jnp.zeros(rows, jnp.float32),
        "q_sum": jnp.zeros(rows + (p.group, p.head_dim), jnp.float32),
        "q_outer": jnp.zeros(rows + (p.group, p.head_dim, p.head_dim), jnp.float32),
        "next": jnp.zeros(rows, jnp.int32),
    }


def _fold_queries(policy: Policy, aux: PyTree, queries: Float[Array, "B K G T D"], position: Int[Array, "B T"]) -> PyTree:
    p = policy.params
    g, d = queries.shape[-3], queries.shape[-1]
    validate.require((g, d) == (p.group, p.head_dim),
                     f"expected_attention was built for group={p.group}, head_dim={p.head_dim}; "
                     f"the queries have group {g}, head_dim {d}")
    angle = position.astype(jnp.float32)[:, None, None, :, None] * _frequencies(p)[None, None, None, None]  # [B, 1, 1, T, D/2]
    # Undo the rotation of each query's own position: statistics of the raw queries.
    raw = rotate(queries.astype(jnp.float32), jnp.cos(angle), -jnp.sin(angle))
    # The first `sinks` positions are outliers (kvpress leaves their queries out too).
    weight = (position >= policy.sinks).astype(jnp.float32)[:, None, None, :]  # [B, 1, 1, T]
    weighted = raw * weight[..., None]
    return {
        "count": aux["count"] + jnp.sum(weight, axis=-1)[..., 0],
        "q_sum": aux["q_sum"] + jnp.sum(weighted, axis=-2),
        "q_outer": aux["q_outer"] + jnp.einsum("bkgtd,bkgte->bkgde", weighted, raw),
        "next": jnp.maximum(aux["next"], jnp.max(position, axis=-1)[:, None] + 1),
    }


def _init_evidence(policy: Policy, payload: PyTree, position: Array, birth: Array) -> tuple[Array, Array]:
    """The value's norm ``[B, K, Q]`` and the key ``[B, K, Q, D]``."""
    if not isinstance(payload, dict) or not {"k", "v"} <= set(payload):
        validate.fail("expected_attention needs a KV memory (payload with 'k' and 'v', flsmem.init_kv)")
    keys = payload["k"].astype(jnp.float32)
    values = payload["v"].astype(jnp.float32)
    validate.require(keys.shape[-1] == policy.params.head_dim,
                     f"expected_attention was built for head_dim={policy.params.head_dim}, the keys have {keys.shape[-1]}")
    return jnp.sqrt(jnp.sum(values * values, axis=-1)), keys


def _score(policy: Policy, view: SlotView, aux: PyTree) -> Float[Array, "B K S"]:
    p = policy.params
    d = p.head_dim
    count = jnp.maximum(aux["count"], 1.0)[..., None, None]  # [B, K, 1, 1]
    mean = aux["q_sum"] / count  # [B, K, G, D]
    cos, sin = mean_rotation(p, aux["next"])  # [B, K, D/2]
    cos, sin = cos[:, :, None], sin[:, :, None]  # [B, K, 1, D/2]
    value_norm, keys = view.evidence  # [B, K, S], [B, K, S, D]
    logits = jnp.einsum("bkgd,bksd->bkgs", rotate(mean, cos, sin), keys) / jnp.sqrt(float(d))
    if p.covariance:
        cov = aux["q_outer"] / count[..., None] - mean[..., :, None] * mean[..., None, :]  # [B, K, G, D, D]
        # R cov R^T: R applied to the columns, then to the rows (cov is symmetric).
        rotated = rotate(jnp.swapaxes(rotate(cov, cos[..., None, :], sin[..., None, :]), -1, -2),
                         cos[..., None, :], sin[..., None, :])
        logits = logits + jnp.einsum("bksd,bkgde,bkse->bkgs", keys, rotated, keys) / (2.0 * d)
    counted = view.present & (view.position >= policy.sinks)  # [B, K, S]
    logits = jnp.where(counted[:, :, None], logits, -jnp.inf)
    expected = jnp.mean(jnp.where(counted[:, :, None], jax.nn.softmax(logits, axis=-1), 0.0), axis=2)
    if p.value_norm:
        expected = (expected + p.epsilon) * value_norm
    return expected


def expected_attention(
    head_dim: int,
    group: int = 1,
    rope_theta: float = 10000.0,
    rope_factors: tuple[float, ...] | None = None,
    future: int = 512,
    sinks: int = 4,
    covariance: bool = True,
    value_norm: bool = True,
    epsilon: float = 0.0,
    recent: int = 0,
) -> Policy:
    """ExpectedAttention: keep the items that Gaussian-modelled future queries are
    expected to attend most, weighted by their value norm.

    The model's shape and RoPE settings are arguments because the rule un-rotates the
    queries it is handed and rotates their mean to the next ``future`` positions:
    ``head_dim``, ``group`` (query heads per KV head), ``rope_theta`` and
    ``rope_factors`` must be the attention layer's. The first ``sinks`` positions are
    protected and left out of the statistics, as kvpress does with ``n_sink``.
    """
    params = ExpectedAttentionParams(head_dim=head_dim, group=group, rope_theta=rope_theta,
                                     rope_factors=rope_factors, future=future, covariance=covariance,
                                     value_norm=value_norm, epsilon=epsilon)
    return Policy(name="expected_attention", score=_score, init_evidence=_init_evidence, init_aux=_init_aux,
                  fold_queries=_fold_queries, evidence_shapes=((), (head_dim,)), params=params, sinks=sinks,
                  recent=recent, score_when_due=True)
