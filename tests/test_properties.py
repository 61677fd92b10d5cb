"""Property tests of the memory operations over random schedules and data.

Every distinct static config costs a compile, so the configs come from the small list
``SETUPS`` (policies, budgets, lags, sinks, schedules, chunk sizes, batch and head
counts) and each one's jitted drivers are cached; hypothesis draws the data freely:
attention and future tables, correctness weights, item positions, ragged write masks
and when to compress with an explicit budget.

Two drivers run a whole stream under one ``lax.scan``:

* ``run_update``: per chunk, ``write`` Q items (with a per-row mask), then ``update``
  with Q queries; a snapshot of the state after each chunk.
* ``run_explicit``: per chunk, ``write`` Q items, then per query ``observe``, ``smooth``,
  ``evict`` and, where drawn, ``evict(budget=...)``; the masks before and after each.

Payloads encode their item's position and head, so a slot whose payload, position and
birth did not move together shows up.

Write masks are dense, random per step, or ragged sequence lengths: each batch row has
its own length and the rest of the stream is padding, at the end or at the start.

The examples are derandomized (the same ones in every run, so CI is deterministic and
a failure reproduces) and number a few thousand per run; each one costs well under a
millisecond once its setup is compiled. ``FLSMEM_PROPERTY_SCALE=10`` draws ten times as
many, for a deeper search by hand.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax

import flsmem
from flsmem import estimator, policies, testing

STEPS = 24  # items (and queries) per stream; every chunk size below divides it
D = 4  # payload width
SCALE = float(os.environ.get("FLSMEM_PROPERTY_SCALE", "1"))


def examples(n: int) -> settings:
    """Settings of a property test drawing ``n`` (times SCALE) fixed examples."""
    return settings(max_examples=max(1, int(n * SCALE)), deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


@dataclasses.dataclass(frozen=True)
class Setup:
    policy: policies.Policy
    budget: int
    evict_every: int
    max_chunk: int
    batch: int
    kv_heads: int
    explicit_budget: int  # budget of the drawn evict(state, budget=...) calls

    @property
    def config(self) -> flsmem.MemoryConfig:
        return flsmem.MemoryConfig(self.policy, budget=self.budget, evict_every=self.evict_every,
                                   max_chunk=self.max_chunk)

    @property
    def protected_count(self) -> int:
        return self.policy.sinks + self.policy.protected_age

    def __repr__(self):
        return (f"Setup({self.policy.name}, sinks={self.policy.sinks}, "
                f"protected_age={self.policy.protected_age}, budget={self.budget}, "
                f"evict_every={self.evict_every}, max_chunk={self.max_chunk}, "
                f"B={self.batch}, K={self.kv_heads}, explicit_budget={self.explicit_budget})")

    def _repr_pretty_(self, p, cycle):  # what hypothesis prints for a failing example
        p.text(repr(self))


SETUPS = [
    Setup(policies.window(), 3, 1, 3, 2, 1, 1),
    Setup(policies.streaming_llm(sinks=2), 5, 2, 4, 3, 2, 3),
    Setup(policies.h2o(recent=2).replace(normalise_by_age=True), 4, 1, 4, 2, 2, 2),
    Setup(policies.tova(recent=1), 3, 3, 2, 1, 2, 1),
    Setup(policies.ema(0.7, weighted=True, recent=1, lag=2), 4, 1, 3, 2, 1, 3),
    Setup(policies.rmm(lag=3, recent=1).replace(sinks=1), 6, 2, 3, 3, 1, 4),
    Setup(policies.scissorhands(4, recent=2), 4, 1, 2, 2, 2, 2),
    Setup(policies.snapkv(3, kernel_size=3), 5, 1, 4, 2, 1, 3),
    Setup(policies.key_norm(), 3, 2, 2, 2, 2, 1),
    Setup(policies.random(seed=3), 4, 1, 3, 2, 1, 2),
    Setup(policies.kalman(adaptive=True, lag=2, weighted=True), 5, 1, 4, 3, 1, 2),
    Setup(policies.oracle(), 3, 1, 2, 2, 2, 1),
    Setup(policies.lag_window(3, gamma=0.8, decay_after=0.95), 5, 3, 3, 2, 1, 3),
    Setup(policies.use_recency(2), 4, 1, 2, 2, 2, 2),
    # Learns online: one optax step per 3 queries, pooled over the rows.
    Setup(estimator.learned(horizon=3, hidden=4, learning_rate=1e-2, recent=1), 4, 2, 3, 2, 2, 2),
]
EVICTING = SETUPS
# The full cache never evicts: its budget must hold the whole stream.
FULL = Setup(policies.full(), STEPS, 1, 3, 2, 1, STEPS)
ALL = SETUPS + [FULL]
# Chunked == per-step holds for every policy, exact ties of scores included (evict
# breaks them by birth, which does not depend on the slot layout), except adaptive
# kalman and learned: their noise estimates and training loss are float sums over the
# slots, taken in slot order, so their rounding depends on the layout.
LAYOUT_FREE = [s for s in ALL if s.policy.name not in ("kalman", "learned")]
# Rows never interact, except in learned (one network trained on every row, its sums
# rounded in row order); random hashes the row index.
PERMUTABLE = [s for s in ALL if s.batch >= 2 and s.policy.name not in ("random", "learned")]


@dataclasses.dataclass
class Stream:
    """One stream's data, per step: ``[STEPS, B]`` and tables ``[B, K, STEPS, STEPS]``."""

    table: np.ndarray
    future: np.ndarray
    position: np.ndarray
    mask: np.ndarray
    weight: np.ndarray
    compress: np.ndarray
    seed: int = -1
    scale: float = 1.0

    def __repr__(self):
        return (f"Stream(seed={self.seed}, scale={self.scale}, mask={self.mask.T.astype(int).tolist()}, "
                f"compress={self.compress.T.astype(int).tolist()})")

    def _repr_pretty_(self, p, cycle):
        p.text(repr(self))

    def permute(self, order) -> "Stream":
        return Stream(self.table[order], self.future[order], self.position[:, order],
                      self.mask[:, order], self.weight[:, order], self.compress[:, order],
                      self.seed, self.scale)


def make_stream(setup: Setup, seed: int, mask: np.ndarray, compress: np.ndarray,
                scale: float) -> Stream:
    rng = np.random.default_rng(seed)
    b, k = setup.batch, setup.kv_heads
    logits = 2.0 * rng.normal(size=(b, k, STEPS, STEPS))
    table = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    table[rng.random(table.shape) < 0.05] = 0.0  # exact zeros are valid attention
    future = rng.exponential(size=(b, k, STEPS, STEPS))
    # Positions need not follow arrival order: sinks may arrive late, births differ.
    position = np.stack([rng.permutation(STEPS) for _ in range(b)], axis=1)
    weight = rng.uniform(size=(STEPS, b))
    weight[rng.random(weight.shape) < 0.2] = 0.0
    return Stream((scale * table).astype(np.float32), future.astype(np.float32),
                  position.astype(np.int32), mask, weight.astype(np.float32), compress, seed, scale)


@st.composite
def streams(draw, setups):
    setup = draw(st.sampled_from(setups))
    shape = (STEPS, setup.batch)
    kind = draw(st.sampled_from(["dense", "random", "lengths", "left-padded"]))
    if kind in ("lengths", "left-padded"):
        # Ragged batch: row b holds a sequence of its own length, padded to STEPS.
        lengths = np.array(draw(st.lists(st.integers(0, STEPS), min_size=setup.batch, max_size=setup.batch)))
        t = np.arange(STEPS)[:, None]
        mask = t < lengths[None, :] if kind == "lengths" else t >= STEPS - lengths[None, :]
    else:
        mask = draw(hnp.arrays(np.bool_, shape, elements=st.booleans() if kind == "random" else st.just(True)))
    compress = draw(hnp.arrays(np.bool_, shape))
    seed = draw(st.integers(0, 2**32 - 1))
    scale = draw(st.sampled_from([1.0, 1e-3, 1e3]))
    return setup, make_stream(setup, seed, mask, compress, scale)


def encode(position, kv_heads):
    """Payloads of items at ``position [B, Q]`` for every head: ``[B, K, Q, D]``."""
    p = position.astype(jnp.float32)[:, None, :, None] + 1.0
    d = jnp.arange(1, D + 1, dtype=jnp.float32)[None, None, None, :]
    h = jnp.arange(kv_heads, dtype=jnp.float32)[None, :, None, None]
    return {"k": p * d + 0.5 * h, "v": -p - 0.25 * h * d}


def _chunked(x, q):
    """``[STEPS, B, ...]`` -> ``[STEPS // q, B, q, ...]``."""
    n = x.shape[0] // q
    return jnp.swapaxes(jnp.reshape(x, (n, q) + x.shape[1:]), 1, 2)


def _select(flag, a, b):
    """Per batch row: ``a`` where ``flag [B]``, else ``b``, for states that differ by an
    ``evict`` (which never touches ``aux``: the learned policy's network is shared by
    the rows and has no batch axis)."""
    pick = jax.tree.map(lambda x, y: jnp.where(jnp.reshape(flag, flag.shape + (1,) * (x.ndim - 1)), x, y),
                        a.replace(aux=None), b.replace(aux=None))
    return pick.replace(aux=b.aux)


def _attention(state, table, future, queries):
    attention = testing.gather_attention(table, state, queries)
    fut = testing.gather_attention(future, state, queries) if state.config.policy.needs_future else None
    return attention, fut


def _new_memory(setup):
    return flsmem.init(setup.config, setup.batch, setup.kv_heads, {"k": (D,), "v": (D,)})


@functools.lru_cache(maxsize=None)
def run_update(setup: Setup, q: int):
    """Jitted stream of ``write`` + ``update`` over chunks of ``q``; the state after
    every chunk, stacked."""

    def run(table, future, position, mask, weight):
        def chunk(state, xs):
            pos, m, w = xs
            state = flsmem.write(state, encode(pos, setup.kv_heads), pos, m)
            attention, fut = _attention(state, table, future, q)
            state = flsmem.update(state, attention, w, future=fut)
            return state, state

        xs = tuple(_chunked(x, q) for x in (position, mask, weight))
        return lax.scan(chunk, _new_memory(setup), xs)[1]

    return jax.jit(run)


@functools.lru_cache(maxsize=None)
def run_explicit(setup: Setup):
    """Jitted stream with the per-query steps spelled out and drawn explicit-budget
    evictions; per query, the masks around each eviction."""
    q = setup.max_chunk

    def run(table, future, position, mask, weight, compress):
        def chunk(state, xs):
            pos, m, w, c = xs
            state = flsmem.write(state, encode(pos, setup.kv_heads), pos, m)

            def query(state, xs):
                w_j, c_j = xs
                attention, fut = _attention(state, table, future, 1)
                fut = None if fut is None else fut[:, :, 0]
                observed = flsmem.smooth(flsmem.observe(state, attention[:, :, 0], w_j, fut))
                evicted = flsmem.evict(observed)
                compressed = flsmem.evict(evicted, budget=setup.explicit_budget)
                out = {
                    "observed": (observed.valid, observed.position, flsmem.present(observed),
                                 flsmem.protected(observed)),
                    "evicted": (evicted.valid, evicted.position, flsmem.present(evicted),
                                flsmem.protected(evicted)),
                    "compressed": (compressed.valid, compressed.position, flsmem.present(compressed)),
                }
                return _select(c_j, compressed, evicted), out

            state, out = lax.scan(query, state, (w.T, c.T))
            return state, (out, state)

        xs = tuple(_chunked(x, q) for x in (position, mask, weight, compress))
        return lax.scan(chunk, _new_memory(setup), xs)[1]

    return jax.jit(run)


def update_snapshots(setup: Setup, s: Stream, q: int | None = None):
    q = setup.max_chunk if q is None else q
    out = run_update(setup, q)(s.table, s.future, s.position, s.mask, s.weight)
    return jax.device_get(out)


def explicit_snapshots(setup: Setup, s: Stream):
    out = run_explicit(setup)(s.table, s.future, s.position, s.mask, s.weight, s.compress)
    return jax.device_get(out)


def kept_sets(valid, position):
    """``[B, K, S]`` -> per row, the set of held positions."""
    b, k, _ = valid.shape
    return [[frozenset(position[i, j][valid[i, j]].tolist()) for j in range(k)] for i in range(b)]


def check_payload(setup: Setup, s: Stream, state, upto: int):
    """Every valid slot holds its own item: payload = the position's encoding for its
    head, birth = the step that wrote it, the position was written and not masked."""
    births = [dict() for _ in range(setup.batch)]
    for t in range(upto):
        for b in range(setup.batch):
            if s.mask[t, b]:
                births[b][int(s.position[t, b])] = t
    for b in range(setup.batch):
        for h in range(setup.kv_heads):
            valid = state.valid[b, h]
            pos = state.position[b, h]
            assert np.all(pos[~valid] == -1)
            held = pos[valid]
            assert len(set(held.tolist())) == len(held), "a position is held twice"
            for slot in np.flatnonzero(valid):
                p = int(pos[slot])
                assert p in births[b], f"position {p} was never written to row {b}"
                assert state.birth[b, h, slot] == births[b][p]
                want_k = (p + 1.0) * np.arange(1, D + 1) + 0.5 * h
                want_v = -(p + 1.0) - 0.25 * h * np.arange(1, D + 1)
                np.testing.assert_array_equal(state.payload["k"][b, h, slot], want_k.astype(np.float32))
                np.testing.assert_array_equal(state.payload["v"][b, h, slot], want_v.astype(np.float32))


def check_accounting(setup: Setup, s: Stream, state, upto: int):
    """Counters are non-negative and ``evictions`` (summed over heads) is the number of
    written items that are gone, each evicted at an age past its protection."""
    stats = state.stats
    for name in ("evictions", "evicted_age", "fallbacks", "forced_writes", "nonfinite_inputs"):
        assert np.all(getattr(stats, name) >= 0), name
    assert np.all(stats.forced_writes == 0)
    written = s.mask[:upto].sum(0) * setup.kv_heads
    np.testing.assert_array_equal(stats.evictions, written - state.valid.sum((1, 2)))
    # The float sums are per (row, head); the count per row.
    assert stats.evicted_age.shape == stats.evicted_score.shape == state.valid.shape[:2]
    assert np.all(stats.evicted_age.sum(-1) >= stats.evictions * (setup.policy.protected_age + 1))
    assert np.all(np.isfinite(stats.evicted_score))


def _at(tree, i):
    return jax.tree.map(lambda x: x[i], tree)


# ----------------------------------------------------------------------- budget


@examples(800)
@given(streams(EVICTING))
def test_update_never_reaches_high_water_mark(drawn):
    """After every ``update`` a row holds fewer present items than its high-water mark
    (budget + evict_every): each query's eviction ran when due. Nothing was forced in
    and nothing still waits once a chunk's queries are done."""
    setup, s = drawn
    states = update_snapshots(setup, s)
    high_water = setup.budget + setup.evict_every
    for c in range(STEPS // setup.max_chunk):
        state = _at(states, c)
        n_present = np.sum(state.valid & (state.birth < state.step[:, None, None]), -1)
        assert np.all(n_present < high_water), n_present
        assert np.all(np.sum(state.valid, -1) == n_present)
        assert np.all(state.stats.forced_writes == 0)


@examples(400)
@given(streams(EVICTING))
def test_evict_keeps_budget_and_protected_items(drawn):
    """Per query: scheduled ``evict`` fires exactly at the high-water mark and leaves
    ``budget`` present items; ``evict(state, budget=b)`` leaves ``min(present, b)``.
    Neither ever frees a slot that ``protected`` marked before it, nor a written item
    whose query has not come yet, nor moves a kept item to another slot."""
    setup, s = drawn
    per_query, _ = explicit_snapshots(setup, s)
    high_water = setup.budget + setup.evict_every
    n_chunks = STEPS // setup.max_chunk
    for c in range(n_chunks):
        for j in range(setup.max_chunk):
            ov, opos, opresent, oprot = (x[c, j] for x in per_query["observed"])
            ev, epos, epresent, eprot = (x[c, j] for x in per_query["evicted"])
            cv, cpos, cpresent = (x[c, j] for x in per_query["compressed"])
            n_obs, n_ev, n_comp = (np.sum(x, -1) for x in (opresent, epresent, cpresent))
            due = n_obs >= high_water
            np.testing.assert_array_equal(n_ev, np.where(due, setup.budget, n_obs))
            np.testing.assert_array_equal(n_comp, np.minimum(n_ev, setup.explicit_budget))
            for before_valid, before_pos, keep, after_valid, after_pos in (
                (ov, opos, oprot | (ov & ~opresent), ev, epos),
                (ev, epos, eprot | (ev & ~epresent), cv, cpos),
            ):
                assert np.all(after_valid <= before_valid), "evict made a slot valid"
                assert np.all(after_valid[keep]), "a protected or waiting item was evicted"
                np.testing.assert_array_equal(after_pos[after_valid], before_pos[after_valid])


# -------------------------------------------------------------------- payload


@examples(300)
@given(streams(ALL))
def test_payload_position_and_birth_move_together_under_update(drawn):
    """After every chunk of ``write`` + ``update``, each valid slot's payload encodes its
    own position and head, and its birth is the step its item was written at."""
    setup, s = drawn
    states = update_snapshots(setup, s)
    q = setup.max_chunk
    for c in range(STEPS // q):
        check_payload(setup, s, _at(states, c), (c + 1) * q)


@examples(250)
@given(streams(EVICTING))
def test_payload_position_and_birth_move_together_under_explicit_evict(drawn):
    """The same with explicit ``observe``/``smooth``/``evict`` and drawn
    ``evict(budget=...)`` compressions between queries; the eviction counters still
    account for every item that left."""
    setup, s = drawn
    _, states = explicit_snapshots(setup, s)
    q = setup.max_chunk
    for c in range(STEPS // q):
        check_payload(setup, s, _at(states, c), (c + 1) * q)
        check_accounting(setup, s, _at(states, c), (c + 1) * q)


# -------------------------------------------------------------- chunk vs step


@examples(500)
@given(streams(LAYOUT_FREE))
def test_chunked_update_equals_single_steps(drawn):
    """Writing a chunk of Q items and updating with its Q queries keeps exactly the
    positions, with exactly the scores, that Q single-item write + update steps keep,
    ragged masks included, at every chunk boundary."""
    setup, s = drawn
    q = setup.max_chunk
    chunked = update_snapshots(setup, s, q)
    single = update_snapshots(setup, s, 1)
    for c in range(STEPS // q):
        a, b = _at(chunked, c), _at(single, (c + 1) * q - 1)
        assert kept_sets(a.valid, a.position) == kept_sets(b.valid, b.position), f"chunk {c}"
        assert scores_by_position(a) == scores_by_position(b), f"scores differ after chunk {c}"
        np.testing.assert_array_equal(a.stats.evictions, b.stats.evictions)
        np.testing.assert_array_equal(a.stats.evicted_age, b.stats.evicted_age)


def scores_by_position(state):
    """{(batch row, head, position): committed score} of the valid slots."""
    return {(i, j, int(state.position[i, j, slot])): float(state.score[i, j, slot])
            for i, j, slot in zip(*np.nonzero(state.valid))}


# --------------------------------------------------------------- finiteness


@examples(800)
@given(streams(ALL))
def test_no_nan_and_stats_account_for_every_item(drawn):
    """With finite inputs (exact zeros and large or tiny scales included) no valid slot
    ever has a non-finite score or evidence, no fallback or non-finite input is counted,
    counters are non-negative, and ``evictions`` is the number of written items that
    are gone, each evicted at an age past its protection."""
    setup, s = drawn
    states = update_snapshots(setup, s)
    q = setup.max_chunk
    for c in range(STEPS // q):
        state = _at(states, c)
        assert np.all(np.isfinite(state.score[state.valid]))
        assert all(np.all(np.isfinite(array[state.valid])) for array in state.evidence)
        assert np.all(state.stats.fallbacks == 0) and np.all(state.stats.nonfinite_inputs == 0)
        check_accounting(setup, s, state, (c + 1) * q)


@examples(300)
@given(streams(ALL), st.data())
def test_nonfinite_inputs_are_exactly_no_evidence(drawn, data):
    """NaN or Inf attention and correctness never reach a kept item: a stream with some
    entries made NaN or Inf leaves the memory exactly as the same stream with those
    entries 0 does, and only the ``nonfinite_inputs`` counter tells them apart."""
    setup, s = drawn
    seed = data.draw(st.integers(0, 2**32 - 1), label="nonfinite seed")
    rng = np.random.default_rng(seed)
    bad_table = rng.random(s.table.shape) < 0.05
    bad_weight = rng.random(s.weight.shape) < 0.1
    values = rng.choice(np.array([np.nan, np.inf, -np.inf], np.float32), size=s.table.shape)
    weights = rng.choice(np.array([np.nan, np.inf], np.float32), size=s.weight.shape)
    broken = dataclasses.replace(s, table=np.where(bad_table, values, s.table),
                                 weight=np.where(bad_weight, weights, s.weight))
    zeroed = dataclasses.replace(s, table=np.where(bad_table, 0.0, s.table).astype(np.float32),
                                 weight=np.where(bad_weight, 0.0, s.weight).astype(np.float32))
    got, want = update_snapshots(setup, broken), update_snapshots(setup, zeroed)
    assert np.all(want.stats.nonfinite_inputs == 0)
    if bad_weight.any():
        assert np.any(got.stats.nonfinite_inputs > 0)
    got = got.replace(stats=got.stats.replace(nonfinite_inputs=want.stats.nonfinite_inputs))
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


# -------------------------------------------------------------- batch order


@examples(400)
@given(streams(PERMUTABLE), st.randoms(use_true_random=False))
def test_batch_row_order_does_not_matter(drawn, rnd):
    """Permuting the batch rows of every input permutes the resulting memory: rows
    never interact (``random`` is excluded: its hash is keyed by the row index)."""
    setup, s = drawn
    order = list(range(setup.batch))
    rnd.shuffle(order)
    base = update_snapshots(setup, s)
    perm = update_snapshots(setup, s.permute(order))
    flat_base, flat_perm = jax.tree.leaves(base), jax.tree.leaves(perm)
    for x, y in zip(flat_base, flat_perm):
        # Snapshots are [chunks, B, ...].
        np.testing.assert_array_equal(x[:, order], y)


# ------------------------------------------------------------- rmm with w = 1

RMM_H2O = (Setup(policies.rmm(lag=3, recent=1), 5, 2, 3, 2, 2, 3),
           Setup(policies.h2o(recent=3), 5, 2, 3, 2, 2, 3))


@examples(300)
@given(streams(RMM_H2O[:1]))
def test_rmm_with_unit_weights_keeps_what_h2o_keeps(drawn):
    """The rmm docstring's claim: with every correctness weight 1 and the same
    max(recent, lag), demonstrated utility keeps exactly what H2O keeps."""
    _, s = drawn
    s = dataclasses.replace(s, weight=np.ones_like(s.weight))
    rmm, h2o = (update_snapshots(setup, s) for setup in RMM_H2O)
    for c in range(STEPS // RMM_H2O[0].max_chunk):
        a, b = _at(rmm, c), _at(h2o, c)
        assert kept_sets(a.valid, a.position) == kept_sets(b.valid, b.position), f"chunk {c}"
        assert scores_by_position(a) == scores_by_position(b)


# ----------------------------------------------------------------- tied scores


@functools.lru_cache(maxsize=None)
def _tie_stream(config: flsmem.MemoryConfig, q: int, steps: int):
    def run(table):
        m = testing.tiny_memory(config, batch=1, kv_heads=1)
        for c in range(steps // q):
            z = jnp.zeros((1, 1, q, testing.HEAD_DIM))
            m = flsmem.write(m, {"k": z, "v": z}, jnp.arange(c * q, (c + 1) * q, dtype=jnp.int32)[None])
            m = flsmem.update(m, testing.gather_attention(table, m, q))
        return m.valid, m.position

    return jax.jit(run)


def test_chunked_update_equals_single_steps_with_tied_scores():
    """Chunked == per-step (evict_every=1) also when scores tie. Hand case: scissorhands
    over 2 queries, budget 3; only query 4 gives position 3 any attention, so nearly
    every eviction is a tie among counts of -2, which the newer items win (chunks take
    their slots before the chunk's earlier queries free any, so a slot-index tie-break
    kept {0, 5, 7} per step and {0, 6, 7} in chunks of 2)."""
    config = flsmem.MemoryConfig(policies.scissorhands(history=2), budget=3, evict_every=1,
                                 max_chunk=2)
    table = np.zeros((1, 1, 8, 8), np.float32)
    table[0, 0, 4, 3] = 1.0
    kept = {}
    for q in (1, 2):
        valid, position = jax.device_get(_tie_stream(config, q, 8)(table))
        kept[q] = sorted(position[0, 0][valid[0, 0]].tolist())
    assert kept[1] == kept[2] == [5, 6, 7]
