"""``observe``: fold the evidence of one query, or of a chunk of queries, into the memory."""

from __future__ import annotations

import functools
from typing import Callable

import jax.numpy as jnp
from jax import lax

from flsmem import validate
from flsmem.policies import Observation, Policy, SlotView
from flsmem.state import MemoryState, check_state
from flsmem.typing import Array, Float

__all__ = ["observe", "observe_args", "reduce_query_heads"]


def reduce_query_heads(
    attention: Float[Array, "B K G *QS"], policy_or_rule: Policy | str
) -> Float[Array, "B K *QS"]:
    """Combine the G query heads of each GQA group into one attention row per KV head.

    Args:
      attention: ``[B, K, G, S]`` or ``[B, K, G, Q, S]`` attention probabilities.
      policy_or_rule: a policy (its ``head_reduction``) or "mean", "sum", "max".

    Returns:
      ``[B, K, S]`` or ``[B, K, Q, S]``.
    """
    rule = policy_or_rule.head_reduction if isinstance(policy_or_rule, Policy) else policy_or_rule
    if jnp.ndim(attention) not in (4, 5) or not jnp.issubdtype(jnp.result_type(attention), jnp.floating):
        raise ValueError(f"attention must be a float array [B, K, G, S] or [B, K, G, Q, S], got "
                         f"{jnp.result_type(attention)}{list(jnp.shape(attention))}")
    combine = {"mean": jnp.add, "sum": jnp.add, "max": jnp.maximum}
    if rule not in combine:
        raise ValueError(f"head reduction rule must be one of {tuple(combine)}, got {rule!r}")
    # Head by head, not a reduction over axis 2: XLA on CPU ran that reduction of a
    # prefill chunk's [B, K, G, Q, S] as a slow library call (half the time of a
    # SmolLM2 chunk of 128 queries over 4,096 slots); G - 1 elementwise operations
    # give the same numbers and fuse with the softmax.
    heads = jnp.moveaxis(attention, 2, 0)
    combined = functools.reduce(combine[rule], heads[1:], heads[0])
    return combined / heads.shape[0] if rule == "mean" else combined


def observe_one(
    state: MemoryState,
    attention: Float[Array, "B K S"],
    correctness: Float[Array, "B"],
    future: Float[Array, "B K S"] | None,
) -> MemoryState:
    """Fold one query (already validated) and advance the clock by one step."""
    policy = state.config.policy
    t = state.step
    # The items that have arrived by this query are those `present` once the clock has
    # advanced; written as that mask is (birth below the next step), XLA computes it
    # once for this step's fold and for what smooth and evict read after it.
    present = state.valid & (state.birth < (t + 1)[:, None, None])
    finite_w = jnp.isfinite(correctness)
    # Whether a row saw a non-finite entry where an item is present. A sum of the
    # attention as it comes is finite when every entry is (NaN and Inf carry through
    # it; finite entries can only overflow it, which the branch then settles), the
    # usual case; only otherwise is the mask applied, in a branch. Masking first would
    # write the masked attention out in full before reducing it (XLA on CPU does not
    # fuse a mask into a reduction). A sum, not a maximum of magnitudes: on CPU it ran
    # in 40% of the time (90 rows of 4,097 slots, 30 against 75 us).
    def masked_check(_):
        return ~jnp.isfinite(jnp.max(jnp.where(present, jnp.abs(attention), 0.0), axis=(1, 2)))

    total = jnp.sum(attention, axis=(1, 2))
    bad = lax.cond(jnp.all(jnp.isfinite(total)), lambda _: jnp.zeros(total.shape, jnp.bool_), masked_check, None)
    bad = bad | ~finite_w
    attention = jnp.where(present & jnp.isfinite(attention), attention, 0.0)
    correctness = jnp.where(finite_w, correctness, 0.0)
    if future is not None:
        future = jnp.where(present & jnp.isfinite(future), future, 0.0)
    evidence, aux = state.evidence, state.aux
    if policy.fold is not None:
        view = SlotView(
            evidence=evidence,
            age=t[:, None, None] + 1 - state.birth,
            birth=state.birth,
            position=state.position,
            present=present,
            step=t,
        )
        evidence, aux = policy.fold(policy, view, Observation(attention, correctness, future), aux)
    stats = state.stats.replace(nonfinite_inputs=state.stats.nonfinite_inputs + bad.astype(jnp.int32))
    return state.replace(evidence=evidence, aux=aux, step=t + 1, stats=stats)


def scan_queries(
    state: MemoryState,
    per_query: Callable[[MemoryState, Array, Array, Array | None], MemoryState],
    attention: Float[Array, "B K Q S"],
    correctness: Float[Array, "B Q"],
    future: Float[Array, "B K Q S"] | None,
) -> MemoryState:
    """Apply ``per_query`` to each query of a validated chunk, in order."""
    payload = state.payload  # no per-query step touches it: keep it out of the carry
    carry = state.replace(payload=None)
    xs = (
        jnp.moveaxis(attention, 2, 0),
        jnp.moveaxis(correctness, 1, 0),
        None if future is None else jnp.moveaxis(future, 2, 0),
    )
    if attention.shape[2] == 1:
        carry = per_query(carry, *(None if x is None else x[0] for x in xs))
    else:
        carry, _ = lax.scan(lambda c, x: (per_query(c, *x), None), carry, xs)
    return carry.replace(payload=payload)


def observe(
    state: MemoryState,
    attention: Float[Array, "B K S"] | Float[Array, "B K Q S"],
    correctness: Float[Array, "B"] | Float[Array, "B Q"] | None = None,
    future: Float[Array, "B K S"] | Float[Array, "B K Q S"] | None = None,
) -> MemoryState:
    """Fold one query's attention (or a chunk of Q queries') into the slots' evidence.

    Query q of a chunk is the memory's step ``step + q``; it sees the slots that are
    occupied and have arrived by then (``birth <= step + q``) and attention to any
    other slot is ignored. NaN or Inf attention or correctness is taken as no evidence
    (0) and counted in ``stats.nonfinite_inputs``. The clock advances by Q. No item is
    evicted here: to interleave eviction query by query, use :func:`flsmem.update`.

    Args:
      state: the memory.
      attention: ``[B, K, S]`` or ``[B, K, Q, S]`` attention each query gave each slot,
        query heads already reduced (:func:`reduce_query_heads`).
      correctness: ``[B]`` or ``[B, Q]`` weight in [0, 1] of each query's prediction
        (1 if None): teacher-forced correctness, or a serving proxy such as the
        probability of the emitted token.
      future: shaped like ``attention``, each slot's future utility; required by the
        oracle policy, ignored by the others.

    Returns:
      The memory with evidence folded and the clock advanced.
    """
    attention, correctness, future, _ = observe_args(state, attention, correctness, future)
    return scan_queries(state, observe_one, attention, correctness, future)


def observe_args(state, attention, correctness, future):
    """Normalise ``observe``'s arguments to a chunk: attention ``[B, K, Q, S]``,
    correctness ``[B, Q]``, future ``[B, K, Q, S]`` or None; returns them and Q."""
    check_state(state)
    b, k, s = state.valid.shape
    shape = validate.shape(attention)
    if shape == (b, k, s):
        single, q = True, 1
    elif len(shape) == 4 and shape[:2] == (b, k) and shape[3] == s:
        single, q = False, shape[2]
    else:
        validate.fail(f"attention must be [B, K, S] = {[b, k, s]} or [B, K, Q, S] = {[b, k, 'Q', s]}, "
              f"got {list(shape)}")
    if not validate.is_float(attention):
        validate.fail(f"attention must be a float array, got {jnp.result_type(attention)}")
    expected = (b,) if single else (b, q)
    if correctness is None:
        correctness = jnp.ones(expected, jnp.float32)
    elif validate.shape(correctness) != expected or not validate.is_float(correctness):
        validate.fail(f"correctness must be a float array of shape {list(expected)} with values in "
              f"[0, 1], got {jnp.result_type(correctness)}{list(validate.shape(correctness))}")
    policy = state.config.policy
    if policy.needs_future:
        if future is None:
            validate.fail(f"future is required by the {policy.name} policy: the future utility of "
                  f"each slot, shaped like attention {list(shape)}")
        if validate.shape(future) != shape or not validate.is_float(future):
            validate.fail(f"future must be a float array shaped like attention {list(shape)}, got "
                  f"{jnp.result_type(future)}{list(validate.shape(future))}")
    else:
        future = None
    attention = jnp.asarray(attention, jnp.float32)
    correctness = jnp.asarray(correctness, jnp.float32)
    if single:
        attention, correctness = attention[:, :, None], correctness[:, None]
        if future is not None:
            future = future[:, :, None]
    if future is not None:
        future = jnp.asarray(future, jnp.float32)
    return attention, correctness, future, q
