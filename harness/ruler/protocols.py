"""Where the bounded memory meets a RULER prompt: three protocols, then greedy decoding.

Everything here touches the decoder and its memories (:class:`~flsmem.models.decoder.Memories`:
the global layers' evictable memories, and the local layers' windows, which keep their
window whatever the policy), and nothing else does. A prompt is a context and a
question (token ids); the memory keeps ``budget`` items per global layer and KV head:

* ``question-agnostic``: the context is prefilled with the whole of it in memory, its
  attention folded as evidence (``flsmem.observe``, chunk by chunk) and the memory cut
  to the budget at once (``flsmem.compress``) and every memory moved into the slots
  the rest needs (``flsmem.resize``), before the question is known; then the
  question's tokens are fed and the answer decoded, evicting every ``evict_every``
  items as they arrive (``flsmem.update_layers``);
* ``question-aware``: the same with the question inside the prefill, so the cut sees
  the question's attention (SnapKV's setting); then the answer is decoded, evicting
  as it goes;
* ``stream``: no prefill: context and question are fed ``evict_every`` tokens at a time,
  evicting whenever a row reaches ``budget + evict_every`` items, then the answer is
  decoded the same way (a long generation under a fixed budget).

Under the prefilling protocols nothing is evicted before the cut, so the prefill is
the same forward pass whatever the policy and budget: :func:`answers` runs it once for
several memories and gives each the answer a run of its own gives. After the prompt
each memory decodes alone, one token a step; :func:`batch_answers` decodes several
prompts' answers under one memory setting as one batch, a row per prompt, and feeds
the pieces of their prompts that they have alike (the stream's first pieces, the
questions' after the cut) as one batch too.

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
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import flsmem
from flsmem import policies as P
from flsmem.models.decoder import Decoder, init_memories
from flsmem.models.generate import confidence

__all__ = ["PROTOCOLS", "PREFILL_CHUNK", "memory_config", "answer", "answers", "batch_answers", "answer_attention"]

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
    resize: bool = True,
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
      resize: after the cut, move the memory into the slots the question and the
        answer need (:func:`flsmem.resize`); False leaves it the prompt's slots (the
        same answer to float rounding, slower: ``bench.ruler_resize`` times the two).

    Returns:
      ``(tokens, info)``: the generated ids (without the end token) and
      ``{"evictions": items evicted over all layers and rows}``.
    """
    ((_, tokens, info),) = answers(model, [config], context, question, protocol=protocol, max_new=max_new,
                                   eos_id=eos_id, tables=[table], resize=resize)
    return tokens, info


def answers(
    model: Decoder,
    configs: list[flsmem.MemoryConfig],
    context: np.ndarray,
    question: np.ndarray,
    *,
    protocol: str,
    max_new: int,
    eos_id: int | None = None,
    tables: list[np.ndarray | None] | None = None,
    resize: bool = True,
) -> Iterator[tuple[int, list[int], dict]]:
    """:func:`answer` under each of ``configs``, the prefill shared where it can be:
    :func:`batch_answers` of one prompt.

    Args:
      configs: the memories' settings, each from :func:`memory_config` for ``protocol``.
      tables: the oracle's table for each config (None for a policy without one), or
        None for none at all.
      Others as in :func:`answer`.

    Yields:
      ``(index, tokens, info)`` per config, ``index`` its place in ``configs``.
    """
    for _, index, tokens, info in batch_answers(model, configs, [(context, question)], protocol=protocol,
                                                max_new=max_new, eos_id=eos_id,
                                                tables=None if tables is None else [tables], resize=resize):
        yield index, tokens, info


def batch_answers(
    model: Decoder,
    configs: list[flsmem.MemoryConfig],
    prompts: list[tuple[np.ndarray, np.ndarray]],
    *,
    protocol: str,
    max_new: int,
    eos_id: int | None = None,
    tables: list[list[np.ndarray | None]] | None = None,
    resize: bool = True,
) -> Iterator[tuple[int, int, list[int], dict]]:
    """:func:`answer` to each of ``prompts`` under each of ``configs``: a prompt's
    prefill shared by the configs where it can be, and a config's answers to the
    prompts decoded together, a batch row per prompt.

    Under a prefilling protocol the prefill is the same forward pass whatever the
    policy and budget: nothing is evicted before the cut, so every memory holds the
    whole prefix and the model's attention does not depend on the policy. So the
    configs whose memories have the same shapes and schedule share one: the first of
    them runs the model, and each of the others writes the same items into its own
    memory (:func:`flsmem.place` with the items) and folds the same attention as its
    own evidence; every config then starts from a copy, so each prompt's prefill is
    run once and held (a prompt-sized payload per prompt, not per config). Streaming
    evicts from the first chunk on, so nothing is shared there.

    After the cut (from the first token, streamed) each config feeds the rest of every
    prompt in pieces of ``evict_every`` tokens and then single tokens; the pieces that
    all the prompts have alike in size, from the first, go as one batch, a row per
    prompt at its own positions.

    Once past its prompt, each memory is a row of its config's batch: a decoding step
    feeds every row its own token at its own position, and each row evicts on its own
    schedule, so it answers as it would alone (to float rounding: the model's products
    run over the batch). Rows stay alone where that would not hold: under a policy
    that commits its scores whenever a row is due (``score_when_due``, which would
    commit every row's), and where memories differ in shape.

    Args:
      configs: the memories' settings, each from :func:`memory_config` for ``protocol``.
      prompts: ``(context, question)`` token ids per prompt, at least one token each.
      tables: per prompt, the oracle's table for each config (None for a policy
        without one); None for none at all.
      Others as in :func:`answer`.

    Yields:
      ``(prompt, index, tokens, info)``, ``prompt`` a place in ``prompts`` and ``index``
      in ``configs``, config by config, each batch as soon as it is answered.
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    tables = [[None] * len(configs) for _ in prompts] if tables is None else [
        [None if t is None else jnp.asarray(t) for t in row] for row in tables]
    if len(tables) != len(prompts) or any(len(row) != len(configs) for row in tables):
        raise ValueError(f"tables must give one table (or None) per config ({len(configs)}) for each prompt "
                         f"({len(prompts)})")
    cuts = [{"question-agnostic": len(c), "question-aware": len(c) + len(q), "stream": 0}[protocol]
            for c, q in prompts]
    prompts = [np.concatenate([np.asarray(c), np.asarray(q)]).astype(np.int32) for c, q in prompts]
    graphdef, params = nnx.split(model)
    groups = _sharing(model.cfg, configs) if any(cuts) else []
    prefills = [_prefills(graphdef, params, model.cfg, configs, groups, prompt, cut, row) if cut else None
                for prompt, cut, row in zip(prompts, cuts, tables)]
    for index, config in enumerate(configs):
        step = config.evict_every
        alone = config.policy.score_when_due or not _stackable(model.cfg, config)
        held = []
        for place, cut in enumerate(cuts):
            if cut:
                memories, logits = _own(prefills[place], index)
                memories = _compress(memories)
                if resize:
                    memories = _resize(memories, step)
            else:
                memories, logits = _empty(model.cfg, config), None
            held.append((place, memories, logits))
        ready = []
        for rows in _batches(held, alone or len({t[index] is None for t in tables}) > 1):
            ready += _feed_rows(graphdef, params, [prompts[place] for place, _, _ in rows], rows,
                                [cuts[place] for place, _, _ in rows], [tables[place][index] for place, _, _ in rows],
                                step)
        for rows in _batches(ready, alone):
            places = [place for place, _, _ in rows]
            memories = _stack([m for _, m, _ in rows])
            logits = jnp.concatenate([lg for _, _, lg in rows])
            table = None if tables[places[0]][index] is None else jnp.concatenate(
                [tables[place][index] for place in places], axis=1)
            starts = np.asarray([len(prompts[place]) for place in places], np.int32)
            answered = _decode(graphdef, params, memories, logits, table, starts, max_new, eos_id)
            for place, (tokens, evictions) in zip(places, answered):
                yield place, index, tokens, {"evictions": evictions}


def _empty(cfg, config: flsmem.MemoryConfig):
    """Empty memories for one answer. A prefilling config's ``max_chunk`` makes the
    global layers hold the whole prompt until the cut; the local layers' windows evict
    as they go, so theirs is the largest piece fed, whatever the budget."""
    return init_memories(cfg, config, 1, window_chunk=min(config.max_chunk, max(PREFILL_CHUNK, config.evict_every)))


def _feed_rows(graphdef, params, prompts, rows, starts, tables, step) -> list[tuple]:
    """Each prompt of ``rows`` (``(place, memories, logits)``, memories of one shape) fed
    from its start to its end in pieces of ``step`` tokens and then single tokens,
    evicting when due. The pieces that every prompt has alike in size, from the first,
    are fed as one batch, a row per prompt at its own positions (a piece's weights read
    once for all of them, each row evicting on its own, so each holds what it would
    alone, to float rounding); the rest of each prompt is fed alone. Returns
    ``(place, memories, logits after the last token)`` per row."""
    pieces = [_pieces(start, len(prompt), (step, 1)) for prompt, start in zip(prompts, starts)]
    shared = 0
    while len(rows) > 1 and all(len(p) > shared for p in pieces) and len({p[shared][1] for p in pieces}) == 1:
        shared += 1
    if shared:
        memories, logits = _stack([m for _, m, _ in rows]), None
        table = None if tables[0] is None else jnp.concatenate(tables, axis=1)
        for j in range(shared):
            size = pieces[0][j][1]
            begins = [p[j][0] for p in pieces]
            tokens = np.stack([prompt[b:b + size] for prompt, b in zip(prompts, begins)])
            targets = np.stack([_targets(prompt, b, size) for prompt, b in zip(prompts, begins)])
            memories, logits = _feed(graphdef, params, memories, jnp.asarray(tokens), jnp.asarray(targets),
                                     jnp.asarray(begins, jnp.int32), table, fold="update")
        rows = [(place, jax.tree.map(lambda x, r=r: x[:, r:r + 1], memories), logits[r:r + 1])
                for r, (place, _, _) in enumerate(rows)]
    fed = []
    for (place, memories, logits), prompt, piece, table in zip(rows, prompts, pieces, tables):
        start = piece[shared][0] if len(piece) > shared else len(prompt)
        memories, last = _feed_pieces(graphdef, params, prompt, table, memories, start, len(prompt), (step, 1),
                                      "update")
        fed.append((place, memories, last if last is not None else logits))
    return fed


def _sharing(cfg, configs) -> list[list[int]]:
    """The configs grouped by what a shared prefill needs alike: the schedule and the
    shapes of every memory (the global layers' slots, the local layers' windows). A
    policy that folds the queries themselves (ExpectedAttention) cannot follow another
    memory's prefill, which hands on attention only: it prefills alone."""
    groups: dict = {}
    for index, config in enumerate(configs):
        shapes = jax.eval_shape(lambda c=config: _empty(cfg, c))
        windows = None if shapes.windows is None else (shapes.windows.config, shapes.windows.valid.shape)
        alone = index if config.policy.fold_queries is not None else None
        groups.setdefault((config.evict_every, shapes.evictable.valid.shape, windows, alone), []).append(index)
    return list(groups.values())


def _prefill(graphdef, params, prompt, cut, memories, followers, tables, step):
    """``prompt[:cut]`` through the model once, folded into ``memories`` and into each
    follower (a global layers' memory without its payload); returns both and the
    logits after the last token."""
    logits = None
    for begin, size in _pieces(0, cut, (max(PREFILL_CHUNK, step), step, 1)):
        tokens = jnp.asarray(prompt[begin:begin + size])[None]
        # Before the question is known, the context's last prediction has no target.
        targets = jnp.asarray(_targets(prompt[:cut], begin, size))[None]
        if not followers:
            memories, logits = _feed(graphdef, params, memories, tokens, targets, begin, tables[0], fold="observe")
            continue
        memories, logits, attention, weight = _feed(graphdef, params, memories, tokens, targets, begin, tables[0],
                                                    fold="observe", keep=True)
        followers = _follow(memories.evictable, followers, attention, weight, begin, tuple(tables[1:]))
    return memories, followers, logits


@functools.partial(jax.jit, donate_argnames=("followers",))
def _follow(lead, followers, attention, weight, start, tables):
    """The lead's new items written into each follower and the chunk's attention
    folded as its evidence (:func:`flsmem.observe_layers`)."""
    queries = attention.shape[3]
    positions = start + jnp.arange(queries, dtype=jnp.int32)[None, :]
    # Where the lead put each new item: the slot holding its position (every item was written).
    slot = jnp.argmax(lead.position[:, :, :, None, :] == positions[None, :, None, :, None], axis=-1)
    items = jax.tree.map(lambda p: jnp.take_along_axis(p, slot[..., None], axis=3), lead.payload)
    followed = []
    for follower, table in zip(followers, tables):
        placed, _ = flsmem.place(follower.replace(payload=lead.payload), positions, items)
        placed = placed.replace(payload=None)
        followed.append(flsmem.observe_layers(placed, attention, weight, _future(placed, table, queries)))
    return tuple(followed)


def _prefills(graphdef, params, cfg, configs, groups, prompt, cut, tables) -> list[tuple]:
    """``prompt[:cut]`` prefilled once for each group of configs that can share it
    (:func:`_sharing`): per group, ``(group, the lead's memories, the others' evidence,
    the logits after the last token)``."""
    found = []
    for group in groups:
        memories = _empty(cfg, configs[group[0]])
        followers = tuple(_empty(cfg, configs[i]).evictable.replace(payload=None) for i in group[1:])
        found.append((group, *_prefill(graphdef, params, prompt, cut, memories, followers,
                                       [tables[i] for i in group], configs[group[0]].evict_every)))
    return found


def _own(prefill, index: int):
    """Config ``index``'s memories after a held prefill (a copy: the prefill serves
    every config of its group) and the logits after its last token."""
    for group, memories, followers, logits in prefill:
        if index in group:
            at = group.index(index)
            if at == 0:
                return jax.tree.map(jnp.copy, memories), logits
            payload = jax.tree.map(jnp.copy, memories.evictable.payload)
            return memories.replace(evictable=followers[at - 1].replace(payload=payload),
                                    windows=jax.tree.map(jnp.copy, memories.windows)), logits
    raise ValueError(f"config {index} is in no group of the prefill")


def _stackable(cfg, config: flsmem.MemoryConfig) -> bool:
    """Whether every array of ``config``'s memories has its batch rows on axis 1 (after
    the layers), so that one-row memories stack into a batch."""
    one, two = (jax.tree.leaves(jax.eval_shape(lambda b=b: init_memories(cfg, config, b))) for b in (1, 2))
    return all(len(a.shape) > 1 and a.shape[1] == 1 and b.shape == a.shape[:1] + (2,) + a.shape[2:]
               for a, b in zip(one, two))


def _batches(ready, alone: bool) -> list[list]:
    """``(place, memories, logits)`` rows grouped into batches: rows whose memories have
    the same structure and shapes together, or each alone."""
    if alone:
        return [[row] for row in ready]
    found: dict = {}
    for row in ready:
        leaves = jax.tree.leaves(row[1])
        found.setdefault((jax.tree.structure(row[1]), tuple(leaf.shape for leaf in leaves)), []).append(row)
    return list(found.values())


def _stack(memories: list):
    """One-row memories as one batch, row after row (axis 1 of every array)."""
    if len(memories) == 1:
        return memories[0]
    return jax.tree.map(lambda *rows: jnp.concatenate(rows, axis=1), *memories)


def _decode(graphdef, params, memories, logits, table, starts: np.ndarray, max_new: int, eos_id: int | None
            ) -> list[tuple[list[int], int]]:
    """Greedy tokens after each row's prompt (``starts``: its length), fed back with
    eviction when due, and the items each row's memories evicted. A row that has
    ended is read then and fed on with the others (its tokens no longer count)."""
    rows = len(starts)
    tokens: list[list[int]] = [[] for _ in range(rows)]
    evictions: list[int | None] = [None] * rows
    for fed in range(max_new + 1):
        chosen = np.argmax(np.asarray(logits), axis=-1).astype(np.int32)
        ended = []
        for row in range(rows):
            if evictions[row] is not None:
                continue
            if len(tokens[row]) < max_new and chosen[row] != eos_id:
                tokens[row].append(int(chosen[row]))
            if len(tokens[row]) == max_new or chosen[row] == eos_id:
                ended.append(row)
        if ended:
            counts = np.asarray(jnp.sum(memories.evictable.stats.evictions, axis=0))
            for row in ended:
                evictions[row] = int(counts[row])
        if all(count is not None for count in evictions):
            break
        memories, logits = _feed(graphdef, params, memories, jnp.asarray(chosen[:, None]),
                                 jnp.full((rows, 1), -1, jnp.int32), jnp.asarray(starts + fed), table, fold="update")
    return list(zip(tokens, evictions))


@functools.partial(jax.jit, donate_argnames=("memories",))
def _compress(memories):
    """``flsmem.compress`` of memories whose prefill is folded already: no more
    queries, so it commits the scores and cuts every row to the budget."""
    return memories.compress(budget=memories.evictable.config.budget)


def _resize(memories, step: int):
    """The cut memories moved into the slots that the rest needs (pieces of ``step``
    tokens), not the prompt's (:func:`flsmem.resize`): each later step attends over the
    budget, and a local layer over its window. A memory holding more than its budget
    (a layer schedule; a window not yet due for eviction) keeps room for what it holds."""
    def one(memory):
        held = int(jnp.max(jnp.sum(memory.valid, axis=-1)))
        return _resize_memory(memory, step + max(0, held - memory.config.head_share))

    return memories.replace(evictable=one(memories.evictable),
                            windows=None if memories.windows is None else one(memories.windows))


# Not donated: the memory it returns has other shapes, so it cannot take the buffers.
_resize_memory = jax.jit(flsmem.resize, static_argnames=("max_chunk",))


def _pieces(start: int, stop: int, sizes: tuple[int, ...]) -> list[tuple[int, int]]:
    """``[start, stop)`` as ``(begin, size)`` pieces, the largest sizes first: a few
    shapes, each compiled once."""
    found = []
    for size in sorted(set(sizes), reverse=True):
        while stop - start >= size:
            found.append((start, size))
            start += size
    return found


def _feed_pieces(graphdef, params, prompt, table, memories, start, stop, sizes, fold, known=None):
    """Feed ``prompt[start:stop]`` piece by piece; returns the memories and the logits
    after the last token (None if none).
    Each prediction's target is the next token of ``prompt[:known]`` (all of it if
    None), and -1 (none) past it."""
    logits = None
    for begin, size in _pieces(start, stop, sizes):
        tokens, targets = prompt[begin:begin + size], _targets(prompt[:known], begin, size)
        memories, logits = _feed(graphdef, params, memories, jnp.asarray(tokens)[None], jnp.asarray(targets)[None],
                                 begin, table, fold=fold)
    return memories, logits


def _targets(known: np.ndarray, begin: int, size: int) -> np.ndarray:
    """What the predictions of ``size`` tokens from ``begin`` aim at: the next token of
    ``known``, and -1 (none) past it."""
    return np.concatenate([known[begin + 1:begin + size + 1], [-1] * size])[:size]


@functools.partial(jax.jit, static_argnames=("graphdef", "fold", "keep"), donate_argnames=("memories",))
def _feed(graphdef, params, memories, tokens, targets, start, table, *, fold, keep=False):
    """One piece through the decoder, its attention folded as ``fold`` says: "observe"
    (evidence only) or "update" (evicting when due). With ``keep`` it returns the
    attention and the correctness weights too, for followers to fold. ``start``: the
    first token's position, one for every row or ``[B]``, one per row."""
    model = nnx.merge(graphdef, params)
    positions = jnp.reshape(start, (-1, 1)) + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    logits, memories, attention = model(tokens, positions, memories)
    hit = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    weight = jnp.where(targets >= 0, hit, confidence(logits))
    future = _future(memories.evictable, table, tokens.shape[1])
    fold = memories.observe if fold == "observe" else memories.fold
    if keep:
        return fold(attention, weight, future), logits[:, -1], attention, weight
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
