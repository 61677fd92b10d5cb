"""Surprise first: the items the model did not predict, then the most attended.

An accumulated score (H2O) keeps what later tokens read. A fact planted in text that
nothing reads until a question arrives gets no more attention than its neighbours, and
is evicted; but the model did not predict it when it arrived, while it predicts the
text around it. The correctness weight of the prediction that produced an item (0 when
the model's argmax missed it, 1 when it hit; the emitted token's probability while
decoding) is measured once, as the item arrives, and ranks first; accumulated attention
orders the items within each level. This is the surprise that gates what a test-time
memory stores (Behrouz et al., 2024, arXiv 2501.00663), used as a prior for eviction.

Where the model mispredicts most of the text (prose: about two tokens in three for
SmolLM2), surprise alone leaves the memory without the predictable words that later
tokens read. A ``reserve`` bounds what surprise may claim: only the ``reserve`` most
surprising of the items eviction ranks get ahead of the accumulated ranking, and every
other item competes by accumulated attention alone, so a rare surprise (a fact in
repetitive text) is kept while common ones cost the accumulated ranking at most
``reserve`` slots.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from flsmem import validate
from flsmem.policies.base import Observation, Params, Policy, SlotView, with_columns
from flsmem.typing import Array, Bool, Float, PyTree

__all__ = ["SurpriseParams", "surprise"]


@dataclasses.dataclass(frozen=True)
class SurpriseParams(Params):
    """Parameters of :func:`surprise`.

    Attributes:
      reserve: the most items per row ranked ahead for their surprise; None for every
        item, 0 for none (H2O's ranking).
    """

    reserve: int | None = None

    def __post_init__(self):
        if self.reserve is not None:
            validate.require(isinstance(self.reserve, int) and not isinstance(self.reserve, bool)
                             and self.reserve >= 0,
                             f"reserve must be None or an int >= 0, got {self.reserve!r}")

# Evidence arrays: attention summed since arrival, and the producing prediction's miss.
_ACCUMULATED, _SURPRISE = 0, 1


def _init_aux(policy: Policy, batch: int, kv_heads: int, slots: int) -> dict:
    """The correctness weight of the last query folded; the first item, which no
    prediction produced, counts as predicted."""
    return {"last_weight": jnp.ones((batch,), jnp.float32)}


def _fold(policy: Policy, view: SlotView, obs: Observation, aux: PyTree):
    e = view.evidence
    # The item arriving now is the token the previous query predicted.
    arriving = view.age == 1
    missed = jnp.where(arriving, 1.0 - aux["last_weight"][:, None, None], e[_SURPRISE])
    evidence = with_columns(view, [e[_ACCUMULATED] + obs.attention, missed])
    return evidence, dict(aux, last_weight=obs.weight)


def _score(policy: Policy, view: SlotView, aux: PyTree) -> Float[Array, "B K S"]:
    # A / (1 + A) maps the accumulated attention A >= 0 into [0, 1), so with 0/1 weights
    # every missed item outranks every predicted one whatever their attention.
    accumulated = view.evidence[_ACCUMULATED]
    attended = accumulated / (1.0 + accumulated)
    first = view.evidence[_SURPRISE] + attended
    reserve = policy.params.reserve
    if reserve is None:
        return first
    # The reserve's items score above 1 > A / (1 + A), ahead of every other item.
    return jnp.where(_top(policy, view, first, reserve), 1.0 + first, attended)


def _top(policy: Policy, view: SlotView, key: Float[Array, "B K S"], n: int) -> Bool[Array, "B K S"]:
    """The ``n`` highest ``key`` among the items eviction ranks (present, not protected),
    equal keys by the newer item, as eviction breaks them."""
    ranked = view.present & (view.position >= policy.sinks) & (view.age > policy.protected_age)
    if n >= key.shape[-1]:
        return ranked
    if n == 0:
        return jnp.zeros_like(ranked)
    key = jnp.where(ranked, key, -jnp.inf)
    # Sorted descending by (key, birth); births are unique among a row's items.
    descending_key, descending_birth = lax.sort((-key, -view.birth), dimension=-1, num_keys=2)
    last_key, last_birth = -descending_key[..., n - 1:n], -descending_birth[..., n - 1:n]
    return ranked & ((key > last_key) | ((key == last_key) & (view.birth >= last_birth)))


def surprise(recent: int = 0, reserve: int | None = None) -> Policy:
    """Surprise first, then accumulated attention.

    Rule: surprise = ``(1 - w_producer) + A / (1 + A)``, where ``w_producer`` is the
    correctness weight of the query before the item's arrival (the prediction of the
    item itself; 1 for an item that arrives first) and ``A`` the attention summed over
    every query since arrival, as H2O sums it. With ``reserve=None`` the score is the
    surprise. With a ``reserve`` of n, the n items of highest surprise among those
    eviction ranks (present, not protected; equal ones by the newer) score
    ``1 + surprise`` and the others ``A / (1 + A)``: at most n items are kept for their
    surprise, the rest by H2O's ranking. Keep the ``recent`` most recent items plus the
    highest scores. A reserve sorts each row to rank it, which costs more than folding
    the evidence, so its scores are committed only when an eviction is due
    (``score_when_due``; the kept sets are the same).
    """
    return Policy(name="surprise", score=_score, fold=_fold, init_aux=_init_aux, evidence_shapes=((), ()),
                  params=SurpriseParams(reserve=reserve), recent=recent,
                  score_when_due=reserve is not None)
