"""Eviction policies: how evidence is folded and how a slot's score is committed.

A policy is a frozen, hashable :class:`Policy`: a few module-level pure functions and
their parameters, in the way optax builds a transformation from ``init`` and
``update``. Two policies built with the same arguments compare equal, so a config
holding one can be a static argument of ``jax.jit`` without retracing.

What every policy shares, and the memory applies for it:

* **Protection.** ``sinks`` (items whose position is below ``sinks``), the ``recent``
  window and the commit ``lag`` are never evicted; they count *inside* the budget. A
  slot's ``age`` is the number of queries it has seen, 1 right after the query of the
  step it arrived in, so a slot is protected while ``age <= max(recent, lag)``.
* **Scoring.** ``smooth`` commits ``score(view)``, divided by ``age + 1`` when
  ``normalise_by_age`` is set; ``evict`` keeps the highest scores.
* **Query heads.** :func:`flsmem.reduce_query_heads` reduces the G query heads of a
  GQA group to one attention row per KV head with ``head_reduction``.

Adding a policy is one short factory: pick or write a ``fold`` (evidence update for one
query) and a ``score`` (evidence to score) and return ``Policy(...)``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from flsmem import validate
from flsmem.typing import Array, Bool, Float, Int, PyTree

__all__ = [
    "Observation",
    "Policy",
    "SlotView",
    "ema",
    "full",
    "h2o",
    "kalman",
    "key_norm",
    "lag_window",
    "oracle",
    "random",
    "rmm",
    "scissorhands",
    "snapkv",
    "streaming_llm",
    "tova",
    "use_recency",
    "window",
]

HEAD_REDUCTIONS = ("mean", "sum", "max")


class SlotView(NamedTuple):
    """What a policy sees of the memory.

    Attributes:
      evidence: ``[B, K, S, E]`` the policy's per-slot statistics.
      age: ``[B, K, S]`` int32, queries seen since arrival (1 after the arrival step's
        query, including the query being folded when inside ``fold``).
      birth: ``[B, K, S]`` int32, step at which the item arrived.
      position: ``[B, K, S]`` int32, absolute position of the item.
      present: ``[B, K, S]`` bool, occupied and already arrived.
      step: ``[B]`` int32, the step of the query being folded (in ``fold``), or the
        number of queries observed so far (in ``score``).
    """

    evidence: Float[Array, "B K S E"]
    age: Int[Array, "B K S"]
    birth: Int[Array, "B K S"]
    position: Int[Array, "B K S"]
    present: Bool[Array, "B K S"]
    step: Int[Array, "B"]


class Observation(NamedTuple):
    """One query's evidence.

    Attributes:
      attention: ``[B, K, S]`` attention the query gave each slot, 0 on slots not
        present and where the input was not finite.
      weight: ``[B]`` correctness weight of the query's prediction in [0, 1] (1 when
        none was given).
      future: ``[B, K, S]`` future utility of each slot (oracle only), else None.
    """

    attention: Float[Array, "B K S"]
    weight: Float[Array, "B"]
    future: Float[Array, "B K S"] | None


FoldFn = Callable[["Policy", SlotView, Observation, PyTree], tuple[Array, PyTree]]
ScoreFn = Callable[["Policy", SlotView, PyTree], Array]
InitEvidenceFn = Callable[["Policy", PyTree, Array, Array], Array]
InitAuxFn = Callable[["Policy", int, int, int], PyTree]
MonitorFn = Callable[["Policy", PyTree], dict[str, Array]]


@dataclasses.dataclass(frozen=True)
class Policy:
    """A frozen, hashable eviction policy.

    Attributes:
      name: short name used in tables.
      score: ``score(policy, view, aux) -> [B, K, S]`` committed score; higher is kept.
      fold: ``fold(policy, view, observation, aux) -> (evidence, aux)`` folds one
        query's evidence; None for policies whose evidence never changes.
      init_evidence: ``init_evidence(policy, payload, position, birth) -> [B, K, Q, E]``
        evidence of newly written items (payload leaves ``[B, K, Q, ...]``); None
        starts from zeros.
      init_aux: ``init_aux(policy, batch, kv_heads, slots) -> pytree`` the policy's own
        state: per-row arrays (the adaptive filter's noise estimates) or shared ones (the
        learned estimator's parameters); None for no state.
      fallback_score: ``fallback_score(policy, view, aux) -> [B, K, S]`` used for a whole
        row when ``score`` is not finite for one of its present slots (a learned score
        falls back to demonstrated utility); None ranks such slots by recency below
        every finite score.
      monitor: ``monitor(policy, aux) -> {name: [B] array}`` figures of the policy's
        state added to :func:`flsmem.summary`; None adds nothing.
      num_evidence: E, statistics kept per slot.
      params: the policy's own parameters as sorted ``(name, value)`` pairs; read them
        with :attr:`p`.
      sinks: items whose position is below this are protected (attention sinks).
      recent: the most recent ``recent`` items are protected.
      lag: commit lag H: a slot is protected until it has seen H queries after its
        arrival step's query.
      normalise_by_age: commit ``score / (age + 1)`` instead of ``score``.
      head_reduction: how :func:`flsmem.reduce_query_heads` combines the G query heads
        of a KV group: "mean", "sum" or "max".
      needs_future: ``observe`` must be given ``future`` (the oracle).
      evicts: False for the full cache, which never evicts.
      score_when_due: :func:`flsmem.update` commits scores only at the steps an
        eviction is due, the only steps that read them, instead of at every query: for
        a score that costs more than folding the evidence (the learned network). The
        kept sets are the same (a score depends on the state of its step only);
        ``state.score`` then holds the scores of the last eviction, ``stats.fallbacks``
        counts the non-finite scores of those steps, and :func:`flsmem.smooth` still
        commits fresh scores whenever called.
    """

    name: str
    score: ScoreFn
    fold: FoldFn | None = None
    init_evidence: InitEvidenceFn | None = None
    init_aux: InitAuxFn | None = None
    fallback_score: ScoreFn | None = None
    monitor: MonitorFn | None = None
    num_evidence: int = 1
    params: tuple[tuple[str, Any], ...] = ()
    sinks: int = 0
    recent: int = 0
    lag: int = 0
    normalise_by_age: bool = False
    head_reduction: str = "mean"
    needs_future: bool = False
    evicts: bool = True
    score_when_due: bool = False

    def __post_init__(self):
        validate.nonneg_int("sinks", self.sinks)
        validate.nonneg_int("recent", self.recent)
        validate.nonneg_int("lag", self.lag)
        validate.require(
            isinstance(self.num_evidence, int) and self.num_evidence >= 1,
            f"num_evidence must be an int >= 1, got {self.num_evidence!r}",
        )
        validate.require(
            self.head_reduction in HEAD_REDUCTIONS,
            f"head_reduction must be one of {HEAD_REDUCTIONS}, got {self.head_reduction!r}",
        )
        validate.require(
            isinstance(self.normalise_by_age, bool),
            f"normalise_by_age must be a bool, got {self.normalise_by_age!r}",
        )
        validate.require(
            isinstance(self.score_when_due, bool),
            f"score_when_due must be a bool, got {self.score_when_due!r}",
        )
        object.__setattr__(self, "params", tuple(sorted(self.params)))

    @property
    def p(self) -> dict[str, Any]:
        """The policy's parameters as a dict."""
        return dict(self.params)

    @property
    def protected_age(self) -> int:
        """Slots with ``age <= protected_age`` are protected."""
        return max(self.recent, self.lag)

    def replace(self, **changes) -> "Policy":
        """A copy with some fields changed, validated again."""
        return dataclasses.replace(self, **changes)


# --------------------------------------------------------------------------- folds


def _weight(policy: Policy, obs: Observation) -> Float[Array, "B 1 1"]:
    w = obs.weight if policy.p.get("weighted", False) else jnp.ones_like(obs.weight)
    return w[:, None, None]


def _fold_decayed_sum(policy, view, obs, aux):
    """e <- decay * e + w * a: accumulates (decay 1) or measures (decay 0)."""
    decay = policy.p["decay"]
    e = view.evidence[..., 0]
    new = decay * e + _weight(policy, obs) * obs.attention
    return jnp.where(view.present, new, e)[..., None], aux


def _fold_lag_window(policy, view, obs, aux):
    """Accumulate gamma^(H + 1 - age) * w * a while age <= H + 1, then decay by rho."""
    gamma, rho = policy.p["gamma"], policy.p["decay_after"]
    e = view.evidence[..., 0]
    inside = view.age <= policy.lag + 1
    exponent = jnp.maximum(policy.lag + 1 - view.age, 0).astype(jnp.float32)
    added = e + jnp.power(jnp.float32(gamma), exponent) * _weight(policy, obs) * obs.attention
    new = jnp.where(inside, added, rho * e)
    return jnp.where(view.present, new, e)[..., None], aux


def _above_uniform(obs: Observation, present) -> Bool[Array, "B K S"]:
    """Attention above 1/n, n the slots the query could attend."""
    n = jnp.sum(present, axis=-1, keepdims=True).astype(jnp.float32)
    return obs.attention * n > 1.0


def _fold_use_recency(policy, view, obs, aux):
    """e <- decay * e + [slot used], so e = sum over uses of decay^(steps since use)."""
    threshold = policy.p["use_threshold"]
    if threshold is None:
        used = _above_uniform(obs, view.present)
    else:
        used = obs.attention > threshold
    e = view.evidence[..., 0]
    new = policy.p["decay"] * e + used.astype(jnp.float32)
    return jnp.where(view.present, new, e)[..., None], aux


def _fold_ring(value_fn):
    """Store this query's per-slot value in a ring buffer of the last E queries."""

    def fold(policy, view, obs, aux):
        value = value_fn(policy, view, obs)
        width = policy.num_evidence
        column = jax.nn.one_hot(view.step % width, width, dtype=jnp.bool_)  # [B, E]
        write_here = view.present[..., None] & column[:, None, None, :]
        return jnp.where(write_here, value[..., None], view.evidence), aux

    return fold


def _snapkv_value(policy, view, obs):
    return _weight(policy, obs) * obs.attention


def _scissorhands_value(policy, view, obs):
    n = jnp.sum(view.present, axis=-1, keepdims=True).astype(jnp.float32)
    return (obs.attention * n < 1.0).astype(jnp.float32)


_fold_snapkv = _fold_ring(_snapkv_value)
_fold_scissorhands = _fold_ring(_scissorhands_value)


def _fold_future(policy, view, obs, aux):
    e = view.evidence[..., 0]
    return jnp.where(view.present, obs.future, e)[..., None], aux


# Kalman evidence columns: the filter (mean, variance P, measurements folded) and, for
# the adaptive filter, the derivatives of the mean and of P / r with respect to
# log(q / r).
_MEAN, _VAR, _COUNT, _DMEAN, _DVAR = range(5)
# Adaptive aux, per row: log(q / r), r, and the running mean of dmean^2 (the
# Gauss-Newton curvature).
_LOG_X, _R, _INFO = range(3)
# The estimated q / r stays in [1e-8, 1e4]: gains from 1e-4 to 1 - 1e-4.
_LOG_X_MIN, _LOG_X_MAX = math.log(1e-8), math.log(1e4)
_R_MIN = 1e-12


def _kalman_noise(policy, aux):
    """(q, r): fixed, or per row from the adaptive estimate."""
    if not policy.p["adaptive"]:
        return jnp.float32(policy.p["q"]), jnp.float32(policy.p["r"])
    r = jnp.maximum(aux[..., _R], _R_MIN)
    q = jnp.exp(aux[..., _LOG_X]) * r
    return q[..., None], r[..., None]


def _fold_kalman(policy, view, obs, aux):
    """Scalar filter per slot: predict P += q, update with z = (w *) a.

    The adaptive filter also carries each slot's sensitivity of the mean to
    theta = log(q / r), and moves theta by a damped Gauss-Newton step on the squared
    innovations pooled over the row's slots (a recursive prediction-error method). With
    the true q / r the filter's one-step predictions have the least error at every age,
    so its innovations are uncorrelated with anything computed from the past, the
    sensitivity included: that is the fixed point. r is the running mean of the
    innovations normalised by their predicted variance.
    """
    ev = view.evidence
    m, var, n = ev[..., _MEAN], ev[..., _VAR], ev[..., _COUNT]
    dmean, dvar = ev[..., _DMEAN], ev[..., _DVAR]
    z = _weight(policy, obs) * obs.attention
    q, r = _kalman_noise(policy, aux)
    first = n == 0
    var_pred = var + q
    spread = var_pred + r  # predicted variance of the innovation
    gain = jnp.where(first, 1.0, var_pred / spread)
    innovation = z - m
    m_new = m + gain * innovation
    var_new = jnp.where(first, r, (1.0 - gain) * var_pred)
    # d/dtheta of the same recursion, P in units of r (where the gain depends on q / r
    # only): P / r <- gain, so its derivative is dgain; the first measurement sets
    # m = z and P = r, which do not depend on theta.
    x = q / r
    dgain = jnp.where(first, 0.0, (dvar + x) * (r / spread) ** 2)
    dmean_new = (1.0 - gain) * dmean + dgain * innovation
    new = jnp.stack([m_new, var_new, n + 1.0, dmean_new, dgain], axis=-1)
    new_ev = jnp.where(view.present[..., None], new, ev)
    if policy.p["adaptive"]:
        used = view.present & ~first  # slots that had a prediction to check
        count = jnp.sum(used, axis=-1).astype(jnp.float32)

        def pooled(v):
            return jnp.sum(jnp.where(used, v, 0.0), axis=-1) / jnp.maximum(count, 1.0)

        beta = policy.p["beta"]
        # -1/2 d(innovation^2)/dtheta = innovation * dmean, since dz/dtheta = 0.
        grad = pooled(innovation * dmean)
        info_now = pooled(dmean * dmean)
        info = (1.0 - beta) * aux[..., _INFO] + beta * info_now
        # Early on the running curvature is still filling up: use this query's if larger.
        # The step is bounded so that one query moves q / r by at most a factor e.
        step = jnp.clip(beta * grad / jnp.maximum(jnp.maximum(info, info_now), 1e-30), -1.0, 1.0)
        log_x = jnp.clip(aux[..., _LOG_X] + step, _LOG_X_MIN, _LOG_X_MAX)
        r_new = (1.0 - beta) * aux[..., _R] + beta * pooled(innovation ** 2 * r / spread)
        updated = jnp.stack([log_x, r_new, info], axis=-1)
        aux = jnp.where((count > 0)[..., None], updated, aux)
    return new_ev, aux


def _kalman_init_aux(policy, batch, kv_heads, slots):
    if not policy.p["adaptive"]:
        return None
    q, r = policy.p["q"], policy.p["r"]
    log_x = min(max(math.log(max(q / r, 1e-30)), _LOG_X_MIN), _LOG_X_MAX)
    prior = jnp.array([log_x, r, 0.0], jnp.float32)
    return jnp.broadcast_to(prior, (batch, kv_heads, 3))


# -------------------------------------------------------------------------- scores


def _score_first(policy, view, aux):
    return view.evidence[..., 0]


def _score_recency(policy, view, aux):
    # Exact in float32 up to 2^24 steps.
    return view.birth.astype(jnp.float32)


def _score_unimportance(policy, view, aux):
    return -jnp.sum(view.evidence, axis=-1)


def _score_snapkv(policy, view, aux):
    votes = jnp.sum(view.evidence, axis=-1)
    return _pool_by_position(
        votes, view.position, view.present, policy.p["kernel_size"], policy.p["pooling"]
    )


def _pool_by_position(x, position, present, kernel_size, pooling):
    """Pool x over each slot's neighbours in position order (SnapKV's 1-D pooling)."""
    if kernel_size == 1:
        return x
    big = jnp.iinfo(jnp.int32).max
    order = jnp.argsort(jnp.where(present, position, big), axis=-1, stable=True)
    xs = jnp.take_along_axis(x, order, axis=-1)
    ps = jnp.take_along_axis(present, order, axis=-1)
    pad = [(0, 0)] * (x.ndim - 1) + [(kernel_size // 2, (kernel_size - 1) // 2)]
    window = (1,) * (x.ndim - 1) + (kernel_size,)
    strides = (1,) * x.ndim
    if pooling == "max":
        xs = jnp.where(ps, xs, -jnp.inf)
        pooled = lax.reduce_window(xs, -jnp.inf, lax.max, window, strides, pad)
    else:  # zero padding, divided by the full kernel size, as avg_pool1d does
        xs = jnp.where(ps, xs, 0.0)
        pooled = lax.reduce_window(xs, 0.0, lax.add, window, strides, pad) / kernel_size
    inverse = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(pooled, inverse, axis=-1)


def _score_kalman(policy, view, aux):
    return view.evidence[..., _MEAN]


# ------------------------------------------------------------------ init evidence


def _init_key_norm(policy, payload, position, birth):
    leaf = policy.p["leaf"]
    if not isinstance(payload, dict) or leaf not in payload:
        raise ValueError(
            f"key_norm(leaf={leaf!r}) needs a payload dict with a {leaf!r} entry, "
            f"got {jax.tree_util.tree_structure(payload)}"
        )
    keys = payload[leaf].astype(jnp.float32)
    norm = jnp.sqrt(jnp.sum(keys * keys, axis=tuple(range(3, keys.ndim))))
    return -norm[..., None]


def _hash32(x: Array) -> Array:
    """A 32-bit integer mixer (lowbias32): cheap, well spread, deterministic."""
    x = x.astype(jnp.uint32)
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def _init_random(policy, payload, position, birth):
    b, k, q = position.shape
    row = lax.broadcasted_iota(jnp.uint32, (b, k, q), 0) * jnp.uint32(k) + lax.broadcasted_iota(
        jnp.uint32, (b, k, q), 1
    )
    h = _hash32(jnp.uint32(policy.p["seed"]) ^ _hash32(row))
    h = _hash32(h ^ position.astype(jnp.uint32))
    return ((h >> 8).astype(jnp.float32) * (1.0 / (1 << 24)))[..., None]


# ----------------------------------------------------------------------- factories


def full() -> Policy:
    """The full cache: never evicts. The quality reference every result compares to."""
    return Policy(name="full", score=_score_recency, evicts=False)


def window() -> Policy:
    """Sliding window: keep the ``budget`` most recent items (score = arrival step)."""
    return Policy(name="window", score=_score_recency)


def streaming_llm(sinks: int = 4) -> Policy:
    """StreamingLLM (Xiao et al., 2023, arXiv 2309.17453).

    Rule: keep the first ``sinks`` tokens (attention sinks) and the most recent
    ``budget - sinks`` tokens; score = arrival step.
    """
    return Policy(name="streaming_llm", score=_score_recency, sinks=sinks)


def h2o(recent: int = 0) -> Policy:
    """H2O, heavy-hitter oracle (Zhang et al., 2023, arXiv 2306.14048).

    Rule: score = attention accumulated over every query since the item arrived,
    ``sum_s a_s(i)``; keep the ``recent`` most recent tokens plus the highest scores
    (the paper splits the budget evenly between the two).
    """
    return Policy(
        name="h2o", score=_score_first, fold=_fold_decayed_sum, recent=recent,
        params=(("decay", 1.0), ("weighted", False)),
    )


def tova(recent: int = 0) -> Policy:
    """TOVA, token omission via attention (Oren et al., 2024, arXiv 2401.06104).

    Rule: score = the current query's attention (query heads of a group averaged);
    at each step the lowest-scoring token is dropped.
    """
    return Policy(
        name="tova", score=_score_first, fold=_fold_decayed_sum, recent=recent,
        params=(("decay", 0.0), ("weighted", False)),
    )


def ema(decay: float = 0.9, *, weighted: bool = False, recent: int = 0, lag: int = 0) -> Policy:
    """Exponentially decayed attention: ``e <- decay * e + (w *) a``.

    Decay 1 accumulates (H2O's rule), decay 0 measures (TOVA's rule); values between
    trade the two off. With ``weighted`` the attention is weighted by correctness.
    """
    validate.unit("decay", decay)
    return Policy(
        name="ema", score=_score_first, fold=_fold_decayed_sum, recent=recent, lag=lag,
        params=(("decay", float(decay)), ("weighted", bool(weighted))),
    )


def rmm(lag: int = 16, *, recent: int = 0, decay: float = 1.0) -> Policy:
    """Demonstrated utility (RMM, arXiv 2607.24667).

    Rule: ``DU_t(i) = sum_{s=birth(i)}^{t} w_s * a_s(i)``, attention weighted by the
    correctness ``w_s`` of the prediction made with it; a new item is protected for
    its commit lag H (``lag``) while the evidence gathers. With every weight 1 and
    ``max(recent, lag)`` equal, it keeps exactly what :func:`h2o` keeps. ``decay < 1``
    forgets old evidence (measuring instead of accumulating).
    """
    validate.unit("decay", decay)
    return Policy(
        name="rmm", score=_score_first, fold=_fold_decayed_sum, recent=recent, lag=lag,
        params=(("decay", float(decay)), ("weighted", True)),
    )


def scissorhands(history: int = 32, *, recent: int = 0) -> Policy:
    """Scissorhands (Liu et al., 2023, arXiv 2305.17118).

    Rule: over the last ``history`` queries, count the steps in which the item got less
    than average attention (``a < 1/n``, n the tokens the query could attend); evict the
    highest counts (score = -count). For items that have seen the whole history window
    this ranks exactly as the count of above-uniform steps.
    """
    validate.require(isinstance(history, int) and history >= 1, f"history must be an int >= 1, got {history!r}")
    return Policy(
        name="scissorhands", score=_score_unimportance, fold=_fold_scissorhands,
        num_evidence=history, recent=recent,
    )


def snapkv(window: int = 32, *, kernel_size: int = 5, pooling: str = "avg") -> Policy:
    """SnapKV (Li et al., 2024, arXiv 2404.14469).

    Rule: score = attention summed over the last ``window`` queries (the observation
    window at the end of the prompt), pooled ("avg" or "max", zero padded) over the
    ``kernel_size`` neighbouring items held, in position order (at prefill, before
    anything is evicted, the neighbouring positions); the window's own tokens are
    protected. Built for prefill
    compression: write and observe the prompt, then ``evict(state, budget=...)``.
    """
    validate.require(isinstance(window, int) and window >= 1, f"window must be an int >= 1, got {window!r}")
    validate.require(
        isinstance(kernel_size, int) and kernel_size >= 1,
        f"kernel_size must be an int >= 1, got {kernel_size!r}",
    )
    validate.require(pooling in ("avg", "max"), f"pooling must be 'avg' or 'max', got {pooling!r}")
    return Policy(
        name="snapkv", score=_score_snapkv, fold=_fold_snapkv, num_evidence=window,
        recent=window,
        params=(("kernel_size", kernel_size), ("pooling", pooling), ("weighted", False)),
    )


def key_norm(leaf: str = "k") -> Policy:
    """Key-norm eviction (Devoto et al., 2024, arXiv 2406.11430).

    Rule: keep the keys with the smallest L2 norm (score = -||k||), read from the
    payload entry ``leaf`` when the item is written.
    """
    return Policy(name="key_norm", score=_score_first, init_evidence=_init_key_norm,
                  params=(("leaf", leaf),))


def random(seed: int = 0) -> Policy:
    """Random eviction: each item draws a fixed uniform score from a hash of
    (seed, batch row, KV head, position), so runs are reproducible."""
    validate.nonneg_int("seed", seed)
    return Policy(name="random", score=_score_first, init_evidence=_init_random,
                  params=(("seed", seed),))


def kalman(
    q: float = 0.01, r: float = 1.0, *, adaptive: bool = False, beta: float = 0.01,
    weighted: bool = False, recent: int = 0, lag: int = 0,
) -> Policy:
    """Per-slot scalar Kalman filter on attention (local-level model).

    Rule: each slot holds a mean m and variance P. Every query: predict ``P += q``,
    then update with the measurement z = a (or w * a when ``weighted``):
    ``K = P / (P + r)``, ``m += K (z - m)``, ``P = (1 - K) P``; the first measurement
    sets ``m = z, P = r``. Score = m. q = 0 gives the running mean of attention
    (accumulating); large q/r gives a gain near 1 (measuring, like TOVA). With
    ``adaptive`` each row estimates q/r online, starting from the given q and r, by a
    damped Gauss-Newton step per query (rate ``beta``) on the squared innovations
    ``z - m`` of its slots (a recursive prediction-error method: at the true q/r the
    innovations are unpredictable from the past), and r as the running mean of the
    innovations over their predicted variance. The estimate averages over about
    ``1 / beta`` queries; in the accumulating regime that window should be longer than
    the filter's own memory, about ``1 / sqrt(q / r)`` queries. :mod:`flsmem.theory`
    gives the steady-state gain for a q/r and the EMA decay it implies.
    """
    validate.require(isinstance(q, (int, float)) and q >= 0, f"q must be a number >= 0, got {q!r}")
    validate.positive("r", r)
    validate.unit("beta", beta)
    return Policy(
        name="kalman", score=_score_kalman, fold=_fold_kalman, init_aux=_kalman_init_aux,
        num_evidence=5, recent=recent, lag=lag,
        params=(("q", float(q)), ("r", float(r)), ("adaptive", bool(adaptive)),
                ("beta", float(beta)), ("weighted", bool(weighted))),
    )


def oracle() -> Policy:
    """Oracle upper bound: score = the future utility of each slot, given to
    ``observe(..., future=...)`` from a trace of the future (for example the attention
    the item will receive from later queries in a full-cache run)."""
    return Policy(name="oracle", score=_score_first, fold=_fold_future, needs_future=True)


def lag_window(lag: int = 16, *, gamma: float = 0.9, decay_after: float = 1.0,
               weighted: bool = True) -> Policy:
    """Preset (a) of the source documents: lag-window accumulation, then freeze.

    Rule: while a slot is inside its lag window (age 1 .. H + 1, H = ``lag``) add
    ``gamma^(H + 1 - age) * (w *) a``, so later observations weigh more; afterwards the
    score is frozen, multiplied by ``decay_after`` each query (1 keeps it forever; a
    value slightly below 1 lets stale high scores fade).
    """
    validate.unit("gamma", gamma)
    validate.unit("decay_after", decay_after)
    return Policy(
        name="lag_window", score=_score_first, fold=_fold_lag_window, lag=lag,
        params=(("gamma", float(gamma)), ("decay_after", float(decay_after)),
                ("weighted", bool(weighted))),
    )


def use_recency(lag: int = 16, *, decay: float = 0.9,
                use_threshold: float | None = None) -> Policy:
    """Preset (b) of the source documents: protect for the lag, then score by recency
    of use.

    Rule: a slot is *used* by a query when its attention is above uniform (``a > 1/n``)
    or above ``use_threshold`` when given; score = ``sum over uses of
    decay^(steps since the use)``, computed incrementally as ``e <- decay * e + used``.
    """
    validate.unit("decay", decay)
    return Policy(
        name="use_recency", score=_score_first, fold=_fold_use_recency, lag=lag,
        params=(("decay", float(decay)), ("use_threshold", use_threshold)),
    )
