"""Save a memory mid-stream and restore it: an orbax checkpoint of a :class:`MemoryState`.

Everything the memory carries is saved: payload, slots, evidence, scores, step,
counters and the policy's own state (``aux``; for the ``learned`` policy the
estimator's parameters and optimizer state), so a stream restored from a checkpoint
continues bit for bit as if it had never stopped.

The static config (the policy's functions) is not data: :func:`restore_state` takes a
state built like the saved one (``flsmem.init`` with the same config and shapes), checks
that its config and every array's shape and dtype match the checkpoint, and restores
the arrays onto its devices and shardings.

A checkpoint is one directory, written by orbax to a temporary name and renamed when
complete, so a save that is killed leaves no checkpoint at ``path``. Beside the arrays
it holds a manifest: each array's path in the state, shape, dtype and SHA-256 digest.
A truncated or corrupted checkpoint raises ``ValueError`` and returns nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

import jax
import numpy as np

from flsmem.config import MemoryConfig
from flsmem.state import MemoryState

__all__ = ["save_state", "restore_state", "describe_config"]

FORMAT = "flsmem.memory_state/1"
# Fields of the config that change what a memory computes; the top-k implementation
# does not (every implementation keeps the same items), so a memory saved on one
# platform restores on another.
_SEMANTIC_FIELDS = ("policy", "budget", "evict_every", "max_chunk")


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


def describe_config(config: MemoryConfig) -> dict:
    """The config fields a checkpoint must agree with, as JSON-able values."""
    return {name: _describe(getattr(config, name)) for name in _SEMANTIC_FIELDS}


def _leaves(state: MemoryState) -> list[tuple[str, jax.Array]]:
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]]


def _digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def _absolute(path) -> Path:
    # orbax wants absolute paths.
    return Path(path).expanduser().absolute()


def save_state(path, state: MemoryState, *, overwrite: bool = False) -> None:
    """Write ``state`` to the directory ``path``.

    Args:
      path: the checkpoint's directory; it must not exist unless ``overwrite``.
      state: the memory (single-process; its arrays may be sharded).
      overwrite: replace an existing checkpoint at ``path``.

    Raises:
      ValueError: ``state`` is not a MemoryState, or ``path`` exists.
    """
    import orbax.checkpoint as ocp

    if not isinstance(state, MemoryState):
        raise ValueError(f"state must be a flsmem.MemoryState, got {type(state).__name__}")
    root = _absolute(path)
    if root.exists() and not overwrite:
        raise ValueError(f"memory checkpoint {str(path)!r} exists; pass overwrite=True to replace it")
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
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        checkpointer.save(root, ocp.args.Composite(arrays=ocp.args.StandardSave(arrays),
                                                   manifest=ocp.args.JsonSave(manifest)), force=overwrite)


def _fail(path, message: str):
    raise ValueError(f"memory checkpoint {str(path)!r} {message}")


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
    import orbax.checkpoint as ocp

    if not isinstance(like, MemoryState):
        raise ValueError(f"like must be a flsmem.MemoryState (e.g. from flsmem.init), got {type(like).__name__}")
    root = _absolute(path)
    if not root.is_dir():
        _fail(path, "does not exist (or its save did not finish)")
    leaves = _leaves(like)
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
            manifest = checkpointer.restore(root, ocp.args.Composite(manifest=ocp.args.JsonRestore()))["manifest"]
    except Exception as error:  # orbax raises many kinds; each means the same here
        _fail(path, f"has no readable manifest: {type(error).__name__}: {error}")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        _fail(path, f"is not a flsmem memory checkpoint of format {FORMAT}")
    expected = describe_config(like.config)
    if manifest["config"] != expected:
        differ = sorted(k for k in expected if manifest["config"].get(k) != expected[k])
        _fail(path, f"was saved from a memory of another config (differs in {', '.join(differ)}): "
                    f"saved {[manifest['config'].get(k) for k in differ]}, given {[expected[k] for k in differ]}")
    saved = manifest["leaves"]
    wanted = [{"path": name, "shape": list(np.shape(leaf)), "dtype": np.dtype(leaf.dtype).name}
              for name, leaf in leaves]
    for have, want in zip(saved, wanted):
        if {k: have[k] for k in want} != want:
            _fail(path, f"holds {have['path']} as {have['dtype']}{have['shape']}, but the given state has "
                        f"{want['path']} as {want['dtype']}{want['shape']}")
    if len(saved) != len(wanted):
        _fail(path, f"holds {len(saved)} arrays, the given state {len(wanted)} (another policy state?)")

    def abstract(leaf):
        sharding = getattr(leaf, "sharding", None)
        return jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype, sharding=sharding)

    target = {f"{i:04d}": abstract(leaf) for i, (_, leaf) in enumerate(leaves)}
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
            arrays = checkpointer.restore(root, ocp.args.Composite(arrays=ocp.args.StandardRestore(target)))["arrays"]
    except Exception as error:
        _fail(path, f"could not be read (truncated or corrupted?): {type(error).__name__}: {error}")
    restored = [arrays[f"{i:04d}"] for i in range(len(leaves))]
    for entry, array in zip(saved, restored):
        if _digest(np.asarray(jax.device_get(array))) != entry["sha256"]:
            _fail(path, f"is corrupted: {entry['path']} does not match its SHA-256 digest")
    return jax.tree_util.tree_unflatten(jax.tree.structure(like), restored)
