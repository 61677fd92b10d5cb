"""Orbax checkpoints, written atomically: any pytree, and a memory mid-stream.

One mechanism serves every checkpoint in the project (a memory, a model's parameters,
a training run's state, an estimator):

* :func:`save_tree` writes a pytree, with an optional JSON manifest, into a temporary
  sibling of its directory and renames it into place once complete, so a save that is
  killed never leaves a half-written checkpoint where a finished one is looked for;
* :func:`restore_tree` reads one back against an abstract target (shapes, dtypes,
  shardings), :func:`read_manifest` its manifest and :func:`saved_shapes` what it holds.
  Anything unreadable raises ``ValueError`` naming the checkpoint; nothing is returned
  in part.

On top of them, :func:`save_state` and :func:`restore_state` save a :class:`MemoryState`.
Everything the memory carries is saved: payload, slots, evidence, scores, step,
counters and the policy's own state (``aux``; for the ``learned`` policy the
estimator's parameters and optimizer state), so a stream restored from a checkpoint
continues bit for bit as if it had never stopped.

The static config (the policy's functions) is not data: :func:`restore_state` takes a
state built like the saved one (``flsmem.init`` with the same config and shapes), checks
that its config and every array's shape and dtype match the checkpoint, and restores
the arrays onto its devices and shardings. Its manifest records each array's path in
the state, shape, dtype and SHA-256 digest, so a corrupted checkpoint is caught.
"""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
import uuid
from pathlib import Path
from typing import Any

import jax
import numpy as np

from flsmem.config import MemoryConfig
from flsmem.state import MemoryState
from flsmem.typing import PyTree

__all__ = [
    "PARTIAL",
    "save_tree",
    "restore_tree",
    "read_manifest",
    "saved_shapes",
    "abstract_tree",
    "save_state",
    "restore_state",
    "describe_config",
]

# Marks the temporary directory of a save in progress: `<name>.partial-<id>`.
PARTIAL = ".partial-"
# With a manifest, the tree and the manifest are two items of one orbax checkpoint.
_ARRAYS, _MANIFEST = "arrays", "manifest"

# The layout of the saved state: 2 holds the evidence as a tuple of arrays (1 held one
# array with the statistics last, which this version cannot read).
FORMAT = "flsmem.memory_state/2"
_MEMORY = "memory checkpoint"
# Fields of the config that change what a memory computes; the top-k implementation
# does not (every implementation keeps the same items), so a memory saved on one
# platform restores on another.
_SEMANTIC_FIELDS = ("policy", "budget", "evict_every", "max_chunk")


def _absolute(path) -> Path:
    # orbax wants absolute paths.
    return Path(path).expanduser().absolute()


def _fail(what: str, path, message: str):
    raise ValueError(f"{what} {str(path)!r} {message}")


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _write(directory: Path, tree: PyTree, manifest: dict | None) -> None:
    import orbax.checkpoint as ocp

    if manifest is None:
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(directory, tree)
            checkpointer.wait_until_finished()
    else:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
            checkpointer.save(directory, ocp.args.Composite(**{
                _ARRAYS: ocp.args.StandardSave(tree), _MANIFEST: ocp.args.JsonSave(manifest)}))
    # Orbax's commit markers record the absolute path written to, here the temporary
    # one; a local restore does not read them, and a checkpoint that is copied or
    # shipped should not carry the writer's file system.
    for marker in directory.rglob("commit_success.txt"):
        marker.unlink()


def save_tree(path, tree: PyTree, *, manifest: dict | None = None, overwrite: bool = False,
              what: str = "checkpoint") -> Path:
    """Write the pytree ``tree`` (and a JSON ``manifest``) to the directory ``path``.

    The checkpoint is written in full to a temporary sibling (``<name>.partial-<id>``)
    and then renamed to ``path``. An earlier checkpoint being replaced is moved aside
    just before and deleted just after, so a crash leaves at ``path`` either a complete
    checkpoint or none, never part of one.

    Layout: without a manifest, orbax's standard pytree layout at ``path``; with one,
    the tree in ``path/arrays`` and the manifest in ``path/manifest``.

    Args:
      path: the checkpoint's directory; its parent is created if missing.
      tree: a pytree of arrays (single-process; they may be sharded).
      manifest: JSON-able record saved with the tree (read with :func:`read_manifest`).
      overwrite: replace a checkpoint already at ``path``.
      what: how errors name the checkpoint (``"memory checkpoint"``, ...).

    Returns:
      ``path`` as an absolute path.

    Raises:
      ValueError: ``path`` exists and not ``overwrite``.
    """
    root = _absolute(path)
    if root.exists() and not overwrite:
        _fail(what, path, "exists; pass overwrite=True to replace it")
    root.parent.mkdir(parents=True, exist_ok=True)
    partial = root.with_name(f"{root.name}{PARTIAL}{uuid.uuid4().hex[:12]}")
    try:
        _write(partial, tree, manifest)
        if root.exists():
            aside = root.with_name(f"{partial.name}-old")
            root.rename(aside)
            partial.rename(root)
            _remove(aside)
        else:
            partial.rename(root)
    finally:
        if partial.exists():
            _remove(partial)
    return root


def abstract_tree(tree: PyTree) -> PyTree:
    """``tree`` with every leaf (an array or a ``jax.ShapeDtypeStruct``) as a
    ``jax.ShapeDtypeStruct`` of its shape, dtype and sharding; a leaf without a
    sharding gets the default device's, where orbax would otherwise guess one."""
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def abstract(leaf):
        sharding = getattr(leaf, "sharding", None) or device
        return jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype, sharding=sharding)

    return jax.tree.map(abstract, tree)


def _finished(path, what: str) -> Path:
    root = _absolute(path)
    if not root.is_dir():
        _fail(what, path, "does not exist (or its save did not finish)")
    return root


def restore_tree(path, target: PyTree, *, what: str = "checkpoint") -> PyTree:
    """Read the pytree saved by :func:`save_tree` (or by orbax's ``StandardCheckpointer``).

    Args:
      path: the checkpoint's directory.
      target: the tree to restore into: its structure, and each leaf's shape, dtype and
        sharding (see :func:`abstract_tree`); arrays or ``jax.ShapeDtypeStruct``.
      what: how errors name the checkpoint.

    Returns:
      The saved tree, as jax arrays placed like ``target``'s leaves.

    Raises:
      ValueError: there is no finished checkpoint at ``path``, or it cannot be read
        into ``target`` (truncated or corrupted files, another structure or shape).
    """
    import orbax.checkpoint as ocp

    root = _finished(path, what)
    abstract = abstract_tree(target)
    try:
        if (root / _ARRAYS).is_dir():
            with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
                items = checkpointer.restore(root, ocp.args.Composite(**{_ARRAYS: ocp.args.StandardRestore(abstract)}))
            return items[_ARRAYS]
        with ocp.StandardCheckpointer() as checkpointer:
            return checkpointer.restore(root, abstract)
    except Exception as error:  # orbax raises many kinds; each means the same here
        _fail(what, path, f"could not be read (truncated or corrupted?): {type(error).__name__}: {error}")


def read_manifest(path, *, what: str = "checkpoint") -> dict:
    """The JSON manifest saved with a tree by :func:`save_tree`.

    Raises:
      ValueError: there is no finished checkpoint at ``path``, or no readable manifest.
    """
    import orbax.checkpoint as ocp

    root = _finished(path, what)
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
            manifest = checkpointer.restore(root, ocp.args.Composite(**{_MANIFEST: ocp.args.JsonRestore()}))[_MANIFEST]
    except Exception as error:
        _fail(what, path, f"has no readable manifest: {type(error).__name__}: {error}")
    if not isinstance(manifest, dict):
        _fail(what, path, f"has no readable manifest: expected a JSON object, got {type(manifest).__name__}")
    return manifest


def saved_shapes(path, *, what: str = "checkpoint") -> PyTree:
    """The structure of the tree saved at ``path``, with a ``jax.ShapeDtypeStruct`` per
    array, read from orbax's metadata without reading the arrays (to build a target
    when the shapes depend on what was saved).

    Raises:
      ValueError: there is no finished checkpoint at ``path``, or no readable metadata.
    """
    import orbax.checkpoint as ocp

    root = _finished(path, what)
    tree_dir = root / _ARRAYS if (root / _ARRAYS).is_dir() else root
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            metadata = checkpointer.metadata(tree_dir)
        tree = metadata.item_metadata.tree if hasattr(metadata, "item_metadata") else metadata
        return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype), tree)
    except Exception as error:
        _fail(what, path, f"has no readable metadata: {type(error).__name__}: {error}")


def _describe(value: Any) -> Any:
    """A JSON-able description of a config value, equal for equal values."""
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{value.__module__}.{value.__qualname__}"
    if dataclasses.is_dataclass(value):
        return {f.name: _describe(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)  # e.g. estimator Weights: their repr holds a digest of the content


def _set_fields(description: Any) -> Any:
    """A description without its unset (None) entries: a field added to a policy later,
    unset, leaves the checkpoints saved before it comparable."""
    if isinstance(description, dict):
        return {k: _set_fields(v) for k, v in description.items() if v is not None}
    if isinstance(description, list):
        return [_set_fields(v) for v in description]
    return description


def describe_config(config: MemoryConfig) -> dict:
    """The config fields a checkpoint must agree with, as JSON-able values."""
    return {name: _describe(getattr(config, name)) for name in _SEMANTIC_FIELDS}


def _leaves(state: MemoryState) -> list[tuple[str, jax.Array]]:
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]]


def _digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def save_state(path, state: MemoryState, *, overwrite: bool = False) -> None:
    """Write ``state`` to the directory ``path`` (atomically, see :func:`save_tree`).

    Args:
      path: the checkpoint's directory; it must not exist unless ``overwrite``.
      state: the memory (single-process; its arrays may be sharded).
      overwrite: replace an existing checkpoint at ``path``.

    Raises:
      ValueError: ``state`` is not a MemoryState, or ``path`` exists.
    """
    if not isinstance(state, MemoryState):
        raise ValueError(f"state must be a flsmem.MemoryState, got {type(state).__name__}")
    leaves = _leaves(state)
    host = [np.asarray(jax.device_get(leaf)) for _, leaf in leaves]
    manifest = {
        "format": FORMAT,
        "config": describe_config(state.config),
        # Arrays are stored under their index: state paths hold characters orbax keys may not.
        "leaves": [{"path": name, "shape": list(a.shape), "dtype": a.dtype.name, "sha256": _digest(a)}
                   for (name, _), a in zip(leaves, host)],
    }
    arrays = {f"{i:04d}": leaf for i, (_, leaf) in enumerate(leaves)}
    save_tree(path, arrays, manifest=manifest, overwrite=overwrite, what=_MEMORY)


def _check_manifest(path, manifest: dict, like: MemoryState) -> list[dict]:
    """The manifest's entry per array, once it is known to describe a memory like ``like``."""
    if manifest.get("format") != FORMAT:
        _fail(_MEMORY, path, f"is not a flsmem memory checkpoint of format {FORMAT}")
    expected = describe_config(like.config)
    if _set_fields(manifest["config"]) != _set_fields(expected):
        differ = sorted(k for k in expected if manifest["config"].get(k) != expected[k])
        _fail(_MEMORY, path, f"was saved from a memory of another config (differs in {', '.join(differ)}): "
                             f"saved {[manifest['config'].get(k) for k in differ]}, "
                             f"given {[expected[k] for k in differ]}")
    saved = manifest["leaves"]
    wanted = [{"path": name, "shape": list(np.shape(leaf)), "dtype": np.dtype(leaf.dtype).name}
              for name, leaf in _leaves(like)]
    for have, want in zip(saved, wanted):
        if {k: have[k] for k in want} != want:
            _fail(_MEMORY, path, f"holds {have['path']} as {have['dtype']}{have['shape']}, but the given state "
                                 f"has {want['path']} as {want['dtype']}{want['shape']}")
    if len(saved) != len(wanted):
        _fail(_MEMORY, path, f"holds {len(saved)} arrays, the given state {len(wanted)} (another policy state?)")
    return saved


def restore_state(path, like: MemoryState) -> MemoryState:
    """Read a state written by :func:`save_state`.

    Args:
      path: the checkpoint's directory.
      like: a state built like the saved one (same config, batch, KV heads, payload
        shapes and dtypes), for example ``flsmem.init(config, ...)``; the restored
        arrays get its devices and shardings.

    Returns:
      The saved state, bit for bit.

    Raises:
      ValueError: there is no finished checkpoint at ``path``, it was saved from a
        memory of another config or shape, or its files are truncated or corrupted.
        Nothing is returned in part.
    """
    if not isinstance(like, MemoryState):
        raise ValueError(f"like must be a flsmem.MemoryState (e.g. from flsmem.init), got {type(like).__name__}")
    saved = _check_manifest(path, read_manifest(path, what=_MEMORY), like)
    leaves = [leaf for _, leaf in _leaves(like)]
    arrays = restore_tree(path, {f"{i:04d}": leaf for i, leaf in enumerate(leaves)}, what=_MEMORY)
    restored = [arrays[f"{i:04d}"] for i in range(len(leaves))]
    for entry, array in zip(saved, restored):
        if _digest(np.asarray(jax.device_get(array))) != entry["sha256"]:
            _fail(_MEMORY, path, f"is corrupted: {entry['path']} does not match its SHA-256 digest")
    return jax.tree_util.tree_unflatten(jax.tree.structure(like), restored)
