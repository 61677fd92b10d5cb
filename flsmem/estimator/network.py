"""The :class:`ImportanceNet` that scores slots from their :data:`FEATURES`, its fresh
parameters, and :class:`Weights`, parameters frozen into a policy."""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flsmem import validate
from flsmem.estimator.evidence import FEATURES
from flsmem.typing import Array, Float, PyTree

__all__ = ["ImportanceNet", "PRIORS", "Weights", "init_params", "predict"]


class ImportanceNet(nnx.Module):
    """Features ``[..., F]`` to the predicted label ``[...]``: a linear part over the
    features plus two hidden layers ("wide and deep"). The linear part can rank exactly
    as one feature does, so a network can start as a heuristic (see ``prior`` in
    :func:`init_params`) and learn corrections to it."""

    def __init__(self, hidden: int, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(len(FEATURES), 1, rngs=rngs)
        self.inner = nnx.Linear(len(FEATURES), hidden, rngs=rngs)
        self.middle = nnx.Linear(hidden, hidden, rngs=rngs)
        self.outer = nnx.Linear(hidden, 1, rngs=rngs)

    def __call__(self, x: Float[Array, "*N F"]) -> Float[Array, "*N"]:
        h = nnx.gelu(self.inner(x))
        h = nnx.gelu(self.middle(h))
        return (self.linear(x) + self.outer(h))[..., 0]


@functools.lru_cache(maxsize=None)
def _graphdef(hidden: int):
    return nnx.split(nnx.eval_shape(lambda: ImportanceNet(hidden, rngs=nnx.Rngs(0))))[0]


PRIORS = {"h2o": FEATURES.index("log_h2o_score"), "rmm": FEATURES.index("log_rmm_score"),
          "far": FEATURES.index("log_far_attention")}


def init_params(hidden: int = 32, seed: int = 0, prior: str | None = None) -> PyTree:
    """Fresh parameters of an :class:`ImportanceNet`, as a plain dict of arrays.

    With ``prior`` ("h2o", "rmm" or "far") the network starts as that heuristic: its
    output is the log of the heuristic's score ("far": H2O's sum over the reads after an
    item's first 16 queries only) (the linear part picks that feature, every other
    output weight is 0), so it ranks as the heuristic until it learns otherwise.
    """
    hidden = validate.positive_int("hidden", hidden)
    validate.nonneg_int("seed", seed)
    validate.one_of("prior", prior, (None, *PRIORS))
    params = nnx.to_pure_dict(nnx.split(ImportanceNet(hidden, rngs=nnx.Rngs(seed)))[1])
    if prior is None:
        params["linear"]["kernel"] = jnp.zeros_like(params["linear"]["kernel"])
    else:
        params["linear"]["kernel"] = jnp.zeros_like(params["linear"]["kernel"]).at[PRIORS[prior], 0].set(1.0)
        params["outer"]["kernel"] = jnp.zeros_like(params["outer"]["kernel"])
    return params


@functools.lru_cache(maxsize=None)
def param_shapes(hidden: int) -> PyTree:
    """The shapes and dtypes of an :class:`ImportanceNet`'s parameters, without drawing them."""
    return nnx.to_pure_dict(nnx.split(nnx.eval_shape(lambda: ImportanceNet(hidden, rngs=nnx.Rngs(0))))[1])


def hidden_of(params: PyTree) -> int:
    """The width of the network ``params`` belong to."""
    return int(params["inner"]["kernel"].shape[-1])


def predict(params: PyTree, x: Float[Array, "*N F"]) -> Float[Array, "*N"]:
    """The network's output for features ``x`` (see :data:`FEATURES`)."""
    return nnx.merge(_graphdef(hidden_of(params)), params)(x)


class Weights:
    """Estimator parameters frozen into a policy.

    Hashed and compared by content, so a policy that holds them is a static argument
    of ``jax.jit``: equal weights give equal policies and no retrace.
    """

    def __init__(self, params: PyTree):
        leaves = jax.tree.leaves(params)
        validate.require(bool(leaves), "params must be a non-empty pytree of arrays")
        self.params = jax.tree.map(lambda x: np.array(x, copy=True), params)
        digest = hashlib.sha256()
        for path, leaf in jax.tree_util.tree_flatten_with_path(self.params)[0]:
            leaf.setflags(write=False)
            digest.update(jax.tree_util.keystr(path).encode())
            digest.update(str((leaf.dtype, leaf.shape)).encode())
            digest.update(leaf.tobytes())
        self.digest = digest.hexdigest()

    def __hash__(self) -> int:
        return hash(self.digest)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Weights) and other.digest == self.digest

    def __repr__(self) -> str:
        return f"Weights({self.digest[:12]})"
