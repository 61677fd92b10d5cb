"""Measure or accumulate, decided online: a mixture of decayed attention sums whose
weights follow how well each one predicted the attention the model later paid.

Each slot keeps several running sums of its attention, ``e_k <- d_k e_k + (w *) a``
(decay 1 accumulates as H2O and RMM do, decay below 1 measures recent use as EMA and
TOVA do). Each row of the memory (one KV head of one layer of one sequence) keeps a
weight per sum. Every ``horizon`` queries it takes a snapshot of each sum's prediction
of where attention will go (the sum normalised over the committed items), and at each
later query it scores the snapshot by the log-loss of the attention the query actually
paid those items: a snapshot that gave little weight to an item the model then uses is
charged much, which is exactly the eviction that would have hurt. The weights are
exponential in the discounted losses (Bayes's rule on the predictions, with forgetting
so that a row can change its mind), and the committed score is the weighted mixture of
the current predictions.

The log-loss judges the whole distribution, and is dominated by the items the model
uses most, which no policy evicts. The ``evicted`` judge charges only what eviction
pays for: each snapshot marks the items each sum ranks lowest (as many as one
eviction per query over the horizon would remove), and each later query charges a
sum the share of its attention that falls on the items that sum marked.
"""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp

from flsmem import validate
from flsmem.policies.base import Observation, Params, Policy, SlotView, with_columns
from flsmem.typing import Array, Bool, Float, PyTree

__all__ = ["AdaptiveParams", "JUDGES", "adaptive", "expert_names"]

# How a snapshot of each sum is charged for the attention the later queries pay.
JUDGES = ("log_loss", "evicted")


@dataclasses.dataclass(frozen=True)
class AdaptiveParams(Params):
    """Parameters of the adaptive mixture (:func:`adaptive`).

    Attributes:
      decays: each expert's decay in [0, 1] (1 accumulates, 0 is the last query's
        attention).
      weighted: for each expert, whether it sums the attention weighted by the
        correctness of the prediction made with it (RMM) or not (H2O).
      horizon: queries between two snapshots; each snapshot is judged on the
        attention of the ``horizon`` queries after it, so predictions are judged 1 to
        ``horizon`` queries ahead.
      forget: in [0, 1], the factor applied to each expert's accumulated loss at every
        judged query (0.99 remembers about 100 queries).
      rate: > 0, the inverse temperature of the weights (1 is Bayes's rule for the
        log-loss).
      floor: in (0, 1), the share of each prediction spread uniformly, so that a
        prediction is never 0 and one surprise costs at most ``log(n / floor)``.
      judge: one of :data:`JUDGES`. ``log_loss`` charges each snapshot ``-sum p log
        q_k`` (``p`` the query's attention over the judged items, normalised);
        ``evicted`` marks the ``horizon`` committed items each sum ranks lowest (ties
        at the cut marked too) and charges the share of ``p`` on the marked items. A
        row holding no more than ``horizon`` committed items marks all of them under
        every sum, so its losses stay equal and its mixture equal-weighted.
    """

    decays: tuple[float, ...] = (1.0, 1.0, 0.9)
    weighted: tuple[bool, ...] = (True, False, False)
    horizon: int = 32
    forget: float = 0.99
    rate: float = 1.0
    floor: float = 1e-3
    judge: str = "log_loss"

    def __post_init__(self):
        validate.require(isinstance(self.decays, (tuple, list)) and len(self.decays) >= 1,
                         f"decays must be a non-empty tuple of numbers in [0, 1], got {self.decays!r}")
        object.__setattr__(self, "decays", tuple(validate.unit("decays", d) for d in self.decays))
        validate.require(isinstance(self.weighted, (tuple, list)) and len(self.weighted) == len(self.decays),
                         f"weighted must be a tuple of {len(self.decays)} bools (one per decay), "
                         f"got {self.weighted!r}")
        object.__setattr__(self, "weighted", tuple(validate.boolean("weighted", w) for w in self.weighted))
        object.__setattr__(self, "horizon", validate.positive_int("horizon", self.horizon))
        object.__setattr__(self, "forget", validate.unit("forget", self.forget))
        object.__setattr__(self, "rate", validate.positive("rate", self.rate))
        floor = self.floor
        ok = isinstance(floor, numbers.Real) and not isinstance(floor, bool) and 0.0 < floor < 1.0
        validate.require(ok, f"floor must be a number in (0, 1), got {floor!r}")
        object.__setattr__(self, "floor", float(floor))
        validate.one_of("judge", self.judge, JUDGES)


def expert_names(params: AdaptiveParams) -> tuple[str, ...]:
    """A name per expert: ``rmm`` and ``h2o`` for the accumulating sums with and without
    correctness weights, ``ema0.9`` (``wema0.9`` weighted) for a decayed one."""
    names = []
    for decay, weighted in zip(params.decays, params.weighted):
        if decay == 1.0:
            names.append("rmm" if weighted else "h2o")
        else:
            names.append(f"{'w' if weighted else ''}ema{decay:g}")
    return tuple(names)


def _committed(policy: Policy, view: SlotView) -> Bool[Array, "B K S"]:
    """Slots past their protection: the only ones a score decides about."""
    return view.present & (view.age > policy.protected_age)


def _prediction(floor: float, total: Float[Array, "B K S"], among: Bool[Array, "B K S"]):
    """``total`` as a distribution over the slots ``among``, a ``floor`` of it uniform;
    uniform where the row's total is 0."""
    count = jnp.maximum(jnp.sum(among, axis=-1, keepdims=True, dtype=jnp.float32), 1.0)
    mass = jnp.sum(jnp.where(among, total, 0.0), axis=-1, keepdims=True)
    share = jnp.where(mass > 0, total / jnp.where(mass > 0, mass, 1.0), 1.0 / count)
    return (1.0 - floor) * share + floor / count


def _lowest(total: Float[Array, "B K S"], among: Bool[Array, "B K S"], count: int) -> Bool[Array, "B K S"]:
    """The ``count`` slots of ``among`` with the lowest ``total`` (all of them when
    fewer; every slot tied with the last one too)."""
    key = jnp.where(among, total, jnp.inf)
    cut = -jax.lax.top_k(-key, min(count, key.shape[-1]))[0][..., -1:]
    return among & (key <= cut)


def _snapshots(params: AdaptiveParams, sums, committed, take):
    """What a snapshot keeps of each sum, per slot: the log of its prediction, or
    whether it would evict the slot. Only rows where ``take`` holds use them."""
    if params.judge == "log_loss":
        return [jnp.log(_prediction(params.floor, total, committed)) for total in sums]
    # A top-k per sum costs far more than the step's other work: rank only when a
    # snapshot is due.
    return jax.lax.cond(jnp.any(take),
                        lambda: [_lowest(total, committed, params.horizon).astype(jnp.float32) for total in sums],
                        lambda: [jnp.zeros_like(total) for total in sums])


def _charge(params: AdaptiveParams, target: Float[Array, "B K S"], snapshot: Float[Array, "B K S"]):
    """A snapshot's loss on one query's normalised attention ``target``."""
    if params.judge == "log_loss":
        return -jnp.sum(target * snapshot, axis=-1)
    return jnp.sum(target * snapshot, axis=-1)


def _fold(policy: Policy, view: SlotView, obs: Observation, aux: PyTree):
    """Judge the last snapshot on this query's attention, fold the attention into every
    sum, and take a new snapshot every ``horizon`` queries."""
    p = policy.params
    n = len(p.decays)
    ev = view.evidence
    losses, snapshot_step = aux[..., :n], aux[..., n]

    # The items the snapshot predicted for: held since it was taken and committed then
    # (an item born later, in a reused slot, is not the one it saw).
    since = snapshot_step[..., None] + 1.0 - view.birth.astype(jnp.float32)
    judged = view.present & (snapshot_step[..., None] >= 0) & (since > policy.protected_age)
    used = jnp.where(judged, obs.attention, 0.0)
    mass = jnp.sum(used, axis=-1)
    target = used / jnp.where(mass > 0, mass, 1.0)[..., None]
    loss = jnp.stack([_charge(p, target, ev[n + k]) for k in range(n)], axis=-1)
    losses = jnp.where((mass > 0)[..., None], p.forget * losses + loss, losses)

    sums = [decay * ev[k] + (obs.weight[:, None, None] if weighted else 1.0) * obs.attention
            for k, (decay, weighted) in enumerate(zip(p.decays, p.weighted))]
    committed = _committed(policy, view)
    take = (view.step % p.horizon == 0)[:, None, None]
    snapshots = [jnp.where(take, fresh, ev[n + k])
                 for k, fresh in enumerate(_snapshots(p, sums, committed, take))]
    snapshot_step = jnp.where(take[..., 0], view.step[:, None].astype(jnp.float32), snapshot_step)
    aux = jnp.concatenate([losses, snapshot_step[..., None]], axis=-1)
    return with_columns(view, sums + snapshots), aux


def _weights(policy: Policy, aux: PyTree) -> Float[Array, "B K N"]:
    n = len(policy.params.decays)
    return jax.nn.softmax(-policy.params.rate * aux[..., :n], axis=-1)


def _score(policy: Policy, view: SlotView, aux: PyTree) -> Float[Array, "B K S"]:
    """The weighted mixture of the experts' current predictions."""
    p = policy.params
    committed = _committed(policy, view)
    weights = _weights(policy, aux)
    return sum(weights[..., k, None] * _prediction(p.floor, view.evidence[k], committed)
               for k in range(len(p.decays)))


def _init_aux(policy: Policy, batch: int, kv_heads: int, slots: int) -> Float[Array, "B K N1"]:
    """No loss yet (equal weights) and no snapshot (step -1)."""
    n = len(policy.params.decays)
    return jnp.concatenate([jnp.zeros((batch, kv_heads, n), jnp.float32),
                            jnp.full((batch, kv_heads, 1), -1.0, jnp.float32)], axis=-1)


def _monitor(policy: Policy, aux: PyTree) -> dict[str, Array]:
    """Each expert's weight, averaged over the KV heads of a row."""
    weights = jnp.mean(_weights(policy, aux), axis=1)
    return {f"weight_{name}": weights[:, k] for k, name in enumerate(expert_names(policy.params))}


def adaptive(
    lag: int = 16, *, recent: int = 0, decays: tuple[float, ...] = (1.0, 1.0, 0.9),
    weighted: tuple[bool, ...] = (True, False, False), horizon: int = 32, forget: float = 0.99,
    rate: float = 1.0, floor: float = 1e-3, judge: str = "log_loss",
) -> Policy:
    """Measure or accumulate, chosen online per row (a KV head of a layer of a sequence).

    Rule: each slot keeps one decayed attention sum per expert, ``e_k <- d_k e_k +
    (w *) a`` (by default RMM's correctness-weighted sum, H2O's sum and EMA at 0.9).
    Every ``horizon`` queries each expert's prediction ``q_k = e_k / sum e_k`` over the
    committed items (a ``floor`` of it uniform) is saved; each later query's attention
    over those items, normalised, charges expert k the log-loss ``-sum p log q_k``. The
    losses are discounted by ``forget`` and the weights are ``softmax(-rate * loss)``;
    score = ``sum_k weight_k q_k`` of the current predictions. With ``judge="evicted"``
    the loss is instead the share of that attention paid to the ``horizon`` items the
    expert ranked lowest (what evicting them would have cost). A new item is protected
    for the commit lag ``lag`` as in :func:`~flsmem.policies.rmm`. With one expert it
    keeps what that expert's policy keeps. :func:`flsmem.summary` reports each expert's
    weight per sequence (``weight_rmm``, ``weight_h2o``, ...).
    """
    params = AdaptiveParams(decays=tuple(decays), weighted=tuple(weighted), horizon=horizon, forget=forget,
                            rate=rate, floor=floor, judge=judge)
    return Policy(
        name="adaptive", score=_score, fold=_fold, init_aux=_init_aux, monitor=_monitor,
        evidence_shapes=((),) * (2 * len(params.decays)), recent=recent, lag=lag, params=params,
    )
