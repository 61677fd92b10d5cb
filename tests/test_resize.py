"""flsmem.resize: a compressed prefill moved into the slots its decoding needs goes on
exactly as the memory it came from."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flsmem
from flsmem import policies as P
from flsmem.estimator import learned

B, K, G, D = 2, 2, 2, 8
PREFIX, BUDGET, EVERY = 40, 8, 4


def test_resize_packs_the_items_in_their_order_and_frees_the_rest():
    """Hand-made rows: the occupied slots 1, 4, 7 of a 10-slot row land in slots 0, 1, 2
    of a 5-slot row with their keys, positions, arrivals, evidence and scores; the
    other two slots are free, as a new memory's (not holding what a free slot was left
    with); the row's step and counters are unchanged."""
    config = flsmem.MemoryConfig(policy=P.h2o(), budget=4, evict_every=1, max_chunk=6)
    memory = flsmem.init(config, 1, 1, {"k": (2,)})
    occupied = np.array([1, 4, 7])
    put = lambda x, values: x.at[0, 0, occupied].set(values)  # noqa: E731
    memory = memory.replace(
        payload={"k": put(memory.payload["k"], jnp.arange(6.0).reshape(3, 2))},
        position=put(memory.position, jnp.array([5, 2, 9])), valid=put(memory.valid, True),
        birth=put(memory.birth, jnp.array([5, 2, 9])), evidence=(put(memory.evidence[0], jnp.array([0.5, 0.25, 1.0])),),
        score=put(memory.score, jnp.array([3.0, 2.0, 1.0])), step=jnp.array([10], jnp.int32),
        stats=memory.stats.replace(evictions=jnp.array([7], jnp.int32)))
    memory = memory.replace(score=memory.score.at[0, 0, 2].set(9.0))  # a free slot's leftover

    small = flsmem.resize(memory)
    assert small.config == config.replace(max_chunk=1) and small.slots == 5
    np.testing.assert_array_equal(small.position[0, 0], [5, 2, 9, -1, -1])
    np.testing.assert_array_equal(small.valid[0, 0], [True, True, True, False, False])
    np.testing.assert_array_equal(small.birth[0, 0, :3], [5, 2, 9])
    np.testing.assert_array_equal(small.payload["k"][0, 0], [[0, 1], [2, 3], [4, 5], [0, 0], [0, 0]])
    np.testing.assert_array_equal(small.evidence[0][0, 0], [0.5, 0.25, 1.0, 0, 0])
    np.testing.assert_array_equal(small.score[0, 0], [3.0, 2.0, 1.0, 0, 0])
    assert int(small.step[0]) == 10 and int(small.stats.evictions[0]) == 7
    flsmem.check_state(small)
    # And back to room for a chunk of 6: the same items, more free slots.
    np.testing.assert_array_equal(flsmem.resize(small, 6).position[0, 0], [5, 2, 9] + [-1] * 7)


def test_resize_refuses_a_row_that_does_not_fit():
    """Outside jit a row with more items than the new slots is refused, naming max_chunk;
    so are a chunk size below 1 and what is not a memory."""
    config = flsmem.MemoryConfig(policy=P.h2o(), budget=4, evict_every=1, max_chunk=6)
    memory = flsmem.init(config, 1, 1, ())
    memory = memory.replace(valid=memory.valid.at[0, 0, :7].set(True))
    with pytest.raises(ValueError, match=r"max_chunk: a row holds 7 items, more than the 5 slots"):
        flsmem.resize(memory)
    assert flsmem.resize(memory, 3).slots == 7
    with pytest.raises(ValueError, match="max_chunk must be an int >= 1, got 0"):
        flsmem.resize(memory, 0)
    with pytest.raises(ValueError, match="memory must be a flsmem.MemoryState"):
        flsmem.resize(memory.valid)


POLICIES = {
    "h2o": P.h2o(recent=2),
    "rmm": P.rmm(lag=2),
    "tova": P.tova(),
    "key_norm": P.key_norm(),
    "adaptive": P.adaptive(lag=2, horizon=4),
    "surprise": P.surprise(recent=2, reserve=2),
    "snapkv": P.snapkv(window=4),
    "adakv(snapkv)": P.adakv(P.snapkv(window=4)),
    "expected_attention": P.expected_attention(head_dim=D, group=G, future=8, sinks=1),
    # Its snapshot of features and labels is kept per slot.
    "learned": learned(horizon=4, snapshots=2, recent=2),
}


@pytest.mark.parametrize("name, stacked", [(name, False) for name in POLICIES] + [
    # Stacked layers put a leading axis on every entry, the per-slot ones included.
    ("learned", True), ("adakv(snapkv)", True)])
def test_a_resized_memory_goes_on_as_the_one_it_came_from(name, stacked):
    """A prefix of 40 items compressed to 8, then 12 decoding steps with evictions:
    resized to decoding's 12 slots (from 51), the memory attends to the same items with
    the same output, scores them the same and evicts the same, step by step."""
    config = flsmem.MemoryConfig(policy=POLICIES[name], budget=BUDGET, evict_every=EVERY, max_chunk=PREFIX)
    keys = iter(jax.random.split(jax.random.key(1), 8))
    q = jax.random.normal(next(keys), (B, PREFIX + 12, K, G, D))
    k, v = (jax.random.normal(next(keys), (B, PREFIX + 12, K, D)) for _ in range(2))
    correctness = jax.random.uniform(next(keys), (B, PREFIX + 12))
    position = jnp.broadcast_to(jnp.arange(PREFIX + 12, dtype=jnp.int32), (B, PREFIX + 12))
    layer = 0 if stacked else None

    memory = flsmem.init_kv(config, B, K, D, layers=1 if stacked else None)
    _, memory, evidence = flsmem.attend(memory, q[:, :PREFIX], k[:, :PREFIX], v[:, :PREFIX], position[:, :PREFIX],
                                        fold=False, layer=layer)
    memory = flsmem.compress(memory, evidence[None] if stacked else evidence, correctness[:, :PREFIX])
    small = flsmem.resize(memory)
    slots = config.head_share + EVERY  # the budget (or a head's ceiling under AdaKV) and what arrives
    assert small.valid.shape[-1] == slots and memory.valid.shape[-1] == slots + PREFIX - 1

    attend = jax.jit(lambda m, *step: flsmem.attend(m, *step[:4], correctness=step[4], layer=layer)[:2])
    step = lambda m, t: attend(m, *(x[:, t:t + 1] for x in (q, k, v, position, correctness)))  # noqa: E731

    def held(m):
        """Each row's items as position -> (score, evidence), the order of slots aside."""
        m = jax.tree.map(lambda x: x[0], m) if stacked else m
        order = np.argsort(np.where(m.valid, m.position, np.iinfo(np.int32).max), axis=-1)
        take = lambda x: np.take_along_axis(np.asarray(x), order.reshape(order.shape + (1,) * (x.ndim - 3)), 2)  # noqa: E731
        count = int(np.max(np.sum(m.valid, -1)))
        held = take(m.valid)[:, :, :count]
        return [np.where(held.reshape(held.shape + (1,) * (np.ndim(x) - 3)), take(x)[:, :, :count], 0)
                for x in (m.position, m.score, *m.evidence)]

    evicted = 0
    for t in range(PREFIX, PREFIX + 12):
        out, memory = step(memory, t)
        got, small = step(small, t)
        np.testing.assert_allclose(got, out, rtol=1e-5, atol=1e-6)
        want, have = held(memory), held(small)
        np.testing.assert_array_equal(have[0], want[0])  # the same items held
        for a, b in zip(have[1:], want[1:]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        evicted = int(np.sum(small.stats.evictions))
    assert evicted > 0
    assert jax.tree.all(jax.tree.map(lambda a, b: np.allclose(a, b, rtol=1e-5, atol=1e-6),
                                     small.stats, memory.stats))
