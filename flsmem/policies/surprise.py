"""Surprise first: the items the model did not predict, then the most attended.

An accumulated score (H2O) keeps what later tokens read. A fact planted in text that
nothing reads until a question arrives gets no more attention than its neighbours, and
is evicted; but the model did not predict it when it arrived, while it predicts the
text around it. The correctness weight of the prediction that produced an item (0 when
the model's argmax missed it, 1 when it hit; the emitted token's probability while
decoding) is measured once, as the item arrives, and ranks first; accumulated attention
orders the items within each level. This is the surprise that gates what a test-time
memory stores (Behrouz et al., 2024, arXiv 2501.00663), used as a prior for eviction.
"""

from __future__ import annotations

import jax.numpy as jnp

from flsmem.policies.base import Observation, Policy, SlotView, with_columns
from flsmem.typing import Array, Float, PyTree

__all__ = ["surprise"]

# Evidence columns: attention summed since arrival, and the producing prediction's miss.
_ACCUMULATED, _SURPRISE = 0, 1


def _init_aux(policy: Policy, batch: int, kv_heads: int, slots: int) -> dict:
    """The correctness weight of the last query folded; the first item, which no
    prediction produced, counts as predicted."""
    return {"last_weight": jnp.ones((batch,), jnp.float32)}


def _fold(policy: Policy, view: SlotView, obs: Observation, aux: PyTree):
    e = view.evidence
    # The item arriving now is the token the previous query predicted.
    arriving = view.age == 1
    missed = jnp.where(arriving, 1.0 - aux["last_weight"][:, None, None], e[..., _SURPRISE])
    evidence = with_columns(view, [e[..., _ACCUMULATED] + obs.attention, missed])
    return evidence, dict(aux, last_weight=obs.weight)


def _score(policy: Policy, view: SlotView, aux: PyTree) -> Float[Array, "B K S"]:
    # A / (1 + A) maps the accumulated attention A >= 0 into [0, 1), so with 0/1 weights
    # every missed item outranks every predicted one whatever their attention.
    accumulated = view.evidence[..., _ACCUMULATED]
    return view.evidence[..., _SURPRISE] + accumulated / (1.0 + accumulated)


def surprise(recent: int = 0) -> Policy:
    """Surprise first, then accumulated attention.

    Rule: score = ``(1 - w_producer) + A / (1 + A)``, where ``w_producer`` is the
    correctness weight of the query before the item's arrival (the prediction of the
    item itself; 1 for an item that arrives first) and ``A`` the attention summed over
    every query since arrival, as H2O sums it; keep the ``recent`` most recent items
    plus the highest scores.
    """
    return Policy(name="surprise", score=_score, fold=_fold, init_aux=_init_aux, num_evidence=2,
                  recent=recent)
