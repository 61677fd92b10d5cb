"""The learned importance estimator: online learning, fallbacks, checkpoints, compiles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flsmem
from flsmem import estimator as E
from flsmem import policies as P
from flsmem import testing

STEPS = 96


def _interest(key, batch, kv_heads, steps):
    """Each item's fixed log-interest: every query attends to item p with weight
    proportional to exp(interest[p]), so a slot's future use is a function of its past
    attention (the features)."""
    return 2.0 * jax.random.normal(key, (batch, kv_heads, steps))


def _stream(policy, budget, steps=STEPS, batch=2, kv_heads=2, weights=None, seed=0):
    """Runs ``steps`` write+update steps of one jitted step function; returns the final
    state, the estimator loss after every step and the step function."""
    config = flsmem.MemoryConfig(policy=policy, budget=budget, evict_every=4)
    state = testing.tiny_memory(config, batch=batch, kv_heads=kv_heads)
    interest = _interest(jax.random.key(seed), batch, kv_heads, steps)

    @jax.jit
    def step(state, t, correctness):
        key = jax.random.fold_in(jax.random.key(seed + 1), t)
        kv = jax.random.normal(key, (batch, kv_heads, 1, testing.HEAD_DIM))
        state = flsmem.write(state, {"k": kv, "v": kv}, jnp.full((batch, 1), t, jnp.int32))
        logits = jnp.take_along_axis(interest, jnp.clip(state.position, 0, steps - 1), axis=-1)
        attention = jax.nn.softmax(jnp.where(flsmem.visible(state), logits, -jnp.inf), axis=-1)
        return flsmem.update(state, attention, correctness)

    losses = []
    for t in range(steps):
        state = step(state, jnp.int32(t), jnp.full((batch,), 1.0 if weights is None else weights[t]))
        losses.append(float(flsmem.summary(state).get("estimator_loss", [np.nan])[0]))
    return state, np.asarray(losses), step


def test_online_updates_reduce_prediction_error():
    # No eviction (the budget holds the stream): every slot gets its labels.
    policy = E.learned(horizon=4, learning_rate=1e-2)
    state, losses, _ = _stream(policy, budget=STEPS)
    summary = flsmem.summary(state)
    updates = int(summary["estimator_updates"][0])
    assert updates == STEPS // 4 - 1  # the first snapshot has nothing to label yet
    assert int(summary["estimator_skipped"][0]) == 0
    first = losses[np.isfinite(losses)][0]
    assert losses[-1] < 0.25 * first, (first, losses[-1])


def test_offline_weights_do_not_move_and_predict_as_trained():
    trained, _, _ = _stream(E.learned(horizon=4, learning_rate=1e-2), budget=STEPS)
    weights = E.Weights(E.carry_over(trained.aux, layers_axis=False)["params"])
    frozen, losses, _ = _stream(E.learned(weights, online=False), budget=STEPS)
    assert np.all(np.isnan(losses))  # no updates, no loss
    for a, b in zip(jax.tree.leaves(frozen.aux["params"]), jax.tree.leaves(weights.params)):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_learning_loop_compiles_once():
    _, _, step = _stream(E.learned(horizon=4), budget=16)
    assert step._cache_size() == 1


def _nan_weights():
    params = jax.tree.map(np.asarray, E.init_params(8))
    params["outer"]["bias"] = np.full_like(params["outer"]["bias"], np.nan)
    return E.Weights(params)


def test_nonfinite_score_falls_back_to_rmm_and_is_counted():
    budget = 12
    learned, _, _ = _stream(E.learned(_nan_weights(), online=False), budget=budget)
    rmm, _, _ = _stream(P.rmm(lag=0), budget=budget)
    assert testing.kept_positions(learned) == testing.kept_positions(rmm)
    # Every present slot of every smooth was scored NaN: one per item and step it was held.
    fallbacks = np.asarray(learned.stats.fallbacks)
    assert np.all(fallbacks > STEPS)
    assert np.all(np.asarray(rmm.stats.fallbacks) == 0)


def test_nonfinite_update_is_skipped_and_counted():
    state, losses, _ = _stream(E.learned(_nan_weights(), online=True, horizon=4), budget=STEPS)
    summary = flsmem.summary(state)
    assert int(summary["estimator_updates"][0]) == 0
    assert int(summary["estimator_skipped"][0]) == STEPS // 4 - 1
    assert np.all(np.isnan(np.asarray(state.aux["params"]["outer"]["bias"])))


def test_checkpoint_round_trips_bit_exactly(tmp_path):
    params = E.init_params(16, seed=3)
    E.save(tmp_path / "estimator", params, {"horizon": 8})
    weights = E.load(tmp_path / "estimator")
    assert E.load_settings(tmp_path / "estimator") == {"horizon": 8}
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(weights.params)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), b)
    assert weights == E.Weights(params)
    assert E.learned(weights) == E.learned(E.Weights(params))


def test_corrupt_checkpoint_is_a_clear_error(tmp_path):
    E.save(tmp_path / "estimator", E.init_params(8))
    for path in (tmp_path / "estimator").rglob("*"):
        if path.is_file():
            path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    with pytest.raises(ValueError, match="could not be read"):
        E.load(tmp_path / "estimator")
    with pytest.raises(ValueError, match="no params directory"):
        E.load(tmp_path / "missing")


def test_carry_over_averages_layers():
    policy = E.learned(horizon=4)
    one = policy.init_aux(policy, 2, 3, 10)
    stacked = jax.tree.map(lambda x: jnp.stack([x, x + 2]), one)
    carried = E.carry_over(stacked)
    np.testing.assert_allclose(carried["params"]["inner"]["bias"], one["params"]["inner"]["bias"] + 1)
    assert set(carried) == {"params", "opt", "loss", "labels", "updates", "skipped"}


def test_weights_hash_by_content():
    a = E.Weights(E.init_params(8, seed=0))
    assert a == E.Weights(E.init_params(8, seed=0)) and hash(a) == hash(E.Weights(E.init_params(8, seed=0)))
    assert a != E.Weights(E.init_params(8, seed=1))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"horizon": 0}, "horizon"),
        ({"learning_rate": 0.0}, "learning_rate"),
        ({"label": "mean"}, "label"),
        ({"hidden": 0}, "hidden"),
        ({"weights": {"inner": 1}}, "weights"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        E.learned(**kwargs)


def test_weights_of_the_wrong_shape():
    params = jax.tree.map(np.asarray, E.init_params(8))
    params["middle"]["kernel"] = np.zeros((8, 9), np.float32)
    with pytest.raises(ValueError, match="must fit"):
        E.learned(E.Weights(params))


@pytest.mark.parametrize("prior, heuristic", [("h2o", P.h2o()), ("rmm", P.rmm(lag=0))])
def test_a_fresh_network_with_a_prior_ranks_as_the_heuristic(prior, heuristic):
    learned, _, _ = _stream(E.learned(prior=prior, online=False), budget=12)
    reference, _, _ = _stream(heuristic, budget=12)
    assert testing.kept_positions(learned) == testing.kept_positions(reference)


def test_the_harness_variants_share_the_shipped_settings():
    from harness.evaluate import ESTIMATOR_DIR, make_policy

    shipped = E.load(ESTIMATOR_DIR)
    settings = E.load_settings(ESTIMATOR_DIR)
    variants = {name: make_policy(name, 64) for name in ("learned", "learned_offline", "learned_scratch")}
    for policy in variants.values():
        assert policy.recent == 32 and policy.lag == 0  # h2o's window, no commit lag
        assert policy.p["horizon"] == settings["horizon"] and policy.p["prior"] == settings["prior"]
    assert variants["learned"].p["weights"] == shipped and variants["learned"].p["online"]
    assert variants["learned_offline"].p["weights"] == shipped and not variants["learned_offline"].p["online"]
    assert variants["learned_scratch"].p["weights"] is None and variants["learned_scratch"].p["online"]
