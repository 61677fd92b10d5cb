"""``smooth``: commit each slot's score from the evidence its policy gathered."""

from __future__ import annotations

import jax.numpy as jnp

from flsmem import validate
from flsmem.policies import SlotView
from flsmem.state import MemoryState, age, present

__all__ = ["smooth", "FALLBACK_SCALE"]

# Slots whose score is not finite rank below every finite score, newer above older.
FALLBACK_SCALE = -1e30


def smooth(state: MemoryState) -> MemoryState:
    """The fixed-lag step: commit ``score`` from the policy's evidence.

    Slots still inside their commit lag are protected by ``evict`` whatever their score;
    once past it they are ranked by the committed score, which follows the policy's
    rule (keep accumulating, decay, freeze, or filter). With ``normalise_by_age`` the
    committed score is ``score / (age + 1)``. A score that is not finite falls back to
    recency, below every finite score, and is counted in ``stats.fallbacks``.

    Args:
      state: the memory, after ``observe``.

    Returns:
      The memory with ``score`` committed.
    """
    validate.check_state(state)
    policy = state.config.policy
    ages = age(state)
    here = present(state)
    view = SlotView(state.evidence, ages, state.birth, state.position, here, state.step)
    raw = policy.score(policy, view, state.aux).astype(jnp.float32)
    if policy.normalise_by_age:
        raw = raw / (ages + 1).astype(jnp.float32)
    finite = jnp.isfinite(raw)
    fallback = FALLBACK_SCALE / (state.birth + 1).astype(jnp.float32)
    score = jnp.where(here, jnp.where(finite, raw, fallback), 0.0)
    fell_back = jnp.sum(here & ~finite, axis=(1, 2), dtype=jnp.int32)
    stats = state.stats.replace(fallbacks=state.stats.fallbacks + fell_back)
    return state.replace(score=score, stats=stats)
