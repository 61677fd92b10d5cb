"""Hand-computed cases: a few steps of attention worked out on paper, kept sets asserted.

Every case streams one item per step through one row (batch 1, one KV head). Query t
gives ``TABLE[t][p]`` to the item at position p (rows need not sum to one: only the
values matter to the rules). The arithmetic behind each expectation is in the comments.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flsmem
from flsmem import policies as P
from flsmem import testing
from flsmem.oracle_future import discounted_future

# One compile per config instead of op-by-op dispatch.
write = jax.jit(flsmem.write)
update = jax.jit(flsmem.update)

TABLE = [
    [1.0, 0.0, 0.0, 0.0],
    [0.6, 0.4, 0.0, 0.0],
    [0.5, 0.2, 0.3, 0.0],
    [0.1, 0.15, 0.3, 0.45],
]


def run(policy, budget=2, table=TABLE, correctness=None, keys=None, evict_every=1):
    """Kept position sets after steps 2 and 3 (the steps where eviction happens)."""
    config = flsmem.MemoryConfig(policy=policy, budget=budget, evict_every=evict_every)
    state = testing.tiny_memory(config, batch=1, kv_heads=1)
    tab = jnp.asarray(table, jnp.float32)[None, None]
    kept = []
    for t in range(len(table)):
        key = jnp.zeros((1, 1, testing.HEAD_DIM)) if keys is None else jnp.asarray(keys[t])
        state = write(state, {"k": key, "v": key}, jnp.array([t]))
        w = None if correctness is None else jnp.array([correctness[t]], jnp.float32)
        state = update(state, testing.gather_attention(tab, state)[:, :, 0], w)
        kept.append(testing.kept_positions(state)[0][0])
    return kept[2:], state


@pytest.mark.parametrize(
    "policy, expected",
    [
        # Keep the newest two.
        (P.window(), [{1, 2}, {2, 3}]),
        # Position 0 is a sink; the newest fills the rest.
        (P.streaming_llm(sinks=1), [{0, 2}, {0, 3}]),
        # Sums at step 2: p0 1+.6+.5=2.1, p1 .4+.2=.6, p2 .3 -> drop p2.
        # Step 3 (p0, p1, p3 present): p0 2.2, p1 .75, p3 .45 -> drop p3.
        (P.h2o(), [{0, 1}, {0, 1}]),
        # The newest item is protected: step 2 keeps p2 and p0 (2.1 > .6);
        # step 3 keeps p3 and p0 (2.2 > p2's .6).
        (P.h2o(recent=1), [{0, 2}, {0, 3}]),
        # Current attention only: step 2 .5/.2/.3 -> drop p1; step 3 .1/.3/.45 -> drop p0.
        (P.tova(), [{0, 2}, {2, 3}]),
        # e <- .5 e + a. Step 2: p0 1.05, p1 .4, p2 .3 -> drop p2.
        # Step 3: p0 .625, p1 .35, p3 .45 -> drop p1.
        (P.ema(0.5), [{0, 1}, {0, 3}]),
        # Average attention is 1/n. Unimportant steps over the last two queries:
        # step 2 (n=3): p0 0, p1 2 (.4 < 1/2, .2 < 1/3), p2 1 -> drop p1.
        # Step 3 (n=3): p0 1 (.1), p2 2 (.3 and .3 < 1/3), p3 0 -> drop p2.
        (P.scissorhands(history=2), [{0, 2}, {0, 3}]),
        # Age-normalised sums, score / (age + 1). Step 2: p0 2.1/4, p1 .6/3, p2 .3/2
        # -> drop p2. Step 3: p0 2.2/5 = .44, p1 .75/4 = .19, p3 .45/2 = .225 -> drop p1.
        (P.h2o().replace(normalise_by_age=True), [{0, 1}, {0, 3}]),
        # Preset (a), H=1, gamma=.5: add .5^(2-age) a while age <= 2, then freeze.
        # p0: .5*1 + .6 = 1.1 then frozen; p1: .5*.4 + .2 = .4; p2 protected at step 2.
        # Step 2 keeps p2 and p0 (1.1 > .4). Step 3: p2 .15 + .3 = .45 < p0 1.1; p3 protected.
        (P.lag_window(lag=1, gamma=0.5, decay_after=1.0, weighted=False), [{0, 2}, {0, 3}]),
        # Same, but committed scores shrink by .1 each query: p0 1.1 -> .11 at step 2,
        # below p1's .4 (p1 commits at step 2, then .04 at step 3, below p2's .45).
        (P.lag_window(lag=1, gamma=0.5, decay_after=0.1, weighted=False), [{1, 2}, {2, 3}]),
        # Preset (b), uses are a > .25, e <- .9 e + used. Step 2: p0 2.71, p1 .9, p2 1
        # -> drop p1. Step 3 (.1, .3, .45): p0 2.439, p2 1.9, p3 1 -> drop p3.
        (P.use_recency(lag=0, decay=0.9, use_threshold=0.25), [{0, 2}, {0, 2}]),
    ],
    ids=lambda x: x.name if isinstance(x, P.Policy) else None,
)
def test_kept_sets(policy, expected):
    kept, _ = run(policy)
    assert kept == expected


def test_rmm_weights_attention_by_correctness():
    # w = (1, 0, 1, 1): the query at step 1 was wrong and counts for nothing.
    # DU at step 2: p0 1 + .5 = 1.5, p1 .2, p2 .3 -> drop p1 (H2O would drop p2).
    # Step 3: p0 1.6, p2 .6, p3 .45 -> drop p3.
    w = [1.0, 0.0, 1.0, 1.0]
    assert run(P.rmm(lag=0), correctness=w)[0] == [{0, 2}, {0, 2}]
    # Lag 1 protects the newest: step 2 keeps p2 and p0; step 3 keeps p3 and p0 (1.6 > .6).
    assert run(P.rmm(lag=1), correctness=w)[0] == [{0, 2}, {0, 3}]


def test_surprise_keeps_what_the_model_did_not_predict():
    # w = (1, 0, 1, 1): query 1 missed item 2 (the first item counts as predicted), so
    # p2 scores 1 + A / (1 + A) and the others A / (1 + A).
    # Step 2: p0 2.1/3.1 = .68, p1 .6/1.6 = .375, p2 1 + .3/1.3 = 1.23 -> drop p1
    # (H2O drops p2). Step 3: p0 2.2/3.2 = .69, p2 1 + .6/1.6 = 1.375, p3 .45/1.45 = .31
    # -> drop p3.
    w = [1.0, 0.0, 1.0, 1.0]
    kept, state = run(P.surprise(), correctness=w)
    assert kept == [{0, 2}, {0, 2}]
    scores = {int(p): float(s) for p, s, v in zip(state.position[0, 0], state.score[0, 0], state.valid[0, 0]) if v}
    assert scores == pytest.approx({0: 2.2 / 3.2, 2: 1 + 0.6 / 1.6}, rel=1e-6)
    # Every prediction right: the ranking is H2O's.
    assert run(P.surprise(), correctness=[1.0] * 4)[0] == run(P.h2o())[0]


def test_surprise_reserve_bounds_what_surprise_keeps():
    # w = (1, 0, 0, 1): items 2 and 3 were missed. Surprise at step 2: p0 2.1/3.1 = .68,
    # p1 .6/1.6 = .375, p2 1 + .3/1.3 = 1.23; at step 3: p0 2.2/3.2 = .69,
    # p2 1 + .6/1.6 = 1.375, p3 1 + .45/1.45 = 1.31.
    w = [1.0, 0.0, 0.0, 1.0]
    # No reserve (and one of 2 or more): both misses outrank p0 at step 3.
    assert run(P.surprise(), correctness=w)[0] == [{0, 2}, {2, 3}]
    assert run(P.surprise(reserve=2), correctness=w)[0] == [{0, 2}, {2, 3}]
    # A reserve of 1 holds p2 (1 + 1.375); p3 falls back to .45/1.45 = .31 < p0's .69.
    kept, state = run(P.surprise(reserve=1), correctness=w)
    assert kept == [{0, 2}, {0, 2}]
    scores = {int(p): float(s) for p, s, v in zip(state.position[0, 0], state.score[0, 0], state.valid[0, 0]) if v}
    assert scores == pytest.approx({0: 2.2 / 3.2, 2: 2 + 0.6 / 1.6}, rel=1e-6)
    # A reserve of 0 is H2O.
    assert run(P.surprise(reserve=0), correctness=w)[0] == run(P.h2o())[0]
    with pytest.raises(ValueError, match="reserve must be None or an int >= 0"):
        P.surprise(reserve=-1)


def test_kalman_running_mean_and_gain():
    table = [row[:] for row in TABLE]
    table[2][2] = 0.35
    # q = 0 is the running mean: step 2 p0 .7, p1 .3, p2 .35 -> drop p1;
    # step 3: p0 .55, p2 .325, p3 .45 -> drop p2.
    kept, state = run(P.kalman(q=0.0, r=1.0), table=table)
    assert kept == [{0, 2}, {0, 3}]
    scores = {int(p): float(s) for p, s, v in zip(state.position[0, 0], state.score[0, 0], state.valid[0, 0]) if v}
    assert scores == pytest.approx({0: 0.55, 3: 0.45}, rel=1e-6)
    # q = r = 1, p0 after two queries: m = 1, P = 1; predict P = 2, gain 2/3,
    # m = 1 + 2/3 (.6 - 1) = .7333.
    config = flsmem.MemoryConfig(policy=P.kalman(q=1.0, r=1.0), budget=4)
    state = testing.tiny_memory(config, batch=1, kv_heads=1)
    for t, a in enumerate([1.0, 0.6]):
        state = write(state, {"k": jnp.zeros((1, 1, 4)), "v": jnp.zeros((1, 1, 4))}, jnp.array([t]))
        att = jnp.zeros((1, 1, state.slots)).at[0, 0, 0].set(a)
        state = flsmem.smooth(flsmem.observe(state, att))
    assert float(state.score[0, 0, 0]) == pytest.approx(1 + 2 / 3 * (0.6 - 1), rel=1e-6)


def test_oracle_keeps_what_the_future_uses():
    # Future attention after query 2: p0 .1, p1 .15, p2 .3 -> keep p1, p2.
    tab = jnp.asarray(TABLE)[None, None]
    fut = discounted_future(tab)
    config = flsmem.MemoryConfig(policy=P.oracle(), budget=2)
    state = testing.tiny_memory(config, batch=1, kv_heads=1)
    for t in range(3):
        state = write(state, {"k": jnp.zeros((1, 1, 4)), "v": jnp.zeros((1, 1, 4))}, jnp.array([t]))
        att = testing.gather_attention(tab, state)[:, :, 0]
        state = update(state, att, future=testing.gather_attention(fut, state)[:, :, 0])
    assert testing.kept_positions(state)[0][0] == {1, 2}


def test_key_norm_keeps_small_keys():
    # Key norms by position: 3, 1, 2, .5. Step 2 keeps p1, p2; step 3 keeps p1, p3.
    norms = [3.0, 1.0, 2.0, 0.5]
    keys = [jnp.array([[[n, 0.0, 0.0, 0.0]]]) for n in norms]
    assert run(P.key_norm(), keys=keys)[0] == [{1, 2}, {1, 3}]


def test_snapkv_pools_window_votes_at_prefill():
    # Prefill five items, observation window = the last two queries (3 and 4).
    # Votes: p0 .05+.45=.5, p1 .3, p2 .26+.05=.31, p3 .39+.1=.49, p4 .4.
    # p3, p4 are the window (protected); one more slot for p0, p1, p2.
    table = jnp.array([
        [1.0, 0, 0, 0, 0],
        [0.5, 0.5, 0, 0, 0],
        [0.3, 0.3, 0.4, 0, 0],
        [0.05, 0.30, 0.26, 0.39, 0],
        [0.45, 0.0, 0.05, 0.10, 0.40],
    ])[None, None]

    def prefill(policy):
        config = flsmem.MemoryConfig(policy=policy, budget=5, max_chunk=5)
        state = testing.tiny_memory(config, batch=1, kv_heads=1)
        kv = jnp.zeros((1, 1, 5, 4))
        state = write(state, {"k": kv, "v": kv}, jnp.arange(5)[None])
        state = flsmem.smooth(flsmem.observe(state, testing.gather_attention(table, state, 5)))
        return testing.kept_positions(flsmem.evict(state, budget=3))[0][0]

    # Raw votes: p0 (.5) wins.
    assert prefill(P.snapkv(window=2, kernel_size=1)) == {0, 3, 4}
    # Average pool of three neighbours (zero padded): p0 (0+.5+.3)/3 = .267,
    # p1 (.5+.3+.31)/3 = .37, p2 (.3+.31+.49)/3 = .367 -> p1 wins.
    assert prefill(P.snapkv(window=2, kernel_size=3)) == {1, 3, 4}


def _lowbias32(x):
    x = np.uint32(x)
    x ^= x >> np.uint32(16)
    x = np.uint32((int(x) * 0x7FEB352D) & 0xFFFFFFFF)
    x ^= x >> np.uint32(15)
    x = np.uint32((int(x) * 0x846CA68B) & 0xFFFFFFFF)
    return x ^ (x >> np.uint32(16))


def test_random_keeps_the_top_hashed_scores():
    # The documented score of the item at position p in row 0 is
    # hash(hash(seed ^ hash(0)) ^ p) / 2^32; evicting the lowest every step leaves
    # the `budget` highest scores of the whole stream.
    seed, steps, budget = 5, 12, 3
    scores = {p: int(_lowbias32(_lowbias32(seed ^ int(_lowbias32(0))) ^ p)) >> 8 for p in range(steps)}
    expected = set(sorted(scores, key=scores.get)[-budget:])
    config = flsmem.MemoryConfig(policy=P.random(seed), budget=budget)
    state = testing.tiny_memory(config, batch=1, kv_heads=1)
    for t in range(steps):
        state = write(state, {"k": jnp.zeros((1, 1, 4)), "v": jnp.zeros((1, 1, 4))}, jnp.array([t]))
        state = update(state, jnp.zeros((1, 1, state.slots)))
    assert testing.kept_positions(state)[0][0] == expected


def test_adaptive_kalman_estimates_the_noise():
    # 64 slots whose attention is a random walk (q) observed with noise (r): the
    # per-row estimates approach the true q and r.
    q, r, slots, steps = 1e-3, 4e-3, 64, 600
    key_walk, key_noise = jax.random.split(jax.random.key(0))
    walk = 0.5 + jnp.cumsum(jnp.sqrt(q) * jax.random.normal(key_walk, (steps, slots)), axis=0)
    z = walk + jnp.sqrt(r) * jax.random.normal(key_noise, (steps, slots))
    config = flsmem.MemoryConfig(policy=P.kalman(q=0.1, r=0.1, adaptive=True, beta=0.02),
                                 budget=slots, max_chunk=slots)
    state = flsmem.init(config, 1, 1, {"v": ()})
    state = flsmem.write(state, {"v": jnp.zeros((1, 1, slots))}, jnp.arange(slots)[None])
    pad = jnp.zeros((steps, config.capacity - slots))
    state = jax.jit(flsmem.observe)(state, jnp.concatenate([z, pad], axis=1)[None, None])
    log_x, r_hat, _ = state.aux[0, 0]
    q_hat = jnp.exp(log_x) * r_hat
    assert float(r_hat) == pytest.approx(r, rel=0.25)
    assert float(q_hat) == pytest.approx(q, rel=0.5)


def test_random_is_seeded_and_reproducible():
    def kept(seed):
        config = flsmem.MemoryConfig(policy=P.random(seed), budget=3)
        state = testing.tiny_memory(config, batch=1, kv_heads=1)
        for t in range(12):
            state = write(state, {"k": jnp.zeros((1, 1, 4)), "v": jnp.zeros((1, 1, 4))}, jnp.array([t]))
            state = update(state, jnp.zeros((1, 1, state.slots)))
        return testing.kept_positions(state)[0][0]

    assert kept(0) == kept(0)
    assert len(kept(0)) == 3
    assert len({frozenset(kept(s)) for s in range(6)}) > 1


def test_full_never_evicts():
    kept, state = run(P.full(), budget=4)
    assert kept == [{0, 1, 2}, {0, 1, 2, 3}]
    assert testing.kept_positions(flsmem.evict(state, budget=1))[0][0] == {0, 1, 2, 3}
    assert int(state.stats.evictions[0]) == 0


def test_sinks_and_lag_count_inside_budget():
    # sinks 1 + lag 2 = 3 protected of a budget of 3: only the sink and the two newest stay.
    policy = P.rmm(lag=2).replace(sinks=1)
    table = np.tril(np.full((6, 6), 0.5)).tolist()
    config = flsmem.MemoryConfig(policy=policy, budget=3)
    state = testing.tiny_memory(config, batch=1, kv_heads=1)
    tab = jnp.asarray(table)[None, None]
    for t in range(6):
        state = write(state, {"k": jnp.zeros((1, 1, 4)), "v": jnp.zeros((1, 1, 4))}, jnp.array([t]))
        state = update(state, testing.gather_attention(tab, state)[:, :, 0])
    assert testing.kept_positions(state)[0][0] == {0, 4, 5}


def test_evict_every_batches_evictions():
    # evict_every=2: the row grows to budget + 2 before it is cut back to the budget.
    sizes = []
    config = flsmem.MemoryConfig(policy=P.h2o(), budget=2, evict_every=2)
    state = testing.tiny_memory(config, batch=1, kv_heads=1)
    for t in range(7):
        state = write(state, {"k": jnp.zeros((1, 1, 4)), "v": jnp.zeros((1, 1, 4))}, jnp.array([t]))
        state = update(state, jnp.full((1, 1, state.slots), 0.1))
        sizes.append(int(flsmem.occupancy(state)[0, 0]))
    assert sizes == [1, 2, 3, 2, 3, 2, 3]


def test_nonfinite_score_falls_back_and_is_counted():
    # A score that is not finite ranks below every finite one and is counted.
    config = flsmem.MemoryConfig(policy=P.key_norm(), budget=2)
    state = testing.tiny_memory(config, batch=1, kv_heads=1)
    keys = [1.0, jnp.inf, 2.0]
    for t, n in enumerate(keys):
        key = jnp.array([[[n, 0.0, 0.0, 0.0]]])
        state = write(state, {"k": key, "v": key}, jnp.array([t]))
        state = update(state, jnp.zeros((1, 1, state.slots)))
    assert testing.kept_positions(state)[0][0] == {0, 2}
    assert int(state.stats.fallbacks[0]) >= 1



# ------------------------------------------------------- registry and typed parameters

NAMES = ("full", "window", "streaming_llm", "h2o", "tova", "ema", "rmm", "scissorhands", "snapkv",
         "key_norm", "random", "kalman", "adaptive", "oracle", "lag_window", "use_recency", "surprise")


@pytest.mark.parametrize("name", NAMES)
def test_every_registry_entry_builds(name):
    policy = P.make(name)
    assert isinstance(policy, P.Policy) and policy.name == name
    # Equal and hashable: a config holding it is one static argument of jit.
    assert policy == P.REGISTRY[name]() and hash(policy) == hash(P.REGISTRY[name]())


def test_registry_holds_the_public_policies():
    # ExpectedAttention is built for a model's attention shape (tests/test_expected_attention.py).
    assert tuple(P.REGISTRY) == NAMES + ("expected_attention",)
    with pytest.raises(ValueError, match="policy 'expected_attention' needs the keyword 'head_dim'"):
        P.make("expected_attention")
    assert P.make("expected_attention", head_dim=8).evidence_shapes == ((), (8,))


def _fold_count_and_last_two(policy, view, obs, aux):
    count, last = view.evidence
    return P.with_columns(view, [count + 1.0, jnp.stack([last[..., 1], obs.attention], axis=-1)]), aux


def test_a_policy_keeps_evidence_arrays_of_the_shapes_it_declares():
    """A policy of two evidence arrays, a count [B, K, S] and the last two attentions
    [B, K, S, 2]: each slot's arrays follow its own queries, a free slot's stay 0."""
    policy = P.Policy(name="last_two", score=lambda policy, view, aux: jnp.sum(view.evidence[1], axis=-1),
                      fold=_fold_count_and_last_two, evidence_shapes=((), (2,)))
    state = testing.tiny_memory(testing.tiny_config(policy, budget=4), batch=1, kv_heads=1)
    assert [e.shape for e in state.evidence] == [(1, 1, state.slots), (1, 1, state.slots, 2)]
    kv = {"k": jnp.ones((1, 1, testing.HEAD_DIM)), "v": jnp.ones((1, 1, testing.HEAD_DIM))}
    for t, a in enumerate([0.5, 0.25, 0.125]):
        state = flsmem.write(state, kv, jnp.array([t]))
        state = flsmem.observe(state, jnp.zeros((1, 1, state.slots)).at[0, 0, 0].set(a))
    count, last = (np.asarray(e[0, 0]) for e in state.evidence)
    assert count[:3].tolist() == [3.0, 2.0, 1.0] and count[3:].tolist() == [0.0] * (state.slots - 3)
    assert last[0].tolist() == [0.25, 0.125] and last[1].tolist() == [0.0, 0.0] and not last[3:].any()
    for bad in [(), 2, ((0,),), ((2.0,),)]:
        with pytest.raises(ValueError, match="evidence_shapes must be a non-empty tuple of tuples of ints >= 1"):
            policy.replace(evidence_shapes=bad)


def test_make_passes_keywords_to_the_factory():
    assert P.make("rmm", lag=8, decay=0.9) == P.rmm(lag=8, decay=0.9)
    assert P.make("snapkv", window=4, pooling="max").params == P.SnapKVParams(pooling="max")


def test_make_names_an_unknown_policy_and_lists_the_known():
    with pytest.raises(ValueError, match=r"policy must be one of \('full', 'window'.*'expected_attention'\), got 'h20'"):
        P.make("h20")


def test_make_names_an_unknown_keyword_and_lists_the_allowed():
    with pytest.raises(ValueError, match=r"policy 'rmm' has no keyword 'decy'; its keywords are \('lag', 'recent', 'decay'\)"):
        P.make("rmm", decy=0.9)
    with pytest.raises(ValueError, match=r"no keyword 'decay'; its keywords are \(\)"):
        P.make("window", decay=0.9)


def test_typed_params_are_attributes_and_changes_are_checked():
    policy = P.kalman(q=0.1, adaptive=True)
    assert isinstance(policy.params, P.KalmanParams) and policy.params.q == 0.1 and policy.params.adaptive
    changed = policy.with_params(beta=0.5)
    assert changed.params.beta == 0.5 and changed.params.q == 0.1 and changed.name == "kalman"
    assert P.ema(0.5).with_params(decay=0.5) == P.ema(0.5)
    assert hash(P.ema(1)) == hash(P.ema(1.0))
    with pytest.raises(ValueError, match=r"unknown parameter 'bta' of KalmanParams; its parameters are "
                                         r"\('q', 'r', 'adaptive', 'beta', 'weighted'\)"):
        policy.with_params(bta=0.5)
    with pytest.raises(ValueError, match="beta must be a number in"):
        policy.with_params(beta=2.0)
    with pytest.raises(ValueError, match="policy 'window' has no parameters"):
        P.window().with_params(decay=0.5)
    with pytest.raises(ValueError, match="params must be a flsmem.policies.Params"):
        P.h2o().replace(params=(("decay", 1.0),))
    with pytest.raises(ValueError, match="weighted must be a bool"):
        P.ema(weighted=1)
    with pytest.raises(ValueError, match="use_threshold must be a number or None"):
        P.use_recency(use_threshold="high")
