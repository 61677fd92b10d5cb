"""The memory state: an immutable pytree of fixed-shape arrays, and ``init``."""

from __future__ import annotations

from typing import Any

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec

from flsmem import validate
from flsmem.config import MemoryConfig
from flsmem.typing import Array, Bool, Float, Int, PyTree

__all__ = [
    "MemoryState", "MemoryStats", "init", "check_state", "present", "visible", "age", "occupancy", "summary",
    "aux_axes",
]


@struct.dataclass
class MemoryStats:
    """Running counters for monitoring. Counts are per batch row (summed over KV
    heads); the float sums of evicted items are per (batch row, KV head), so that a
    memory with its heads split over devices adds up exactly what one device adds up
    (a float sum over heads would run in another order). :func:`summary` gives every
    figure per batch row.

    Attributes:
      evictions: ``[B]`` int32, items evicted.
      evicted_age: ``[B, K]`` float32, sum of the ages of evicted items.
      evicted_score: ``[B, K]`` float32, sum of the committed scores of evicted items.
      fallbacks: ``[B]`` int32, slots whose score was not finite when committed; their
        row was ranked by the policy's fallback score, or they by recency below every
        finite score.
      forced_writes: ``[B]`` int32, writes that found no free slot and replaced the
        lowest-priority item (the schedule was not followed).
      nonfinite_inputs: ``[B]`` int32, queries whose attention or correctness had NaN
        or Inf entries; those entries were taken as no evidence.
    """

    evictions: Int[Array, "B"]
    evicted_age: Float[Array, "B K"]
    evicted_score: Float[Array, "B K"]
    fallbacks: Int[Array, "B"]
    forced_writes: Int[Array, "B"]
    nonfinite_inputs: Int[Array, "B"]

    # Fields shaped [B, K]; the others are [B].
    PER_HEAD = ("evicted_age", "evicted_score")

    @classmethod
    def zeros(cls, batch: int, kv_heads: int) -> "MemoryStats":
        i = jnp.zeros((batch,), jnp.int32)
        f = jnp.zeros((batch, kv_heads), jnp.float32)
        return cls(i, f, f, i, i, i)


@struct.dataclass
class MemoryState:
    """Memory of every (batch, KV head) row, as fixed-shape arrays.

    Attributes:
      payload: pytree of ``[B, K, S, ...]`` arrays, what each slot holds (for a KV
        cache ``{"k": [B, K, S, D], "v": [B, K, S, D]}``).
      position: ``[B, K, S]`` int32, absolute position of the item; -1 when free.
      valid: ``[B, K, S]`` bool, the slot is occupied.
      birth: ``[B, K, S]`` int32, step (query index) at which the item arrived.
      evidence: tuple of float32 arrays ``[B, K, S, ...]``, the policy's per-slot
        statistics, shaped by its ``evidence_shapes``.
      score: ``[B, K, S]`` float32, committed score used by ``evict``.
      step: ``[B]`` int32, queries observed so far (an array, so nothing retraces).
      aux: the policy's own state (a pytree: per-row ``[B, K, ...]`` arrays, or the
        learned estimator's parameters and optimizer state) or None.
      stats: :class:`MemoryStats`.
      config: the static :class:`~flsmem.config.MemoryConfig` (not a pytree leaf).
    """

    payload: PyTree
    position: Int[Array, "B K S"]
    valid: Bool[Array, "B K S"]
    birth: Int[Array, "B K S"]
    evidence: tuple[Float[Array, "B K S ..."], ...]
    score: Float[Array, "B K S"]
    step: Int[Array, "B"]
    aux: PyTree
    stats: MemoryStats
    config: MemoryConfig = struct.field(pytree_node=False)

    @property
    def batch(self) -> int:
        return self.valid.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.valid.shape[1]

    @property
    def slots(self) -> int:
        return self.valid.shape[2]


def _as_spec(leaf: Any, dtype) -> jax.ShapeDtypeStruct:
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    if isinstance(leaf, tuple) and all(isinstance(d, int) and d >= 1 for d in leaf):
        return jax.ShapeDtypeStruct(leaf, dtype)
    raise ValueError(
        "payload_spec leaves must be jax.ShapeDtypeStruct or tuples of positive ints "
        f"(the trailing shape of one item), got {leaf!r}"
    )


def init(
    config: MemoryConfig,
    batch: int,
    kv_heads: int,
    payload_spec: PyTree,
    dtype=jnp.float32,
) -> MemoryState:
    """An empty memory.

    Args:
      config: the :class:`~flsmem.config.MemoryConfig`.
      batch: B, independent sequences.
      kv_heads: K, rows per sequence (1 for a memory that is not per head).
      payload_spec: pytree whose leaves give one item's trailing shape, as
        ``jax.ShapeDtypeStruct`` or a tuple of ints (then of ``dtype``); for a KV cache
        ``{"k": (D,), "v": (D,)}``; ``()`` for a scalar per item.
      dtype: dtype of leaves given as plain shapes.

    Returns:
      A :class:`MemoryState` with ``config.capacity`` free slots per row.
    """
    if not isinstance(config, MemoryConfig):
        raise ValueError(f"config must be a MemoryConfig, got {type(config).__name__}")
    for name, value in (("batch", batch), ("kv_heads", kv_heads)):
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    specs = jax.tree.map(
        lambda leaf: _as_spec(leaf, dtype), payload_spec,
        is_leaf=lambda x: isinstance(x, (tuple, jax.ShapeDtypeStruct)),
    )
    if not jax.tree.leaves(specs):
        raise ValueError("payload_spec must have at least one leaf")
    s = config.capacity
    rows = (batch, kv_heads, s)
    payload = jax.tree.map(lambda sp: jnp.zeros(rows + tuple(sp.shape), sp.dtype), specs)
    policy = config.policy
    aux = None if policy.init_aux is None else policy.init_aux(policy, batch, kv_heads, s)
    return MemoryState(
        payload=payload,
        position=jnp.full(rows, -1, jnp.int32),
        valid=jnp.zeros(rows, jnp.bool_),
        birth=jnp.zeros(rows, jnp.int32),
        evidence=policy.zero_evidence(rows),
        score=jnp.zeros(rows, jnp.float32),
        step=jnp.zeros((batch,), jnp.int32),
        aux=aux,
        stats=MemoryStats.zeros(batch, kv_heads),
        config=config,
    )


def check_state(state) -> None:
    """The state is a :class:`~flsmem.MemoryState` whose arrays agree with each other and
    with its config (a state edited by hand, restored from elsewhere or taken apart by
    a transformation fails here, not deep inside a policy). The payload may be None:
    per-query loops carry the state without it."""
    if not isinstance(state, MemoryState):
        validate.fail(f"state must be a flsmem.MemoryState (from flsmem.init), got {type(state).__name__}")
    valid = state.valid
    if jnp.ndim(valid) != 3 or jnp.result_type(valid) != jnp.bool_:
        validate.fail(f"state.valid must be a bool array [B, K, S], got {jnp.result_type(valid)}{list(validate.shape(valid))} "
              "(a memory stacked over layers must be mapped over, e.g. with jax.vmap or lax.map)")
    rows = validate.shape(valid)
    capacity = state.config.capacity
    if rows[2] != capacity:
        validate.fail(f"state has {rows[2]} slots per row but its config's capacity is {capacity} "
              "(budget + evict_every + max_chunk - 1); build the state with flsmem.init(config, ...)")
    shapes = state.config.policy.evidence_shapes
    if not (isinstance(state.evidence, tuple) and len(state.evidence) == len(shapes)):
        evidence = state.evidence
        got = f"a tuple of {len(evidence)}" if isinstance(evidence, tuple) else type(evidence).__name__
        validate.fail(f"state.evidence must be a tuple of {len(shapes)} arrays (the policy's evidence_shapes), "
                      f"got {got}")
    fields = (
        ("position", state.position, rows, jnp.int32),
        ("birth", state.birth, rows, jnp.int32),
        ("score", state.score, rows, jnp.float32),
        *((f"evidence[{i}]", array, rows + shape, jnp.float32)
          for i, (array, shape) in enumerate(zip(state.evidence, shapes))),
        ("step", state.step, rows[:1], jnp.int32),
    )
    for name, value, shape, dtype in fields:
        if validate.shape(value) != shape or jnp.result_type(value) != dtype:
            validate.fail(f"state.{name} must be {jnp.dtype(dtype).name}{list(shape)}, got "
                  f"{jnp.result_type(value)}{list(validate.shape(value))}")
    for field in dataclasses.fields(state.stats):
        value = getattr(state.stats, field.name)
        per_head = field.name in state.stats.PER_HEAD
        shape, dims = (rows[:2], "[B, K]") if per_head else (rows[:1], "[B]")
        if validate.shape(value) != shape:
            validate.fail(f"state.stats.{field.name} must have shape {dims} = {list(shape)}, got {list(validate.shape(value))}")
    if state.payload is not None:
        for path, value in jax.tree_util.tree_flatten_with_path(state.payload)[0]:
            if validate.shape(value)[:3] != rows:
                validate.fail(f"state.payload{jax.tree_util.keystr(path)} must be [B, K, S, ...] with [B, K, S] = "
                      f"{list(rows)}, got {list(validate.shape(value))}")


def present(state: MemoryState) -> Bool[Array, "B K S"]:
    """Occupied slots whose item has arrived (a chunk's items arrive one per query).

    Returns:
      ``[B, K, S]`` bool.
    """
    return state.valid & (state.birth < state.step[:, None, None])


def visible(state: MemoryState, queries: int | None = None) -> Bool[Array, "B K *Q S"]:
    """The slots the next query (or each of the next ``queries``) may attend.

    Use it as the attention mask after ``write``: query q of a chunk sees the items
    that arrived up to its own step, ``birth <= step + q``.

    Returns:
      ``[B, K, S]`` for ``queries=None``, else ``[B, K, Q, S]``.
    """
    check_state(state)
    if queries is None:
        return state.valid & (state.birth <= state.step[:, None, None])
    if not (isinstance(queries, int) and not isinstance(queries, bool) and queries >= 1):
        raise ValueError(f"queries must be an int >= 1 or None, got {queries!r}")
    t = state.step[:, None, None, None] + jnp.arange(queries, dtype=jnp.int32)[None, None, :, None]
    return state.valid[:, :, None, :] & (state.birth[:, :, None, :] <= t)


def age(state: MemoryState) -> Int[Array, "B K S"]:
    """Queries each slot has seen: 1 right after the query of its arrival step.

    Returns:
      ``[B, K, S]`` int32 (meaningless for free slots).
    """
    return state.step[:, None, None] - state.birth


def count(mask: Bool[Array, "..."], axis=-1) -> Int[Array, "..."]:
    """True entries of ``mask`` along ``axis``, as int32.

    Summed in float32, exact below 2**24 entries: on CPU a float sum vectorises, where
    an int32 sum of a bool mask is a tree of reduce-windows that runs about twice as
    long (and this count runs on every row at every step).
    """
    axes = range(mask.ndim) if axis is None else (axis,) if isinstance(axis, int) else axis
    size = math.prod(mask.shape[a] for a in axes)
    dtype = jnp.float32 if size < 2**24 else jnp.int32
    return jnp.sum(mask, axis=axis, dtype=dtype).astype(jnp.int32)


def occupancy(state: MemoryState) -> Int[Array, "B K"]:
    """Items held per row (including written items whose query is still to come).

    Returns:
      ``[B, K]`` int32.
    """
    return count(state.valid)


def summary(state: MemoryState) -> dict[str, Array]:
    """Monitoring figures per batch row: counters, mean age/score of evicted items and
    the policy's own figures (its ``monitor``, for example the estimator's loss).

    Returns:
      A dict of ``[B]`` arrays: ``step``, ``occupancy`` (items held over all KV heads),
      ``evictions``, ``mean_evicted_age`` and ``mean_evicted_score`` (NaN before the
      first eviction), ``fallbacks``, ``forced_writes``, ``nonfinite_inputs``, and the
      policy's own entries.
    """
    check_state(state)
    s = state.stats
    n = jnp.maximum(s.evictions, 1).astype(jnp.float32)
    # The per-head sums are added over heads only here, when read.
    evicted_age = jnp.sum(s.evicted_age, axis=-1)
    evicted_score = jnp.sum(s.evicted_score, axis=-1)
    policy = state.config.policy
    extra = {} if policy.monitor is None else policy.monitor(policy, state.aux)
    return extra | {
        "step": state.step,
        "occupancy": jnp.sum(state.valid, axis=(1, 2), dtype=jnp.int32),
        "evictions": s.evictions,
        "mean_evicted_age": jnp.where(s.evictions > 0, evicted_age / n, jnp.nan),
        "mean_evicted_score": jnp.where(s.evictions > 0, evicted_score / n, jnp.nan),
        "fallbacks": s.fallbacks,
        "forced_writes": s.forced_writes,
        "nonfinite_inputs": s.nonfinite_inputs,
    }


def aux_axes(state: MemoryState, batch_axis: Any = "batch", head_axis: Any = "heads", slot_axis: Any = None
             ) -> PyTree:
    """Which axes of each leaf of the policy's own state (``state.aux``) are batch rows,
    KV heads and slots, as a ``PartitionSpec`` per leaf: ``batch_axis``, ``head_axis``
    and ``slot_axis`` where they are, None elsewhere. Found by asking ``init_aux`` for a
    memory of another size and seeing which axes grow; an entry shared by every row
    (the learned estimator's parameters) grows on none. None when the policy keeps no
    state. Sharding splits the state by it; :func:`flsmem.update_layers` folds layers
    into rows when every entry has its rows first or is shared; :func:`flsmem.resize`
    moves the entries kept per slot with their items."""
    if not isinstance(state, MemoryState):
        raise TypeError(f"state must be a MemoryState (from flsmem.init), got {type(state).__name__}")
    if state.aux is None:
        return None
    policy = state.config.policy
    b, k, s = state.valid.shape[-3:]
    # Each axis grows by its own amount, so no two can be taken for each other.
    grown = jax.eval_shape(lambda: policy.init_aux(policy, b + 1, k + 2, s + 3))

    def spec(leaf, other):
        axes = []
        for n, m in zip(jnp.shape(leaf)[jnp.ndim(leaf) - other.ndim:], other.shape):
            if (n, m) == (b, b + 1) and batch_axis not in axes:
                axes.append(batch_axis)
            elif (n, m) == (k, k + 2) and head_axis not in axes:
                axes.append(head_axis)
            elif (n, m) == (s, s + 3):
                axes.append(slot_axis)
            else:
                axes.append(None)
        return PartitionSpec(*axes)

    return jax.tree.map(spec, state.aux, grown)
