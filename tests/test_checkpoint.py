"""Faults: a memory saved mid-stream and restored continues bit for bit; damaged
checkpoints are clear errors, never partial states."""

import functools
from importlib import resources
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flsmem
from flsmem import checkpoint
from flsmem import estimator as E
from flsmem import policies as P
from flsmem import testing

STEPS = 24  # half before the save, half after
B, K = 2, 2


@functools.partial(jax.jit, static_argnames=("steps",))
def stream(state, table, start, *, steps):
    """``steps`` decode steps from position ``start``: write, then update."""

    def body(state, t):
        kv = {"k": jnp.full((B, K, testing.HEAD_DIM), jnp.sin(t + 1.0)),
              "v": jnp.full((B, K, testing.HEAD_DIM), jnp.cos(t + 1.0))}
        state = flsmem.write(state, kv, jnp.full((B,), t))
        attention = testing.gather_attention(table, state)[:, :, 0]
        return flsmem.update(state, attention, jnp.where(t % 3 == 0, 0.5, 1.0) * jnp.ones((B,))), None

    return jax.lax.scan(body, state, start + jnp.arange(steps))[0]


POLICIES = {
    "rmm": P.rmm(lag=2, recent=1, decay=0.95),
    "kalman": P.kalman(adaptive=True, lag=1),
    # Online learning: parameters and Adam state change every 4 queries.
    "learned": E.learned(horizon=4, hidden=8, learning_rate=1e-2),
}


def _assert_identical(a, b):
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("name", list(POLICIES))
def test_restored_stream_continues_bit_for_bit(tmp_path, name):
    config = flsmem.MemoryConfig(POLICIES[name], budget=6, evict_every=2)
    table = testing.attention_table(jax.random.key(3), B, K, STEPS)
    fresh = testing.tiny_memory(config, batch=B, kv_heads=K)
    unbroken = stream(stream(fresh, table, 0, steps=STEPS // 2), table, STEPS // 2, steps=STEPS // 2)

    middle = stream(fresh, table, 0, steps=STEPS // 2)
    checkpoint.save_state(tmp_path / "memory", middle)
    restored = checkpoint.restore_state(tmp_path / "memory", like=fresh)
    _assert_identical(middle, restored)
    resumed = stream(restored, table, STEPS // 2, steps=STEPS // 2)
    _assert_identical(unbroken, resumed)
    assert int(resumed.stats.evictions.sum()) > 0
    if name == "learned":
        assert int(resumed.aux["updates"]) > int(middle.aux["updates"]) > 0
        assert int(resumed.aux["opt"][1][0].count) > 0  # Adam's step count came back too


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of an rmm memory after a few steps, and an empty memory like it."""
    config = flsmem.MemoryConfig(POLICIES["rmm"], budget=6, evict_every=2)
    fresh = testing.tiny_memory(config, batch=B, kv_heads=K)
    state = stream(fresh, testing.attention_table(jax.random.key(4), B, K, STEPS), 0, steps=STEPS // 2)
    path = tmp_path_factory.mktemp("saved") / "memory"
    checkpoint.save_state(path, state)
    return path, fresh, state


def _copy(path, tmp_path):
    import shutil

    target = tmp_path / "copy"
    shutil.copytree(path, target)
    return target


def _files(path):
    return sorted(p for p in path.rglob("*") if p.is_file())


def test_every_truncated_file_is_a_clear_error(saved, tmp_path):
    path, fresh, _ = saved
    files = _files(path)
    assert len(files) >= 3
    for i, victim in enumerate(files):
        copy = _copy(path, tmp_path / str(i))
        damaged = copy / victim.relative_to(path)
        damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
        try:
            restored = checkpoint.restore_state(copy, like=fresh)
        except ValueError as error:
            assert str(copy) in str(error)
            continue
        # orbax may ignore a file it does not need (metadata it can rebuild); then the
        # restored state must still be exactly the saved one.
        _assert_identical(restored, saved[2])


def test_flipped_bytes_in_the_data_are_caught(saved, tmp_path):
    path, fresh, _ = saved
    copy = _copy(path, tmp_path)
    data = max(_files(copy / "arrays"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    for i in range(len(raw) // 3, len(raw) // 3 + 16):
        raw[i] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="corrupted|could not be read"):
        checkpoint.restore_state(copy, like=fresh)


def test_missing_unfinished_or_mismatched_checkpoints_are_clear_errors(saved, tmp_path):
    path, fresh, state = saved
    with pytest.raises(ValueError, match="does not exist"):
        checkpoint.restore_state(tmp_path / "never-saved", like=fresh)
    copy = _copy(path, tmp_path)
    for manifest in (copy / "manifest").rglob("*"):
        if manifest.is_file():
            manifest.unlink()
    with pytest.raises(ValueError, match="manifest"):
        checkpoint.restore_state(copy, like=fresh)
    other = flsmem.MemoryConfig(P.rmm(lag=3, recent=1, decay=0.95), budget=6, evict_every=2)
    with pytest.raises(ValueError, match="another config.*policy"):
        checkpoint.restore_state(path, like=testing.tiny_memory(other, batch=B, kv_heads=K))
    with pytest.raises(ValueError, match=r"holds .payload\['k'\] as float32\[2, 2, 8, 4\]"):
        checkpoint.restore_state(path, like=testing.tiny_memory(state.config, batch=B, kv_heads=1))
    with pytest.raises(ValueError, match="exists"):
        checkpoint.save_state(path, state)
    with pytest.raises(ValueError, match="like must be"):
        checkpoint.restore_state(path, like={"valid": fresh.valid})


def test_the_top_k_implementation_may_differ_on_restore(saved):
    path, fresh, state = saved
    like = testing.tiny_memory(state.config.replace(implementation="pallas", interpret=True), batch=B, kv_heads=K)
    restored = checkpoint.restore_state(path, like=like)
    assert restored.config.implementation == "pallas"
    _assert_identical(restored, state)


# ------------------------------------------------------------ the generic mechanism


TREE = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "n": {"count": np.array(7, np.int32)}}


def _same_tree(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("manifest", [None, {"step": 3, "settings": {"lr": 0.01}}])
def test_save_tree_round_trip(tmp_path, manifest):
    path = checkpoint.save_tree(tmp_path / "tree", TREE, manifest=manifest)
    _same_tree(checkpoint.restore_tree(path, TREE), TREE)
    # An abstract target is enough; the shapes can be read without the arrays.
    shapes = checkpoint.saved_shapes(path)
    assert shapes["w"].shape == (3, 4) and shapes["n"]["count"].dtype == np.int32
    _same_tree(checkpoint.restore_tree(path, checkpoint.abstract_tree(shapes)), TREE)
    if manifest is not None:
        assert checkpoint.read_manifest(path) == manifest
    assert not list(path.rglob("commit_success.txt"))  # no trace of the writer's paths
    assert [p.name for p in tmp_path.iterdir()] == ["tree"]  # no temporary left beside it


def test_save_tree_replaces_only_when_told(tmp_path):
    path = checkpoint.save_tree(tmp_path / "tree", TREE)
    with pytest.raises(ValueError, match="exists; pass overwrite=True"):
        checkpoint.save_tree(path, TREE)
    doubled = jax.tree.map(lambda x: 2 * x, TREE)
    checkpoint.save_tree(path, doubled, overwrite=True)
    _same_tree(checkpoint.restore_tree(path, TREE), doubled)
    assert [p.name for p in tmp_path.iterdir()] == ["tree"]


def test_a_save_that_dies_leaves_no_checkpoint_in_place(tmp_path, monkeypatch):
    path = checkpoint.save_tree(tmp_path / "tree", TREE)
    write = checkpoint._write

    def dies_half_way(directory, tree, manifest):
        write(directory, tree, manifest)
        next(directory.rglob("manifest.ocdbt")).unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "_write", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_tree(path, jax.tree.map(lambda x: 2 * x, TREE), overwrite=True)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_tree(tmp_path / "never", TREE)
    _same_tree(checkpoint.restore_tree(path, TREE), TREE)  # the old checkpoint, whole
    assert [p.name for p in tmp_path.iterdir()] == ["tree"]


def test_restore_tree_errors_name_the_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="'nowhere' does not exist"):
        checkpoint.restore_tree("nowhere", TREE, what="parameters")
    path = checkpoint.save_tree(tmp_path / "tree", TREE)
    with pytest.raises(ValueError, match="could not be read"):
        checkpoint.restore_tree(path, {"w": np.zeros((4, 4), np.float32), "n": TREE["n"]})
    with pytest.raises(ValueError, match="no readable manifest"):
        checkpoint.read_manifest(path)


def test_the_shipped_checkpoints_read_through_the_generic_helpers():
    from flsmem.models.tiny import CHECKPOINT_DIR

    estimator = Path(str(resources.files("flsmem.checkpoints"))) / "estimator" / "params"
    kernel = checkpoint.saved_shapes(estimator)["inner"]["kernel"]
    assert kernel.shape[0] == len(E.FEATURES)
    params = checkpoint.saved_shapes(CHECKPOINT_DIR / "params")
    assert len(jax.tree.leaves(params)) > 0


def test_a_policy_field_added_unset_leaves_older_manifests_comparable():
    import copy

    config = flsmem.MemoryConfig(flsmem.policies.h2o(recent=2), budget=8)
    now = checkpoint.describe_config(config)
    before = copy.deepcopy(now)
    for field in ("fold_queries", "head_budget", "layer_schedule"):
        assert now["policy"][field] is None
        del before["policy"][field]
    assert checkpoint._set_fields(before) == checkpoint._set_fields(now)
    # A field that is set still tells configs apart.
    wrapped = checkpoint.describe_config(config.replace(policy=flsmem.policies.adakv(config.policy)))
    assert checkpoint._set_fields(wrapped) != checkpoint._set_fields(now)
