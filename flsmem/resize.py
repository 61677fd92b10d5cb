"""``resize``: a memory given room for chunks of another size, its items kept.

A memory's slots are its budget plus room for what may arrive before the next eviction,
a chunk of up to ``max_chunk`` items among it (:attr:`MemoryConfig.capacity`). A prompt
prefilled with the whole of it in memory and then cut to its budget
(:func:`flsmem.compress`) needed room for the whole prompt, and that room stays in
every later step: a decode step attends over every slot. :func:`resize` moves the
items into a memory sized for the chunks still to come (one token at a time while
decoding), so that a prompt of 32,768 tokens compressed to 512 is decoded in 512 slots
and one eviction period, not in the prompt's 32,768."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from flsmem import validate
from flsmem.layers import is_stacked
from flsmem.state import MemoryState, aux_axes, init

__all__ = ["resize"]


def resize(memory: MemoryState, max_chunk: int = 1) -> MemoryState:
    """``memory`` with slots for chunks of at most ``max_chunk`` items, every item kept.

    The items keep their order and everything the memory knows of them (payload,
    position, arrival, evidence, committed score, and the policy's entries kept per
    slot, such as the learned estimator's snapshot); they fill the first slots of each
    row, and the rest are free. The rows' own state (steps, counters, the policy's
    per-row state) is unchanged. So the memory goes on as it would have: attention
    over the same items, the same evictions (ties are broken by arrival, not slot).

    Args:
      memory: a memory, one layer's or stacked over layers ``[L, ...]``.
      max_chunk: most items one later ``write`` may add (1 for token-by-token
        decoding); the memory gets ``config.replace(max_chunk=max_chunk).capacity``
        slots per row.

    Returns:
      The memory with its config's ``max_chunk`` replaced.

    Raises:
      ValueError: a row holds more items than the new slots (outside ``jax.jit``; a
        traced call keeps the first items of such a row, so call it where every row
        is within its budget, such as right after :func:`flsmem.compress`).
    """
    if not isinstance(memory, MemoryState):
        validate.fail(f"memory must be a flsmem.MemoryState, got {type(memory).__name__}")
    config = memory.config.replace(max_chunk=max_chunk)
    slots = config.capacity
    if not isinstance(memory.valid, jax.core.Tracer):
        held = int(jnp.max(jnp.sum(memory.valid, axis=-1)))
        if held > slots:
            validate.fail(f"max_chunk: a row holds {held} items, more than the {slots} slots of max_chunk="
                          f"{max_chunk} (budget + evict_every + max_chunk - 1); evict or compress it first")
    one = lambda m: _resize_one(m, config)  # noqa: E731
    return jax.vmap(one)(memory) if is_stacked(memory) else one(memory)


_ROWS = PartitionSpec("batch", "heads", "slots")


def _resize_one(memory: MemoryState, config) -> MemoryState:
    batch, kv_heads, old = memory.valid.shape
    kept = min(old, config.capacity)
    # The occupied slots first, in their order, then the free ones.
    order = jnp.argsort(~memory.valid, axis=-1, stable=True)[..., :kept]
    occupied = jnp.take_along_axis(memory.valid, order, axis=-1)
    payload_spec = () if memory.payload is None else jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape[3:], x.dtype), memory.payload)
    empty = init(config, batch, kv_heads, payload_spec)

    def move(leaf, free, spec=_ROWS):
        """``free`` (the new memory's leaf) with its first ``kept`` slots holding
        ``leaf``'s items in ``order``; ``spec`` names the leaf's row, head and slot axes."""
        spec = tuple(spec) + (None,) * (leaf.ndim - len(spec))
        if not {"batch", "heads"} <= set(spec):
            validate.fail(f"{config.policy.name}: an entry of its state kept per slot must also be kept per row "
                          f"and KV head to be resized, got axes {spec}")
        axes = [spec.index(name) for name in ("batch", "heads", "slots")]
        # A [B, K, kept] array laid along the leaf's axes, size 1 on its others.
        along = lambda x: jnp.transpose(x, np.argsort(axes)).reshape(  # noqa: E731
            [x.shape[axes.index(a)] if a in axes else 1 for a in range(leaf.ndim)])
        taken = jnp.take_along_axis(leaf, along(order), axis=axes[2])
        # A slot left free reads as a new memory's, not as the item it held once.
        taken = jnp.where(along(occupied), taken, jax.lax.slice_in_dim(free, 0, kept, axis=axes[2]))
        return jax.lax.dynamic_update_slice_in_dim(free, taken.astype(free.dtype), 0, axes[2])

    moved = dict(
        payload=None if memory.payload is None else jax.tree.map(move, memory.payload, empty.payload),
        position=move(memory.position, empty.position),
        valid=move(memory.valid, empty.valid),
        birth=move(memory.birth, empty.birth),
        evidence=tuple(map(move, memory.evidence, empty.evidence)),
        score=move(memory.score, empty.score),
    )
    aux = memory.aux
    if aux is not None:
        specs = aux_axes(memory, slot_axis="slots")
        aux = jax.tree.map(lambda leaf, free, spec: move(leaf, free, spec) if "slots" in spec else leaf,
                           aux, empty.aux, specs)
    return memory.replace(**moved, aux=aux, config=config)
