"""Policies that fold each query's attention into one running sum per slot: H2O, TOVA,
the exponential average, demonstrated utility (RMM), and the two presets of the source
documents (lag-window accumulation, recency of use)."""

from __future__ import annotations

import dataclasses
import numbers

import jax.numpy as jnp

from flsmem import validate
from flsmem.policies.base import Observation, Params, Policy, SlotView, score_first, weight, with_column
from flsmem.typing import Array, Bool, PyTree

__all__ = [
    "DecayParams",
    "LagWindowParams",
    "UseRecencyParams",
    "ema",
    "h2o",
    "lag_window",
    "rmm",
    "tova",
    "use_recency",
]


@dataclasses.dataclass(frozen=True)
class DecayParams(Params):
    """Parameters of the decayed attention sum ``e <- decay * e + (w *) a``.

    Attributes:
      decay: in [0, 1]; 1 accumulates (H2O), 0 measures (TOVA).
      weighted: weight each query's attention by its correctness.
    """

    decay: float = 1.0
    weighted: bool = False

    def __post_init__(self):
        object.__setattr__(self, "decay", validate.unit("decay", self.decay))
        validate.boolean("weighted", self.weighted)


@dataclasses.dataclass(frozen=True)
class LagWindowParams(Params):
    """Parameters of lag-window accumulation (:func:`lag_window`).

    Attributes:
      gamma: in [0, 1], the discount of early observations inside the lag window.
      decay_after: in [0, 1], the factor applied to the frozen score at each later query.
      weighted: weight each query's attention by its correctness.
    """

    gamma: float = 0.9
    decay_after: float = 1.0
    weighted: bool = True

    def __post_init__(self):
        object.__setattr__(self, "gamma", validate.unit("gamma", self.gamma))
        object.__setattr__(self, "decay_after", validate.unit("decay_after", self.decay_after))
        validate.boolean("weighted", self.weighted)


@dataclasses.dataclass(frozen=True)
class UseRecencyParams(Params):
    """Parameters of recency of use (:func:`use_recency`).

    Attributes:
      decay: in [0, 1], the factor applied to the score at each query.
      use_threshold: attention above which a query uses a slot; None means above
        uniform (``a > 1/n``).
    """

    decay: float = 0.9
    use_threshold: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "decay", validate.unit("decay", self.decay))
        threshold = self.use_threshold
        ok = threshold is None or (isinstance(threshold, numbers.Real) and not isinstance(threshold, bool))
        validate.require(ok, f"use_threshold must be a number or None, got {threshold!r}")
        if threshold is not None:
            object.__setattr__(self, "use_threshold", float(threshold))


def _fold_decayed_sum(policy: Policy, view: SlotView, obs: Observation, aux: PyTree):
    """e <- decay * e + w * a: accumulates (decay 1) or measures (decay 0)."""
    e = view.evidence[0]
    return with_column(view, policy.params.decay * e + weight(policy.params.weighted, obs) * obs.attention), aux


def _fold_lag_window(policy: Policy, view: SlotView, obs: Observation, aux: PyTree):
    """Accumulate gamma^(H + 1 - age) * w * a while age <= H + 1, then decay by rho."""
    gamma, rho = policy.params.gamma, policy.params.decay_after
    e = view.evidence[0]
    inside = view.age <= policy.lag + 1
    exponent = jnp.maximum(policy.lag + 1 - view.age, 0).astype(jnp.float32)
    added = e + jnp.power(jnp.float32(gamma), exponent) * weight(policy.params.weighted, obs) * obs.attention
    new = jnp.where(inside, added, rho * e)
    return with_column(view, new), aux


def _above_uniform(obs: Observation, present) -> Bool[Array, "B K S"]:
    """Attention above 1/n, n the slots the query could attend."""
    n = jnp.sum(present, axis=-1, keepdims=True).astype(jnp.float32)
    return obs.attention * n > 1.0


def _fold_use_recency(policy: Policy, view: SlotView, obs: Observation, aux: PyTree):
    """e <- decay * e + [slot used], so e = sum over uses of decay^(steps since use)."""
    threshold = policy.params.use_threshold
    if threshold is None:
        used = _above_uniform(obs, view.present)
    else:
        used = obs.attention > threshold
    e = view.evidence[0]
    new = policy.params.decay * e + used.astype(jnp.float32)
    return with_column(view, new), aux


def _decayed_sum(name: str, params: DecayParams, recent: int, lag: int = 0) -> Policy:
    return Policy(name=name, score=score_first, fold=_fold_decayed_sum, recent=recent, lag=lag, params=params)


def h2o(recent: int = 0) -> Policy:
    """H2O, heavy-hitter oracle (Zhang et al., 2023, arXiv 2306.14048).

    Rule: score = attention accumulated over every query since the item arrived,
    ``sum_s a_s(i)``; keep the ``recent`` most recent tokens plus the highest scores
    (the paper splits the budget evenly between the two).
    """
    return _decayed_sum("h2o", DecayParams(decay=1.0, weighted=False), recent)


def tova(recent: int = 0) -> Policy:
    """TOVA, token omission via attention (Oren et al., 2024, arXiv 2401.06104).

    Rule: score = the current query's attention (query heads of a group averaged);
    at each step the lowest-scoring token is dropped.
    """
    return _decayed_sum("tova", DecayParams(decay=0.0, weighted=False), recent)


def ema(decay: float = 0.9, *, weighted: bool = False, recent: int = 0, lag: int = 0) -> Policy:
    """Exponentially decayed attention: ``e <- decay * e + (w *) a``.

    Decay 1 accumulates (H2O's rule), decay 0 measures (TOVA's rule); values between
    trade the two off. With ``weighted`` the attention is weighted by correctness.
    """
    return _decayed_sum("ema", DecayParams(decay=decay, weighted=weighted), recent, lag)


def rmm(lag: int = 16, *, recent: int = 0, decay: float = 1.0) -> Policy:
    """Demonstrated utility (RMM, arXiv 2607.24667).

    Rule: ``DU_t(i) = sum_{s=birth(i)}^{t} w_s * a_s(i)``, attention weighted by the
    correctness ``w_s`` of the prediction made with it; a new item is protected for
    its commit lag H (``lag``) while the evidence gathers. With every weight 1 and
    ``max(recent, lag)`` equal, it keeps exactly what :func:`h2o` keeps. ``decay < 1``
    forgets old evidence (measuring instead of accumulating).
    """
    return _decayed_sum("rmm", DecayParams(decay=decay, weighted=True), recent, lag)


def lag_window(lag: int = 16, *, gamma: float = 0.9, decay_after: float = 1.0,
               weighted: bool = True) -> Policy:
    """Preset (a) of the source documents: lag-window accumulation, then freeze.

    Rule: while a slot is inside its lag window (age 1 .. H + 1, H = ``lag``) add
    ``gamma^(H + 1 - age) * (w *) a``, so later observations weigh more; afterwards the
    score is frozen, multiplied by ``decay_after`` each query (1 keeps it forever; a
    value slightly below 1 lets stale high scores fade).
    """
    params = LagWindowParams(gamma=gamma, decay_after=decay_after, weighted=weighted)
    return Policy(name="lag_window", score=score_first, fold=_fold_lag_window, lag=lag, params=params)


def use_recency(lag: int = 16, *, decay: float = 0.9,
                use_threshold: float | None = None) -> Policy:
    """Preset (b) of the source documents: protect for the lag, then score by recency
    of use.

    Rule: a slot is *used* by a query when its attention is above uniform (``a > 1/n``)
    or above ``use_threshold`` when given; score = ``sum over uses of
    decay^(steps since the use)``, computed incrementally as ``e <- decay * e + used``.
    """
    params = UseRecencyParams(decay=decay, use_threshold=use_threshold)
    return Policy(name="use_recency", score=score_first, fold=_fold_use_recency, lag=lag, params=params)
