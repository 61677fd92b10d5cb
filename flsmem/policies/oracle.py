"""The oracle upper bound: ranks by the future utility the caller passes in."""

from __future__ import annotations


from flsmem.policies.base import Observation, Policy, SlotView, score_first, with_column
from flsmem.typing import PyTree

__all__ = ["oracle"]


def _fold_future(policy: Policy, view: SlotView, obs: Observation, aux: PyTree):
    return with_column(view, obs.future), aux


def oracle() -> Policy:
    """Oracle upper bound: score = the future utility of each slot, given to
    ``observe(..., future=...)`` from a trace of the future (for example the attention
    the item will receive from later queries in a full-cache run)."""
    return Policy(name="oracle", score=score_first, fold=_fold_future, needs_future=True)
