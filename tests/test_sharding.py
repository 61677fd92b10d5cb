"""Scale-out: a memory and its decode sharded over batch rows and KV heads on 8 devices
give what one device gives: bit for bit, but for the rounding of the learned
network's floats, which learn from a sum over every row.

XLA's device count is fixed when jax starts, so the 8-device tests run in a child
pytest of this same module with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``
(8 simulated CPU devices); ``test_eight_simulated_devices`` starts it and fails if any
of them fails or is skipped. In the parent process they skip.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

import flsmem
from flsmem import checkpoint, sharding
from flsmem import estimator as E
from flsmem import policies as P

DEVICES = 8
CHILD = "FLSMEM_SHARDING_CHILD"
multidevice = pytest.mark.skipif(jax.device_count() < DEVICES, reason="runs in the 8-device child process")

B, K, G, D, T = 8, 4, 2, 8, 24  # batch, KV heads, query heads per KV head, head dim, steps


def test_eight_simulated_devices():
    if os.environ.get(CHILD):
        pytest.skip("this is the child process")
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}"
    env = dict(os.environ, XLA_FLAGS=flags, **{CHILD: "1"})
    env.pop("PYTEST_ADDOPTS", None)
    root = Path(__file__).resolve().parent.parent
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-rs", "-n", "0", "-p", "no:cacheprovider", str(Path(__file__).resolve())],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )
    report = child.stdout + child.stderr
    assert child.returncode == 0, report
    # Every multi-device test ran; only this launcher skipped itself.
    counts = re.search(r"(\d+) passed, 1 skipped", report)
    assert counts and int(counts.group(1)) >= 7, report


def test_partition_specs_follow_rows_and_replicate_shared_state():
    config = flsmem.MemoryConfig(E.learned(horizon=4, hidden=8), budget=6, evict_every=2)
    state = flsmem.init(config, 3, 2, {"k": (D,), "v": (D,)})
    specs = sharding.partition_specs(state)
    rows = PartitionSpec("batch", "heads")
    assert specs.payload == {"k": rows, "v": rows}
    assert (specs.position, specs.valid, specs.step) == (rows, rows, PartitionSpec("batch"))
    assert specs.evidence == (rows,) * len(state.evidence)
    # Counts are per batch row; the float sums of evicted items per row and head.
    assert specs.stats.evictions == PartitionSpec("batch")
    assert specs.stats.evicted_score == rows
    # Per-row snapshots split with the rows; the network is shared and replicated.
    assert specs.aux["snap_features"] == PartitionSpec("batch", "heads", None, None)
    assert specs.aux["last_weight"] == PartitionSpec("batch")
    assert specs.aux["params"]["inner"]["kernel"] == PartitionSpec(None, None)
    assert specs.aux["loss"] == PartitionSpec()
    # Memories stacked over layers (as the decoder holds them) give each layer's axes.
    stacked = jax.tree.map(lambda x: jnp.stack([x, x]), state)
    assert flsmem.state.aux_axes(stacked)["snap_features"] == PartitionSpec("batch", "heads", None, None)
    kalman = flsmem.init(flsmem.MemoryConfig(P.kalman(adaptive=True), budget=4), 3, 2, {"k": (D,)})
    assert sharding.partition_specs(kalman, head_axis=None).aux == PartitionSpec("batch", None, None)


# --------------------------------------------------------------- 8 devices


def _tables(key):
    """Keys, values and queries of a synthetic decode: ``[B, K, T, D]`` and ``[B, K, T, G, D]``."""
    k1, k2, k3 = jax.random.split(key, 3)
    keys = jax.random.normal(k1, (B, K, T, D))
    values = jax.random.normal(k2, (B, K, T, D))
    # Queries aligned with a few keys make heavy hitters, so policies disagree.
    queries = 2.0 * jax.random.normal(k3, (B, K, T, G, D)) + 3.0 * keys[:, :, :1, None, :]
    return keys, values, queries


def decode(state, keys, values, queries, *, mesh=None):
    """T steps of decode against the memory: write the step's key and value, attend with
    G query heads over the visible slots, fold the attention (correctness: the
    attention's peak) and evict. Returns the final state and the outputs ``[T, B, K, G, D]``."""

    def step(state, t):
        kv = {"k": keys[:, :, t], "v": values[:, :, t]}
        state = flsmem.write(state, kv, jnp.full((B,), t, jnp.int32))
        logits = jnp.einsum("bkgd,bksd->bkgs", queries[:, :, t], state.payload["k"]) / np.sqrt(D)
        seen = flsmem.visible(state)[:, :, None, :]
        probs = jax.nn.softmax(jnp.where(seen, logits, -jnp.inf), axis=-1)
        out = jnp.einsum("bkgs,bksd->bkgd", probs, state.payload["v"])
        attention = flsmem.reduce_query_heads(probs, state.config.policy)
        correctness = jnp.max(attention, axis=(1, 2))
        future = attention if state.config.policy.needs_future else None
        state = flsmem.update(state, attention, correctness, future)
        if mesh is not None:
            state = sharding.constrain(state, mesh)
        return state, out

    return jax.lax.scan(step, state, jnp.arange(T))


POLICIES = {
    "h2o": P.h2o(recent=1),
    "rmm": P.rmm(lag=2, decay=0.95),
    "kalman": P.kalman(adaptive=True, lag=1),
    "random": P.random(seed=1),
    "learned": E.learned(horizon=4, hidden=8, learning_rate=1e-2),
}


# The learned policy's network is shared by every row and learns from a gradient pooled
# over all of them: sharded, that sum is taken per device and then across devices, in
# another order than on one device, and how XLA's CPU backend orders a reduction depends
# on the host's vector width. Its floats agree to rounding; every integer, flag and kept
# set still agrees exactly. The other policies have no state shared across rows and are
# compared bit for bit.
FLOAT_TOLERANCE = {"learned": 1e-5}


def _assert_identical(a, b, rtol=0.0):
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b), strict=True):
        x, y, where = np.asarray(x), np.asarray(y), jax.tree_util.keystr(path)
        if rtol and np.issubdtype(x.dtype, np.floating):
            np.testing.assert_allclose(x, y, rtol=rtol, atol=rtol / 10, err_msg=where)
        else:
            np.testing.assert_array_equal(x, y, err_msg=where)


# Each case compiles the decode twice: the 2 x 4 mesh for most policies, batch rows
# alone over all 8 devices for one.
CASES = [(name, (2, 4)) for name in ("h2o", "kalman", "random", "learned")] + [("rmm", (8, 1))]


@multidevice
@pytest.mark.parametrize("name, mesh_shape", CASES, ids=[f"{n}-mesh{m[0]}x{m[1]}" for n, m in CASES])
def test_sharded_decode_equals_one_device(name, mesh_shape):
    """Everything the memory holds (counters, the learned policy's network and optimizer
    state included) and every decode output is the same: bit for bit, or to rounding
    for the learned policy's floats (:data:`FLOAT_TOLERANCE`)."""
    config = flsmem.MemoryConfig(POLICIES[name], budget=6, evict_every=2)
    fresh = flsmem.init(config, B, K, {"k": (D,), "v": (D,)})
    tables = _tables(jax.random.key(7))
    run = jax.jit(decode, static_argnames="mesh")
    one_state, one_out = run(jax.device_put(fresh, jax.devices()[0]), *jax.device_put(tables, jax.devices()[0]))

    mesh = sharding.make_mesh(*mesh_shape)
    state = sharding.shard(fresh, mesh)
    keys, values, queries = (jax.device_put(x, sharding.row_sharding(mesh, x.ndim, per_head=True)) for x in tables)
    many_state, many_out = run(state, keys, values, queries, mesh=mesh)

    # Each device holds its own block of rows, all slots.
    blocks = (B // mesh_shape[0], K // mesh_shape[1], config.capacity)
    assert many_state.valid.sharding.shard_shape(many_state.valid.shape) == blocks
    assert len(many_state.valid.sharding.device_set) == DEVICES
    rtol = FLOAT_TOLERANCE.get(name, 0.0)
    _assert_identical(one_state, many_state, rtol)
    _assert_identical(one_out, many_out, rtol)
    assert int(one_state.stats.evictions.sum()) > 0


@multidevice
def test_shard_map_update_runs_the_pallas_kernel_per_device():
    """shard_map hands each device its own batch rows, so the Pallas top-k (here in
    interpret mode) runs on local blocks; it keeps exactly what one device's jnp
    reference keeps."""
    config = flsmem.MemoryConfig(P.h2o(recent=1), budget=6, evict_every=2)
    kernel = config.replace(implementation="pallas", interpret=True)
    batch = B
    keys, values, queries = _tables(jax.random.key(8))
    mesh = sharding.make_mesh(DEVICES, 1)
    update = sharding.shard_map_update(mesh)

    @jax.jit
    def run(state):
        def step(state, t):
            state = flsmem.write(state, {"k": keys[:, :, t], "v": values[:, :, t]}, jnp.full((batch,), t, jnp.int32))
            logits = jnp.einsum("bkgd,bksd->bkgs", queries[:, :, t], state.payload["k"])
            probs = jax.nn.softmax(jnp.where(flsmem.visible(state)[:, :, None], logits, -jnp.inf), axis=-1)
            attention = flsmem.reduce_query_heads(probs, "mean")
            if state.config.implementation == "pallas":
                return update(state, attention, jnp.ones((batch,))), None
            return flsmem.update(state, attention, jnp.ones((batch,))), None

        return jax.lax.scan(step, state, jnp.arange(T))[0]

    reference = run(flsmem.init(config, batch, K, {"k": (D,), "v": (D,)}))
    sharded = run(sharding.shard(flsmem.init(kernel, batch, K, {"k": (D,), "v": (D,)}), mesh, head_axis=None))
    assert sharded.valid.sharding.shard_shape(sharded.valid.shape) == (1, K, config.capacity)
    _assert_identical(reference, sharded)


@multidevice
def test_sharded_checkpoint_restores_onto_the_mesh(tmp_path):
    config = flsmem.MemoryConfig(POLICIES["rmm"], budget=6, evict_every=2)
    mesh = sharding.make_mesh(2, 4)
    fresh = sharding.shard(flsmem.init(config, B, K, {"k": (D,), "v": (D,)}), mesh)
    state, _ = jax.jit(decode, static_argnames="mesh")(fresh, *_tables(jax.random.key(9)), mesh=mesh)
    checkpoint.save_state(tmp_path / "memory", state)
    restored = checkpoint.restore_state(tmp_path / "memory", like=fresh)
    _assert_identical(state, restored)
    assert [e.sharding for e in restored.evidence] == [e.sharding for e in state.evidence]


@multidevice
def test_bad_meshes_are_named():
    state = flsmem.init(flsmem.MemoryConfig(P.h2o(), budget=4), 3, 4, {"k": (D,)})
    with pytest.raises(ValueError, match="batch B = 3 must divide evenly over mesh axis 'batch' of size 2"):
        sharding.shard(state, sharding.make_mesh(2, 4))
    explicit = jax.make_mesh((2, 4), ("batch", "heads"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    with pytest.raises(ValueError, match="needs Auto axes"):
        sharding.shard(state, explicit)
    with pytest.raises(ValueError, match="'rows' is not an axis"):
        sharding.shard(state, sharding.make_mesh(1, 4), batch_axis="rows")
    learned = flsmem.init(flsmem.MemoryConfig(E.learned(hidden=4), budget=4), 8, 1, {"k": (D,)})
    with pytest.raises(ValueError, match="cannot run the learned policy"):
        sharding.shard_map_update(sharding.make_mesh(8))(learned, jnp.zeros((8, 1, learned.slots)))
