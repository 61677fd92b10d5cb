"""``write``: put new items into free slots."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from flsmem import validate
from flsmem.evict import priority
from flsmem.state import MemoryState, check_state, count
from flsmem.typing import Array, Bool, Int, PyTree

__all__ = ["write", "write_slots"]


def _ranked_targets(state: MemoryState, q: int):
    """Free slots first (lowest index first), then the lowest-priority occupied ones."""
    preference = jnp.where(state.valid, -priority(state), jnp.inf)
    _, target = lax.top_k(preference, q)  # [B, K, Q]
    return target, jnp.take_along_axis(state.valid, target, axis=-1)


def _targets(state: MemoryState, q: int):
    """The slots the ``q`` new items of every row go to, and which of them were
    occupied (forced writes): ``([B, K, Q] int32, [B, K, Q] bool)``."""
    if q > 1:
        return _ranked_targets(state, q)
    # Decode hot path. The schedule (capacity = budget + evict_every) leaves every row
    # a free slot, and the lowest free slot is one min-reduction over the row, where
    # ranking the row costs a priority pass and a top_k per write (and an argmax, a
    # two-operand reduction, runs several times slower than a min on CPU). The ranking
    # runs only when some row is full.
    s = state.valid.shape[-1]
    # In float32 (exact below 2**24 slots): XLA on CPU runs an int32 min over a row as
    # a tree of reduce-windows, several times slower than a float min.
    dtype = jnp.float32 if s < 2**24 else jnp.int32
    slot = lax.broadcasted_iota(dtype, state.valid.shape, 2)
    lowest = jnp.min(jnp.where(state.valid, s, slot), axis=-1).astype(jnp.int32)

    def lowest_free(state):
        return lowest[..., None], jnp.zeros(lowest.shape + (1,), jnp.bool_)

    return lax.cond(jnp.all(lowest < s), lowest_free, lambda st: _ranked_targets(st, 1), state)


def write(
    state: MemoryState,
    payload: PyTree,
    position: Int[Array, "B"] | Int[Array, "B Q"],
    mask: Bool[Array, "B"] | Bool[Array, "B Q"] | None = None,
) -> MemoryState:
    """Write one item, or a chunk of Q items, into every row of the memory.

    Item j of a chunk arrives with query ``step + j``: it is stamped
    ``birth = step + j`` and becomes *present* when ``observe`` reaches that query, so a
    chunk written at once is scored exactly as if it had been written one item per step.
    Items go to the lowest free slots. A row with no free slot (``evict`` was not run
    on schedule) replaces its lowest-priority unprotected item and counts it in
    ``stats.forced_writes``.

    Args:
      state: the memory.
      payload: pytree like the memory's payload, leaves ``[B, K, ...item]`` for one item
        or ``[B, K, Q, ...item]`` for a chunk (Q <= ``config.max_chunk``).
      position: ``[B]`` or ``[B, Q]`` int, absolute position of each item (shared by
        the K heads of a sequence).
      mask: ``[B]`` or ``[B, Q]`` bool, False for padding that must not be written.

    Returns:
      The memory with the items written.
    """
    state, target, payload = _write_slots(state, payload, position, mask)
    b, k, _ = state.valid.shape
    bi = jnp.arange(b)[:, None, None]
    ki = jnp.arange(k)[None, :, None]
    put = lambda dest, new: dest.at[bi, ki, target].set(new, mode="drop")  # noqa: E731
    return state.replace(payload=jax.tree.map(put, state.payload, payload))


def write_slots(
    state: MemoryState,
    payload: PyTree,
    position: Int[Array, "B"] | Int[Array, "B Q"],
    mask: Bool[Array, "B"] | Bool[Array, "B Q"] | None = None,
) -> tuple[MemoryState, Int[Array, "B K Q"]]:
    """:func:`write` for a caller that stores the payload itself.

    Everything :func:`write` does except putting the payload into ``state.payload``,
    which is returned unchanged (it is only read for its shapes): a decoder whose
    caches of all layers live in one stacked array writes the new keys and values in
    place there, instead of copying out one layer's cache and back.

    Returns:
      ``(state, target)``: the memory with the items' slots filled in, and ``[B, K, Q]``
      int32, the slot of each item (``S``, out of range, for a masked one). Put item
      ``[b, k, q]`` of the payload at slot ``target[b, k, q]`` of row ``(b, k)``.
    """
    state, target, _ = _write_slots(state, payload, position, mask)
    return state, target


def _write_slots(state, payload, position, mask):
    """``write`` without the payload: returns the state, the targets and the payload
    normalised to chunks ``[B, K, Q, ...]``."""
    payload, position, mask, q = _write_args(state, payload, position, mask)
    b, k, s = state.valid.shape
    birth = state.step[:, None] + jnp.arange(q, dtype=jnp.int32)[None, :]  # [B, Q]

    target, forced = _targets(state, q)
    forced = forced & mask[:, None, :]
    target = jnp.where(mask[:, None, :], target, s)  # out of range: dropped below

    bi = jnp.arange(b)[:, None, None]
    ki = jnp.arange(k)[None, :, None]

    def put(dest, new):
        return dest.at[bi, ki, target].set(new, mode="drop")

    policy = state.config.policy
    per_head = lambda x: jnp.broadcast_to(x[:, None, :], (b, k, q))  # noqa: E731
    if policy.init_evidence is None:
        new_evidence = policy.zero_evidence((b, k, q))
    else:
        new_evidence = policy.init_evidence(policy, payload, per_head(position), per_head(birth))
    stats = state.stats.replace(
        forced_writes=state.stats.forced_writes + count(forced, axis=(1, 2))
    )
    state = state.replace(
        position=put(state.position, per_head(position)),
        valid=put(state.valid, jnp.ones((b, k, q), jnp.bool_)),
        birth=put(state.birth, per_head(birth)),
        evidence=tuple(map(put, state.evidence, new_evidence)),
        score=put(state.score, jnp.zeros((b, k, q), jnp.float32)),
        stats=stats,
    )
    return state, target, payload


def _write_args(state, payload, position, mask):
    """Normalise ``write``'s arguments to a chunk: payload leaves ``[B, K, Q, ...]``,
    position ``[B, Q]`` int32, mask ``[B, Q]`` bool; returns them and Q."""
    check_state(state)
    b, k, s = state.valid.shape
    if jax.tree.structure(payload) != jax.tree.structure(state.payload):
        validate.fail(
            f"payload must have the memory's structure {jax.tree.structure(state.payload)}, "
            f"got {jax.tree.structure(payload)}"
        )
    single = None
    q = 1
    for new, old in zip(jax.tree.leaves(payload), jax.tree.leaves(state.payload)):
        item = old.shape[3:]
        shape = validate.shape(new)
        if shape == (b, k) + item:
            is_single = True
        elif len(shape) == 3 + len(item) and shape[:2] == (b, k) and shape[3:] == item:
            is_single, q = False, shape[2]
        else:
            validate.fail(
                f"payload leaves must be [B, K, ...item] = {(b, k) + item} or "
                f"[B, K, Q, ...item] = {(b, k, 'Q') + item}, got {shape}"
            )
        if single is not None and single != is_single:
            validate.fail("payload leaves must all be single items or all be chunks of Q items")
        single = is_single
        if validate.is_float(old) != validate.is_float(new) or validate.is_int(old) != validate.is_int(new):
            validate.fail(f"payload leaf dtype must be like the memory's {old.dtype}, got {jnp.result_type(new)}")
    if not single and (q < 1 or q > state.config.max_chunk):
        validate.fail(f"payload chunk length Q must be in [1, max_chunk={state.config.max_chunk}], got {q}")
    expected = (b,) if single else (b, q)
    if validate.shape(position) != expected or not validate.is_int(position):
        validate.fail(f"position must be an int array of shape {expected}, got "
              f"{jnp.result_type(position)}{list(validate.shape(position))}")
    if mask is None:
        mask = jnp.ones(expected, jnp.bool_)
    elif validate.shape(mask) != expected or jnp.result_type(mask) != jnp.bool_:
        validate.fail(f"mask must be a bool array of shape {expected}, got "
              f"{jnp.result_type(mask)}{list(validate.shape(mask))}")
    if single:
        payload = jax.tree.map(lambda x: jnp.expand_dims(x, 2), payload)
        position, mask = position[:, None], mask[:, None]
    payload = jax.tree.map(lambda new, old: jnp.asarray(new, old.dtype), payload, state.payload)
    return payload, jnp.asarray(position, jnp.int32), jnp.asarray(mask), q
