"""Policies that the theory says coincide do coincide, on 1,000 random streams at once.

Each stream is one row of a batch of 1,000; the kept set of every row is compared
after every step.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

import flsmem
from flsmem import policies as P
from flsmem import testing

STREAMS, STEPS = 1000, 40
TABLE = testing.attention_table(jax.random.key(7), STREAMS, 1, STEPS)
CORRECT = jnp.ones((STREAMS, STEPS))


@functools.partial(jax.jit, static_argnames=("config",))
def kept_trace(config, table, correctness):
    """Per step, which positions each row holds: ``[T, B, T]`` bool."""
    state = flsmem.init(config, table.shape[0], 1, {"v": ()})

    def body(state, t):
        state = flsmem.write(state, {"v": jnp.zeros((table.shape[0], 1))}, jnp.full((table.shape[0],), t))
        attention = testing.gather_attention(table, state)[:, :, 0]
        state = flsmem.update(state, attention, correctness[:, t])
        held = jnp.zeros((table.shape[0], STEPS), bool)
        rows = jnp.arange(table.shape[0])[:, None]
        held = held.at[rows, jnp.where(state.valid[:, 0], state.position[:, 0], STEPS)].set(True, mode="drop")
        return state, (held, state.score[:, 0], state.position[:, 0], state.valid[:, 0])

    return jax.lax.scan(body, state, jnp.arange(STEPS))[1]


def kept(policy, budget=8, correctness=CORRECT, evict_every=1):
    config = flsmem.MemoryConfig(policy=policy, budget=budget, evict_every=evict_every)
    return kept_trace(config, TABLE, correctness)


def test_rmm_with_unit_weights_keeps_exactly_what_h2o_keeps():
    np.testing.assert_array_equal(kept(P.rmm(lag=0))[0], kept(P.h2o())[0])
    # The lag protects what H2O's recent window protects.
    np.testing.assert_array_equal(kept(P.rmm(lag=3))[0], kept(P.h2o(recent=3))[0])
    # And the weights matter: random correctness changes what is kept.
    weights = jax.random.bernoulli(jax.random.key(1), 0.5, (STREAMS, STEPS)).astype(jnp.float32)
    assert np.any(np.asarray(kept(P.rmm(lag=0), correctness=weights)[0]) != np.asarray(kept(P.h2o())[0]))


def test_ema_decay_one_accumulates_and_decay_zero_measures():
    np.testing.assert_array_equal(kept(P.ema(1.0))[0], kept(P.h2o())[0])
    np.testing.assert_array_equal(kept(P.ema(0.0))[0], kept(P.tova())[0])
    assert np.any(np.asarray(kept(P.ema(0.5))[0]) != np.asarray(kept(P.h2o())[0]))


def _running_mean(policy, view, aux):
    """A policy written in one function: mean attention per query seen."""
    return view.evidence[0] / jnp.maximum(view.age, 1).astype(jnp.float32)


def test_kalman_without_process_noise_ranks_as_the_running_mean():
    mean_policy = P.h2o().replace(name="running_mean", score=_running_mean)
    held_k, score_k, pos_k, valid_k = kept(P.kalman(q=0.0, r=1.0))
    held_m, score_m, pos_m, valid_m = kept(mean_policy)
    np.testing.assert_allclose(
        np.where(valid_k, score_k, 0), np.where(valid_m, score_m, 0), rtol=1e-5, atol=1e-7
    )
    np.testing.assert_array_equal(held_k, held_m)
    # With process noise the filter forgets, and keeps something else.
    assert np.any(np.asarray(kept(P.kalman(q=1.0, r=0.01))[0]) != np.asarray(held_m))


def test_chunked_teacher_forcing_equals_per_step_decode():
    """evict_every=1: write 8 items as a chunk, update 8 queries, equals 8 single steps."""
    chunk = 8
    config = flsmem.MemoryConfig(policy=P.rmm(lag=2), budget=6, max_chunk=chunk)
    weights = jax.random.uniform(jax.random.key(3), (STREAMS, STEPS))

    @jax.jit
    def chunked(table, correctness):
        state = flsmem.init(config, STREAMS, 1, {"v": ()})
        for c in range(STEPS // chunk):
            positions = jnp.broadcast_to(jnp.arange(c * chunk, (c + 1) * chunk), (STREAMS, chunk))
            state = flsmem.write(state, {"v": jnp.zeros((STREAMS, 1, chunk))}, positions)
            attention = testing.gather_attention(table, state, chunk)
            state = flsmem.update(state, attention, correctness[:, c * chunk:(c + 1) * chunk])
        return state

    state = chunked(TABLE, weights)
    per_step = kept_trace(config.replace(max_chunk=1), TABLE, weights)[0][-1]
    held = np.zeros((STREAMS, STEPS), bool)
    valid, position = np.asarray(state.valid[:, 0]), np.asarray(state.position[:, 0])
    for row in range(STREAMS):
        held[row, position[row][valid[row]]] = True
    np.testing.assert_array_equal(held, per_step)
