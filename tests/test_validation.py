"""Bad input: trace-time checks of states and configs, and the checkify runtime checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import flsmem
from flsmem import checks
from flsmem import policies as P
from flsmem import testing

KV = {"k": jnp.zeros((2, 2, 4)), "v": jnp.zeros((2, 2, 4))}
# Compiled once for the module (jit caches by function and shapes).
checked_update = jax.jit(checks.update)
checked_write = jax.jit(checks.write)


def _memory(**kwargs):
    return testing.tiny_memory(testing.tiny_config(**kwargs))


# ------------------------------------------------------------------ trace time


def test_config_takes_numpy_ints_as_ints_and_rejects_other_types():
    config = flsmem.MemoryConfig(P.h2o(), budget=np.int64(8), evict_every=np.int32(2))
    assert type(config.budget) is int and type(config.evict_every) is int
    assert config == flsmem.MemoryConfig(P.h2o(), budget=8, evict_every=2)
    assert hash(config) == hash(flsmem.MemoryConfig(P.h2o(), budget=8, evict_every=2))
    for bad in (True, 8.0, "8", -3):
        with pytest.raises(ValueError, match="budget must be an int >= 1"):
            flsmem.MemoryConfig(P.h2o(), budget=bad)
    with pytest.raises(ValueError, match="interpret must be a bool"):
        flsmem.MemoryConfig(P.h2o(), budget=8, interpret=1)


@pytest.mark.parametrize(
    "edit, match",
    [
        # A state kept while its config was swapped for one of another capacity.
        (lambda s: s.replace(config=s.config.replace(budget=5)), "capacity"),
        (lambda s: s.replace(position=s.position.astype(jnp.float32)), r"state.position must be int32\[2, 2, 9\]"),
        (lambda s: s.replace(birth=s.birth[:, :1]), "state.birth"),
        (lambda s: s.replace(score=s.score.astype(jnp.bfloat16)), "state.score must be float32"),
        (lambda s: s.replace(evidence=(jnp.zeros(s.valid.shape + (3,)),)),
         r"state.evidence\[0\] must be float32\[2, 2, 9\]"),
        (lambda s: s.replace(evidence=s.evidence[0]), r"state.evidence must be a tuple of 1 arrays"),
        (lambda s: s.replace(step=jnp.zeros((3,), jnp.int32)), "state.step"),
        (lambda s: s.replace(stats=s.stats.replace(evictions=jnp.zeros((1,), jnp.int32))), r"state.stats.evictions"),
        (lambda s: s.replace(stats=s.stats.replace(evicted_score=jnp.zeros((2,)))),
         r"state.stats.evicted_score must have shape \[B, K\] = \[2, 2\]"),
        (lambda s: s.replace(payload={"k": s.payload["k"][:, :, :4], "v": s.payload["v"]}), r"state.payload\['k'\]"),
        # A memory stacked over layers, given as is instead of mapped over.
        (lambda s: jax.tree.map(lambda x: jnp.stack([x, x]), s), "stacked over layers"),
        (lambda s: s.replace(valid=s.valid.astype(jnp.int32)), "state.valid must be a bool"),
    ],
)
def test_inconsistent_states_are_rejected_at_trace_time(edit, match):
    state = edit(_memory(budget=8))
    attention = jnp.zeros((2, 2, 9))
    calls = [
        lambda: flsmem.smooth(state),
        lambda: flsmem.evict(state),
        lambda: flsmem.observe(state, attention),
        lambda: jax.jit(flsmem.update)(state, attention),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=match):
            call()


def test_state_without_payload_is_accepted():
    """Per-query loops carry the state without its payload (flsmem.models.decoder does)."""
    state = _memory(budget=4)
    flsmem.check_state(state.replace(payload=None))


# ----------------------------------------------------------------- checkify


def _stream(state, steps, attention_fn, update):
    """``steps`` of write + checked update; the first error and the final state."""
    error = checkify.checkify(lambda: None)()[0]  # no error yet
    write = jax.jit(flsmem.write)
    for t in range(steps):
        state = write(state, KV, jnp.array([t, t]))
        err, state = update(state, attention_fn(state, t))
        error = error if error.get() else err
    return error, state


def _softmax_on_visible(state, t):
    logits = jnp.sin(jnp.arange(state.slots, dtype=jnp.float32) * (t + 1))
    return jax.nn.softmax(jnp.where(flsmem.visible(state), logits, -jnp.inf), axis=-1)


def test_checked_update_passes_clean_input_and_equals_update():
    config = testing.tiny_config(policy=P.rmm(lag=2, recent=1), budget=4, evict_every=2)
    error, checked = _stream(testing.tiny_memory(config), 12, _softmax_on_visible, checked_update)
    assert error.get() is None
    plain = testing.tiny_memory(config)
    write, update = jax.jit(flsmem.write), jax.jit(flsmem.update)
    for t in range(12):
        plain = write(plain, KV, jnp.array([t, t]))
        plain = update(plain, _softmax_on_visible(plain, t))
    for a, b in zip(jax.tree.leaves(checked), jax.tree.leaves(plain)):
        np.testing.assert_array_equal(a, b)
    assert int(checked.stats.evictions.sum()) > 0


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda a, w: (a.at[1, 0, 0].set(jnp.nan), w), "attention is NaN or Inf on a slot the query can see"),
        (lambda a, w: (a.at[1, 1, 0].set(-0.5), w), "attention is negative"),
        (lambda a, w: (a.at[0, 0, -1].set(0.1), w), "attention is not 0 on a slot the query cannot see"),
        (lambda a, w: (a, w.at[1].set(1.5)), "correctness is outside"),
        (lambda a, w: (a, w.at[0].set(jnp.inf)), "correctness is NaN or Inf"),
    ],
)
def test_checked_update_names_bad_input(bad, match):
    state = flsmem.write(_memory(budget=4), KV, jnp.array([0, 0]))
    attention, weight = bad(_softmax_on_visible(state, 0), jnp.ones((2,)))
    err, out = checked_update(state, attention, weight)
    with pytest.raises(checkify.JaxRuntimeError, match=match):
        err.throw()
    # The state itself still follows the documented rule (NaN is no evidence).
    assert bool(jnp.all(jnp.isfinite(out.score)))


def test_checked_update_names_the_batch_row():
    state = flsmem.write(_memory(budget=4), KV, jnp.array([0, 0]))
    attention = _softmax_on_visible(state, 0).at[1, 0, 0].set(jnp.nan)
    err, _ = checked_update(state, attention, jnp.ones((2,)))
    assert "batch row 1" in err.get()


@pytest.mark.parametrize(
    "position, payload, match",
    [
        (jnp.array([-1, 3]), KV, "negative"),
        (jnp.array([0, 3]), KV, "already held"),
        (jnp.array([5, 6]), {"k": KV["k"].at[0, 1, 2].set(jnp.nan), "v": KV["v"]}, "payload has NaN"),
    ],
)
def test_checked_write_names_bad_items(position, payload, match):
    state = flsmem.write(_memory(budget=4), KV, jnp.array([0, 1]))
    err, _ = checked_write(state, payload, position, None)
    with pytest.raises(checkify.JaxRuntimeError, match=match):
        err.throw()
    # The same items, masked out, are fine.
    err, _ = checked_write(state, payload, position, jnp.array([False, False]))
    assert err.get() is None


def test_checked_write_catches_a_chunk_with_a_repeated_position():
    config = testing.tiny_config(budget=4, max_chunk=3)
    state = testing.tiny_memory(config)
    chunk = jax.tree.map(lambda x: jnp.zeros((2, 2, 3, 4)), KV)
    err, _ = checked_write(state, chunk, jnp.array([[0, 1, 2], [4, 5, 4]]))
    assert "same position twice" in err.get() and "batch row 1" in err.get()


def test_state_checks_catch_a_corrupted_state():
    state = flsmem.write(_memory(budget=4), KV, jnp.array([0, 0]))
    state = flsmem.update(state, _softmax_on_visible(state, 0))
    broken = {
        "position and valid flag disagree": state.replace(position=state.position.at[0, 0, 0].set(-1)),
        "score is NaN": state.replace(score=state.score.at[1, 0, 0].set(jnp.nan)),
        "evidence is NaN": state.replace(evidence=(state.evidence[0].at[0, 1, 0].set(jnp.inf),)),
        "stats.evictions is negative": state.replace(stats=state.stats.replace(
            evictions=jnp.array([0, -1], jnp.int32))),
    }
    checked = jax.jit(checkify.checkify(checks.state_checks))
    assert checked(state)[0].get() is None
    for match, bad in broken.items():
        err, _ = checked(bad)
        assert match in (err.get() or ""), (match, err.get())


def test_checks_work_inside_scan_and_report_the_bad_step():
    config = testing.tiny_config(policy=P.h2o(recent=1), budget=3)
    table = testing.attention_table(jax.random.key(0), 2, 2, 16)
    table = table.at[:, :, 9].set(jnp.nan)  # query 9 is broken

    def loop(state):
        def body(state, t):
            state = flsmem.write(state, KV, jnp.full((2,), t))
            attention = testing.gather_attention(table, state)[:, :, 0]
            checkify.check(t < 100, "unreachable")
            checks.input_checks(state, attention)
            state = flsmem.update(state, attention)
            checks.state_checks(state, after_update=True)
            return state, None

        return jax.lax.scan(body, state, jnp.arange(16))[0]

    err, state = jax.jit(checkify.checkify(loop))(testing.tiny_memory(config))
    assert "attention is NaN" in err.get()
    # Without checks the loop runs on: NaN was no evidence, once per row.
    assert state.stats.nonfinite_inputs.tolist() == [1, 1]
