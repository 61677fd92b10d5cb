"""The per-slot scalar Kalman filter on attention (local-level model), with fixed noise
or noise estimated online per row."""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax.numpy as jnp

from flsmem import validate
from flsmem.policies.base import Observation, Params, Policy, SlotView, weight, with_columns
from flsmem.typing import Array, Float, PyTree

__all__ = ["KalmanParams", "kalman"]

# Kalman evidence arrays: the filter (mean, variance P, measurements folded) and, for
# the adaptive filter only, the derivatives of the mean and of P / r with respect to
# log(q / r). The fixed filter carries three: every array is read and written per
# query, so two unused ones would cost two fifths of its fold.
_MEAN, _VAR, _COUNT, _DMEAN, _DVAR = range(5)
# Adaptive aux, per row: log(q / r), r, and the running mean of dmean^2 (the
# Gauss-Newton curvature).
_LOG_X, _R, _INFO = range(3)
# The estimated q / r stays in [1e-8, 1e4]: gains from 1e-4 to 1 - 1e-4.
_LOG_X_MIN, _LOG_X_MAX = math.log(1e-8), math.log(1e4)
_R_MIN = 1e-12


@dataclasses.dataclass(frozen=True)
class KalmanParams(Params):
    """Parameters of the filter (:func:`kalman`).

    Attributes:
      q: process noise, >= 0 (the adaptive filter's starting value).
      r: measurement noise, > 0 (the adaptive filter's starting value).
      adaptive: estimate q / r and r online per row.
      beta: in [0, 1], the adaptive estimate's rate per query.
      weighted: measure the attention weighted by correctness.
    """

    q: float = 0.01
    r: float = 1.0
    adaptive: bool = False
    beta: float = 0.01
    weighted: bool = False

    def __post_init__(self):
        q = self.q
        ok = isinstance(q, numbers.Real) and not isinstance(q, bool) and q >= 0
        validate.require(ok, f"q must be a number >= 0, got {q!r}")
        object.__setattr__(self, "q", float(q))
        object.__setattr__(self, "r", validate.positive("r", self.r))
        object.__setattr__(self, "beta", validate.unit("beta", self.beta))
        validate.boolean("adaptive", self.adaptive)
        validate.boolean("weighted", self.weighted)


def _kalman_noise(policy: Policy, aux: PyTree):
    """(q, r): fixed, or per row from the adaptive estimate."""
    if not policy.params.adaptive:
        return jnp.float32(policy.params.q), jnp.float32(policy.params.r)
    r = jnp.maximum(aux[..., _R], _R_MIN)
    q = jnp.exp(aux[..., _LOG_X]) * r
    return q[..., None], r[..., None]


def _fold_kalman(policy: Policy, view: SlotView, obs: Observation, aux: PyTree):
    """Scalar filter per slot: predict P += q, update with z = (w *) a.

    The adaptive filter also carries each slot's sensitivity of the mean to
    theta = log(q / r), and moves theta by a damped Gauss-Newton step on the squared
    innovations pooled over the row's slots (a recursive prediction-error method). With
    the true q / r the filter's one-step predictions have the least error at every age,
    so its innovations are uncorrelated with anything computed from the past, the
    sensitivity included: that is the fixed point. r is the running mean of the
    innovations normalised by their predicted variance.
    """
    ev = view.evidence
    m, var, n = ev[_MEAN], ev[_VAR], ev[_COUNT]
    z = weight(policy.params.weighted, obs) * obs.attention
    q, r = _kalman_noise(policy, aux)
    first = n == 0
    var_pred = var + q
    spread = var_pred + r  # predicted variance of the innovation
    gain = jnp.where(first, 1.0, var_pred / spread)
    innovation = z - m
    m_new = m + gain * innovation
    var_new = jnp.where(first, r, (1.0 - gain) * var_pred)
    # d/dtheta of the same recursion, P in units of r (where the gain depends on q / r
    # only): P / r <- gain, so its derivative is dgain; the first measurement sets
    # m = z and P = r, which do not depend on theta.
    if not policy.params.adaptive:
        return with_columns(view, [m_new, var_new, n + 1.0]), aux
    dmean, dvar = ev[_DMEAN], ev[_DVAR]
    x = q / r
    dgain = jnp.where(first, 0.0, (dvar + x) * (r / spread) ** 2)
    dmean_new = (1.0 - gain) * dmean + dgain * innovation
    used = view.present & ~first  # slots that had a prediction to check
    aux = _adapt(policy.params.beta, aux, used, innovation, dmean, r, spread)
    return with_columns(view, [m_new, var_new, n + 1.0, dmean_new, dgain]), aux


def _adapt(beta: float, aux: PyTree, used, innovation, dmean, r, spread) -> Float[Array, "B K 3"]:
    """One damped Gauss-Newton step of each row's log(q / r), and its running r."""
    count = jnp.sum(used, axis=-1).astype(jnp.float32)

    def pooled(v):
        return jnp.sum(jnp.where(used, v, 0.0), axis=-1) / jnp.maximum(count, 1.0)

    # -1/2 d(innovation^2)/dtheta = innovation * dmean, since dz/dtheta = 0.
    grad = pooled(innovation * dmean)
    info_now = pooled(dmean * dmean)
    info = (1.0 - beta) * aux[..., _INFO] + beta * info_now
    # Early on the running curvature is still filling up: use this query's if larger.
    # The step is bounded so that one query moves q / r by at most a factor e.
    step = jnp.clip(beta * grad / jnp.maximum(jnp.maximum(info, info_now), 1e-30), -1.0, 1.0)
    log_x = jnp.clip(aux[..., _LOG_X] + step, _LOG_X_MIN, _LOG_X_MAX)
    r_new = (1.0 - beta) * aux[..., _R] + beta * pooled(innovation ** 2 * r / spread)
    updated = jnp.stack([log_x, r_new, info], axis=-1)
    return jnp.where((count > 0)[..., None], updated, aux)


def _kalman_init_aux(policy: Policy, batch: int, kv_heads: int, slots: int):
    if not policy.params.adaptive:
        return None
    q, r = policy.params.q, policy.params.r
    log_x = min(max(math.log(max(q / r, 1e-30)), _LOG_X_MIN), _LOG_X_MAX)
    prior = jnp.array([log_x, r, 0.0], jnp.float32)
    return jnp.broadcast_to(prior, (batch, kv_heads, 3))


def _score_kalman(policy: Policy, view: SlotView, aux: PyTree) -> Float[Array, "B K S"]:
    return view.evidence[_MEAN]


def kalman(
    q: float = 0.01, r: float = 1.0, *, adaptive: bool = False, beta: float = 0.01,
    weighted: bool = False, recent: int = 0, lag: int = 0,
) -> Policy:
    """Per-slot scalar Kalman filter on attention (local-level model).

    Rule: each slot holds a mean m and variance P. Every query: predict ``P += q``,
    then update with the measurement z = a (or w * a when ``weighted``):
    ``K = P / (P + r)``, ``m += K (z - m)``, ``P = (1 - K) P``; the first measurement
    sets ``m = z, P = r``. Score = m. q = 0 gives the running mean of attention
    (accumulating); large q/r gives a gain near 1 (measuring, like TOVA). With
    ``adaptive`` each row estimates q/r online, starting from the given q and r, by a
    damped Gauss-Newton step per query (rate ``beta``) on the squared innovations
    ``z - m`` of its slots (a recursive prediction-error method: at the true q/r the
    innovations are unpredictable from the past), and r as the running mean of the
    innovations over their predicted variance. The estimate averages over about
    ``1 / beta`` queries; in the accumulating regime that window should be longer than
    the filter's own memory, about ``1 / sqrt(q / r)`` queries. :mod:`flsmem.theory`
    gives the steady-state gain for a q/r and the EMA decay it implies.
    """
    params = KalmanParams(q=q, r=r, adaptive=adaptive, beta=beta, weighted=weighted)
    return Policy(
        name="kalman", score=_score_kalman, fold=_fold_kalman, init_aux=_kalman_init_aux,
        evidence_shapes=((),) * (5 if adaptive else 3), recent=recent, lag=lag, params=params,
    )
