"""``smooth``: commit each slot's score from the evidence its policy gathered."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from flsmem.policies import SlotView
from flsmem.state import MemoryState, age, check_state, count, present

__all__ = ["smooth", "FALLBACK_SCALE"]

# Slots whose score is not finite rank below every finite score, newer above older.
FALLBACK_SCALE = -1e30


def smooth(state: MemoryState) -> MemoryState:
    """The fixed-lag step: commit ``score`` from the policy's evidence.

    Slots still inside their commit lag are protected by ``evict`` whatever their score;
    once past it they are ranked by the committed score, which follows the policy's
    rule (keep accumulating, decay, freeze, or filter). With ``normalise_by_age`` the
    committed score is ``score / (age + 1)``. A score that is not finite is counted in
    ``stats.fallbacks``; its row is then ranked by the policy's ``fallback_score`` when
    it has one, and what is still not finite falls back to recency, below every finite
    score.

    Args:
      state: the memory, after ``observe``.

    Returns:
      The memory with ``score`` ``[B, K, S]`` committed (0 for slots that are free or
      whose item has not arrived yet) and ``stats.fallbacks`` counted.
    """
    check_state(state)
    policy = state.config.policy
    ages = age(state)
    here = present(state)
    view = SlotView(state.evidence, ages, state.birth, state.position, here, state.step)

    def committed(score_fn):
        raw = score_fn(policy, view, state.aux).astype(jnp.float32)
        if not policy.normalise_by_age:
            return raw
        # A present item's age is at least 1. An item still to arrive (a chunk's later
        # items) has age 0 or below and is committed to 0 whatever it divides to, but a
        # division by 0 would send the finiteness check below to its slow branch.
        return raw / jnp.maximum(ages + 1, 1).astype(jnp.float32)

    raw = committed(policy.score)
    fallback = FALLBACK_SCALE / (state.birth + 1).astype(jnp.float32)

    def robust(raw):
        return jnp.where(here, jnp.where(jnp.isfinite(raw), raw, fallback), 0.0)

    def with_fallbacks(raw):
        not_finite = here & ~jnp.isfinite(raw)
        fell_back = count(not_finite, axis=(1, 2))
        if policy.fallback_score is not None:
            # One scale per row: a row with any bad score is ranked wholly by the fallback.
            row_bad = jnp.any(not_finite, axis=-1, keepdims=True)
            raw = jnp.where(row_bad, committed(policy.fallback_score), raw)
        return robust(raw), fell_back

    # The fallbacks are for rows gone wrong. One sum over the scores of every slot (a
    # non-finite one carries through it; finite ones can only overflow it) says that no
    # row needs them, the usual case; only otherwise are they counted, in a branch, which
    # finds none if the sum only overflowed. It reads the scores as they are, not masked
    # to the present slots: XLA on CPU would write the masked scores out in full before
    # reducing them. A free slot's stale score can only send a step to the count. A sum,
    # not a maximum of magnitudes: on CPU it runs in 40% of the time.
    finite = jnp.all(jnp.isfinite(jnp.sum(raw, axis=(1, 2))))
    if policy.fallback_score is None:
        # The scores are committed outside the branch, in one pass (an array a
        # conditional returns is copied by XLA); only the count goes through it.
        score = robust(raw)
        fell_back = lax.cond(finite, lambda _: jnp.zeros(state.step.shape, jnp.int32),
                             lambda raw: with_fallbacks(raw)[1], raw)
    else:
        score, fell_back = lax.cond(finite, lambda raw: (robust(raw), jnp.zeros(state.step.shape, jnp.int32)),
                                    with_fallbacks, raw)
    stats = state.stats.replace(fallbacks=state.stats.fallbacks + fell_back)
    return state.replace(score=score, stats=stats)
