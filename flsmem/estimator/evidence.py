"""What the learned estimator reads: the evidence each slot gathers, and the
:data:`FEATURES` computed from it.

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

The evidence arrays are private to this module; the learner reads them through
:func:`features`, :func:`init_evidence`, :func:`fold_evidence` and :func:`score_rmm`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flsmem.policies import Observation, Policy, SlotView
from flsmem.policies.base import with_columns
from flsmem.typing import Array, Float, PyTree

__all__ = ["FEATURES", "features"]

# Evidence arrays, one number per slot each.
(_H2O, _RMM, _SUM, _UTILITY, _LAST, _MAX, _RECENT, _PRODUCER, _KEY_NORM, _VALUE_NORM,
 _FAR_ATTENTION, _FAR_UTILITY) = range(12)
NUM_EVIDENCE = 12
# Reads of an item in its first _FAR_AGE queries are mostly local (the tokens right
# after it read it, whatever it holds); later reads are retrievals. On the chain task
# ranking by far reads alone keeps the pair a correct lookup read, where every-age sums
# drown it among prose read locally.
_FAR_AGE = 16
# Fixed-point resolution of the heads' far attention mass (see fold_evidence).
_FIXED = float(2**20)
# The fast moving average of relative attention halves every query.
_RECENT_DECAY = 0.5

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


def features(evidence: tuple[Float[Array, "B K S"], ...], age, step, position, head: dict) -> Float[Array, "B K S F"]:
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
        jnp.log(1e-3 + jnp.maximum(e[_H2O], 0.0)),
        jnp.log(1e-3 + jnp.maximum(e[_RMM], 0.0)),
        log(e[_SUM]),
        log(e[_UTILITY]),
        log(e[_SUM] / a),
        log(e[_UTILITY] / a),
        log(e[_LAST]),
        log(e[_MAX]),
        log(e[_RECENT]),
        e[_PRODUCER],
        jnp.log(a),
        jnp.minimum(a / steps, 1.0),
        log(e[_KEY_NORM]),
        log(e[_VALUE_NORM]),
        log(position.astype(jnp.float32)),
        jnp.log(1e-3 + jnp.maximum(e[_FAR_ATTENTION], 0.0)),
        log(e[_FAR_UTILITY]),
        *head_columns,
    ]
    # Stacked on a leading axis and moved last: a stack on the last axis of arrays this
    # size runs several times slower on CPU (the same numbers either way).
    return jnp.moveaxis(jnp.stack(columns, axis=0), 0, -1)


def init_evidence(policy: Policy, payload: PyTree, position: Array, birth: Array) -> tuple[Array, ...]:
    """Key and value norms of the new items (payload ``{"k", "v"}``; another payload
    gives the norm of its first leaf as the key norm and no value norm)."""
    leaves = payload if isinstance(payload, dict) and "k" in payload else {"k": jax.tree.leaves(payload)[0]}

    def norm(x):
        x = x.astype(jnp.float32)
        return jnp.sqrt(jnp.sum(x * x, axis=tuple(range(3, x.ndim))))

    zeros = jnp.zeros(position.shape, jnp.float32)
    columns = [zeros] * NUM_EVIDENCE
    columns[_KEY_NORM] = norm(leaves["k"])
    columns[_VALUE_NORM] = norm(leaves["v"]) if "v" in leaves else zeros
    return tuple(columns)


def fold_evidence(view: SlotView, obs: Observation, aux: PyTree):
    """Fold one query into every slot's evidence and the heads' statistics in ``aux``.

    Returns:
      ``(evidence, aux, shown)``: ``shown`` is the utility each slot showed this query,
      the correctness-weighted relative attention ``w * n * a`` that labels gather.
    """
    e = view.evidence
    n = jnp.sum(view.present, axis=-1, keepdims=True).astype(jnp.float32)
    z = obs.attention * n
    w = obs.weight[:, None, None]
    arriving = view.age == 1
    far = view.age > _FAR_AGE
    columns = [
        e[_H2O] + obs.attention,
        e[_RMM] + w * obs.attention,
        e[_SUM] + z,
        e[_UTILITY] + w * z,
        z,
        jnp.maximum(e[_MAX], z),
        _RECENT_DECAY * e[_RECENT] + z,
        # The item arriving now is the token the previous query predicted.
        jnp.where(arriving, aux["last_weight"][:, None, None], e[_PRODUCER]),
        e[_KEY_NORM],
        e[_VALUE_NORM],
        e[_FAR_ATTENTION] + jnp.where(far, obs.attention, 0.0),
        e[_FAR_UTILITY] + jnp.where(far, w * z, 0.0),
    ]
    evidence = with_columns(view, columns)
    # The head's far attention mass [B, K], summed in fixed point: an integer sum is exact
    # in any order, so however XLA splits the reduction over devices it gives one
    # device's result. Attention sums to 1 per query: the total stays far inside int32.
    ticks = jnp.round(jnp.where(far & view.present, obs.attention, 0.0) * _FIXED).astype(jnp.int32)
    far_mass = jnp.sum(ticks, axis=-1).astype(jnp.float32) / _FIXED
    aux = dict(aux, last_weight=obs.weight, head_far=aux["head_far"] + far_mass,
               head_far_right=aux["head_far_right"] + obs.weight[:, None] * far_mass,
               head_right=aux["head_right"] + obs.weight, head_queries=aux["head_queries"] + 1.0)
    return evidence, aux, w * z


def score_rmm(policy: Policy, view: SlotView, aux: PyTree) -> Float[Array, "B K S"]:
    """The RMM score (correctness-weighted attention summed over the slot's life), one of
    the evidence arrays: the learned policy's fallback."""
    return view.evidence[_RMM]
