"""Where the bounded memory meets a RULER prompt: three protocols, then greedy decoding.

Everything here touches the decoder and its memories (:class:`~flsmem.models.decoder.Memories`:
the global layers' evictable memories, and the local layers' windows, which keep their
window whatever the policy), and nothing else does. A prompt is a context and a
question (token ids); the memory keeps ``budget`` items per global layer and KV head:

* ``question-agnostic``: the context is prefilled with the whole of it in memory, its
  attention folded as evidence (``flsmem.observe``, chunk by chunk) and the memory cut
  to the budget at once (``flsmem.compress``), before the question is known; then the
  question's tokens are fed and the answer decoded, evicting every ``evict_every``
  items as they arrive (``flsmem.update_layers``);
* ``question-aware``: the same with the question inside the prefill, so the cut sees
  the question's attention (SnapKV's setting); then the answer is decoded, evicting
  as it goes;
* ``stream``: no prefill: context and question are fed ``evict_every`` tokens at a time,
  evicting whenever a row reaches ``budget + evict_every`` items, then the answer is
  decoded the same way (a long generation under a fixed budget).

The correctness weight of each prediction is teacher-forced on the prompt (whether the
argmax was the prompt's next token: the prompt is known when serving too) and, while
decoding, the probability of the emitted token.

The oracle's evidence is a table from :func:`answer_attention`: for each position, the
attention that the queries producing the answer pay it, in a full-cache run with the
question and the gold answer teacher-forced. Every slot is ranked by its position's
entry, whatever the protocol; items past the gold answer's length get 0 (the recent
window protects them while new).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import flsmem
from flsmem import policies as P
from flsmem.models.decoder import Decoder, init_memories

__all__ = ["PROTOCOLS", "PREFILL_CHUNK", "memory_config", "answer", "answer_attention"]

PROTOCOLS = ("question-agnostic", "question-aware", "stream")
# Tokens per prefill step: a step's attention is [layers, KV heads, chunk, slots], so
# this bounds its memory (about 200 MB for SmolLM2 at 4,096 slots).
PREFILL_CHUNK = 128


def memory_config(policy: P.Policy, budget: int, protocol: str, *, length: int, evict_every: int,
                  max_new: int) -> flsmem.MemoryConfig:
    """The memory settings of ``policy`` at ``budget`` under ``protocol``, for prompts
    of at most ``length`` tokens and answers of at most ``max_new``.

    The prefilling protocols hold the whole prefill before cutting it, so their slots
    number at least ``length``; a policy that never evicts holds everything.
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    chunk = max(PREFILL_CHUNK, evict_every)
    if not policy.evicts:
        return flsmem.MemoryConfig(policy=policy, budget=length + max_new, evict_every=evict_every, max_chunk=chunk)
    if protocol == "stream":
        return flsmem.MemoryConfig(policy=policy, budget=budget, evict_every=evict_every, max_chunk=evict_every)
    return flsmem.MemoryConfig(policy=policy, budget=budget, evict_every=evict_every,
                               max_chunk=max(chunk, length - budget - evict_every + 1))


def answer(
    model: Decoder,
    config: flsmem.MemoryConfig,
    context: np.ndarray,
    question: np.ndarray,
    *,
    protocol: str,
    max_new: int,
    eos_id: int | None = None,
    table: np.ndarray | None = None,
) -> tuple[list[int], dict]:
    """Greedy answer to ``context`` + ``question`` under ``config``'s memory.

    Args:
      model: the decoder.
      config: from :func:`memory_config` for the same protocol.
      context, question: token ids (1-D), at least one token in all.
      protocol: one of :data:`PROTOCOLS`.
      max_new: most tokens to generate; decoding stops earlier at ``eos_id``.
      eos_id: the end-of-sequence token, or None.
      table: the oracle's ``[L, 1, K, W]`` from :func:`answer_attention`; None for
        every other policy.

    Returns:
      ``(tokens, info)``: the generated ids (without the end token) and
      ``{"evictions": items evicted over all layers and rows}``.
    """
    prompt = np.concatenate([np.asarray(context), np.asarray(question)]).astype(np.int32)
    table = None if table is None else jnp.asarray(table)
    feed = functools.partial(_feed_pieces, *nnx.split(model), prompt, table)
    memories = init_memories(model.cfg, config, 1)
    cut = {"question-agnostic": len(context), "question-aware": len(prompt), "stream": 0}[protocol]
    step = config.evict_every
    logits = None
    if cut:
        # Before the question is known, the context's last prediction has no target.
        memories, logits = feed(memories, 0, cut, (max(PREFILL_CHUNK, step), step, 1), "observe", known=cut)
        memories = _compress(memories)
    memories, last = feed(memories, cut, len(prompt), (step, 1), "update")
    tokens, memories = _decode(feed, memories, last if last is not None else logits, len(prompt), max_new, eos_id)
    return tokens, {"evictions": int(jnp.sum(memories.evictable.stats.evictions))}


def _decode(feed, memories, logits, start: int, max_new: int, eos_id: int | None):
    """Greedy tokens after the prompt, each fed back with eviction when due."""
    tokens: list[int] = []
    while len(tokens) < max_new:
        token = int(np.argmax(np.asarray(logits[0])))
        if token == eos_id:
            break
        tokens.append(token)
        if len(tokens) < max_new:
            memories, logits = feed(memories, start, start + 1, (1,), "update", forced=[token])
            start += 1
    return tokens, memories


@functools.partial(jax.jit, donate_argnames=("memories",))
def _compress(memories):
    """``flsmem.compress`` of memories whose prefill is folded already: no more
    queries, so it commits the scores and cuts every row to the budget."""
    return memories.compress(budget=memories.evictable.config.budget)


def _pieces(start: int, stop: int, sizes: tuple[int, ...]) -> list[tuple[int, int]]:
    """``[start, stop)`` as ``(begin, size)`` pieces, the largest sizes first: a few
    shapes, each compiled once."""
    found = []
    for size in sorted(set(sizes), reverse=True):
        while stop - start >= size:
            found.append((start, size))
            start += size
    return found


def _feed_pieces(graphdef, params, prompt, table, memories, start, stop, sizes, fold, forced=None, known=None):
    """Feed ``prompt[start:stop]`` (or the ``forced`` tokens at ``start``) piece by
    piece; returns the memories and the logits after the last token (None if none).
    Each prediction's target is the next token of ``prompt[:known]`` (all of it if
    None), and -1 (none) past it."""
    logits = None
    seen = prompt[:known]
    for begin, size in _pieces(start, stop, sizes):
        if forced is None:
            tokens = prompt[begin:begin + size]
            targets = np.concatenate([seen[begin + 1:begin + size + 1], [-1] * size])[:size]
        else:
            tokens, targets = np.asarray(forced, np.int32), np.full(size, -1)
        memories, logits = _feed(graphdef, params, memories, jnp.asarray(tokens)[None], jnp.asarray(targets)[None],
                                 begin, table, fold=fold)
    return memories, logits


@functools.partial(jax.jit, static_argnames=("graphdef", "fold"), donate_argnames=("memories",))
def _feed(graphdef, params, memories, tokens, targets, start, table, *, fold):
    """One piece through the decoder, its attention folded as ``fold`` says: "observe"
    (evidence only) or "update" (evicting when due)."""
    model = nnx.merge(graphdef, params)
    positions = start + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    logits, memories, attention = model(tokens, positions, memories)
    logp = jax.nn.log_softmax(logits, axis=-1)
    hit = (jnp.argmax(logp, axis=-1) == targets).astype(jnp.float32)
    weight = jnp.where(targets >= 0, hit, jnp.exp(jnp.max(logp, axis=-1)))
    future = _future(memories.evictable, table, tokens.shape[1])
    fold = memories.observe if fold == "observe" else memories.fold
    return fold(attention, weight, future), logits[:, -1]


def _future(memories, table, queries: int):
    """The oracle's evidence ``[L, B, K, Q, S]``: each slot's entry of ``table`` at its
    position, the same for every query; None without a table."""
    if table is None:
        return None
    position = jnp.clip(memories.position, 0, table.shape[-1] - 1)
    utility = jnp.where(memories.valid, jnp.take_along_axis(table, position, axis=-1), 0.0)
    return jnp.broadcast_to(utility[:, :, :, None, :], utility.shape[:3] + (queries,) + utility.shape[3:])


def answer_attention(model: Decoder, context: np.ndarray, question: np.ndarray, gold: np.ndarray, *,
                     evict_every: int, width: int) -> np.ndarray:
    """The oracle's table: the attention each position receives from the queries that
    produce the answer, the question's and the gold answer's tokens teacher-forced
    with the full cache, each query counting only positions before its own.

    Args:
      model: the decoder.
      context, question, gold: token ids; the gold answer is cut to fit ``width``.
      evict_every: the run's eviction period (the prefill's piece size).
      width: positions in the table (the prompt's length limit plus the answer's).

    Returns:
      ``[L, 1, K, width]`` float32, per layer and KV head (query heads averaged).
    """
    prompt = np.concatenate([np.asarray(context), np.asarray(question)]).astype(np.int32)
    prompt = np.concatenate([prompt, np.asarray(gold, np.int32)])[:width]
    chunk = max(PREFILL_CHUNK, evict_every)
    config = flsmem.MemoryConfig(policy=P.full(), budget=width, evict_every=evict_every, max_chunk=chunk)
    graphdef, params = nnx.split(model)
    memories = init_memories(model.cfg, config, 1)
    memories, _ = _feed_pieces(graphdef, params, prompt, None, memories, 0, len(context), (chunk, evict_every, 1),
                               "update")
    total = 0.0
    for begin, size in _pieces(len(context), len(prompt), (chunk, evict_every, 1)):
        memories, paid = _attention_paid(graphdef, params, memories, jnp.asarray(prompt[begin:begin + size])[None],
                                         begin)
        total = total + paid
    position = np.asarray(memories.evictable.position)
    slot = np.where(np.asarray(memories.evictable.valid) & (position < width), position, width)
    table = np.zeros(position.shape[:3] + (width + 1,), np.float32)
    np.put_along_axis(table, slot, np.asarray(total, np.float32), axis=-1)
    return table[..., :width]


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("memories",))
def _attention_paid(graphdef, params, memories, tokens, start):
    """One piece under the full cache; returns the memories and ``[L, B, K, S]``, the
    attention the piece's queries paid each slot of an earlier position."""
    model = nnx.merge(graphdef, params)
    positions = start + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    _, memories, attention = model(tokens, positions, memories)
    earlier = memories.evictable.position[:, :, :, None, :] < positions[None, :, None, :, None]
    paid = jnp.sum(jnp.where(earlier, attention, 0.0), axis=3)
    return memories.fold(attention), paid
