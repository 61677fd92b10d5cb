"""Estimator checkpoints: :func:`save` and :func:`load` the parameters (an orbax
checkpoint) with the settings they were trained with, and :func:`from_checkpoint` builds
the policy from both. A checkpoint may also hold the optimizer state its pretraining
ended with (:func:`load_optimizer`), for online learning that continues it rather than
starting Adam's moments afresh. A missing, truncated or corrupted checkpoint, or one
whose network reads other features than :data:`~flsmem.estimator.FEATURES`, is refused
with a ``ValueError`` before anything partial is returned."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from flsmem.checkpoint import abstract_tree, restore_tree, save_tree
from flsmem.estimator.evidence import FEATURES
from flsmem.estimator.labels import optimizer
from flsmem.estimator.learner import learned
from flsmem.estimator.network import Weights, hidden_of, param_shapes
from flsmem.policies import Policy
from flsmem.typing import PyTree

__all__ = ["from_checkpoint", "load", "load_optimizer", "load_settings", "save"]


def save(path, params: PyTree, settings: dict | None = None, optimizer_state: PyTree | None = None) -> None:
    """Write estimator parameters to the directory ``path`` (created; it must not
    exist): an orbax checkpoint in ``path/params``, when given the ``settings`` they
    were trained with (horizon, label, ...) in ``path/settings.json``, and when given
    the ``optimizer_state`` their training ended with (the ``"opt"`` entry of the
    learned state) in ``path/optimizer``."""
    root = _absolute(path)
    if root.exists():
        raise ValueError(f"estimator checkpoint {str(path)!r} exists; choose a new directory")
    # flsmem.checkpoint's writer: atomic, and no trace of the writer's paths in the files.
    save_tree(root / "params", jax.tree.map(np.asarray, params), what="estimator checkpoint")
    if optimizer_state is not None:
        save_tree(root / "optimizer", jax.tree.map(np.asarray, optimizer_state), what="estimator checkpoint")
    if settings is not None:
        (root / "settings.json").write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")


def load(path) -> Weights:
    """Read estimator parameters written by :func:`save` (or by
    ``train/train_estimator.py``) as :class:`Weights` for :func:`learned`.

    Raises:
      ValueError: the directory is missing, or its content is not a complete estimator
        checkpoint (truncated or corrupted files); nothing partial is returned.
    """
    import orbax.checkpoint as ocp

    full = _absolute(path) / "params"
    if not full.is_dir():
        raise ValueError(f"estimator checkpoint {str(path)!r} has no params directory")
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            metadata = checkpointer.metadata(full)
            tree = metadata.item_metadata.tree if hasattr(metadata, "item_metadata") else metadata
            inputs, width = (int(n) for n in _leaf_shape(tree["inner"]["kernel"]))
            if inputs != len(FEATURES):
                raise ValueError(f"its network reads {inputs} features, this flsmem computes {len(FEATURES)} "
                                 f"(FEATURES); retrain it with train/train_estimator.py")
            target = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), param_shapes(width))
            params = checkpointer.restore(full, target)
        weights = Weights(jax.tree.map(np.asarray, params))
    except Exception as error:  # orbax raises many kinds; none may leave partial state
        raise ValueError(f"estimator checkpoint {str(path)!r} could not be read: {error}") from error
    if not all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(weights.params)):
        raise ValueError(f"estimator checkpoint {str(path)!r} holds non-finite parameters")
    return weights


def load_optimizer(path, policy: Policy) -> PyTree:
    """The optimizer state saved beside the parameters at ``path``, in the form
    ``policy``'s state holds it (the ``"opt"`` entry of :func:`learned`'s state and of
    :func:`~flsmem.estimator.carry_over`): online learning from it continues the
    pretraining's Adam moments and step count instead of starting them afresh.

    Raises:
      ValueError: the checkpoint holds no optimizer state (written without one), or it
        does not match ``policy``'s optimizer.
    """
    full = _absolute(path) / "optimizer"
    if not full.is_dir():
        raise ValueError(f"estimator checkpoint {str(path)!r} holds no optimizer state (saved without it); "
                         f"retrain it with train/train_estimator.py --out, which saves it")
    params = load(path).params
    target = abstract_tree(optimizer(policy).init(jax.tree.map(np.asarray, params)))
    return restore_tree(full, target, what="estimator checkpoint")


def load_settings(path) -> dict:
    """The settings saved beside the parameters by :func:`save` ({} if none)."""
    file = _absolute(path) / "settings.json"
    return json.loads(file.read_text()) if file.is_file() else {}


def from_checkpoint(path, *, online: bool = True, learning_rate: float = 1e-3, fresh: bool = False,
                    **protection) -> Policy:
    """The :func:`learned` policy with the weights saved at ``path`` and the horizon,
    snapshots, label, loss and prior they were trained with (``settings.json``; a
    checkpoint saved without ``snapshots`` had one).

    Args:
      path: a directory written by :func:`save` or ``train/train_estimator.py``.
      online: keep learning while serving.
      learning_rate: step size of the online updates.
      fresh: start from a fresh network of the same width instead of the saved
        weights (learning from scratch, with the same settings).
      protection: ``sinks``, ``recent``, ``lag`` (0 by default: decide at H = 0).
    """
    weights = load(path)
    settings = load_settings(path)
    return learned(None if fresh else weights, online=online, learning_rate=learning_rate,
                   hidden=hidden_of(weights.params), horizon=settings.get("horizon", 32),
                   snapshots=settings.get("snapshots", 1),
                   label=settings.get("label", "peak"), loss=settings.get("loss", "squared"),
                   prior=settings.get("prior"), **protection)


def _leaf_shape(meta) -> tuple[int, ...]:
    return tuple(getattr(meta, "shape", np.shape(meta)))


def _absolute(path) -> Path:
    return Path(path).absolute()
