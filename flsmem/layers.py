"""Memories of every layer of a model, stacked on a leading layer axis ``[L, ...]``.

A decoder that runs its layers with ``lax.scan`` keeps all its layers' memories in one
pytree and carries it through the scan; these functions do the per-layer bookkeeping of
such a stack in a few large operations instead of a few small ones per layer:

* :func:`init_kv`: empty KV memories, one per layer (or a single one);
* :func:`place`: where each layer's new items go and what each query may see, for every
  layer at once, before the layer loop (:func:`flsmem.attend` takes it as
  ``placement``);
* :func:`update_layers`: :func:`flsmem.update` in every layer, once the step's
  predictions are scored.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flsmem import validate
from flsmem.config import MemoryConfig
from flsmem.observe import observe
from flsmem.state import MemoryState, aux_axes, init, visible
from flsmem.typing import Array, Bool, Float, Int, PyTree
from flsmem.update import update
from flsmem.write import write_slots

__all__ = ["init_kv", "is_stacked", "place", "update_layers", "observe_layers", "fold_layers"]


def init_kv(
    config: MemoryConfig,
    batch: int,
    kv_heads: int,
    head_dim: int,
    *,
    layers: int | None = None,
    dtype=jnp.float32,
) -> MemoryState:
    """An empty KV memory (payload ``{"k", "v"}`` of ``[B, K, S, D]``) for :func:`flsmem.attend`.

    Args:
      config: the memory's static settings.
      batch: B, independent sequences.
      kv_heads: K, key/value heads.
      head_dim: D.
      layers: L: the memories of L layers stacked on a leading axis; None for one.
      dtype: dtype of the cached keys and values.
    """
    validate.positive_int("head_dim", head_dim)
    one = init(config, batch, kv_heads, {"k": (head_dim,), "v": (head_dim,)}, dtype)
    if layers is None:
        return one
    layers = validate.positive_int("layers", layers)
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (layers,) + x.shape), one)


def is_stacked(memory: MemoryState) -> bool:
    """Whether ``memory`` holds several layers' memories on a leading axis."""
    if not isinstance(memory, MemoryState):
        validate.fail(f"memory must be a flsmem.MemoryState (from flsmem.init_kv), got {type(memory).__name__}")
    return memory.valid.ndim == 4


def _shared(memories: MemoryState):
    """Which entries of the policy state a memory's rows share (no batch axis, such as
    the learned estimator's network): a pytree of bools shaped like ``memories.aux``,
    or None when the policy keeps no state."""
    specs = aux_axes(memories)
    if specs is None:
        return None
    return jax.tree.map(lambda spec: "batch" not in spec, specs)


def fold_layers(memories: MemoryState):
    """``(flat, unfold, unfold_state)``: the L layers of B sequences as one memory of
    L * B sequences (row ``l * B + b`` is sequence b of layer l), the inverse map for
    arrays of rows, and the inverse for the memory.

    An entry of the policy state that a memory's rows share keeps its leading layer
    axis: the folded memory holds one such entry per group of B rows, entry l for the
    rows of layer l, and the policy reads the groups from that axis."""
    validate.require(is_stacked(memories), "memories must be stacked layers [L, B, K, S] (from flsmem.init_kv "
                                           f"with layers=), got a memory of shape {tuple(memories.valid.shape)}")
    depth, batch = memories.step.shape
    merge = lambda x: x.reshape((depth * batch,) + x.shape[2:])  # noqa: E731
    unfold = lambda x: x.reshape((depth, batch) + x.shape[1:])  # noqa: E731
    shared = _shared(memories)

    def each(fn, state):
        folded = jax.tree.map(fn, state.replace(aux=None))
        if state.aux is None:
            return folded
        return folded.replace(aux=jax.tree.map(lambda x, s: x if s else fn(x), state.aux, shared))

    return each(merge, memories), unfold, lambda flat: each(unfold, flat)


def place(
    memories: MemoryState, position: Int[Array, "B T"], items: PyTree | None = None
) -> tuple[MemoryState, tuple[Int[Array, "L B K T"], Bool[Array, "L B K T S"]]]:
    """The bookkeeping of writing T new items in every layer at once, before the layer loop.

    Where the new items go and what each query may see depend on the memories only, not
    on the keys and values the layers are about to compute, so all layers are placed in
    one go. A policy whose new evidence reads the payload (``policy.init_evidence``)
    needs the items themselves: without them, such policies place layer by layer
    inside :func:`flsmem.attend`.

    Args:
      memories: stacked memories ``[L, ...]`` (:func:`init_kv` with ``layers``).
      position: ``[B, T]`` int, absolute position of each new item.
      items: the new items' payload, leaves ``[L, B, K, T, ...item]``, when they are
        known already (another memory holds them); None reads no payload.

    Returns:
      ``(memories, placement)``: the memories with the items' slots filled in (payload
      not yet written), and ``(target [L, B, K, T], visible [L, B, K, T, S])`` to pass
      layer ``l``'s slice of to :func:`flsmem.attend` as ``placement``.
    """
    if not is_stacked(memories):
        validate.fail(f"memories must be stacked over layers [L, B, K, S], got valid of shape {memories.valid.shape}")
    if items is None and memories.config.policy.init_evidence is not None:
        validate.fail(f"place needs the items' payload (items=) for {memories.config.policy.name}, whose new "
                      "evidence reads it; or let flsmem.attend place each layer")
    depth = memories.step.shape[0]
    t = jnp.shape(position)[-1]
    flat, unfold, unfold_state = fold_layers(memories)
    if items is None:
        # The payload is read for its shapes only: nothing computed from these zeros is kept.
        items = jax.tree.map(lambda p: jnp.zeros(p.shape[:2] + (t,) + p.shape[3:], p.dtype), flat.payload)
    else:
        expected = jax.tree.map(lambda p: p.shape[:3] + (t,) + p.shape[4:], memories.payload)
        got = jax.tree.map(validate.shape, items) if jax.tree.structure(items) == jax.tree.structure(
            memories.payload) else None
        if got != expected:
            validate.fail(f"items must be the new items' payload, leaves [L, B, K, T, ...item] = {expected}, "
                          f"got {jax.tree.map(validate.shape, items)}")
        items = jax.tree.map(lambda x: jnp.reshape(x, (-1,) + jnp.shape(x)[2:]), items)
    flat, target = write_slots(flat, items, jnp.tile(jnp.asarray(position), (depth, 1)))
    seen = visible(flat, t)
    placed = unfold_state(flat.replace(payload=None)).replace(payload=memories.payload)
    return placed, (unfold(target), unfold(seen))


def update_layers(
    memories: MemoryState,
    attention: Float[Array, "L B K S"] | Float[Array, "L B K Q S"],
    correctness: Float[Array, "B"] | Float[Array, "B Q"] | None = None,
    future: Float[Array, "L B K S"] | Float[Array, "L B K Q S"] | None = None,
) -> MemoryState:
    """:func:`flsmem.update` for every layer of stacked memories.

    Args:
      memories: stacked memories ``[L, ...]``.
      attention: ``[L, B, K, Q, S]`` (from :func:`flsmem.attend` in each layer), or
        ``[L, B, K, S]`` for one query.
      correctness: ``[B, Q]`` (or ``[B]``), shared by the layers.
      future: like ``attention``, for the oracle; else None.
    """
    if not is_stacked(memories):
        validate.fail(f"memories must be stacked over layers [L, B, K, S], got valid of shape {memories.valid.shape}")
    # No step reads the payload (the keys and values): keep it out of the loops below,
    # which would otherwise copy every layer's cache once more per step.
    payload = memories.payload
    memories = memories.replace(payload=None)
    one_query = jnp.ndim(attention) == 4 or (
        jnp.shape(attention)[3] == 1 and (correctness is None or jnp.ndim(correctness) == 2))
    if one_query and _state_folds(memories):
        squeeze = jnp.ndim(attention) == 5
        at = (lambda x: None if x is None else x[:, :, :, 0]) if squeeze else (lambda x: x)  # noqa: E731
        if squeeze and correctness is not None:
            correctness = correctness[:, 0]
        memories = _update_one_query(memories, at(attention), correctness, at(future))
    else:
        if jnp.ndim(attention) == 4:
            # A policy state with its rows on another axis cannot be folded into rows:
            # one query per layer, as a chunk of one.
            expand = lambda x: None if x is None else x[:, :, :, None]  # noqa: E731
            attention, future = expand(attention), expand(future)
            correctness = None if correctness is None else jnp.reshape(correctness, (-1, 1))
        memories = _each_layer(update, memories, attention, correctness, future)
    return memories.replace(payload=payload)


def observe_layers(
    memories: MemoryState,
    attention: Float[Array, "L B K Q S"],
    correctness: Float[Array, "B Q"] | None = None,
    future: Float[Array, "L B K Q S"] | None = None,
) -> MemoryState:
    """:func:`flsmem.observe` for every layer of stacked memories: a chunk's evidence
    folded in, nothing evicted.

    A long prefix prefilled chunk by chunk folds each chunk's attention here and is cut
    once at the end by :func:`flsmem.compress` (``evidence=None``): the same kept set as
    compressing the whole prefix's attention at once, without ever holding it.
    """
    if not is_stacked(memories):
        validate.fail(f"memories must be stacked over layers [L, B, K, S], got valid of shape {memories.valid.shape}")
    payload = memories.payload
    memories = _each_layer(observe, memories.replace(payload=None), attention, correctness, future)
    return memories.replace(payload=payload)


def _each_layer(step, memories, attention, correctness, future):
    """``step`` (update or observe) query by query in every layer. A loop over layers
    (not vmap) keeps each layer's eviction a real branch; each layer's memory is written
    back in place (``lax.map`` would stack a fresh copy of every layer's state at every
    step)."""

    def layer(i, memories):
        at = lambda x: None if x is None else jax.lax.dynamic_index_in_dim(x, i, keepdims=False)  # noqa: E731
        one = step(jax.tree.map(at, memories), at(attention), correctness, at(future))
        return jax.tree.map(lambda x, y: jax.lax.dynamic_update_index_in_dim(x, y, i, 0), memories, one)

    return jax.lax.fori_loop(0, attention.shape[0], layer, memories)


def _state_folds(memories) -> bool:
    """Whether the L layers of B sequences can be updated as L * B rows: every entry of
    the policy state has one row per sequence (axis 1 after the layers) or is shared by
    a memory's rows (no batch axis), and so becomes one entry per layer's group of
    rows. An entry with its rows elsewhere cannot be folded."""
    specs = aux_axes(memories)
    return specs is None or all(spec[:1] == ("batch",) or "batch" not in spec for spec in jax.tree.leaves(specs))


def _update_one_query(memories, attention, correctness, future):
    """:func:`flsmem.update` of one query in every layer: the decode hot path.

    Every step of the memory treats each batch row on its own, so the L layers of B
    sequences are updated as one memory of L * B sequences, with one real branch around
    eviction (due in every layer at the same steps) instead of one per layer.
    """
    depth = memories.step.shape[0]
    flat, _, unfold_state = fold_layers(memories)
    fold = lambda x: None if x is None else x.reshape((-1,) + x.shape[2:])  # noqa: E731
    if correctness is not None:
        correctness = jnp.tile(jnp.asarray(correctness), depth)  # row l * B + b is sequence b
    flat = update(flat, fold(attention), correctness, fold(future))
    return unfold_state(flat)
