"""The adaptive policy: its losses and mixture worked out by hand, the policies it
reduces to with one expert, and the expert it follows on streams made for each."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flsmem
from flsmem import policies as P
from flsmem import testing

write = jax.jit(flsmem.write)
update = jax.jit(flsmem.update)


def test_losses_and_mixture_by_hand():
    # One row, no eviction (budget 4), two experts: the sum (decay 1) and the last
    # query's attention (decay 0); lag 0, a snapshot after every query, floor .1,
    # nothing forgotten. Query t gives row t of the table to positions 0..t.
    table = [[1.0, 0.0, 0.0], [0.6, 0.4, 0.0], [0.5, 0.2, 0.3]]
    policy = P.adaptive(lag=0, decays=(1.0, 0.0), weighted=(False, False), horizon=1, forget=1.0, floor=0.1)
    state = testing.tiny_memory(flsmem.MemoryConfig(policy=policy, budget=4), batch=1, kv_heads=1)
    tab = jnp.asarray(table, jnp.float32)[None, None]
    for t in range(3):
        state = write(state, {"k": jnp.zeros((1, 1, 4)), "v": jnp.zeros((1, 1, 4))}, jnp.array([t]))
        state = update(state, testing.gather_attention(tab, state)[:, :, 0])
    # Query 1 judges the snapshot of query 0, which held p0 alone (loss 0 for both).
    # Snapshot of query 1 over p0, p1: the sum predicts .9 (1.6, .4) / 2 + .1 / 2 =
    # (.77, .23), the last query .9 (.6, .4) + .05 = (.59, .41). Query 2 pays p0 and p1
    # (.5, .2), normalised (5/7, 2/7).
    loss_sum = -(5 / 7 * math.log(0.77) + 2 / 7 * math.log(0.23))
    loss_last = -(5 / 7 * math.log(0.59) + 2 / 7 * math.log(0.41))
    np.testing.assert_allclose(state.aux[0, 0, :2], [loss_sum, loss_last], rtol=1e-5)
    assert float(state.aux[0, 0, 2]) == 2.0  # the step of the last snapshot
    # Weights softmax(-loss); the score mixes the current predictions over p0..p2:
    # the sum (2.1, .6, .3) / 3, the last query (.5, .2, .3), each .9 of it plus .1 / 3.
    w_sum = 1.0 / (1.0 + math.exp(loss_sum - loss_last))
    q_sum = 0.9 * np.array([2.1, 0.6, 0.3]) / 3.0 + 0.1 / 3
    q_last = 0.9 * np.array([0.5, 0.2, 0.3]) + 0.1 / 3
    expected = w_sum * q_sum + (1 - w_sum) * q_last
    held = np.asarray(state.valid[0, 0])
    order = np.argsort(np.asarray(state.position[0, 0])[held])
    np.testing.assert_allclose(np.asarray(state.score[0, 0])[held][order], expected, rtol=1e-5)
    assert float(flsmem.summary(state)["weight_h2o"][0]) == pytest.approx(w_sum, rel=1e-5)


def test_evicted_judge_by_hand():
    # As above, but each snapshot marks the lowest item (horizon 1) of each expert among
    # the committed ones and a query charges the share of its attention on the marks.
    table = [[1.0, 0.0, 0.0], [0.3, 0.7, 0.0], [0.5, 0.2, 0.3]]
    policy = P.adaptive(lag=0, decays=(1.0, 0.0), weighted=(False, False), horizon=1, forget=1.0, floor=0.1,
                        judge="evicted")
    state = testing.tiny_memory(flsmem.MemoryConfig(policy=policy, budget=4), batch=1, kv_heads=1)
    tab = jnp.asarray(table, jnp.float32)[None, None]
    for t in range(3):
        state = write(state, {"k": jnp.zeros((1, 1, 4)), "v": jnp.zeros((1, 1, 4))}, jnp.array([t]))
        state = update(state, testing.gather_attention(tab, state)[:, :, 0])
    # Query 0's snapshot marks p0 for both, and query 1 pays p0 all of the judged
    # attention: 1 each. Query 1's snapshot: the sum (1.3, .7) marks p1, the last query
    # (.3, .7) marks p0. Query 2 pays p0 and p1 (.5, .2), normalised (5/7, 2/7).
    loss_sum, loss_last = 1 + 2 / 7, 1 + 5 / 7
    np.testing.assert_allclose(state.aux[0, 0, :2], [loss_sum, loss_last], rtol=1e-6)
    w_sum = 1.0 / (1.0 + math.exp(loss_sum - loss_last))
    q_sum = 0.9 * np.array([1.8, 0.9, 0.3]) / 3.0 + 0.1 / 3
    q_last = 0.9 * np.array([0.5, 0.2, 0.3]) + 0.1 / 3
    held = np.asarray(state.valid[0, 0])
    order = np.argsort(np.asarray(state.position[0, 0])[held])
    np.testing.assert_allclose(np.asarray(state.score[0, 0])[held][order],
                               w_sum * q_sum + (1 - w_sum) * q_last, rtol=1e-5)


def _kept_over_stream(policy, evict_every=1, steps=28, budget=6):
    """Kept position sets of every row after every step of a random stream with
    correctness weights."""
    config = flsmem.MemoryConfig(policy=policy, budget=budget, evict_every=evict_every)
    state = testing.tiny_memory(config, batch=2, kv_heads=3)
    key = jax.random.key(3)
    table = testing.attention_table(key, 2, 3, steps)
    correctness = jax.random.uniform(jax.random.fold_in(key, 1), (2, steps))
    kept = []
    for t in range(steps):
        state = write(state, {"k": jnp.zeros((2, 3, 4)), "v": jnp.zeros((2, 3, 4))}, jnp.full((2,), t))
        state = update(state, testing.gather_attention(table, state)[:, :, 0], correctness[:, t])
        kept.append(testing.kept_positions(state))
    return kept


@pytest.mark.parametrize("judge", ["log_loss", "evicted"])
@pytest.mark.parametrize("alone, weighted", [(P.rmm(lag=3, recent=2), True), (P.h2o(recent=3), False)],
                         ids=["rmm", "h2o"])
def test_one_expert_keeps_what_its_policy_keeps(alone, weighted, judge):
    # Normalising a row's sums and adding a floor keeps their order.
    one = P.adaptive(lag=3, recent=2 if weighted else 3, decays=(1.0,), weighted=(weighted,), horizon=4,
                     judge=judge)
    assert _kept_over_stream(one, evict_every=2) == _kept_over_stream(alone, evict_every=2)


def _weights_after(attention: np.ndarray, policy) -> dict[str, float]:
    """Each expert's weight after one row of items, all present from the start, is
    shown ``attention`` ``[T, S]`` (no eviction)."""
    steps, slots = attention.shape
    config = flsmem.MemoryConfig(policy=policy, budget=slots, max_chunk=slots)
    state = flsmem.init(config, 1, 1, {"v": ()})
    state = flsmem.write(state, {"v": jnp.zeros((1, 1, slots))}, jnp.arange(slots)[None])
    pad = np.zeros((steps, config.capacity - slots), np.float32)
    state = jax.jit(flsmem.observe)(state, jnp.asarray(np.concatenate([attention, pad], axis=1))[None, None])
    return {name: float(value[0]) for name, value in flsmem.summary(state).items() if name.startswith("weight_")}


def _stream(rng, steps, slots, hot_for):
    """Each query's attention: a noisy draw around a propensity per item; the
    propensities are redrawn every ``hot_for`` queries (never, when None)."""
    rows, propensity = [], None
    for t in range(steps):
        if propensity is None or (hot_for and t % hot_for == 0):
            propensity = rng.dirichlet(np.full(slots, 0.3))
        rows.append(rng.dirichlet(20.0 * propensity + 1e-3))
    return np.asarray(rows, np.float32)


def test_follows_the_accumulator_on_steady_use_and_the_measure_when_use_moves():
    rng = np.random.default_rng(0)
    policy = P.adaptive(lag=0, decays=(1.0, 0.5), weighted=(False, False), horizon=4, forget=0.98)
    steady = _weights_after(_stream(rng, 300, 32, hot_for=None), policy)
    moving = _weights_after(_stream(rng, 300, 32, hot_for=24), policy)
    assert steady["weight_h2o"] > 0.9, steady
    assert moving["weight_ema0.5"] > 0.9, moving


def test_bad_parameters_are_named():
    with pytest.raises(ValueError, match="weighted must be a tuple of 2 bools"):
        P.adaptive(decays=(1.0, 0.9), weighted=(True,))
    with pytest.raises(ValueError, match=r"decays must be a number in \[0, 1\]"):
        P.adaptive(decays=(1.5,), weighted=(False,))
    with pytest.raises(ValueError, match=r"floor must be a number in \(0, 1\)"):
        P.adaptive(floor=0.0)
    with pytest.raises(ValueError, match="horizon must be an int >= 1"):
        P.adaptive(horizon=0)
    with pytest.raises(ValueError, match="judge must be one of"):
        P.adaptive(judge="rank")
