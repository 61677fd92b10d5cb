"""The memory API: purity under jit, vmap and scan, no retracing, stats, bad input."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flsmem
from flsmem import policies as P
from flsmem import testing

KV = {"k": jnp.zeros((2, 2, 4)), "v": jnp.zeros((2, 2, 4))}


def decode_loop(state, table, steps):
    """A jit-able decode loop over the table: write one item, update, per step."""

    def body(state, t):
        kv = jax.tree.map(lambda x: x + t.astype(x.dtype), KV)
        state = flsmem.write(state, kv, jnp.full((state.batch,), t))
        attention = testing.gather_attention(table, state)[:, :, 0]
        return flsmem.update(state, attention), None

    return jax.lax.scan(body, state, jnp.arange(steps))[0]


def test_scan_of_512_decode_steps_compiles_once():
    config = flsmem.MemoryConfig(policy=P.rmm(lag=8), budget=32, evict_every=4)
    table = testing.attention_table(jax.random.key(0), 2, 2, 512)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def run(state, table):
        return decode_loop(state, table, 512)

    first = run(testing.tiny_memory(config), table)
    # Running on from the result (new step counter, new data) must not retrace.
    second = run(first, table * 0.5)
    for state in (first, second):
        assert int(flsmem.occupancy(state).max()) <= config.high_water
    assert first.step.tolist() == [512, 512]
    assert second.step.tolist() == [1024, 1024]
    assert int(first.stats.evictions.sum()) > 0


def test_jit_matches_eager_and_vmap_matches_loop():
    config = testing.tiny_config(policy=P.ema(0.7, recent=1), budget=5, evict_every=2)
    table = testing.attention_table(jax.random.key(1), 2, 2, 12)
    eager = decode_loop(testing.tiny_memory(config), table, 12)
    jitted = jax.jit(decode_loop, static_argnums=2)(testing.tiny_memory(config), table, 12)
    chex.assert_trees_all_close(eager, jitted)
    # vmap over an extra leading axis of independent memories.
    tables = jnp.stack([table, table[::-1]])
    states = jax.tree.map(lambda x: jnp.stack([x, x]), testing.tiny_memory(config))
    batched = jax.vmap(decode_loop, in_axes=(0, 0, None))(states, tables, 12)
    for i in range(2):
        single = decode_loop(testing.tiny_memory(config), tables[i], 12)
        chex.assert_trees_all_close(jax.tree.map(lambda x: x[i], batched), single)


def test_pallas_kernel_in_interpret_mode_keeps_what_the_reference_keeps():
    table = testing.attention_table(jax.random.key(2), 2, 2, 16)
    run = jax.jit(decode_loop, static_argnums=2)
    reference = run(testing.tiny_memory(testing.tiny_config(budget=5)), table, 16)
    kernel = run(testing.tiny_memory(testing.tiny_config(budget=5, implementation="pallas", interpret=True)), table, 16)
    assert testing.kept_positions(reference) == testing.kept_positions(kernel)


def test_configs_and_policies_are_hashable_and_equal_by_value():
    assert P.rmm(lag=16) == P.rmm(lag=16)
    assert hash(P.kalman(q=0.1)) == hash(P.kalman(q=0.1))
    assert P.rmm(lag=16) != P.rmm(lag=8)
    a = flsmem.MemoryConfig(policy=P.h2o(recent=4), budget=16, evict_every=8)
    b = flsmem.MemoryConfig(policy=P.h2o(recent=4), budget=16, evict_every=8)
    assert a == b and hash(a) == hash(b)
    assert a.capacity == 16 + 8 and a.high_water == 24
    assert flsmem.MemoryConfig(policy=P.h2o(), budget=16, evict_every=8, max_chunk=4).capacity == 27


def test_nonfinite_inputs_are_no_evidence_and_counted():
    config = testing.tiny_config(policy=P.rmm(lag=0), budget=4)
    state = flsmem.write(testing.tiny_memory(config), KV, jnp.array([0, 0]))
    attention = jnp.zeros((2, 2, state.slots)).at[0, 0, 0].set(jnp.nan).at[1, 0, 0].set(0.5)
    state = flsmem.update(state, attention, jnp.array([1.0, jnp.inf]))
    assert state.stats.nonfinite_inputs.tolist() == [1, 1]
    assert bool(jnp.all(jnp.isfinite(state.score)))
    # Row 0: NaN attention counts as 0; row 1: infinite correctness weighs 0.
    assert float(state.evidence[0][0, 0, 0]) == 0.0
    assert float(state.evidence[0][1, 0, 0]) == 0.0


def test_nonfinite_entries_of_free_slots_are_neither_inputs_nor_fallbacks():
    """Only present items are checked. ``observe`` and ``smooth`` first reduce every
    slot, free ones too, and count in a masked branch when that finds a non-finite
    entry; the branch must leave a free slot's entries out."""
    config = testing.tiny_config(policy=P.h2o(), budget=4)
    state = flsmem.write(testing.tiny_memory(config), KV, jnp.array([0, 0]))  # slot 0 holds it, slot 1 is free
    attention = jnp.zeros((2, 2, state.slots)).at[0, 0, 1].set(jnp.nan).at[1, 1, 1].set(jnp.inf)
    state = flsmem.update(state, attention.at[1, 0, 0].set(jnp.nan))
    assert state.stats.nonfinite_inputs.tolist() == [0, 1]
    assert float(state.evidence[0][0, 0, 1]) == 0.0
    stale = state.replace(evidence=(state.evidence[0].at[:, :, 1].set(jnp.nan),))
    assert flsmem.smooth(stale).stats.fallbacks.tolist() == state.stats.fallbacks.tolist()
    broken = stale.replace(evidence=(stale.evidence[0].at[0, 1, 0].set(jnp.inf),))
    smoothed = flsmem.smooth(broken)
    assert (smoothed.stats.fallbacks - state.stats.fallbacks).tolist() == [1, 0]
    assert float(smoothed.score[0, 1, 0]) < -1e29 and bool(jnp.all(jnp.isfinite(smoothed.score)))

def test_finite_entries_whose_sum_overflows_are_neither_inputs_nor_fallbacks():
    """``observe`` and ``smooth`` first sum every slot's entries; a sum that overflows
    sends the step to the masked count, which must find every entry finite."""
    config = testing.tiny_config(policy=P.h2o(), budget=4)
    state = testing.tiny_memory(config)
    for t in range(2):
        state = flsmem.write(state, KV, jnp.array([t, t]))
    huge = jnp.zeros((2, 2, state.slots)).at[:, :, :2].set(3e38)
    assert not bool(jnp.all(jnp.isfinite(jnp.sum(huge, axis=(1, 2)))))
    state = flsmem.update(state, huge)
    assert state.stats.nonfinite_inputs.tolist() == [0, 0]
    assert state.stats.fallbacks.tolist() == [0, 0]
    assert float(state.score[0, 0, 0]) == pytest.approx(3e38, rel=1e-6)



def test_missed_evictions_force_replacement_and_are_counted():
    config = testing.tiny_config(policy=P.h2o(), budget=2)
    state = testing.tiny_memory(config, batch=1, kv_heads=1)
    kv = {"k": jnp.zeros((1, 1, 4)), "v": jnp.zeros((1, 1, 4))}
    for t in range(5):  # never evicts: capacity is 3, so writes 4 and 5 find no free slot
        state = flsmem.write(state, kv, jnp.array([t]))
        state = flsmem.smooth(flsmem.observe(state, jnp.full((1, 1, state.slots), 0.1 * (t + 1))))
    assert int(state.stats.forced_writes[0]) == 2
    # Each forced write replaced the lowest sum: p2 (.3) at write 4, then p3 (.4).
    assert testing.kept_positions(state)[0][0] == {0, 1, 4}
    assert int(flsmem.occupancy(state)[0, 0]) == config.capacity


def _window_run(kv_heads: int):
    """A window(budget 2) memory of one row after four steps of zero attention."""
    config = testing.tiny_config(policy=P.window(), budget=2)
    state = testing.tiny_memory(config, batch=1, kv_heads=kv_heads)
    kv = {"k": jnp.zeros((1, kv_heads, 4)), "v": jnp.zeros((1, kv_heads, 4))}
    for t in range(4):
        state = flsmem.write(state, kv, jnp.array([t]))
        state = flsmem.update(state, jnp.zeros((1, kv_heads, state.slots)))
    return state


def test_summary_reports_means_of_evicted_items():
    s = flsmem.summary(_window_run(kv_heads=1))
    # p0 evicted at step 2 with age 3, p1 at step 3 with age 3.
    assert s["evictions"].tolist() == [2]
    assert s["mean_evicted_age"].tolist() == [3.0]
    assert s["occupancy"].tolist() == [2]


def test_summary_adds_the_per_head_sums_of_evicted_items():
    """The state keeps the float sums per (row, head); summary reads them per row."""
    state = _window_run(kv_heads=2)
    # Each head evicts p0 and p1, each at age 3.
    assert state.stats.evicted_age.tolist() == [[6.0, 6.0]]
    s = flsmem.summary(state)
    assert s["evictions"].tolist() == [4]
    assert s["mean_evicted_age"].tolist() == [3.0]


def test_reduce_query_heads():
    att = jnp.arange(2 * 1 * 3 * 4, dtype=jnp.float32).reshape(2, 1, 3, 4)
    np.testing.assert_allclose(flsmem.reduce_query_heads(att, "mean"), att.mean(axis=2))
    np.testing.assert_allclose(flsmem.reduce_query_heads(att, P.h2o().replace(head_reduction="max")), att.max(axis=2))
    chunk = jax.random.uniform(jax.random.key(0), (1, 2, 4, 3, 5))  # [B, K, G, Q, S]
    for rule, reference in (("mean", np.mean), ("sum", np.sum), ("max", np.max)):
        np.testing.assert_allclose(flsmem.reduce_query_heads(chunk, rule), reference(chunk, axis=2), rtol=1e-6)
    one_head = chunk[:, :, :1]
    np.testing.assert_array_equal(flsmem.reduce_query_heads(one_head, "mean"), one_head[:, :, 0])
    with pytest.raises(ValueError, match="attention"):
        flsmem.reduce_query_heads(att[0], "mean")
    with pytest.raises(ValueError, match="head reduction"):
        flsmem.reduce_query_heads(att, "median")


# ----------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: flsmem.MemoryConfig(policy=P.h2o(), budget=0), "budget"),
        (lambda: flsmem.MemoryConfig(policy=P.h2o(), budget=4, evict_every=0), "evict_every"),
        (lambda: flsmem.MemoryConfig(policy=P.h2o(), budget=4, max_chunk=1.5), "max_chunk"),
        (lambda: flsmem.MemoryConfig(policy=P.h2o(), budget=4, implementation="cuda"), "implementation"),
        (lambda: flsmem.MemoryConfig(policy="h2o", budget=4), "policy"),
        (lambda: flsmem.MemoryConfig(policy=P.rmm(lag=8).replace(sinks=4), budget=8), "budget"),
        (lambda: P.rmm(lag=-1), "lag"),
        (lambda: P.h2o(recent=2.5), "recent"),
        (lambda: P.ema(decay=1.5), "decay"),
        (lambda: P.kalman(q=-0.1), "q"),
        (lambda: P.kalman(r=0.0), "r"),
        (lambda: P.snapkv(pooling="min"), "pooling"),
        (lambda: P.scissorhands(history=0), "history"),
        (lambda: P.h2o().replace(head_reduction="median"), "head_reduction"),
        (lambda: P.random(seed=-1), "seed"),
    ],
)
def test_invalid_configs_name_the_argument(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_invalid_init_arguments():
    config = testing.tiny_config()
    with pytest.raises(ValueError, match="batch"):
        flsmem.init(config, 0, 2, {"k": (4,)})
    with pytest.raises(ValueError, match="kv_heads"):
        flsmem.init(config, 1, -2, {"k": (4,)})
    with pytest.raises(ValueError, match="payload_spec"):
        flsmem.init(config, 1, 2, {"k": "D"})
    with pytest.raises(ValueError, match="config"):
        flsmem.init({"budget": 4}, 1, 2, {"k": (4,)})


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda s: flsmem.write(s, {"k": jnp.zeros((2, 2, 5)), "v": jnp.zeros((2, 2, 4))}, jnp.zeros(2, jnp.int32)), "payload"),
        (lambda s: flsmem.write(s, {"k": jnp.zeros((2, 2, 4))}, jnp.zeros(2, jnp.int32)), "payload"),
        (lambda s: flsmem.write(s, KV, jnp.zeros((2, 1), jnp.int32)), "position"),
        (lambda s: flsmem.write(s, KV, jnp.zeros(2)), "position"),
        (lambda s: flsmem.write(s, KV, jnp.zeros(2, jnp.int32), mask=jnp.ones(2)), "mask"),
        (lambda s: flsmem.write(s, {"k": jnp.zeros((2, 2, 4), jnp.int32), "v": jnp.zeros((2, 2, 4))}, jnp.zeros(2, jnp.int32)), "dtype"),
        (lambda s: flsmem.write(s, jax.tree.map(lambda x: jnp.zeros((2, 2, 3, 4)), KV), jnp.zeros((2, 3), jnp.int32)), "max_chunk"),
        (lambda s: flsmem.observe(s, jnp.zeros((2, 2, 7))), "attention"),
        (lambda s: flsmem.observe(s, jnp.zeros((2, 2, s.slots), jnp.int32)), "attention"),
        (lambda s: flsmem.observe(s, jnp.zeros((2, 2, s.slots)), jnp.ones((2, 1))), "correctness"),
        (lambda s: flsmem.update(s, jnp.zeros((2, 2, 3, s.slots)), jnp.ones((2,))), "correctness"),
        (lambda s: flsmem.update(s, jnp.zeros((1, 2, s.slots))), "attention"),
        (lambda s: flsmem.evict(s, budget=0), "budget"),
        (lambda s: flsmem.smooth({"valid": s.valid}), "state"),
    ],
)
def test_bad_arguments_name_the_argument(call, match):
    state = testing.tiny_memory(testing.tiny_config(budget=4))
    with pytest.raises(ValueError, match=match):
        call(state)


def test_oracle_requires_future_and_key_norm_requires_its_leaf():
    state = testing.tiny_memory(testing.tiny_config(policy=P.oracle(), budget=4))
    with pytest.raises(ValueError, match="future"):
        flsmem.observe(state, jnp.zeros((2, 2, state.slots)))
    with pytest.raises(ValueError, match="future"):
        flsmem.observe(state, jnp.zeros((2, 2, state.slots)), future=jnp.zeros((2, 2, 3)))
    state = flsmem.init(testing.tiny_config(policy=P.key_norm(leaf="keys"), budget=4), 2, 2, {"k": (4,)})
    with pytest.raises(ValueError, match="keys"):
        flsmem.write(state, {"k": jnp.zeros((2, 2, 4))}, jnp.zeros(2, jnp.int32))


def test_count_matches_numpy_over_any_axes():
    from flsmem.state import count

    mask = np.random.default_rng(0).random((2, 3, 50)) < 0.3
    for axis, expected in ((-1, mask.sum(-1)), ((1, 2), mask.sum((1, 2))), (None, mask.sum())):
        got = count(jnp.asarray(mask), axis=axis)
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(got, expected)
