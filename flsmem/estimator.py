"""A learned importance estimator, trained online from the labels that mature H queries
after each decision.

A small :class:`ImportanceNet` scores every slot from cheap per-slot features. The
label it learns is free: ``horizon`` queries after a snapshot of a slot's features,
the slot's demonstrated utility over those queries is known,

    label = log(1 + peak over the next ``horizon`` queries of w_s * n_s * a_s(i)),

with w_s the correctness weight of query s and n_s * a_s(i) the attention relative to
uniform (n_s the items the query could attend, so 1 means "as much as any item", and
the label means the same at every memory size); the "sum" label adds the queries up
instead. The policy ranks slots by the predicted label, so it decides at commit lag
H = 0 without paying the lag's memory.

A row snapshots its slots' features every ``horizon / snapshots`` queries, and each
snapshot is labelled ``horizon`` queries after it was taken, so ``snapshots`` of them
are in flight at once, each gathering the utility every slot shows. When one is due,
its slots that still hold the same item (by its birth step) get their labels, the
network takes one optax step on them, and the snapshot is taken again from the slots
held now. The horizon must reach past the gap between two reads of an item: an item
read again 150 queries after its last use shows nothing over a horizon of 64, gets
label 0 and is learnt as one to evict. A long horizon with one snapshot would label
(and learn) rarely; several in flight keep labels coming every ``horizon / snapshots``
queries while each reaches the whole horizon ahead.

A stream that ends leaves its in-flight snapshots unlabelled. For offline pretraining,
:func:`flush` labels each with what it gathered up to the end, which for a stream that
ends there is the truth (the peak over the rest of the stream), and takes one step on
them all: with a horizon as long as the stream, every label reaches to its end.

The parameters and the optimizer state live in the memory's ``aux``, so online
learning is a pure function of the state inside a jitted loop, with no retrace. A step
whose loss or gradient is not finite is skipped and counted; a score that is not
finite falls back to the ``rmm`` score for the row (``stats.fallbacks``).

Features (each chosen because one baseline or the oracle's behaviour depends on it):

* the scores of H2O (attention summed over the slot's life) and RMM (the same,
  weighted by correctness), so the network can at least rank as they do;
* attention relative to uniform, summed, weighted by correctness, both also per query
  of age (the means do not grow with age), the last query's (what TOVA ranks by), the
  largest and a fast moving average (recent use);
* the correctness weight of the prediction that produced the item: an item the model
  itself produced, confidently and correctly, is the kind an endogenous reuse reads
  back later;
* log age and age relative to the stream's length (how long it has been useful);
* log key and value norms at write time (key-norm eviction ranks by the first);
* log position: the first items of a stream are attention sinks (StreamingLLM keeps
  them whatever their age);
* attention (as H2O sums it) and correctness-weighted relative attention received
  after the item's first 16 queries: reads by the tokens right after an item are local
  and come to every item, later reads are retrievals, the kind a reuse repeats;
* what kind of head holds the slot (one network serves every layer and head, and they
  need different rankings): the share of the head's attention that goes to items past
  their first 16 queries, and how much larger that share is when the head's
  prediction is right than when it is wrong (a retrieval head reads far items in order
  to predict; a diffuse one spreads over them whatever it predicts).

Labels are censored by eviction: only items still held when their snapshot is labelled
get a label, so the estimator learns from what its policy kept.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from flsmem import validate
from flsmem.policies import Observation, Params, Policy, SlotView
from flsmem.typing import Array, Float, PyTree

__all__ = [
    "FEATURES",
    "GuidedParams",
    "ImportanceNet",
    "LearnedParams",
    "PRIORS",
    "Weights",
    "carry_over",
    "features",
    "flush",
    "from_checkpoint",
    "guided",
    "init_params",
    "learned",
    "load",
    "load_settings",
    "predict",
    "save",
]

# Evidence columns.
(_H2O, _RMM, _SUM, _UTILITY, _LAST, _MAX, _RECENT, _PRODUCER, _KEY_NORM, _VALUE_NORM,
 _FAR_ATTENTION, _FAR_UTILITY) = range(12)
_NUM_EVIDENCE = 12
# Reads of an item in its first _FAR_AGE queries are mostly local (the tokens right
# after it read it, whatever it holds); later reads are retrievals. On the chain task
# ranking by far reads alone keeps the pair a correct lookup read (0.54 at budget 1/4
# against rmm's 0.31), where every-age sums drown it among prose read locally.
_FAR_AGE = 16
# Fixed-point resolution of the heads' far attention mass (see _fold).
_FIXED = float(2**20)
# The fast moving average of relative attention halves every query.
_RECENT_DECAY = 0.5
_LABELS = ("peak", "sum")
_LOSSES = ("squared", "ranking")

FEATURES = (
    "log_h2o_score",
    "log_rmm_score",
    "log_attention_sum",
    "log_utility_sum",
    "log_attention_mean",
    "log_utility_mean",
    "log_last_attention",
    "log_max_attention",
    "log_recent_attention",
    "producer_weight",
    "log_age",
    "relative_age",
    "log_key_norm",
    "log_value_norm",
    "log_position",
    "log_far_attention",
    "log_far_utility",
    "log_head_far_mass",
    "head_retrieval",
)


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
    validate.require(isinstance(hidden, int) and hidden >= 1, f"hidden must be an int >= 1, got {hidden!r}")
    validate.nonneg_int("seed", seed)
    validate.require(prior is None or prior in PRIORS, f"prior must be None or one of {tuple(PRIORS)}, got {prior!r}")
    params = nnx.to_pure_dict(nnx.split(ImportanceNet(hidden, rngs=nnx.Rngs(seed)))[1])
    if prior is None:
        params["linear"]["kernel"] = jnp.zeros_like(params["linear"]["kernel"])
    else:
        params["linear"]["kernel"] = jnp.zeros_like(params["linear"]["kernel"]).at[PRIORS[prior], 0].set(1.0)
        params["outer"]["kernel"] = jnp.zeros_like(params["outer"]["kernel"])
    return params


@functools.lru_cache(maxsize=None)
def _shapes(hidden: int) -> PyTree:
    return nnx.to_pure_dict(nnx.split(nnx.eval_shape(lambda: ImportanceNet(hidden, rngs=nnx.Rngs(0))))[1])


def _hidden_of(params: PyTree) -> int:
    return int(params["inner"]["kernel"].shape[-1])


def predict(params: PyTree, x: Float[Array, "*N F"]) -> Float[Array, "*N"]:
    """The network's output for features ``x`` (see :data:`FEATURES`)."""
    return nnx.merge(_graphdef(_hidden_of(params)), params)(x)


def features(evidence: Float[Array, "B K S E"], age, step, position, head: dict) -> Float[Array, "B K S F"]:
    """The :data:`FEATURES` of every slot from its evidence, ``age [B, K, S]``, the
    row's ``step [B]`` (queries so far), the items' ``position [B, K, S]`` and what each
    head has read so far (``head``: the ``head_*`` entries of the policy state)."""
    a = jnp.maximum(age, 1).astype(jnp.float32)
    steps = jnp.asarray(step, jnp.float32)[:, None, None] + 1.0
    # What kind of head this is: how much of its attention goes to far items, and how much
    # more of it when its prediction is right than when it is wrong (a retrieval head
    # reads far items to predict; a diffuse head spreads over them whatever it predicts).
    # On the slots' shape like every other feature, and the ratio as a difference of two
    # logs: XLA on CPU rounded log(x / y) differently in a memory split over devices than
    # on one device, and a split memory must score as one device does.
    def slots(x):
        return jnp.broadcast_to(x[..., None], a.shape)

    queries = slots(jnp.maximum(head["head_queries"], 1.0)[:, None])
    right = slots(head["head_right"][:, None])
    far, far_right = slots(head["head_far"]), slots(head["head_far_right"])
    right_share = far_right / jnp.maximum(right, 1.0)
    wrong_share = (far - far_right) / jnp.maximum(queries - right, 1.0)
    head_columns = [jnp.log(1e-3 + far / queries), jnp.log(1e-3 + right_share) - jnp.log(1e-3 + wrong_share)]

    def log(x):
        return jnp.log1p(jnp.maximum(x, 0.0))

    e = evidence
    columns = [
        # The baselines' own scores; attention sums span decades, hence the log.
        jnp.log(1e-3 + jnp.maximum(e[..., _H2O], 0.0)),
        jnp.log(1e-3 + jnp.maximum(e[..., _RMM], 0.0)),
        log(e[..., _SUM]),
        log(e[..., _UTILITY]),
        log(e[..., _SUM] / a),
        log(e[..., _UTILITY] / a),
        log(e[..., _LAST]),
        log(e[..., _MAX]),
        log(e[..., _RECENT]),
        e[..., _PRODUCER],
        jnp.log(a),
        jnp.minimum(a / steps, 1.0),
        log(e[..., _KEY_NORM]),
        log(e[..., _VALUE_NORM]),
        log(position.astype(jnp.float32)),
        jnp.log(1e-3 + jnp.maximum(e[..., _FAR_ATTENTION], 0.0)),
        log(e[..., _FAR_UTILITY]),
        *head_columns,
    ]
    return jnp.stack(columns, axis=-1)


# --------------------------------------------------------------------- frozen weights


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


def save(path, params: PyTree, settings: dict | None = None) -> None:
    """Write estimator parameters to the directory ``path`` (created; it must not
    exist): an orbax checkpoint in ``path/params`` and, when given, the ``settings``
    they were trained with (horizon, label, ...) in ``path/settings.json``."""
    import json

    import orbax.checkpoint as ocp

    root = _absolute(path)
    if root.exists():
        raise ValueError(f"estimator checkpoint {str(path)!r} exists; choose a new directory")
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(root / "params", jax.tree.map(np.asarray, params))
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
            target = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), _shapes(width))
            params = checkpointer.restore(full, target)
        weights = Weights(jax.tree.map(np.asarray, params))
    except Exception as error:  # orbax raises many kinds; none may leave partial state
        raise ValueError(f"estimator checkpoint {str(path)!r} could not be read: {error}") from error
    if not all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(weights.params)):
        raise ValueError(f"estimator checkpoint {str(path)!r} holds non-finite parameters")
    return weights


def load_settings(path) -> dict:
    """The settings saved beside the parameters by :func:`save` ({} if none)."""
    import json

    file = _absolute(path) / "settings.json"
    return json.loads(file.read_text()) if file.is_file() else {}


def _leaf_shape(meta) -> tuple[int, ...]:
    return tuple(getattr(meta, "shape", np.shape(meta)))


def _absolute(path):
    from pathlib import Path

    return Path(path).absolute()


# ------------------------------------------------------------------------- policy


@dataclasses.dataclass(frozen=True)
class LearnedParams(Params):
    """Parameters of the learned policy (:func:`learned` documents each).

    Attributes:
      weights: pretrained :class:`Weights`, or None for a fresh network.
      online: keep learning while serving.
      learning_rate: Adam step size of the online updates, > 0.
      horizon: queries over which a label is gathered, >= 1.
      snapshots: snapshots in flight per row; divides ``horizon``.
      label: "peak" or "sum".
      loss: "squared" or "ranking".
      prior: the heuristic a fresh network starts as ("h2o", "rmm", "far") or None.
      hidden: width of the network; set from ``weights`` when they are given.
      seed: draws a fresh network.
    """

    weights: Weights | None = None
    online: bool = True
    learning_rate: float = 1e-3
    horizon: int = 32
    snapshots: int = 1
    label: str = "peak"
    loss: str = "squared"
    prior: str | None = None
    hidden: int = 32
    seed: int = 0

    def __post_init__(self):
        validate.require(self.weights is None or isinstance(self.weights, Weights),
                         f"weights must be flsmem.estimator.Weights (from load) or None, "
                         f"got {type(self.weights).__name__}")
        validate.require(isinstance(self.online, bool), f"online must be a bool, got {self.online!r}")
        object.__setattr__(self, "learning_rate", validate.positive("learning_rate", self.learning_rate))
        validate.one_of("label", self.label, _LABELS)
        validate.one_of("loss", self.loss, _LOSSES)
        horizon = validate.positive_int("horizon", self.horizon)
        snapshots = validate.positive_int("snapshots", self.snapshots)
        validate.require(horizon % snapshots == 0,
                         f"snapshots must divide horizon (a snapshot every horizon / snapshots queries), "
                         f"got snapshots={snapshots} for horizon={horizon}")
        hidden = validate.positive_int("hidden", self.hidden)
        seed = validate.nonneg_int("seed", self.seed)
        validate.one_of("prior", self.prior, (None, *PRIORS))
        if self.weights is not None:
            hidden = _hidden_of(self.weights.params)
            shapes = jax.tree.map(np.shape, self.weights.params)
            expected = jax.tree.map(np.shape, _shapes(hidden))
            validate.require(shapes == expected, f"weights must fit an ImportanceNet of width {hidden}: "
                                                 f"expected shapes {expected}, got {shapes}")
        for name, value in (("horizon", horizon), ("snapshots", snapshots), ("hidden", hidden), ("seed", seed)):
            object.__setattr__(self, name, value)


@dataclasses.dataclass(frozen=True)
class GuidedParams(Params):
    """Parameters of a :func:`guided` policy.

    Attributes:
      learner: the :func:`learned` policy that gathers evidence and learns.
      behaviour: the policy that ranks the slots for eviction.
    """

    learner: Policy
    behaviour: Policy

    def __post_init__(self):
        learner, behaviour = self.learner, self.behaviour
        validate.require(isinstance(learner, Policy) and learner.name == "learned",
                         f"learner must be the learned policy, got {getattr(learner, 'name', learner)!r}")
        validate.require(isinstance(behaviour, Policy) and behaviour.init_aux is None and behaviour.evicts,
                         f"behaviour must be a policy that evicts and keeps no state of its own, "
                         f"got {getattr(behaviour, 'name', behaviour)!r}")


def _optimizer(policy: Policy) -> optax.GradientTransformation:
    # Clipping keeps one burst of large labels from throwing the network off.
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(policy.params.learning_rate))


def _init_evidence(policy, payload, position, birth):
    """Key and value norms of the new items (payload ``{"k", "v"}``; another payload
    gives the norm of its first leaf as the key norm and no value norm)."""
    leaves = payload if isinstance(payload, dict) and "k" in payload else {"k": jax.tree.leaves(payload)[0]}

    def norm(x):
        x = x.astype(jnp.float32)
        return jnp.sqrt(jnp.sum(x * x, axis=tuple(range(3, x.ndim))))

    zeros = jnp.zeros(position.shape, jnp.float32)
    columns = [zeros] * _NUM_EVIDENCE
    columns[_KEY_NORM] = norm(leaves["k"])
    columns[_VALUE_NORM] = norm(leaves["v"]) if "v" in leaves else zeros
    return jnp.stack(columns, axis=-1)


# The per-row state of the snapshots in flight, each with a leading [M] axis when M > 1.
_SNAPSHOT = ("snap_features", "gathered", "snap_birth", "snap_queries")


def _init_aux(policy, batch, kv_heads, slots):
    weights = policy.params.weights
    params = (
        init_params(policy.params.hidden, policy.params.seed, policy.params.prior) if weights is None
        else jax.tree.map(jnp.asarray, weights.params)
    )
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    # One snapshot keeps the shapes the state had before several could be in flight.
    m = policy.params.snapshots
    rows = ((m,) if m > 1 else ()) + (batch, kv_heads, slots)
    return {
        "params": params,
        "opt": _optimizer(policy).init(params),
        "snap_features": jnp.zeros(rows + (len(FEATURES),), jnp.float32),
        # The utility each slot has shown since the snapshot: its label to be.
        "gathered": jnp.zeros(rows, jnp.float32),
        # The birth of the item each slot held at the snapshot; -1 where it held none
        # or has lost it since (only the other slots are labelled).
        "snap_birth": jnp.full(rows, -1, jnp.int32),
        # Queries the snapshot has gathered: one taken at a stream's last step has none.
        "snap_queries": jnp.zeros(rows[:-2], jnp.int32),
        "last_weight": jnp.zeros((batch,), jnp.float32),
        # What each head reads over the stream (see features): far attention mass summed
        # over queries, the same over queries predicted right, and the query counts.
        "head_far": jnp.zeros((batch, kv_heads), jnp.float32),
        "head_far_right": jnp.zeros((batch, kv_heads), jnp.float32),
        "head_right": jnp.zeros((batch,), jnp.float32),
        "head_queries": jnp.zeros((batch,), jnp.float32),
        "loss": jnp.full((), jnp.nan, jnp.float32),
        "labels": jnp.zeros((), jnp.int32),
        "updates": jnp.zeros((), jnp.int32),
        "skipped": jnp.zeros((), jnp.int32),
    }


def _in_flight(policy, aux) -> dict:
    """The snapshot entries of ``aux``, each with its leading [M] axis."""
    if policy.params.snapshots > 1:
        return {name: aux[name] for name in _SNAPSHOT}
    return {name: aux[name][None] for name in _SNAPSHOT}


def _stored(policy, snapshots: dict) -> dict:
    """The inverse of :func:`_in_flight`: the entries as ``aux`` holds them."""
    if policy.params.snapshots > 1:
        return snapshots
    return {name: x[0] for name, x in snapshots.items()}


def carry_over(aux: PyTree, layers_axis: bool = True) -> PyTree:
    """What an estimator learned in a run, to start the next run's memories from.

    Given the policy state ``aux`` a run ended with, returns the learned entries only
    (parameters, optimizer state, loss and counters), averaged over a leading layer
    axis when ``layers_axis`` (integer entries such as the counters and Adam's step
    count keep their dtype, rounded down); the per-stream entries (snapshots) are left
    out, so the next run may have another batch size or budget. Merge it into a fresh
    state: ``state.replace(aux=state.aux | carry_over(old_aux))``.
    """

    def mean(x):
        if not layers_axis:
            return x
        if jnp.issubdtype(x.dtype, jnp.integer):
            return (jnp.sum(x, axis=0) // x.shape[0]).astype(x.dtype)
        return jnp.mean(x, axis=0)

    return {name: jax.tree.map(mean, aux[name]) for name in ("params", "opt", "loss", "labels", "updates", "skipped")}


def _fold(policy, view: SlotView, obs: Observation, aux):
    e = view.evidence
    n = jnp.sum(view.present, axis=-1, keepdims=True).astype(jnp.float32)
    z = obs.attention * n
    w = obs.weight[:, None, None]
    arriving = view.age == 1
    far = view.age > _FAR_AGE
    columns = [
        e[..., _H2O] + obs.attention,
        e[..., _RMM] + w * obs.attention,
        e[..., _SUM] + z,
        e[..., _UTILITY] + w * z,
        z,
        jnp.maximum(e[..., _MAX], z),
        _RECENT_DECAY * e[..., _RECENT] + z,
        # The item arriving now is the token the previous query predicted.
        jnp.where(arriving, aux["last_weight"][:, None, None], e[..., _PRODUCER]),
        e[..., _KEY_NORM],
        e[..., _VALUE_NORM],
        e[..., _FAR_ATTENTION] + jnp.where(far, obs.attention, 0.0),
        e[..., _FAR_UTILITY] + jnp.where(far, w * z, 0.0),
    ]
    evidence = jnp.where(view.present[..., None], jnp.stack(columns, axis=-1), e)
    # The head's far attention mass [B, K], summed in fixed point: an integer sum is exact
    # in any order, so however XLA splits the reduction over devices it gives one
    # device's result. Attention sums to 1 per query: the total stays far inside int32.
    ticks = jnp.round(jnp.where(far & view.present, obs.attention, 0.0) * _FIXED).astype(jnp.int32)
    far_mass = jnp.sum(ticks, axis=-1).astype(jnp.float32) / _FIXED
    aux = dict(aux, last_weight=obs.weight, head_far=aux["head_far"] + far_mass,
               head_far_right=aux["head_far_right"] + obs.weight[:, None] * far_mass,
               head_right=aux["head_right"] + obs.weight, head_queries=aux["head_queries"] + 1.0)
    if policy.params.online:  # a frozen network takes no snapshots: no upkeep, no branch
        # Every snapshot in flight gathers the utility each slot shows: its label to be.
        snaps = _in_flight(policy, aux)
        shown = (w * z)[None]
        present = view.present[None]
        gathered = snaps["gathered"]
        gathered = jnp.maximum(gathered, shown) if policy.params.label == "peak" else gathered + shown
        snaps["gathered"] = jnp.where(present, gathered, snaps["gathered"])
        # A slot that loses its item never holds it again (a later item has a later birth),
        # so the snapshot forgets it now: the aux alone then tells which slots to label,
        # as the flush at a stream's end needs.
        kept = present & (snaps["snap_birth"] == view.birth[None])
        snaps["snap_birth"] = jnp.where(kept, snaps["snap_birth"], -1)
        snaps["snap_queries"] = snaps["snap_queries"] + 1
        aux = dict(aux, **_stored(policy, snaps))
        due = (view.step + 1) % (policy.params.horizon // policy.params.snapshots) == 0
        aux = lax.cond(jnp.any(due), functools.partial(_learn, policy, view, evidence, due),
                       lambda aux: aux, aux)
    return evidence, aux


def _ranking_loss(prediction, label, held):
    """Pairwise logistic loss over the labelled slots of each row: for every pair whose
    labels differ, -log sigmoid of the prediction gap in the labels' order, weighted by
    how much the labels differ (eviction only needs each row's order right)."""
    gap = label[..., :, None] - label[..., None, :]  # [B, K, S, S]
    pair = held[..., :, None] & held[..., None, :] & (gap > 0)
    margin = prediction[..., :, None] - prediction[..., None, :]
    weight = jnp.where(pair, gap, 0.0)
    return jnp.sum(weight * jax.nn.softplus(-margin)) / jnp.maximum(jnp.sum(weight), 1e-6)


def _whole(x: Array) -> Array:
    """``x`` gathered whole onto every device of the mesh it is split over (unchanged
    on one device). The network's gradient sums over every slot of every row; computed
    on split rows, each device would add up its own block and the blocks would then be
    added across devices, in another order than one device adds and so with another
    rounding. Gathered, every device runs one device's computation on the same data."""
    mesh = jax.typeof(x).sharding.mesh
    if mesh.empty:
        return x
    return lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec()))


def _fit(policy, aux, snapshot, gathered, held):
    """One optimizer step on the error of the predictions for the ``snapshot``
    features ``[..., S, F]`` against the labels from ``gathered`` ``[..., S]``, over the
    ``held`` slots (every leading axis pooled); a non-finite step is skipped and
    counted, and a step with no slot to label is not taken."""
    held = _whole(held)
    label = _whole(jnp.log1p(jnp.maximum(gathered, 0.0)))
    snapshot = _whole(snapshot)
    count = jnp.sum(held)

    def loss_fn(params):
        prediction = predict(params, snapshot)
        if policy.params.loss == "squared":
            error = jnp.where(held, prediction - label, 0.0)
            return jnp.sum(error * error) / jnp.maximum(count, 1).astype(jnp.float32)
        return _ranking_loss(prediction, label, held)

    loss, grads = jax.value_and_grad(loss_fn)(aux["params"])
    finite = jnp.isfinite(loss) & jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    updates, opt = _optimizer(policy).update(grads, aux["opt"], aux["params"])
    params = optax.apply_updates(aux["params"], updates)
    take = finite & (count > 0)
    keep = functools.partial(jax.tree.map, lambda new, old: jnp.where(take, new, old))
    return dict(
        aux,
        params=keep(params, aux["params"]),
        opt=keep(opt, aux["opt"]),
        loss=jnp.where(take, loss, aux["loss"]),
        labels=aux["labels"] + jnp.where(take, count, 0).astype(jnp.int32),
        updates=aux["updates"] + take.astype(jnp.int32),
        skipped=aux["skipped"] + ((count > 0) & ~finite).astype(jnp.int32),
    )


def _learn(policy, view: SlotView, evidence, due, aux):
    """At a row's snapshot step: label the slots of the snapshot due (taken ``horizon``
    queries ago) that still hold their item, take one optimizer step on them, then
    take that snapshot again from the slots held now."""
    m = policy.params.snapshots
    snaps = _in_flight(policy, aux)
    index = (view.step + 1) // (policy.params.horizon // m) % m  # [B]: the snapshot due in each row
    due_now = {name: x[index, jnp.arange(due.shape[0])] for name, x in snaps.items()}
    # The same slots as snap_birth >= 0 (a lost item is forgotten as it goes), written as
    # before several snapshots could be in flight: XLA fuses the loss, and so rounds it,
    # by how the mask is built, and one snapshot learns bit for bit as it did.
    held = due[:, None, None] & view.present & (due_now["snap_birth"] == view.birth)
    aux = _fit(policy, aux, due_now["snap_features"], due_now["gathered"], held)
    retake = (jnp.arange(m)[:, None] == index[None]) & due[None]  # [M, B]
    slots = retake[:, :, None, None]
    now = features(evidence, view.age, view.step + 1, view.position, aux)[None]
    snaps = dict(
        snap_features=jnp.where(slots[..., None], now, snaps["snap_features"]),
        gathered=jnp.where(slots, 0.0, snaps["gathered"]),
        snap_birth=jnp.where(slots, jnp.where(view.present, view.birth, -1)[None], snaps["snap_birth"]),
        snap_queries=jnp.where(retake, 0, snaps["snap_queries"]),
    )
    return dict(aux, **_stored(policy, snaps))


def flush(policy: Policy, aux: PyTree, layers_axis: bool = True) -> PyTree:
    """Label every snapshot still in flight at the end of a stream, and learn from them.

    Each snapshot's slots that still hold their item are labelled with the utility they
    showed from the snapshot to the end of the stream (for a stream that ends there,
    the peak over the rest of it), and the network takes one optimizer step on all of
    them pooled, as an online step does (same optimizer, same skip rule and counters).
    Snapshots that gathered no query (empty, or taken at the last step) add nothing.
    The snapshots are emptied. Offline pretraining calls it after each batch's stream,
    before :func:`carry_over`, so its labels reach the end of the stream.

    Args:
      policy: the :func:`learned` policy the memories ran (only its estimator
        settings count: protection may differ).
      aux: the policy state a stream ended with.
      layers_axis: ``aux`` has a leading layer axis (as ``stats["aux"]`` of
        :func:`flsmem.harness.evaluate.evaluate_windows`); each layer's copy of the network
        takes its own step.

    Returns:
      ``aux`` after the step.
    """
    validate.require(isinstance(policy, Policy) and policy.name == "learned",
             f"policy must be the learned policy, got {getattr(policy, 'name', policy)!r}")
    validate.require(isinstance(layers_axis, bool), f"layers_axis must be a bool, got {layers_axis!r}")
    missing = [name for name in ("params", "opt", *_SNAPSHOT) if not isinstance(aux, dict) or name not in aux]
    validate.require(not missing, f"aux must be the learned policy's state (memory.aux), missing {missing}")
    # snap_features is [L?, M?, B, K, S, F]: the axes say which policy and layout made it.
    expected = 4 + (policy.params.snapshots > 1) + layers_axis
    got = jnp.shape(aux["snap_features"])
    validate.require(len(got) == expected and got[-1] == len(FEATURES),
             f"aux['snap_features'] must have {expected} axes ending in {len(FEATURES)} features for "
             f"snapshots={policy.params.snapshots} and layers_axis={layers_axis}, got shape {list(got)}")
    # Protection does not change the step: one compile serves every budget.
    return _flush(policy.replace(sinks=0, recent=0, lag=0), aux, layers_axis)


@functools.partial(jax.jit, static_argnames=("policy", "layers_axis"))
def _flush(policy, aux, layers_axis):
    def one(aux):
        snaps = _in_flight(policy, aux)
        held = (snaps["snap_birth"] >= 0) & (snaps["snap_queries"] > 0)[..., None, None]
        aux = _fit(policy, aux, snaps["snap_features"], snaps["gathered"], held)
        empty = dict(snap_features=jnp.zeros_like(aux["snap_features"]), gathered=jnp.zeros_like(aux["gathered"]),
                     snap_birth=jnp.full_like(aux["snap_birth"], -1), snap_queries=jnp.zeros_like(aux["snap_queries"]))
        return dict(aux, **empty)

    return jax.vmap(one)(aux) if layers_axis else one(aux)


def _score(policy, view: SlotView, aux):
    return predict(aux["params"], features(view.evidence, view.age, view.step, view.position, aux))


def _score_rmm(policy, view: SlotView, aux):
    return view.evidence[..., _RMM]


def _monitor(policy, aux):
    batch = aux["last_weight"].shape[-1]

    def per_row(x):
        return jnp.broadcast_to(x[..., None], x.shape + (batch,))

    return {
        "estimator_loss": per_row(aux["loss"]),
        "estimator_labels": per_row(aux["labels"]),
        "estimator_updates": per_row(aux["updates"]),
        "estimator_skipped": per_row(aux["skipped"]),
    }


def learned(
    weights: Weights | None = None, *, online: bool = True, learning_rate: float = 1e-3,
    horizon: int = 32, snapshots: int = 1, label: str = "peak", loss: str = "squared", prior: str | None = None,
    hidden: int = 32, seed: int = 0, sinks: int = 0, recent: int = 0, lag: int = 0,
) -> Policy:
    """The learned importance estimator as a policy.

    Rule: score = the :class:`ImportanceNet`'s prediction of the slot's demonstrated
    utility over the next ``horizon`` queries, from its :data:`FEATURES`; with
    ``online`` the network learns from each label as it matures (one optax step per
    ``horizon / snapshots`` queries, pooled over the memory's rows). A row with a
    non-finite score is ranked by the ``rmm`` score.

    Args:
      weights: pretrained parameters (:func:`load`); None starts from a fresh network
        drawn with ``seed`` (online from scratch).
      online: keep learning while serving.
      learning_rate: Adam step size of the online updates.
      horizon: queries over which a label is gathered. It must reach past the gap
        between two reads of an item, or the item is labelled 0 and learnt as one to
        evict (on 256-token windows, reuses 100-170 queries apart need more than 64).
      snapshots: snapshots in flight per row: one is taken every ``horizon /
        snapshots`` queries (the update period) and labelled ``horizon`` queries later,
        so a long horizon still gives labels often. Must divide ``horizon``. At the end
        of a stream, :func:`flush` labels those in flight with what they gathered.
      label: "peak", the largest correctness-weighted relative attention the slot gets
        over the horizon (was it needed by some correct prediction?), or "sum", the
        total (how much was it used?).
      loss: "squared" error of the predicted label, or "ranking", a pairwise logistic
        loss on the order of each row's labels.
      prior: a fresh network starts ranking as this heuristic ("h2o", "rmm" or "far") and
        learns corrections (see :func:`init_params`); None starts from random.
      hidden: width of the network (ignored when ``weights`` are given).
      sinks, recent, lag: protection, as for every policy (0 decides at H = 0).
    """
    params = LearnedParams(weights=weights, online=online, learning_rate=learning_rate, horizon=horizon,
                           snapshots=snapshots, label=label, loss=loss, prior=prior, hidden=hidden, seed=seed)
    return Policy(
        name="learned", score=_score, fold=_fold, init_evidence=_init_evidence, init_aux=_init_aux,
        fallback_score=_score_rmm, monitor=_monitor, num_evidence=_NUM_EVIDENCE,
        # The network costs more per slot than the fold: score only when evicting.
        score_when_due=True, sinks=sinks, recent=recent, lag=lag, params=params,
    )


def guided(learner: Policy, behaviour: Policy) -> Policy:
    """``learner`` gathering its evidence and learning as it would, in a memory whose
    kept set ``behaviour`` decides (off-policy pretraining).

    A learner labels only the items its memory still holds, so on its own it learns
    about what it already keeps: an item it evicts before anything reads it is never
    labelled, and at a small budget it never learns to keep it. Run behind the oracle
    (``behaviour=oracle()``), which keeps what later queries will read, the labels
    cover the items a good memory holds. Protection (``sinks``, ``recent``, ``lag``)
    is the returned policy's own; ``flush`` takes ``learner``.

    Args:
      learner: the :func:`learned` policy.
      behaviour: a policy without state of its own (``init_aux`` None), such as the
        oracle; it ranks the slots for eviction.
    """
    params = GuidedParams(learner=learner, behaviour=behaviour)
    return Policy(
        name=f"{learner.name}@{behaviour.name}", score=_guided_score, fold=_guided_fold,
        init_evidence=_guided_init_evidence, init_aux=_guided_init_aux, monitor=_guided_monitor,
        num_evidence=learner.num_evidence + behaviour.num_evidence, normalise_by_age=behaviour.normalise_by_age,
        needs_future=behaviour.needs_future, sinks=learner.sinks, recent=learner.recent, lag=learner.lag,
        # The learner's features are of the attention reduced as it was trained on.
        head_reduction=learner.head_reduction, params=params,
    )


# The guided policy's parts: module functions, so that equal learners and behaviours give
# equal policies (one compile), each part handing its own evidence to its own policy.
def _guided_views(policy, view):
    width = policy.params.learner.num_evidence
    return view._replace(evidence=view.evidence[..., :width]), view._replace(evidence=view.evidence[..., width:])


def _guided_score(policy, view, aux):
    behaviour = policy.params.behaviour
    return behaviour.score(behaviour, _guided_views(policy, view)[1], None)


def _guided_fold(policy, view, obs, aux):
    learner, behaviour = policy.params.learner, policy.params.behaviour
    mine, theirs = _guided_views(policy, view)
    evidence, aux = learner.fold(learner, mine, obs, aux)
    if behaviour.fold is not None:
        theirs = theirs._replace(evidence=behaviour.fold(behaviour, theirs, obs, None)[0])
    return jnp.concatenate([evidence, theirs.evidence], axis=-1), aux


def _guided_init_evidence(policy, payload, position, birth):
    learner, behaviour = policy.params.learner, policy.params.behaviour
    mine = learner.init_evidence(learner, payload, position, birth)
    theirs = (jnp.zeros(position.shape + (behaviour.num_evidence,), jnp.float32) if behaviour.init_evidence is None
              else behaviour.init_evidence(behaviour, payload, position, birth))
    return jnp.concatenate([mine, theirs], axis=-1)


def _guided_init_aux(policy, batch, kv_heads, slots):
    learner = policy.params.learner
    return learner.init_aux(learner, batch, kv_heads, slots)


def _guided_monitor(policy, aux):
    learner = policy.params.learner
    return learner.monitor(learner, aux)


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
                   hidden=_hidden_of(weights.params), horizon=settings.get("horizon", 32),
                   snapshots=settings.get("snapshots", 1),
                   label=settings.get("label", "peak"), loss=settings.get("loss", "squared"),
                   prior=settings.get("prior"), **protection)
