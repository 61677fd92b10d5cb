"""The learned importance estimator: online learning, fallbacks, checkpoints, compiles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flsmem
from flsmem import estimator as E
from flsmem import policies as P
from flsmem import testing
from flsmem.oracle_future import discounted_future

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
    # The network scores only when an eviction is due (score_when_due), and then every
    # present slot was NaN: budget + evict_every per head, at steps that each evict
    # evict_every items per head.
    fallbacks = np.asarray(learned.stats.fallbacks)
    due_steps = np.asarray(learned.stats.evictions) // (2 * 4)  # kv_heads * evict_every
    assert np.all(due_steps > 0)
    np.testing.assert_array_equal(fallbacks, due_steps * 2 * (budget + 4))
    assert np.all(np.asarray(rmm.stats.fallbacks) == 0)


def test_scoring_only_when_evicting_keeps_what_scoring_every_query_keeps():
    # The network runs only at the steps an eviction is due; every query's scores gave
    # the same kept sets and the same learning, at 4x the scoring.
    policy = E.learned(horizon=8, learning_rate=1e-2)
    assert policy.score_when_due
    lazy, lazy_losses, _ = _stream(policy, budget=12)
    eager, eager_losses, _ = _stream(policy.replace(score_when_due=False), budget=12)
    assert testing.kept_positions(lazy) == testing.kept_positions(eager)
    np.testing.assert_array_equal(lazy_losses, eager_losses)
    assert int(lazy.stats.evictions.sum()) > 0
    # The committed scores are those of the last eviction (STEPS is a multiple of 4, so
    # the last step evicted): the same as scoring at every query.
    np.testing.assert_array_equal(np.asarray(lazy.score), np.asarray(eager.score))


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
    # A checkpoint to ship carries no trace of the writer's paths (orbax's commit markers).
    assert not list((tmp_path / "estimator").rglob("commit_success.txt"))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(weights.params)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), b)
    assert weights == E.Weights(params)
    assert E.learned(weights) == E.learned(E.Weights(params))


def test_optimizer_state_round_trips_and_its_absence_is_a_clear_error(tmp_path):
    policy = E.learned(E.Weights(E.init_params(16, seed=3)), online=True, horizon=4)
    state, _, _ = _stream(policy, budget=12)
    learned = E.carry_over(state.aux, layers_axis=False)
    assert int(learned["updates"]) > 0  # moments and a step count that a fresh start lacks
    E.save(tmp_path / "with", learned["params"], {"horizon": 4}, optimizer_state=learned["opt"])
    restored = E.load_optimizer(tmp_path / "with", E.from_checkpoint(tmp_path / "with"))
    assert jax.tree.structure(restored) == jax.tree.structure(learned["opt"])
    for a, b in zip(jax.tree.leaves(learned["opt"]), jax.tree.leaves(restored)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    E.save(tmp_path / "without", learned["params"], {"horizon": 4})
    with pytest.raises(ValueError, match="holds no optimizer state"):
        E.load_optimizer(tmp_path / "without", policy)


def test_corrupt_checkpoint_is_a_clear_error(tmp_path):
    E.save(tmp_path / "estimator", E.init_params(8))
    for path in (tmp_path / "estimator").rglob("*"):
        if path.is_file():
            path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    with pytest.raises(ValueError, match="could not be read"):
        E.load(tmp_path / "estimator")
    with pytest.raises(ValueError, match="no params directory"):
        E.load(tmp_path / "missing")


def test_checkpoint_of_another_feature_set_is_a_clear_error(tmp_path):
    # A network trained when flsmem computed fewer features cannot score today's.
    params = jax.tree.map(np.asarray, E.init_params(8))
    params["inner"]["kernel"] = params["inner"]["kernel"][:15]
    params["linear"]["kernel"] = params["linear"]["kernel"][:15]
    E.save(tmp_path / "estimator", params)
    with pytest.raises(ValueError, match=f"reads 15 features, this flsmem computes {len(E.FEATURES)}"):
        E.load(tmp_path / "estimator")


def test_carry_over_averages_layers():
    policy = E.learned(horizon=4)
    one = policy.init_aux(policy, 2, 3, 10)
    stacked = jax.tree.map(lambda x: jnp.stack([x, x + 2]), one)
    carried = E.carry_over(stacked)
    np.testing.assert_allclose(carried["params"]["inner"]["bias"], one["params"]["inner"]["bias"] + 1)
    assert set(carried) == {"params", "opt", "loss", "labels", "updates", "skipped"}


def test_learned_params_are_typed_and_checked_when_changed():
    policy = E.learned(horizon=8, snapshots=2)
    assert isinstance(policy.params, E.LearnedParams) and policy.params.horizon == 8
    assert policy.with_params(horizon=16).params.horizon == 16
    with pytest.raises(ValueError, match=r"unknown parameter 'horizn' of LearnedParams; its parameters are "
                                         r"\('weights', 'online', 'learning_rate', 'horizon'"):
        policy.with_params(horizn=16)
    with pytest.raises(ValueError, match="snapshots must divide horizon"):
        policy.with_params(snapshots=3)
    with pytest.raises(ValueError, match="behaviour must be a policy that evicts"):
        E.guided(policy, P.oracle()).with_params(behaviour=P.full())


def test_weights_hash_by_content():
    a = E.Weights(E.init_params(8, seed=0))
    assert a == E.Weights(E.init_params(8, seed=0)) and hash(a) == hash(E.Weights(E.init_params(8, seed=0)))
    assert a != E.Weights(E.init_params(8, seed=1))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"horizon": 0}, "horizon"),
        ({"snapshots": 0}, "snapshots"),
        ({"snapshots": 2.0}, "snapshots"),
        ({"snapshots": True}, "snapshots"),
        ({"horizon": 8, "snapshots": 3}, "snapshots must divide horizon"),
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


def _far_reads(recent):
    """H2O that counts only the reads after an item's first 16 queries (the "far" prior)."""

    def fold(policy, view, obs, aux):
        e = view.evidence[0]
        return (jnp.where(view.present, e + jnp.where(view.age > 16, obs.attention, 0.0), e),), aux

    return P.Policy(name="far_reads", score=lambda policy, view, aux: view.evidence[0], fold=fold, recent=recent)


@pytest.mark.parametrize("prior, heuristic, budget, recent", [
    ("h2o", P.h2o(), 12, 0), ("rmm", P.rmm(lag=0), 12, 0),
    # Items must outlive 16 queries to show far reads: a recent window keeps them that long.
    ("far", _far_reads(recent=20), 32, 20),
])
def test_a_fresh_network_with_a_prior_ranks_as_the_heuristic(prior, heuristic, budget, recent):
    learned, _, _ = _stream(E.learned(prior=prior, online=False, recent=recent), budget=budget)
    reference, _, _ = _stream(heuristic, budget=budget)
    kept = testing.kept_positions(learned)
    assert kept == testing.kept_positions(reference)
    if prior == "far":  # the far reads decided: the oldest kept items outlived the window
        assert min(min(row) for rows in kept for row in rows) < STEPS - recent - 4


def test_head_features_by_hand():
    # Two heads over 4 queries, 2 of them predicted right. Head 0 put 4.0 of attention on
    # far items in all, 3.0 of it in the right queries; head 1: 2.0, 0.5 of it right.
    head = {"head_far": jnp.array([[4.0, 2.0]]), "head_far_right": jnp.array([[3.0, 0.5]]),
            "head_right": jnp.array([2.0]), "head_queries": jnp.array([4.0])}
    shape = (1, 2, 3)
    x = E.features((jnp.zeros(shape),) * E.learned().num_evidence, jnp.ones(shape, jnp.int32), jnp.array([3]),
                   jnp.ones(shape, jnp.int32), head)
    mass = np.asarray(x[..., E.FEATURES.index("log_head_far_mass")])
    retrieval = np.asarray(x[..., E.FEATURES.index("head_retrieval")])
    # Mean far mass per query: 1.0 and 0.5; per right query 1.5 and 0.25, per wrong 0.5 and 0.75.
    np.testing.assert_allclose(mass, np.log(1e-3 + np.array([1.0, 0.5]))[None, :, None].repeat(3, -1), rtol=1e-6, atol=1e-6)
    expected = np.log((1e-3 + np.array([1.5, 0.25])) / (1e-3 + np.array([0.5, 0.75])))
    np.testing.assert_allclose(retrieval, expected[None, :, None].repeat(3, -1), rtol=1e-6, atol=1e-6)


def test_head_state_sums_far_attention():
    # Every query attends to every item by the same fixed interest, so the far mass of a
    # query is the attention on items older than 16 queries; weights alternate 1 and 0.
    weights = np.tile([1.0, 0.0], STEPS // 2)
    state, _, _ = _stream(E.learned(online=False), budget=STEPS, weights=weights)
    aux = state.aux
    np.testing.assert_array_equal(np.asarray(aux["head_queries"]), [STEPS, STEPS])
    np.testing.assert_array_equal(np.asarray(aux["head_right"]), [STEPS // 2, STEPS // 2])
    # Recompute the far mass of every query from the stream's attention.
    interest = np.asarray(_interest(jax.random.key(0), 2, 2, STEPS))
    far, far_right = np.zeros((2, 2)), np.zeros((2, 2))
    for t in range(STEPS):
        logits = interest[..., :t + 1]
        attention = np.exp(logits - logits.max(-1, keepdims=True))
        attention /= attention.sum(-1, keepdims=True)
        mass = attention[..., :max(t - 15, 0)].sum(-1)  # items p with age t - p + 1 > 16
        far += mass
        far_right += weights[t] * mass
    np.testing.assert_allclose(np.asarray(aux["head_far"]), far, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(aux["head_far_right"]), far_right, rtol=1e-4)


def test_the_harness_variants_share_the_shipped_settings():
    from flsmem.harness.evaluate import ESTIMATOR_DIR, make_policy

    shipped = E.load(ESTIMATOR_DIR)
    settings = E.load_settings(ESTIMATOR_DIR)
    variants = {name: make_policy(name, 64) for name in ("learned", "learned_offline", "learned_scratch")}
    for policy in variants.values():
        assert policy.recent == 32 and policy.lag == 0  # h2o's window, no commit lag
        assert policy.params.horizon == settings["horizon"] and policy.params.prior == settings["prior"]
        assert policy.params.snapshots == settings.get("snapshots", 1)
    assert variants["learned"].params.weights == shipped and variants["learned"].params.online
    assert variants["learned_offline"].params.weights == shipped and not variants["learned_offline"].params.online
    assert variants["learned_scratch"].params.weights is None and variants["learned_scratch"].params.online


def test_smollm2_has_its_own_shipped_estimator():
    """The checkpoint ``flsmem eval --model smollm2-135m`` uses was pretrained on SmolLM2's
    traces alone, with the general one's settings otherwise, and the learned variants
    load it."""
    from flsmem.harness.evaluate import ESTIMATOR_DIR, estimator_for, make_policy

    own = estimator_for("smollm2-135m")
    assert own != ESTIMATOR_DIR and estimator_for("tiny") == ESTIMATOR_DIR
    settings, general = E.load_settings(own), E.load_settings(ESTIMATOR_DIR)
    assert settings["sources"] == ["smollm2"]
    assert {k: settings[k] for k in general if k not in ("sources", "seed")} == \
        {k: v for k, v in general.items() if k not in ("sources", "seed")}
    policy = make_policy("learned", 64, estimator=str(own))
    assert policy.params.weights == E.load(own) and policy.params.weights != E.load(ESTIMATOR_DIR)


# ------------------------------------------------------ several snapshots in flight

HAND = 10  # queries of the hand-made stream


def _hand_table():
    """``[T, T]``: what query t gives position p (causal; position 0 draws 90% of query
    2, so the label of the snapshot that saw query 2 is known)."""
    table = np.tril(np.random.default_rng(0).uniform(0.1, 1.0, (HAND, HAND)))
    table[2] = [0.9, 0.05, 0.05] + [0.0] * (HAND - 3)
    return table / table.sum(axis=1, keepdims=True)


def _hand_stream(policy, drop=None):
    """One row, one head, room for everything: item t is written at step t, then query t
    attends by the table with correctness 1; item ``drop`` is dropped (as an eviction
    would) before step 7. Returns the table, the state after every step and the items
    each query saw."""
    table = _hand_table()
    config = flsmem.MemoryConfig(policy=policy, budget=HAND, evict_every=HAND)
    state = testing.tiny_memory(config, batch=1, kv_heads=1)

    @jax.jit
    def step(state, t):
        kv = jnp.ones((1, 1, 1, testing.HEAD_DIM)) * (1.0 + t)
        state = flsmem.write(state, {"k": kv, "v": kv}, jnp.full((1, 1), t, jnp.int32))
        attention = testing.gather_attention(jnp.asarray(table)[None, None], state)[:, :, 0]
        return flsmem.observe(state, attention, jnp.ones((1,)))

    states, seen = [], []
    for t in range(HAND):
        if t == 7 and drop is not None:
            state = state.replace(valid=state.valid.at[0, 0, drop].set(False))
        state = step(state, jnp.int32(t))
        states.append(state)
        seen.append(int(jnp.sum(state.valid)))
    assert step._cache_size() == 1
    assert list(states[6].position[0, 0, :7]) == list(range(7))  # item p sits in slot p until the drop
    return table, states, np.asarray(seen)


def _peak(table, seen, first, last, items):
    """The label rule by hand: log(1 + the largest attention relative to uniform that
    each item gets from queries first..last), query t seeing seen[t] items."""
    relative = table[first:last + 1][:, items] * seen[first:last + 1, None]
    return np.log1p(relative.max(axis=0))


def _errors(aux_before, snapshot, slots, labels):
    """The squared errors of the step's predictions for these slots of the snapshot."""
    prediction = E.predict(aux_before["params"], aux_before["snap_features"][0, snapshot, 0, slots])
    return (np.asarray(prediction) - labels) ** 2


def test_snapshots_in_flight_are_labelled_a_horizon_after_they_were_taken():
    # Horizon 4 with 2 in flight: a snapshot every 2 queries (after queries 2, 4, 6, 8 =
    # steps 1, 3, 5, 7), snapshot (step + 1) // 2 % 2 due, each labelled 4 queries later.
    table, states, seen = _hand_stream(E.learned(horizon=4, snapshots=2, learning_rate=1e-2))
    aux = [jax.tree.map(np.asarray, s.aux) for s in states]
    assert aux[0]["snap_birth"].shape == (1, 2) + states[0].valid.shape[1:]  # [B, M, K, S]
    births = lambda t, m: list(aux[t]["snap_birth"][0, m, 0, :HAND])  # noqa: E731
    # Step 1 takes snapshot 1 (items 0, 1); step 3 snapshot 0 (items 0..3); nothing to label.
    assert births(1, 1) == [0, 1] + [-1] * (HAND - 2) and births(1, 0) == [-1] * HAND
    assert births(3, 0) == [0, 1, 2, 3] + [-1] * (HAND - 4)
    assert int(aux[4]["labels"]) == 0 and int(aux[4]["updates"]) == 0
    # Both gather every query: snapshot 1 saw queries 2..4 (with item 0's peak at 2), 0 saw 4.
    np.testing.assert_allclose(np.log1p(aux[4]["gathered"][0, 1, 0, :2]), _peak(table, seen, 2, 4, [0, 1]), rtol=1e-6)
    np.testing.assert_allclose(np.log1p(aux[4]["gathered"][0, 0, 0, :4]), _peak(table, seen, 4, 4, [0, 1, 2, 3]),
                               rtol=1e-6)
    assert aux[4]["gathered"][0, 1, 0, 0] == pytest.approx(0.9 * 3)
    # Step 5 labels snapshot 1 (items 0, 1 over queries 2..5) and takes it again.
    assert int(aux[5]["labels"]) == 2 and int(aux[5]["updates"]) == 1
    errors = _errors(aux[4], 1, [0, 1], _peak(table, seen, 2, 5, [0, 1]))
    assert float(aux[5]["loss"]) == pytest.approx(errors.mean(), rel=1e-5)
    assert births(5, 1) == list(range(6)) + [-1] * (HAND - 6) and births(5, 0) == births(3, 0)
    # Step 7 labels snapshot 0 (items 0..3 over queries 4..7).
    assert int(aux[7]["labels"]) == 2 + 4 and int(aux[7]["updates"]) == 2
    errors = _errors(aux[6], 0, [0, 1, 2, 3], _peak(table, seen, 4, 7, [0, 1, 2, 3]))
    assert float(aux[7]["loss"]) == pytest.approx(errors.mean(), rel=1e-5)


def test_flush_labels_the_snapshots_in_flight_with_the_rest_of_the_stream():
    policy = E.learned(horizon=4, snapshots=2, learning_rate=1e-2)
    table, states, seen = _hand_stream(policy, drop=1)
    # Item 1 is gone before step 7: snapshot 0 (from step 3) labels items 0, 2, 3 only.
    assert int(states[7].aux["labels"]) == 2 + 3
    held = {int(p): s for s, p in enumerate(states[7].position[0, 0]) if states[7].valid[0, 0, s]}
    assert 1 not in held and 7 in held
    # Three memories as the layers of one model: after step 8 (snapshot 1 from step 5
    # holds items 0, 2..5 and has seen queries 6..8; snapshot 0 from step 7 holds 0, 2..7
    # and has seen query 8), after step 7 (snapshot 0 was just taken: it has seen nothing
    # and is left out) and a fresh one (nothing in flight).
    fresh = policy.init_aux(policy, 1, 1, states[0].valid.shape[-1])
    layers = [states[8].aux, states[7].aux, fresh]
    flushed = jax.tree.map(np.asarray, E.flush(policy, jax.tree.map(lambda *x: jnp.stack(x), *layers)))
    before = [jax.tree.map(np.asarray, aux) for aux in layers]
    np.testing.assert_array_equal(flushed["labels"], [5 + 5 + 7, 5 + 5, 0])
    np.testing.assert_array_equal(flushed["updates"], [2 + 1, 2 + 1, 0])
    assert np.all(flushed["snap_birth"] == -1) and np.all(flushed["gathered"] == 0)
    # One step on the labels pooled: the squared error is their mean.
    one = [0, 2, 3, 4, 5]
    zero = [0, 2, 3, 4, 5, 6, 7]
    errors = np.concatenate([_errors(before[0], 1, [held[p] for p in one], _peak(table, seen, 6, 8, one)),
                             _errors(before[0], 0, [held[p] for p in zero], _peak(table, seen, 8, 8, zero))])
    assert flushed["loss"][0] == pytest.approx(errors.mean(), rel=1e-5)
    errors = _errors(before[1], 1, [held[p] for p in one], _peak(table, seen, 6, 7, one))
    assert flushed["loss"][1] == pytest.approx(errors.mean(), rel=1e-5)
    assert np.isnan(flushed["loss"][2])
    for a, b in zip(jax.tree.leaves(flushed["params"]), jax.tree.leaves(before[2]["params"])):
        np.testing.assert_array_equal(a[2], b)  # no step where nothing was in flight


def test_flush_rejects_state_it_cannot_label():
    policy = E.learned(horizon=4, snapshots=2)
    one_layer = policy.init_aux(policy, 1, 1, 8)
    with pytest.raises(ValueError, match="policy must be the learned policy"):
        E.flush(P.h2o(), one_layer)
    with pytest.raises(ValueError, match="missing"):
        E.flush(policy, {"params": one_layer["params"]}, layers_axis=False)
    with pytest.raises(ValueError, match="snap_features.*snapshots=2 and layers_axis=True"):
        E.flush(policy, one_layer)  # no layer axis
    single = E.learned(horizon=4)
    with pytest.raises(ValueError, match="snapshots=1"):
        E.flush(single, one_layer, layers_axis=False)  # made with two snapshots in flight


def test_snapshots_split_with_the_rows_when_sharded():
    from flsmem import sharding

    config = flsmem.MemoryConfig(E.learned(horizon=4, snapshots=2, hidden=8), budget=6, evict_every=2)
    state = flsmem.init(config, 3, 2, {"k": (testing.HEAD_DIM,)})
    specs = sharding.partition_specs(state).aux
    assert specs["snap_features"] == jax.sharding.PartitionSpec("batch", None, "heads", None, None)
    assert specs["snap_queries"] == jax.sharding.PartitionSpec("batch", None)


def test_stacked_layers_fold_into_rows_and_each_keeps_its_own_network():
    """update_layers runs the layers' memories as rows of one memory, each layer's
    network learning from its own rows only: every layer ends as the same stream run
    through a memory of its own, with flsmem.update, would (kept items, scores, and
    each network's parameters and counters)."""
    depth, batch, heads, steps = 2, 2, 2, 20
    policy = E.learned(horizon=4, snapshots=2, hidden=8, prior="h2o", learning_rate=1e-2)
    config = flsmem.MemoryConfig(policy, budget=6, evict_every=2)
    key = jax.random.key(3)
    items = jax.random.normal(key, (depth, batch, heads, steps, testing.HEAD_DIM))
    interest = jax.random.normal(jax.random.fold_in(key, 1), (depth, batch, heads, steps)) * 3
    correctness = jax.random.uniform(jax.random.fold_in(key, 2), (batch, steps))

    def write(memory, layer, t):
        item = jax.lax.dynamic_slice_in_dim(items[layer], t, 1, axis=2)
        return flsmem.write(memory, {"k": item, "v": item}, jnp.full((batch, 1), t, jnp.int32))

    def attention(memory, layer):
        logits = jnp.take_along_axis(interest[layer], jnp.maximum(memory.position, 0), axis=-1)
        return jax.nn.softmax(jnp.where(memory.valid, logits, -jnp.inf), axis=-1)

    @jax.jit
    def stacked_step(stacked, t):
        stacked = jax.vmap(write, in_axes=(0, 0, None))(stacked, jnp.arange(depth), t)
        return flsmem.update_layers(stacked, jax.vmap(attention)(stacked, jnp.arange(depth)), correctness[:, t])

    @jax.jit
    def own_step(memory, layer, t):
        memory = write(memory, layer, t)
        return flsmem.update(memory, attention(memory, layer), correctness[:, t])

    stacked = flsmem.init_kv(config, batch, heads, testing.HEAD_DIM, layers=depth)
    assert flsmem.layers._state_folds(stacked)
    own = [flsmem.init_kv(config, batch, heads, testing.HEAD_DIM) for _ in range(depth)]
    for t in range(steps):
        stacked = stacked_step(stacked, t)
        own = [own_step(memory, layer, t) for layer, memory in enumerate(own)]
    assert int(flsmem.summary(own[0])["evictions"].sum()) > 0
    for layer, memory in enumerate(own):
        folded = jax.tree.map(lambda x: x[layer], stacked)
        held = lambda m: np.sort(np.where(m.valid, m.position, -1), axis=-1)  # noqa: E731
        np.testing.assert_array_equal(held(folded), held(memory))
        np.testing.assert_allclose(np.where(folded.valid, folded.score, 0), np.where(memory.valid, memory.score, 0),
                                   rtol=1e-5, atol=1e-5)
        assert int(folded.aux["updates"]) == int(memory.aux["updates"]) > 0
        # The folded update sums a layer's gradient in another order (a product batched
        # over the layers), and Adam divides each step by the root of its second
        # moment, so float32 rounding reaches a few 1e-5 in the parameters after ten
        # steps, more on some CPUs than on others. The two layers'
        # networks differ by about 7e-2 (checked below): a network shared between
        # them, or one layer learning from the other's rows, would not pass.
        for a, b in zip(jax.tree.leaves(folded.aux["params"]), jax.tree.leaves(memory.aux["params"])):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    # The layers saw different streams: their networks learnt different things.
    between = np.abs(stacked.aux["params"]["inner"]["kernel"][0] - stacked.aux["params"]["inner"]["kernel"][1])
    assert between.max() > 100 * 1e-4


def test_from_checkpoint_reads_snapshots_and_defaults_to_one(tmp_path):
    E.save(tmp_path / "many", E.init_params(8), {"horizon": 8, "snapshots": 4})
    E.save(tmp_path / "one", E.init_params(8), {"horizon": 8})
    assert E.from_checkpoint(tmp_path / "many").params.snapshots == 4
    assert E.from_checkpoint(tmp_path / "one").params.snapshots == 1


def _table_stream(policy, budget, steps=48, batch=2, kv_heads=2):
    """``steps`` write+update steps where every query attends by fixed item interests,
    with the future attention the oracle reads; returns the final state."""
    logits = _interest(jax.random.key(5), batch, kv_heads, steps)[:, :, None, :]
    causal = jnp.arange(steps)[None, :] <= jnp.arange(steps)[:, None]
    table = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1)  # [B, K, T, T]
    future = discounted_future(table)
    config = flsmem.MemoryConfig(policy=policy, budget=budget, evict_every=4)
    state = testing.tiny_memory(config, batch=batch, kv_heads=kv_heads)

    @jax.jit
    def step(state, t):
        kv = jnp.zeros((batch, kv_heads, 1, testing.HEAD_DIM))
        state = flsmem.write(state, {"k": kv, "v": kv}, jnp.full((batch, 1), t, jnp.int32))
        at = testing.gather_attention(table, state)[:, :, 0]
        return flsmem.update(state, at, future=testing.gather_attention(future, state)[:, :, 0])

    for t in range(steps):
        state = step(state, jnp.int32(t))
    return state


def test_guided_keeps_what_the_behaviour_keeps_and_learns_as_alone():
    learner = E.learned(horizon=8, learning_rate=1e-2)
    guided = E.guided(learner, P.oracle())
    assert guided == E.guided(E.learned(horizon=8, learning_rate=1e-2), P.oracle())  # one compile per setting
    # At a small budget the oracle decides what stays; the learner still labels and learns.
    behind, oracle = _table_stream(guided, budget=12), _table_stream(P.oracle(), budget=12)
    assert testing.kept_positions(behind) == testing.kept_positions(oracle)
    assert int(behind.aux["labels"]) > 0 and int(behind.aux["updates"]) > 0
    # With nothing evicted the learner's evidence and learning are its own, bit for bit.
    alone, behind = _table_stream(learner, budget=48), _table_stream(guided, budget=48)
    assert len(behind.evidence) == learner.num_evidence + 1  # the oracle's one
    for a, b in zip(alone.evidence, behind.evidence):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
    for a, b in zip(jax.tree.leaves(alone.aux), jax.tree.leaves(behind.aux)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_guided_arguments_are_checked():
    with pytest.raises(ValueError, match="learner must be the learned policy"):
        E.guided(P.h2o(), P.oracle())
    with pytest.raises(ValueError, match="behaviour must be a policy that evicts and keeps no state"):
        E.guided(E.learned(), P.kalman(adaptive=True))
    with pytest.raises(ValueError, match="behaviour must be a policy that evicts"):
        E.guided(E.learned(), P.full())
