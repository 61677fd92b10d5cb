"""The learned estimator as a policy (:func:`learned`), its typed parameters, and
:func:`guided`, a learner run behind another policy's evictions.

The parameters and the optimizer state live in the memory's ``aux``, so online
learning is a pure function of the state inside a jitted loop, with no retrace. A step
whose loss or gradient is not finite is skipped and counted; a score that is not
finite falls back to the ``rmm`` score for the row (``stats.fallbacks``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from flsmem import validate
from flsmem.estimator.evidence import FEATURES, NUM_EVIDENCE, features, fold_evidence, init_evidence, score_rmm
from flsmem.estimator.labels import gather, groups, optimizer, per_group
from flsmem.estimator.network import PRIORS, Weights, hidden_of, init_params, param_shapes, predict
from flsmem.policies import Observation, Params, Policy, SlotView
from flsmem.typing import PyTree

__all__ = ["GuidedParams", "LearnedParams", "guided", "learned"]

_LABELS = ("peak", "sum")
_LOSSES = ("squared", "ranking")


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
        validate.boolean("online", self.online)
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
            hidden = hidden_of(self.weights.params)
            shapes = jax.tree.map(np.shape, self.weights.params)
            expected = jax.tree.map(np.shape, param_shapes(hidden))
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


def _init_aux(policy, batch, kv_heads, slots):
    weights = policy.params.weights
    params = (
        init_params(policy.params.hidden, policy.params.seed, policy.params.prior) if weights is None
        else jax.tree.map(jnp.asarray, weights.params)
    )
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    # One snapshot in flight has no [M] axis (see labels._in_flight); the rows come
    # first, so that stacked layers fold into rows (flsmem.update_layers).
    m = policy.params.snapshots
    rows = (batch,) + ((m,) if m > 1 else ()) + (kv_heads, slots)
    return {
        "params": params,
        "opt": optimizer(policy).init(params),
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


def _fold(policy: Policy, view: SlotView, obs: Observation, aux: PyTree):
    evidence, aux, shown = fold_evidence(view, obs, aux)
    if policy.params.online:  # a frozen network takes no snapshots: no upkeep, no branch
        aux = gather(policy, view, evidence, shown, aux)
    return evidence, aux


def _score(policy, view: SlotView, aux):
    x = features(view.evidence, view.age, view.step, view.position, aux)
    return per_group(predict, groups(aux), aux["params"], x).reshape(x.shape[:-1])


def _monitor(policy, aux):
    rows = aux["last_weight"].shape[-1]

    def per_row(x):
        if groups(aux):  # one figure per network, repeated over the rows it serves
            return jnp.repeat(x, rows // x.shape[-1])
        return jnp.broadcast_to(x[..., None], x.shape + (rows,))

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
        name="learned", score=_score, fold=_fold, init_evidence=init_evidence, init_aux=_init_aux,
        fallback_score=score_rmm, monitor=_monitor, evidence_shapes=((),) * NUM_EVIDENCE,
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
        evidence_shapes=learner.evidence_shapes + behaviour.evidence_shapes,
        normalise_by_age=behaviour.normalise_by_age,
        needs_future=behaviour.needs_future, sinks=learner.sinks, recent=learner.recent, lag=learner.lag,
        # The learner's features are of the attention reduced as it was trained on.
        head_reduction=learner.head_reduction, params=params,
    )


# The guided policy's parts: module functions, so that equal learners and behaviours give
# equal policies (one compile), each part handing its own evidence to its own policy.
def _guided_views(policy, view):
    width = policy.params.learner.num_evidence
    return view._replace(evidence=view.evidence[:width]), view._replace(evidence=view.evidence[width:])


def _guided_score(policy, view, aux):
    behaviour = policy.params.behaviour
    return behaviour.score(behaviour, _guided_views(policy, view)[1], None)


def _guided_fold(policy, view, obs, aux):
    learner, behaviour = policy.params.learner, policy.params.behaviour
    mine, theirs = _guided_views(policy, view)
    evidence, aux = learner.fold(learner, mine, obs, aux)
    if behaviour.fold is not None:
        theirs = theirs._replace(evidence=behaviour.fold(behaviour, theirs, obs, None)[0])
    return evidence + theirs.evidence, aux


def _guided_init_evidence(policy, payload, position, birth):
    learner, behaviour = policy.params.learner, policy.params.behaviour
    mine = learner.init_evidence(learner, payload, position, birth)
    theirs = (behaviour.zero_evidence(position.shape) if behaviour.init_evidence is None
              else behaviour.init_evidence(behaviour, payload, position, birth))
    return tuple(mine) + tuple(theirs)


def _guided_init_aux(policy, batch, kv_heads, slots):
    learner = policy.params.learner
    return learner.init_aux(learner, batch, kv_heads, slots)


def _guided_monitor(policy, aux):
    learner = policy.params.learner
    return learner.monitor(learner, aux)
