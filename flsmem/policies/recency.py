"""Policies that rank by arrival alone: the full cache, the sliding window, StreamingLLM."""

from __future__ import annotations

import jax.numpy as jnp

from flsmem.policies.base import Policy, SlotView
from flsmem.typing import Array, Float, PyTree

__all__ = ["full", "streaming_llm", "window"]


def _score_recency(policy: Policy, view: SlotView, aux: PyTree) -> Float[Array, "B K S"]:
    # Exact in float32 up to 2^24 steps.
    return view.birth.astype(jnp.float32)


def full() -> Policy:
    """The full cache: never evicts. The quality reference every result compares to."""
    return Policy(name="full", score=_score_recency, evicts=False)


def window() -> Policy:
    """Sliding window: keep the ``budget`` most recent items (score = arrival step)."""
    return Policy(name="window", score=_score_recency)


def streaming_llm(sinks: int = 4) -> Policy:
    """StreamingLLM (Xiao et al., 2023, arXiv 2309.17453).

    Rule: keep the first ``sinks`` tokens (attention sinks) and the most recent
    ``budget - sinks`` tokens; score = arrival step.
    """
    return Policy(name="streaming_llm", score=_score_recency, sinks=sinks)
