"""How the learned estimator labels and learns: snapshots in flight, their labels, the
optimizer step, and the end of a stream.

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

Labels are censored by eviction: only items still held when their snapshot is labelled
get a label, so the estimator learns from what its policy kept.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from flsmem import validate
from flsmem.estimator.evidence import FEATURES, features
from flsmem.estimator.network import predict
from flsmem.policies import Policy, SlotView
from flsmem.typing import Array, Float, PyTree

__all__ = ["carry_over", "flush", "fit_one"]

# The per-row state of the snapshots in flight, each with an [M] axis after the rows
# when M > 1.
_SNAPSHOT = ("snap_features", "gathered", "snap_birth", "snap_queries")
# What an optimizer step changes: shared by a memory's rows.
_LEARNED = ("params", "opt", "loss", "labels", "updates", "skipped")
# What the features read of the state besides the evidence: what each head reads.
_HEAD = ("head_queries", "head_right", "head_far", "head_far_right")


def optimizer(policy: Policy) -> optax.GradientTransformation:
    """The learned policy's optimizer: Adam at its learning rate, after clipping."""
    # Clipping keeps one burst of large labels from throwing the network off.
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(policy.params.learning_rate))


def groups(aux: PyTree) -> int | None:
    """How many networks the state holds: None for a memory's own (or a stack of
    them, one per layer); G when the layers of stacked memories are folded into rows
    (:func:`flsmem.update_layers`), network l serving rows ``l * B`` to ``l * B + B - 1``."""
    # A memory's own rows have one axis more than what they share (the loss is a
    # scalar, the rows' weights [B]); folded layers give both the same leading axis.
    grouped = jnp.ndim(aux["loss"]) == jnp.ndim(aux["last_weight"])
    return jnp.shape(aux["loss"])[0] if grouped else None


def per_group(fn, g: int | None, shared: PyTree, *rows: Array):
    """``fn(shared, *rows)``, or with ``g`` groups, ``fn`` of each network in
    ``shared`` (leading axis [G]) and its group of rows (``rows`` ``[G * B, ...]``), its
    outputs stacked on a leading [G] axis."""
    if g is None:
        return fn(shared, *rows)
    return jax.vmap(fn)(shared, *(x.reshape((g, -1) + x.shape[1:]) for x in rows))


def _in_flight(policy, aux) -> dict:
    """The snapshot entries of ``aux``, each with its [M] axis after the rows."""
    if policy.params.snapshots > 1:
        return {name: aux[name] for name in _SNAPSHOT}
    return {name: aux[name][:, None] for name in _SNAPSHOT}


def _stored(policy, snapshots: dict) -> dict:
    """The inverse of :func:`_in_flight`: the entries as ``aux`` holds them."""
    if policy.params.snapshots > 1:
        return snapshots
    return {name: x[:, 0] for name, x in snapshots.items()}


def gather(policy: Policy, view: SlotView, evidence: tuple[Float[Array, "B K S"], ...], shown: Float[Array, "B K S"],
           aux: PyTree) -> PyTree:
    """Every snapshot in flight gathers the utility each slot showed this query
    (``shown``): its label to be. At a row's snapshot step, the snapshot due is
    labelled and learnt from, then taken again."""
    snaps = _in_flight(policy, aux)
    shown = shown[:, None]
    present = view.present[:, None]
    gathered = snaps["gathered"]
    gathered = jnp.maximum(gathered, shown) if policy.params.label == "peak" else gathered + shown
    snaps["gathered"] = jnp.where(present, gathered, snaps["gathered"])
    # A slot that loses its item never holds it again (a later item has a later birth),
    # so the snapshot forgets it now: the aux alone then tells which slots to label,
    # as the flush at a stream's end needs.
    kept = present & (snaps["snap_birth"] == view.birth[:, None])
    snaps["snap_birth"] = jnp.where(kept, snaps["snap_birth"], -1)
    snaps["snap_queries"] = snaps["snap_queries"] + 1
    # Every query is folded into every row of a memory, so its rows share their step and
    # the snapshot due: a dynamic slice of the M in flight. Only that slice passes through
    # the branch; XLA gives a branch's outputs buffers of their own, and the whole
    # [B, M, K, S, F] passed through would be copied at every step.
    m = policy.params.snapshots
    period = policy.params.horizon // m
    # A static index for one snapshot: XLA then slices it in place, without a copy.
    index = (view.step[0] + 1) // period % m if m > 1 else 0
    due = (view.step + 1) % period == 0
    slice_due = {name: lax.dynamic_index_in_dim(x, index, axis=1, keepdims=False) for name, x in snaps.items()}
    learned = {name: aux[name] for name in _LEARNED}
    head = {name: aux[name] for name in _HEAD}
    learn = functools.partial(_learn, policy, view, evidence, due, head, groups(aux))
    learned, slice_due = lax.cond(jnp.any(due), learn, lambda learned, slice_due: (learned, slice_due),
                                  learned, slice_due)
    snaps = {name: lax.dynamic_update_index_in_dim(x, slice_due[name], index, 1) for name, x in snaps.items()}
    return dict(aux, **learned, **_stored(policy, snaps))


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


def _fit(policy, learned, snapshot, gathered, held, g):
    """One optimizer step of each network in ``learned`` (the :data:`_LEARNED`
    entries) on the error of its predictions for the ``snapshot`` features
    ``[R, ..., S, F]`` against the labels from ``gathered`` ``[R, ..., S]``, over the
    ``held`` slots of its rows (every axis but the features pooled), with ``g`` groups
    of rows as :func:`groups` gives them; a non-finite step is skipped and counted, and
    a step with no slot to label is not taken."""
    return per_group(functools.partial(fit_one, policy), g, learned, snapshot, gathered, held)


def fit_one(policy, learned, snapshot, gathered, held):
    """One optimizer step of one network (``learned``, the :data:`_LEARNED` entries of
    one group of rows) on its prediction error over the ``held`` slots of
    ``snapshot``, labelled from ``gathered``; what :func:`_fit` runs per group, public
    so that its cost can be counted alone (``bench.learned_flops``)."""
    validate.require(jnp.shape(gathered) == jnp.shape(held) == jnp.shape(snapshot)[:-1],
                     f"gathered and held must have the snapshot's shape without its feature axis, "
                     f"{tuple(jnp.shape(snapshot)[:-1])}; got {tuple(jnp.shape(gathered))} and {tuple(jnp.shape(held))}")
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

    loss, grads = jax.value_and_grad(loss_fn)(learned["params"])
    finite = jnp.isfinite(loss) & jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    updates, opt = optimizer(policy).update(grads, learned["opt"], learned["params"])
    params = optax.apply_updates(learned["params"], updates)
    take = finite & (count > 0)
    keep = functools.partial(jax.tree.map, lambda new, old: jnp.where(take, new, old))
    return dict(
        params=keep(params, learned["params"]),
        opt=keep(opt, learned["opt"]),
        loss=jnp.where(take, loss, learned["loss"]),
        labels=learned["labels"] + jnp.where(take, count, 0).astype(jnp.int32),
        updates=learned["updates"] + take.astype(jnp.int32),
        skipped=learned["skipped"] + ((count > 0) & ~finite).astype(jnp.int32),
    )


def _learn(policy, view: SlotView, evidence, due, head, g, learned, snapshot):
    """At a row's snapshot step: label the slots of the ``snapshot`` due (taken
    ``horizon`` queries ago) that still hold their item, take one optimizer step on
    them, then take that snapshot again from the slots held now. Returns the
    ``learned`` entries after the step and the snapshot taken again."""
    # The same slots as snap_birth >= 0 (a lost item is forgotten as it goes), built from
    # the view: XLA fuses the loss, and so rounds it, by how the mask is built, and the
    # results recorded with one snapshot in flight were computed with this form.
    held = due[:, None, None] & view.present & (snapshot["snap_birth"] == view.birth)
    learned = _fit(policy, learned, snapshot["snap_features"], snapshot["gathered"], held, g)
    slots = due[:, None, None]
    now = features(evidence, view.age, view.step + 1, view.position, head)
    snapshot = dict(
        snap_features=jnp.where(slots[..., None], now, snapshot["snap_features"]),
        gathered=jnp.where(slots, 0.0, snapshot["gathered"]),
        snap_birth=jnp.where(slots, jnp.where(view.present, view.birth, -1), snapshot["snap_birth"]),
        snap_queries=jnp.where(due, 0, snapshot["snap_queries"]),
    )
    return learned, snapshot


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

    return {name: jax.tree.map(mean, aux[name]) for name in _LEARNED}


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
    validate.boolean("layers_axis", layers_axis)
    missing = [name for name in ("params", "opt", *_SNAPSHOT) if not isinstance(aux, dict) or name not in aux]
    validate.require(not missing, f"aux must be the learned policy's state (memory.aux), missing {missing}")
    # snap_features is [L?, B, M?, K, S, F]: the axes say which policy and layout made it.
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
        aux = dict(aux, **_fit(policy, {name: aux[name] for name in _LEARNED}, snaps["snap_features"],
                               snaps["gathered"], held, None))
        empty = dict(snap_features=jnp.zeros_like(aux["snap_features"]), gathered=jnp.zeros_like(aux["gathered"]),
                     snap_birth=jnp.full_like(aux["snap_birth"], -1), snap_queries=jnp.zeros_like(aux["snap_queries"]))
        return dict(aux, **empty)

    return jax.vmap(one)(aux) if layers_axis else one(aux)
