"""The door for an attention layer: a bounded KV memory behind one call per step.

A user's own attention module computes its queries, keys and values (with its own
projections, rotary embedding and norms) and hands them to :func:`attend`, which writes
the new keys and values into the layer's memory, attends over what the memory holds and
folds the step's attention in as evidence; eviction happens inside when it is due. After
a prefill, :func:`compress` cuts a memory down to a budget at once, the way kvpress
compresses a prompt.

The memory is one layer's (from :func:`flsmem.init_kv`) or every layer's, stacked on a
leading axis, with ``layer`` naming the one to use: a decoder that scans its layers
carries the stack and writes each layer's keys and values in place.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from flsmem import validate
from flsmem.evict import evict
from flsmem.layers import is_stacked
from flsmem.observe import observe, reduce_query_heads
from flsmem.policies.budgets import layer_budgets
from flsmem.smooth import smooth
from flsmem.state import MemoryState, visible
from flsmem.typing import Array, Bool, Float, Int
from flsmem.update import update
from flsmem.write import write_slots

__all__ = ["attend", "compress"]


def attend(
    memory: MemoryState,
    q: Float[Array, "B T H D"] | Float[Array, "B T K G D"],
    k: Float[Array, "B T K D"],
    v: Float[Array, "B T K D"],
    position: Int[Array, "B T"],
    *,
    correctness: Float[Array, "B T"] | None = None,
    fold: bool = True,
    scale: float | None = None,
    layer: Int[Array, ""] | int | None = None,
    placement: tuple[Int[Array, "B K T"], Bool[Array, "B K T S"]] | None = None,
    window: int | None = None,
) -> tuple[Float[Array, "B T H D"], MemoryState, Float[Array, "B K T S"]]:
    """Write a step's keys and values into the memory and attend over it.

    The T new items arrive one per query (query t sees the items up to its own), so a
    chunk of T tokens gives what T single-token steps give. Query heads are grouped:
    head ``h`` reads KV head ``h // G`` with ``G = H / K``.

    Args:
      memory: a KV memory (:func:`flsmem.init_kv`): one layer's, or every layer's
        stacked on a leading axis with ``layer`` naming this one.
      q: ``[B, T, H, D]`` queries, position encoding already applied (or already
        grouped by KV head, ``[B, T, K, G, D]``; the output then has that shape).
      k: ``[B, T, K, D]`` keys, position encoding already applied.
      v: ``[B, T, K, D]`` values.
      position: ``[B, T]`` int, absolute position of each new item.
      correctness: ``[B, T]`` weight in [0, 1] of each query's prediction for the
        folded evidence (1 if None). Only with ``fold``.
      fold: fold the step's attention into the memory (and evict when due) here; with
        False the caller folds the returned evidence later with :func:`flsmem.update`
        (or :func:`flsmem.update_layers`), once it knows how correct the predictions
        were.
      scale: logit scale (``D ** -0.5`` if None).
      layer: index of this layer in stacked memories; None for a single memory.
      placement: this layer's ``(target, visible)`` from :func:`flsmem.place` when the
        stacked memories were placed for every layer at once; None to place here.
      window: sliding-window attention: a query at position p sees only the items at
        positions above ``p - window`` (``window`` items, itself included), as Gemma's
        and Mistral's local layers do; None sees every item the memory holds. A memory
        under the ``window`` policy with ``budget = window`` then holds exactly what
        such a layer needs.

    Returns:
      ``(out [B, T, H, D], memory, evidence [B, K, T, S])``: the attention output, the
      memory with the items written (and the evidence folded, with ``fold``), and each
      query's attention over the slots, query heads reduced by the policy's rule.
    """
    b, t, kv_heads, head_dim = _check_qkv(memory, q, k, v, layer)
    kv = {"k": jnp.swapaxes(k, 1, 2), "v": jnp.swapaxes(v, 1, 2)}  # [B, K, T, D]
    memory, seen = _write(memory, kv, position, layer, placement)
    if window is not None:
        held = memory.position if layer is None else memory.position[layer]  # [B, K, S]
        gap = jnp.asarray(position)[:, None, :, None] - held[:, :, None, :]  # [B, K, T, S]
        seen = seen & (gap < validate.positive_int("window", window))
    keys, values = (memory.payload[name] if layer is None else memory.payload[name][layer] for name in ("k", "v"))
    grouped = q if jnp.ndim(q) == 5 else q.reshape(b, t, kv_heads, -1, head_dim)
    if memory.config.policy.fold_queries is not None:
        memory = _fold_queries(memory, grouped, position, layer)
    # Both products keep the slots last and the queries in the order the softmax reads
    # them: written with the queries' own [B, T, ...] order, XLA on CPU laid the logits
    # out slots-first and transposed them twice around the softmax (at a prefill chunk
    # of 128 queries over 4,096 slots, those passes cost as much as the products).
    queries = jnp.moveaxis(grouped, 1, 3)  # [B, K, G, T, D]
    logits = jnp.einsum("BKGTD,BKSD->BKGTS", queries, keys) * (head_dim ** -0.5 if scale is None else scale)
    probs = jax.nn.softmax(jnp.where(seen[:, :, None], logits, -jnp.inf), axis=-1)
    out = jnp.moveaxis(jnp.einsum("BKGTS,BKSD->BKGTD", probs, values), 3, 1).reshape(q.shape)
    evidence = reduce_query_heads(probs, memory.config.policy)  # [B, K, T, S]
    if fold:
        memory = _fold(memory, evidence, correctness, layer)
    elif correctness is not None:
        validate.fail("correctness weighs the evidence folded here; with fold=False pass it to flsmem.update")
    return out, memory, evidence


def _write(memory, kv, position, layer, placement):
    """The memory with the new keys and values written, and what each query may see."""
    if layer is None:
        if placement is not None:
            validate.fail("placement comes from flsmem.place for stacked memories; pass layer with it")
        memory, target = write_slots(memory, kv, position)
        seen = visible(memory, jnp.shape(position)[-1])
        index = ()
    else:
        memory, (target, seen) = _place_layer(memory, kv, position, layer, placement)
        index = (layer,)
    b, kv_heads = memory.valid.shape[-3:-1]
    bi = jnp.arange(b)[:, None, None]
    ki = jnp.arange(kv_heads)[None, :, None]
    # Every layer's cache stays in one stacked array: the new items are written there in
    # place, never copied out and back.
    payload = jax.tree.map(
        lambda cache, new: cache.at[index + (bi, ki, target)].set(new.astype(cache.dtype), mode="drop"),
        memory.payload, kv,
    )
    return memory.replace(payload=payload), seen


def _check_qkv(memory, q, k, v, layer):
    stacked = is_stacked(memory)
    if stacked != (layer is not None):
        validate.fail("layer must be given exactly when the memory is stacked over layers "
                      f"(valid of shape {memory.valid.shape}, layer={layer!r})")
    if not isinstance(memory.payload, dict) or set(memory.payload) != {"k", "v"}:
        validate.fail("memory must be a KV memory with payload {'k', 'v'} (flsmem.init_kv)")
    kv_heads, head_dim = memory.payload["k"].shape[-3], memory.payload["k"].shape[-1]
    if jnp.ndim(k) != 4 or jnp.shape(k)[2:] != (kv_heads, head_dim) or jnp.shape(v) != jnp.shape(k):
        validate.fail(f"k and v must be [B, T, K, D] with K={kv_heads}, D={head_dim}, got "
                      f"{list(jnp.shape(k))} and {list(jnp.shape(v))}")
    b, t = jnp.shape(k)[:2]
    shape = jnp.shape(q)
    heads_ok = shape[2] % kv_heads == 0 if len(shape) == 4 else len(shape) == 5 and shape[2] == kv_heads
    if len(shape) not in (4, 5) or shape[:2] != (b, t) or shape[-1] != head_dim or not heads_ok:
        validate.fail(f"q must be [B, T, H, D] = [{b}, {t}, H, {head_dim}] with H a multiple of K={kv_heads}, "
                      f"or [B, T, K, G, D] = [{b}, {t}, {kv_heads}, G, {head_dim}], got {list(shape)}")
    return b, t, kv_heads, head_dim


def _place_layer(memories, kv, position, layer, placement):
    """Layer ``layer``'s slots for the new items and its visibility mask; the stacked
    bookkeeping is updated at that index (the payload is left to the caller)."""
    if placement is not None:
        return memories, placement
    # Only the bookkeeping is sliced out: the payload in ``one`` is read for its shapes.
    one = jax.tree.map(lambda a: a[layer], memories)
    one, target = write_slots(one, kv, position)
    seen = visible(one, jnp.shape(position)[-1])
    memories = jax.tree.map(
        lambda stacked, new: stacked.at[layer].set(new),
        memories.replace(payload=None), one.replace(payload=None),
    ).replace(payload=memories.payload)
    return memories, (target, seen)


def _fold_queries(memory, grouped, position, layer):
    """The policy's state with the step's queries folded in (ExpectedAttention's
    statistics), in this layer's memory."""
    policy = memory.config.policy
    queries = jnp.moveaxis(grouped, 1, 3)  # [B, K, G, T, D]
    position = jnp.asarray(position)
    if layer is None:
        return memory.replace(aux=policy.fold_queries(policy, memory.aux, queries, position))
    mine = jax.tree.map(lambda a: a[layer], memory.aux)
    new = policy.fold_queries(policy, mine, queries, position)
    return memory.replace(aux=jax.tree.map(lambda a, n: a.at[layer].set(n), memory.aux, new))


def _fold(memory, evidence, correctness, layer):
    if layer is None:
        return update(memory, evidence, correctness)
    one = jax.tree.map(lambda a: a[layer], memory.replace(payload=None))
    one = update(one, evidence, correctness)
    stacked = jax.tree.map(lambda s, n: s.at[layer].set(n), memory.replace(payload=None), one)
    return stacked.replace(payload=memory.payload)


def compress(
    memory: MemoryState,
    evidence: Float[Array, "*L B K T S"] | None = None,
    correctness: Float[Array, "B T"] | None = None,
    future: Float[Array, "*L B K T S"] | None = None,
    *,
    budget: int | Sequence[int] | None = None,
) -> MemoryState:
    """After a prefill, fold its evidence and cut the memory to ``budget`` at once.

    The prefix's items were written (and its evidence returned) by :func:`attend` with
    ``fold=False``; every item is scored from the whole prefix's attention and the
    lowest are evicted, whatever the schedule (kvpress's protocol). A long prefix is
    better prefilled in chunks, each chunk's evidence folded with :func:`flsmem.observe`
    (:func:`flsmem.observe_layers`) as it comes, and then cut here with
    ``evidence=None``: the same kept set, in memory bounded by the chunk.

    Args:
      memory: one layer's memory or stacked memories ``[L, ...]``.
      evidence: the prefix's attention, ``[B, K, T, S]`` (``[L, B, K, T, S]`` stacked),
        or None when it was folded already.
      correctness: ``[B, T]`` weights of the prefix's predictions (1 if None).
      future: like ``evidence``, for the oracle; else None.
      budget: items each row keeps (the config's budget if None); for stacked
        memories also one budget per layer (a sequence, see
        :func:`flsmem.policies.layer_budgets`). A policy with a layer schedule
        (:func:`flsmem.policies.pyramid`) spreads an int budget over the layers by
        it, the same total, no layer above the slots it has.
    """
    stacked = is_stacked(memory)
    cuts = _layer_cuts(memory, budget) if stacked else None

    def one(args):
        mem, att, fut, cut = args
        return evict(smooth(mem if att is None else observe(mem, att, correctness, fut)), budget=cut)

    if isinstance(budget, Sequence) and not stacked:
        validate.fail("budget: one budget per layer needs memories stacked over layers; give an int")
    if cuts is None:
        return one((memory, evidence, future, budget)) if not stacked else \
            jax.lax.map(lambda args: one(args + (budget,)), (memory, evidence, future))
    return jax.lax.map(one, (memory, evidence, future, jnp.asarray(cuts, jnp.int32)))


def _layer_cuts(memory: MemoryState, budget) -> tuple[int, ...] | None:
    """Each layer's budget for :func:`compress`, or None for the same one everywhere."""
    layers, policy = memory.step.shape[0], memory.config.policy
    protected = policy.sinks + policy.protected_age
    if isinstance(budget, Sequence):
        cuts = tuple(validate.nonneg_int("budget", b) for b in budget)
        validate.require(len(cuts) == layers and min(cuts) >= protected,
                         f"budget per layer must give {layers} ints, each >= the protected items ({protected}), "
                         f"got {list(cuts)}")
        return cuts
    if policy.layer_schedule is None:
        return None
    mean = memory.config.budget if budget is None else budget
    return layer_budgets(mean, layers, policy.layer_schedule, minimum=protected, maximum=memory.valid.shape[-1])
