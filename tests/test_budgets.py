"""Budgets per KV head (AdaKV) and per layer (PyramidKV): the wrapper against the plain
policy, a hand-computed allocation, and the layer schedules' totals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flsmem
from flsmem import policies as P
from flsmem.testing import attention_table, gather_attention, kept_positions, tiny_memory


def _stream(config, steps=24, batch=2, kv_heads=3, seed=0):
    """Write one item per step and update from a fixed attention table; the final memory."""
    state = tiny_memory(config, batch=batch, kv_heads=kv_heads)
    table = attention_table(jax.random.key(seed), batch, kv_heads, steps)

    @jax.jit
    def step(state, t):
        item = {"k": jnp.ones((batch, kv_heads, 4)), "v": jnp.ones((batch, kv_heads, 4))}
        state = flsmem.write(state, item, jnp.full((batch,), t, jnp.int32))
        return flsmem.update(state, gather_attention(table, state)), None

    for t in range(steps):
        state, _ = step(state, t)
    return state


@pytest.mark.parametrize("name", ["h2o", "rmm", "tova", "snapkv"])
def test_uniform_adakv_is_the_plain_policy(name):
    settings = {"rmm": {"lag": 2, "recent": 2}, "snapkv": {"window": 2}}.get(name, {"recent": 2})
    plain = P.make(name, **settings)
    uniform = P.adakv(plain, floor=1.0, ceiling=1.0)
    a = _stream(flsmem.MemoryConfig(plain, budget=6, evict_every=2))
    b = _stream(flsmem.MemoryConfig(uniform, budget=6, evict_every=2))
    assert kept_positions(a) == kept_positions(b)
    np.testing.assert_array_equal(np.asarray(a.score), np.asarray(b.score))
    np.testing.assert_array_equal(np.asarray(a.stats.evictions), np.asarray(b.stats.evictions))


def _scored_memory(scores, policy):
    """One sequence whose K heads hold items at positions 0..S-1 with given scores."""
    scores = jnp.asarray(scores, jnp.float32)[None]  # [1, K, S]
    k, s = scores.shape[1:]
    config = flsmem.MemoryConfig(policy, budget=2, max_chunk=s)
    state = tiny_memory(config, batch=1, kv_heads=k)
    item = {"k": jnp.zeros((1, k, s, 4)), "v": jnp.zeros((1, k, s, 4))}
    state = flsmem.write(state, item, jnp.arange(s, dtype=jnp.int32)[None])
    state = flsmem.observe(state, jnp.zeros((1, k, s, state.slots)))
    # The committed scores, as smooth would leave them, put in by hand.
    score = jnp.zeros_like(state.score).at[:, :, :s].set(scores)
    return state.replace(score=score)


def test_adakv_shares_the_budget_by_score_with_a_floor():
    # Two heads, budget 2 each (4 in all). Head 0 has the four best scores; the floor
    # (0.5 * 2 = 1) keeps head 1's best item; the ceiling (1.5 * 2 = 3) caps head 0.
    scores = [[9.0, 8.0, 7.0, 6.0], [1.0, 0.5, 0.2, 0.1]]
    state = _scored_memory(scores, P.adakv(P.h2o(), floor=0.5, ceiling=1.5))
    kept = kept_positions(flsmem.evict(state, budget=2))
    assert kept == [[{0, 1, 2}, {0}]]
    # Without a floor and with room, head 0 takes everything it scores highest.
    state = _scored_memory(scores, P.adakv(P.h2o(), floor=0.0, ceiling=2.0))
    assert kept_positions(flsmem.evict(state, budget=2)) == [[{0, 1, 2, 3}, set()]]
    # The plain policy keeps two per head.
    state = _scored_memory(scores, P.h2o())
    assert kept_positions(flsmem.evict(state, budget=2)) == [[{0, 1}, {0, 1}]]


def test_adakv_keeps_the_total_and_protection_on_a_stream():
    policy = P.adakv(P.h2o(recent=2), floor=0.25, ceiling=2.0)
    config = flsmem.MemoryConfig(policy, budget=8, evict_every=2)
    assert config.capacity == 16 + 2 + 1 - 1
    state = _stream(config, steps=40)
    held = np.asarray(flsmem.occupancy(state))  # [B, K]
    present = np.asarray(jnp.sum(flsmem.present(state), axis=-1))
    assert (present.sum(axis=1) < 3 * config.high_water).all()
    assert (held.sum(axis=1) <= 3 * (8 + 2)).all()
    # Heads of a sequence keep different numbers of items, and the two most recent
    # items stay in every head.
    assert any(len(set(row)) > 1 for row in held)
    for row in kept_positions(state):
        for head in row:
            assert {38, 39} <= head
    err, _ = flsmem.checks.update(state, jnp.zeros(state.valid.shape))
    err.throw()


def test_policy_names_with_wrappers():
    policy = P.make("adakv(h2o)", recent=4, floor=0.3)
    assert policy.name == "adakv(h2o)" and policy.recent == 4 and policy.head_budget.floor == 0.3
    assert P.make("pyramid(snapkv)", window=8).layer_schedule == P.LayerSchedule("pyramid", 20.0)
    assert P.make("adakv(pyramid(rmm))").name == "adakv(pyramid(rmm))"
    with pytest.raises(ValueError, match="policy wrapper must be one of"):
        P.make("twice(h2o)")
    with pytest.raises(ValueError, match="policy must be one of"):
        P.make("adakv(nope)")
    with pytest.raises(ValueError, match="ceiling must be a number >= 1"):
        P.adakv(P.h2o(), ceiling=0.5)


@pytest.mark.parametrize("budget,layers,minimum,maximum", [(64, 30, 0, None), (128, 30, 32, None),
                                                           (128, 7, 64, 160), (10, 4, 0, 12)])
def test_pyramid_budgets_keep_the_total(budget, layers, minimum, maximum):
    cuts = P.layer_budgets(budget, layers, P.LayerSchedule(), minimum=minimum, maximum=maximum)
    assert sum(cuts) == budget * layers and len(cuts) == layers
    assert min(cuts) >= minimum and (maximum is None or max(cuts) <= maximum)
    assert list(cuts) == sorted(cuts, reverse=True) and cuts[0] > cuts[-1]


def test_layer_budgets_refuse_a_wrong_list():
    with pytest.raises(ValueError, match="sum to layers"):
        P.layer_budgets(4, 2, [4, 5])
    assert P.layer_budgets(4, 2, [6, 2]) == (6, 2)
    assert P.layer_budgets(4, 3, None) == (4, 4, 4)


def test_compress_with_layer_budgets_holds_the_uniform_total():
    layers, batch, kv_heads, steps, budget = 4, 2, 2, 24, 6
    def held_after(policy, cut=None):
        config = flsmem.MemoryConfig(policy, budget=budget, max_chunk=steps)
        memory = flsmem.init_kv(config, batch, kv_heads, 4, layers=layers)
        q = jax.random.normal(jax.random.key(2), (batch, steps, kv_heads, 4))
        position = jnp.broadcast_to(jnp.arange(steps, dtype=jnp.int32), (batch, steps))
        evidence = []
        for layer in range(layers):
            _, memory, att = flsmem.attend(memory, q, q, q, position, fold=False, layer=layer)
            evidence.append(att)
        memory = flsmem.compress(memory, jnp.stack(evidence), budget=cut)
        return np.asarray(jnp.sum(memory.valid, axis=-1))  # [L, B, K]

    uniform = held_after(P.h2o(recent=2))
    pyramid = held_after(P.pyramid(P.h2o(recent=2)))
    listed = held_after(P.h2o(recent=2), cut=[9, 7, 5, 3])
    assert (uniform == budget).all()
    assert pyramid.sum() == uniform.sum() and pyramid[0].min() > pyramid[-1].max()
    assert listed.sum() == uniform.sum() and (listed[:, 0, 0] == [9, 7, 5, 3]).all()


def test_adakv_selection_without_a_sort_is_exact_wherever_it_says_so():
    # Many sequences of 3 heads at once: free slots, protected (+inf) and waiting items,
    # tied scores and births; per sequence, the selection made without sorting must equal
    # the exact three-pass one wherever it claims to, and both outcomes must occur.
    from flsmem.evict import _joint_when_within, _shared_by_heads
    from flsmem.kernels.topk import topk_mask

    rng = np.random.default_rng(0)
    b, k, s, target = 512, 3, 12, 3
    head_budget = P.HeadBudget(floor=0.34, ceiling=1.5)  # floor 1, ceiling 5 items
    used = rng.random((b, k, s)) < rng.uniform(0.3, 1.0, (b, 1, 1))
    # Mostly protected in a tenth of the sequences: more to leave out than is unprotected.
    protected = used & (rng.random((b, k, s)) < np.where(rng.random((b, 1, 1)) < 0.1, 0.8, 0.15))
    score = rng.choice([0.0, 0.5, 1.0], (b, k, s)) + rng.choice([0.0, 1e-3], (b, k, s)) * rng.random((b, k, s))
    # An item may score -inf or NaN (both rank with or below the free slots).
    score = np.where(rng.random((b, k, s)) < 0.01, -np.inf, score)
    score = np.where(rng.random((b, k, s)) < 0.005, np.nan, score)
    rank = np.where(used, np.where(protected, np.inf, score), -np.inf).astype(np.float32)
    birth = rng.integers(0, 8, (b, k, s)).astype(np.int32)
    n_waiting = np.minimum(rng.integers(0, 2, (b, k)), protected.sum(-1)).astype(np.int32)

    def top(scores, kept, tiebreak, max_dropped=None):
        n = scores.shape[-1]
        return topk_mask(scores.reshape(-1, n), jnp.reshape(kept, -1), tiebreak=tiebreak.reshape(-1, n),
                         max_dropped=max_dropped).reshape(scores.shape)

    args = (jnp.asarray(rank), jnp.asarray(birth), target, jnp.asarray(n_waiting), head_budget, top)
    exact = np.asarray(_shared_by_heads(*args, jnp.asarray(~used), None, None))
    rank_, birth_, _, waiting_, _, _ = args
    fast, claims = _joint_when_within(rank_, birth_, target, waiting_, head_budget, top, jnp.asarray(~used),
                                      max_dropped=k * s)
    fast, claims = np.asarray(fast), np.asarray(claims)
    assert 50 < claims.sum() < b - 50, claims.sum()
    np.testing.assert_array_equal(fast[claims], exact[claims])
    # Where it does not claim to, it often differs (the floor or ceiling binds).
    assert (fast[~claims] != exact[~claims]).any(axis=(1, 2)).sum() > 20
    # By hand: an item scored -inf ties with the free slots and one scored NaN ranks
    # below them, so the exact selection may keep a free slot before it; not claimed.
    for bad in (-np.inf, np.nan):
        used = np.zeros((1, 2, 4), bool)
        used[0, 0, :2] = used[0, 1, 0] = True
        rank = np.where(used, bad, -np.inf).astype(np.float32)
        rank[0, 0, 0] = 5.0
        birth = np.where(used, 0, 9).astype(np.int32)
        args = (jnp.asarray(rank), jnp.asarray(birth), 1, jnp.zeros((1, 2), jnp.int32), P.HeadBudget(0.0, 2.0), top)
        exact = np.asarray(_shared_by_heads(*args, jnp.asarray(~used), None, None))
        fast, claims = _joint_when_within(args[0], args[1], 1, args[3], args[4], top, jnp.asarray(~used),
                                          max_dropped=8)
        assert (np.asarray(fast) & used).sum() == 2 and (exact & used).sum() == 1
        assert not bool(claims[0])
