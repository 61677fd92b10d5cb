"""Policies that fold each query's attention into one running sum per slot: H2O, TOVA,
the exponential average, demonstrated utility (RMM), and the two presets of the source
documents (lag-window accumulation, recency of use)."""

from __future__ import annotations

import jax.numpy as jnp

from flsmem import validate
from flsmem.policies.base import Observation, Policy, score_first, weight
from flsmem.typing import Array, Bool

__all__ = ["ema", "h2o", "lag_window", "rmm", "tova", "use_recency"]


def _fold_decayed_sum(policy, view, obs, aux):
    """e <- decay * e + w * a: accumulates (decay 1) or measures (decay 0)."""
    decay = policy.p["decay"]
    e = view.evidence[..., 0]
    new = decay * e + weight(policy, obs) * obs.attention
    return jnp.where(view.present, new, e)[..., None], aux


def _fold_lag_window(policy, view, obs, aux):
    """Accumulate gamma^(H + 1 - age) * w * a while age <= H + 1, then decay by rho."""
    gamma, rho = policy.p["gamma"], policy.p["decay_after"]
    e = view.evidence[..., 0]
    inside = view.age <= policy.lag + 1
    exponent = jnp.maximum(policy.lag + 1 - view.age, 0).astype(jnp.float32)
    added = e + jnp.power(jnp.float32(gamma), exponent) * weight(policy, obs) * obs.attention
    new = jnp.where(inside, added, rho * e)
    return jnp.where(view.present, new, e)[..., None], aux


def _above_uniform(obs: Observation, present) -> Bool[Array, "B K S"]:
    """Attention above 1/n, n the slots the query could attend."""
    n = jnp.sum(present, axis=-1, keepdims=True).astype(jnp.float32)
    return obs.attention * n > 1.0


def _fold_use_recency(policy, view, obs, aux):
    """e <- decay * e + [slot used], so e = sum over uses of decay^(steps since use)."""
    threshold = policy.p["use_threshold"]
    if threshold is None:
        used = _above_uniform(obs, view.present)
    else:
        used = obs.attention > threshold
    e = view.evidence[..., 0]
    new = policy.p["decay"] * e + used.astype(jnp.float32)
    return jnp.where(view.present, new, e)[..., None], aux


def h2o(recent: int = 0) -> Policy:
    """H2O, heavy-hitter oracle (Zhang et al., 2023, arXiv 2306.14048).

    Rule: score = attention accumulated over every query since the item arrived,
    ``sum_s a_s(i)``; keep the ``recent`` most recent tokens plus the highest scores
    (the paper splits the budget evenly between the two).
    """
    return Policy(
        name="h2o", score=score_first, fold=_fold_decayed_sum, recent=recent,
        params=(("decay", 1.0), ("weighted", False)),
    )


def tova(recent: int = 0) -> Policy:
    """TOVA, token omission via attention (Oren et al., 2024, arXiv 2401.06104).

    Rule: score = the current query's attention (query heads of a group averaged);
    at each step the lowest-scoring token is dropped.
    """
    return Policy(
        name="tova", score=score_first, fold=_fold_decayed_sum, recent=recent,
        params=(("decay", 0.0), ("weighted", False)),
    )


def ema(decay: float = 0.9, *, weighted: bool = False, recent: int = 0, lag: int = 0) -> Policy:
    """Exponentially decayed attention: ``e <- decay * e + (w *) a``.

    Decay 1 accumulates (H2O's rule), decay 0 measures (TOVA's rule); values between
    trade the two off. With ``weighted`` the attention is weighted by correctness.
    """
    validate.unit("decay", decay)
    return Policy(
        name="ema", score=score_first, fold=_fold_decayed_sum, recent=recent, lag=lag,
        params=(("decay", float(decay)), ("weighted", bool(weighted))),
    )


def rmm(lag: int = 16, *, recent: int = 0, decay: float = 1.0) -> Policy:
    """Demonstrated utility (RMM, arXiv 2607.24667).

    Rule: ``DU_t(i) = sum_{s=birth(i)}^{t} w_s * a_s(i)``, attention weighted by the
    correctness ``w_s`` of the prediction made with it; a new item is protected for
    its commit lag H (``lag``) while the evidence gathers. With every weight 1 and
    ``max(recent, lag)`` equal, it keeps exactly what :func:`h2o` keeps. ``decay < 1``
    forgets old evidence (measuring instead of accumulating).
    """
    validate.unit("decay", decay)
    return Policy(
        name="rmm", score=score_first, fold=_fold_decayed_sum, recent=recent, lag=lag,
        params=(("decay", float(decay)), ("weighted", True)),
    )


def lag_window(lag: int = 16, *, gamma: float = 0.9, decay_after: float = 1.0,
               weighted: bool = True) -> Policy:
    """Preset (a) of the source documents: lag-window accumulation, then freeze.

    Rule: while a slot is inside its lag window (age 1 .. H + 1, H = ``lag``) add
    ``gamma^(H + 1 - age) * (w *) a``, so later observations weigh more; afterwards the
    score is frozen, multiplied by ``decay_after`` each query (1 keeps it forever; a
    value slightly below 1 lets stale high scores fade).
    """
    validate.unit("gamma", gamma)
    validate.unit("decay_after", decay_after)
    return Policy(
        name="lag_window", score=score_first, fold=_fold_lag_window, lag=lag,
        params=(("gamma", float(gamma)), ("decay_after", float(decay_after)),
                ("weighted", bool(weighted))),
    )


def use_recency(lag: int = 16, *, decay: float = 0.9,
                use_threshold: float | None = None) -> Policy:
    """Preset (b) of the source documents: protect for the lag, then score by recency
    of use.

    Rule: a slot is *used* by a query when its attention is above uniform (``a > 1/n``)
    or above ``use_threshold`` when given; score = ``sum over uses of
    decay^(steps since the use)``, computed incrementally as ``e <- decay * e + used``.
    """
    validate.unit("decay", decay)
    return Policy(
        name="use_recency", score=score_first, fold=_fold_use_recency, lag=lag,
        params=(("decay", float(decay)), ("use_threshold", use_threshold)),
    )
