"""``evict``: keep the highest-priority items of each row, protected ones always.

Equal priorities go to the newer item (the higher ``birth``), and only items born at
the same step (written without a query in between) fall back to the lower slot index.
Births are unique among a row's items in the usual write-then-update loop, so the kept
set does not depend on which slots the items occupy: writing a chunk at once and
writing it one item per step keep the same items.
"""

from __future__ import annotations

import jax

import jax.numpy as jnp
from jax import lax

from flsmem.kernels.topk import topk_mask
from flsmem.state import MemoryState, age, check_state, count, present
from flsmem.typing import Array, Bool, Float

__all__ = ["evict", "is_due", "priority", "protected"]


def protected(state: MemoryState) -> Bool[Array, "B K S"]:
    """Present items that ``evict`` must keep: attention sinks (position below
    ``sinks``), the recent window and slots inside their commit lag.

    Returns:
      ``[B, K, S]`` bool.
    """
    policy = state.config.policy
    sink = state.position < policy.sinks
    young = age(state) <= policy.protected_age
    return present(state) & (sink | young)


def priority(state: MemoryState) -> Float[Array, "B K S"]:
    """The key ``evict`` ranks by: +inf for protected items and for items written but
    not yet arrived (a chunk's later items), the committed score for the other items,
    -inf for free slots.

    Returns:
      ``[B, K, S]`` float32.
    """
    here = present(state)
    keep_always = state.valid & (~here | protected(state))
    return jnp.where(keep_always, jnp.inf, jnp.where(here, state.score, -jnp.inf))


def is_due(state: MemoryState, budget: int | None = None) -> Bool[Array, "B K"]:
    """Rows that :func:`evict` with the same ``budget`` would evict now: with None,
    those holding ``config.high_water`` present items; else those holding more than
    ``budget``. Always False for a policy that never evicts.

    For head-adaptive budgets a sequence's K heads are due together, when they hold
    ``K`` times that many together.

    Returns:
      ``[B, K]`` bool.
    """
    n_present = count(present(state))
    if not state.config.policy.evicts:
        return jnp.zeros(n_present.shape, jnp.bool_)
    if state.config.policy.head_budget is not None:
        # The heads of a sequence share one budget: they are due together.
        heads = n_present.shape[-1]
        total = jnp.sum(n_present, axis=-1, keepdims=True)
        due = total >= heads * state.config.high_water if budget is None else total > heads * budget
        return jnp.broadcast_to(due, n_present.shape)
    if budget is None:
        return n_present >= state.config.high_water
    return n_present > budget


def evict(state: MemoryState, budget: int | None = None) -> MemoryState:
    """Free the lowest-priority items of each row.

    With ``budget=None`` a row is evicted only when due, that is when it holds
    ``config.high_water = budget + evict_every`` present items, and then down to
    ``config.budget``. For a policy with head-adaptive budgets
    (:func:`flsmem.policies.adakv`) a sequence's K heads are evicted together, when
    they hold ``K * high_water`` together, down to ``K * budget`` shared by score. With an explicit ``budget`` every row holding more is evicted
    down to it now (prefill compression). Protected items are always kept and count
    inside the budget; written items whose query has not come yet are kept and not
    counted. The kept set is the top-``budget`` priority per row, ties to the newer
    item (higher ``birth``, whatever the slots), selected by
    :func:`flsmem.kernels.topk_mask`. Evictions, with the age and score of what was
    evicted, are added to ``stats``.

    Args:
      state: the memory, after ``smooth``.
      budget: items to keep per row now (an int, or an int32 scalar traced inside a
        map over layers, checked by its caller); None follows the schedule.

    Returns:
      The memory with the evicted slots freed (``valid`` False, ``position`` -1).
    """
    check_state(state)
    config = state.config
    if budget is not None and not _is_traced_count(budget):
        protected_count = config.policy.sinks + config.policy.protected_age
        if not (isinstance(budget, int) and not isinstance(budget, bool) and budget >= protected_count):
            raise ValueError(
                f"budget must be an int >= the protected items (sinks + max(recent, lag) = "
                f"{protected_count}), got {budget!r}"
            )
    if not config.policy.evicts:
        return state
    b, k, s = state.valid.shape
    target = config.budget if budget is None else budget
    due = is_due(state, budget)

    def top(scores, kept, tiebreak, max_dropped=None):
        """The top-``kept`` mask of each row of ``scores [..., N]``."""
        n = scores.shape[-1]
        return topk_mask(
            scores.reshape(-1, n), jnp.reshape(kept, -1),
            tiebreak=tiebreak.reshape(-1, n),
            implementation=config.implementation,
            interpret=config.interpret,
            max_dropped=max_dropped,
        ).reshape(scores.shape)

    def run(changed):
        n_waiting = count(state.valid & ~present(state))
        rank = priority(state)
        head_budget = config.policy.head_budget
        if head_budget is None:
            # On schedule a row keeps at least `budget` of its `capacity` slots.
            keep = top(rank, target + n_waiting, state.birth,
                       config.capacity - config.budget if budget is None else None)
        else:
            keep = _shared_by_heads(rank, state.birth, target, n_waiting, head_budget, top, ~state.valid, due,
                                    config.capacity - config.head_share if budget is None else None)
        evicted = state.valid & ~keep & due[..., None]
        ages = age(state).astype(jnp.float32)
        stats = state.stats
        # Float sums stay per (row, head): summed over heads they would round
        # differently when the heads are split over devices (see MemoryStats).
        stats = stats.replace(
            evictions=stats.evictions + count(evicted, axis=(1, 2)),
            evicted_age=stats.evicted_age + jnp.sum(jnp.where(evicted, ages, 0.0), axis=-1),
            evicted_score=stats.evicted_score + jnp.sum(jnp.where(evicted, state.score, 0.0), axis=-1),
        )
        return state.valid & ~evicted, jnp.where(evicted, -1, state.position), stats

    # Only what an eviction changes goes through the branch: an array passed through
    # a conditional unchanged is copied by XLA every step, taken or not.
    changed = (state.valid, state.position, state.stats)
    valid, position, stats = lax.cond(jnp.any(due), run, lambda c: c, changed)
    return state.replace(valid=valid, position=position, stats=stats)


def _is_traced_count(budget) -> bool:
    return isinstance(budget, jax.Array) and jnp.ndim(budget) == 0 and jnp.issubdtype(budget.dtype, jnp.integer)


def _shared_by_heads(rank, birth, target, n_waiting, head_budget, top, free, due, max_arrived):
    """AdaKV's selection: each sequence keeps the ``K * target`` highest priorities over
    its K heads, after each head's top ``int(floor * target)`` are made safe and what
    lies beyond its top ``ceil(ceiling * target)`` is excluded. Items still to arrive
    are kept on top, in their own head.

    ``max_arrived``: on schedule, the most items a head takes in between two
    evictions; None off schedule. Then the selection is first tried without sorting
    (:func:`_joint_when_within`), and the exact three passes, each a sort of every
    row, run only for a due sequence where that does not give it."""
    b, k, s = rank.shape
    kept = _kept(k, target, n_waiting)

    def exact(_):
        held = rank > -jnp.inf  # a head with fewer items than its floor must not spend the rest on free slots
        safe = top(rank, _floor(head_budget, target) + n_waiting, birth) & held
        allowed = top(rank, _ceiling(head_budget, target) + n_waiting, birth)
        joint = jnp.where(safe, jnp.inf, jnp.where(allowed, rank, -jnp.inf))
        return top(joint.reshape(b, k * s), kept, birth.reshape(b, k * s)).reshape(b, k, s)

    if max_arrived is None:
        return exact(None)
    keep, exact_already = _joint_when_within(rank, birth, target, n_waiting, head_budget, top, free,
                                             k * max_arrived)
    return lax.cond(jnp.all(exact_already | ~due[:, 0]), lambda _: keep, exact, None)


def _kept(heads, target, n_waiting):
    """Items a sequence keeps over its ``heads``: ``target`` each, plus those still to arrive."""
    return heads * target + jnp.sum(n_waiting, axis=-1)


def _floor(head_budget, target):
    return jnp.floor(head_budget.floor * target).astype(jnp.int32)


def _ceiling(head_budget, target):
    return jnp.ceil(head_budget.ceiling * target).astype(jnp.int32)


def _joint_when_within(rank, birth, target, n_waiting, head_budget, top, free, max_dropped):
    """AdaKV's selection where no floor and no ceiling binds, found without a sort.

    The plain top over a sequence's heads leaves out only the lowest items it holds:
    with free slots lifted above every item, a ``top`` that leaves out at most
    ``max_dropped`` entries per row finds them. That selection keeps a prefix of each
    head's own order (the joint order restricted to a head is the head's order), so
    where it holds each head's floor and stays within its ceiling, making the floor
    safe and cutting at the ceiling change nothing: it is the exact selection.

    Returns the mask ``[B, K, S]`` and, per sequence, whether it is the exact one: every
    slot in use ranks above -inf (and is not NaN, which ranks below it), the items left out are no more than those ranked
    below +inf (so neither a free slot nor a +inf item is among them), and every head
    keeps between its floor (or all it holds) and its ceiling."""
    b, k, s = rank.shape
    kept = _kept(k, target, n_waiting)
    used = ~free
    n_free = count(free, axis=(1, 2))
    dropped = k * s - n_free - kept
    lifted = jnp.where(free, jnp.inf, rank).reshape(b, k * s)
    keep = top(lifted, kept + n_free, birth.reshape(b, k * s), max_dropped).reshape(b, k, s) & used
    per_head = count(keep)
    within = ((per_head >= jnp.minimum(_floor(head_budget, target) + n_waiting, count(used)))
              & (per_head <= _ceiling(head_budget, target) + n_waiting))
    plain = ((dropped >= 0) & (dropped <= count(used & (rank < jnp.inf), axis=(1, 2)))
             & jnp.all(~used | (rank > -jnp.inf), axis=(1, 2)))  # no -inf and no NaN
    return keep, plain & jnp.all(within, axis=-1)
