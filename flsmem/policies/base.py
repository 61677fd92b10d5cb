"""What every policy is made of: :class:`Policy`, the views it reads, typed parameters.

A policy is a frozen, hashable :class:`Policy`: a few module-level pure functions and
their typed :class:`Params`, in the way optax builds a transformation from ``init`` and
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
query) and a ``score`` (evidence to score), a :class:`Params` dataclass for what the
functions read, and return ``Policy(...)``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax.numpy as jnp

from flsmem import validate
from flsmem.typing import Array, Bool, Float, Int, PyTree

__all__ = [
    "FoldFn",
    "FoldQueriesFn",
    "HEAD_REDUCTIONS",
    "InitAuxFn",
    "InitEvidenceFn",
    "MonitorFn",
    "Observation",
    "Params",
    "Policy",
    "ScoreFn",
    "SlotView",
    "score_first",
    "weight",
    "with_column",
    "with_columns",
]

HEAD_REDUCTIONS = ("mean", "sum", "max")


class SlotView(NamedTuple):
    """What a policy sees of the memory.

    Attributes:
      evidence: the policy's per-slot statistics, a tuple of arrays ``[B, K, S, ...]``
        shaped by ``policy.evidence_shapes``.
      age: ``[B, K, S]`` int32, queries seen since arrival (1 after the arrival step's
        query, including the query being folded when inside ``fold``).
      birth: ``[B, K, S]`` int32, step at which the item arrived.
      position: ``[B, K, S]`` int32, absolute position of the item.
      present: ``[B, K, S]`` bool, occupied and already arrived.
      step: ``[B]`` int32, the step of the query being folded (in ``fold``), or the
        number of queries observed so far (in ``score``).
    """

    evidence: tuple[Float[Array, "B K S ..."], ...]
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


@dataclasses.dataclass(frozen=True)
class Params:
    """The typed parameters of a policy family: subclasses are frozen dataclasses whose
    fields are the values the family's functions read, checked in ``__post_init__``.

    Frozen dataclasses hash and compare by type and field values, so a policy holding
    its parameters stays a static argument of ``jax.jit``; a field name misspelt by a
    reader fails when the module is traced rather than reading a default.
    """

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The parameter names of this family, in declaration order."""
        return tuple(field.name for field in dataclasses.fields(cls))

    def replace(self, **changes) -> "Params":
        """A copy with some parameters changed, checked again.

        Raises:
          ValueError: a name is not a parameter of this family; the message lists the
            names that are.
        """
        allowed = self.names()
        unknown = [name for name in changes if name not in allowed]
        if unknown:
            validate.fail(f"unknown parameter {', '.join(map(repr, unknown))} of {type(self).__name__}; "
                          f"its parameters are {allowed}")
        return dataclasses.replace(self, **changes)


FoldFn = Callable[["Policy", SlotView, Observation, PyTree], tuple[Array, PyTree]]
ScoreFn = Callable[["Policy", SlotView, PyTree], Array]
InitEvidenceFn = Callable[["Policy", PyTree, Array, Array], Array]
InitAuxFn = Callable[["Policy", int, int, int], PyTree]
MonitorFn = Callable[["Policy", PyTree], dict[str, Array]]
FoldQueriesFn = Callable[["Policy", PyTree, Array, Array], PyTree]


@dataclasses.dataclass(frozen=True)
class Policy:
    """A frozen, hashable eviction policy.

    Attributes:
      name: short name used in tables.
      score: ``score(policy, view, aux) -> [B, K, S]`` committed score; higher is kept.
      fold: ``fold(policy, view, observation, aux) -> (evidence, aux)`` folds one
        query's evidence; None for policies whose evidence never changes.
      init_evidence: ``init_evidence(policy, payload, position, birth) -> tuple`` the
        evidence arrays of newly written items, ``[B, K, Q, ...]`` each (payload leaves
        ``[B, K, Q, ...]``); None starts from zeros.
      init_aux: ``init_aux(policy, batch, kv_heads, slots) -> pytree`` the policy's own
        state: per-row arrays with the rows first (the adaptive filter's noise
        estimates) or arrays the rows share, with no batch axis (the learned
        estimator's parameters); None for no state. When the layers of stacked memories
        are updated as rows of one memory (:func:`flsmem.update_layers`), a shared
        array comes with a leading axis of one entry per layer, entry l for rows
        ``l * B`` to ``l * B + B - 1``, and the policy's functions serve each group of
        rows with its own entry.
      fallback_score: ``fallback_score(policy, view, aux) -> [B, K, S]`` used for a whole
        row when ``score`` is not finite for one of its present slots (a learned score
        falls back to demonstrated utility); None ranks such slots by recency below
        every finite score.
      monitor: ``monitor(policy, aux) -> {name: [B] array}`` figures of the policy's
        state added to :func:`flsmem.summary`; None adds nothing.
      evidence_shapes: the trailing shape of each of the policy's evidence arrays:
        array ``i`` is ``[B, K, S, *evidence_shapes[i]]`` float32; ``((),)``, one
        number per slot, by default. A statistic the fold reads and writes as a whole
        is best an array of its own: one array of several columns is rewritten whole
        at every query (XLA cannot update a column in place while the others are
        read), and copied (``python -m bench.evidence_layout``).
      params: the family's typed :class:`Params`, read as attributes
        (``policy.params.decay``); None for a policy without parameters. Change them
        with :meth:`with_params`.
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
      fold_queries: ``fold_queries(policy, aux, queries, position) -> aux`` folds a
        step's queries (``[B, K, G, T, D]``, position encoding applied; ``position``
        ``[B, T]``) into the policy's state; :func:`flsmem.attend` calls it, for a
        policy that predicts from the queries themselves (ExpectedAttention); None
        for the others.
      head_budget: a :class:`~flsmem.policies.budgets.HeadBudget` to share each
        sequence's budget among its KV heads by score (:func:`~flsmem.policies.adakv`);
        None for the same budget in every head.
      layer_schedule: a :class:`~flsmem.policies.budgets.LayerSchedule` of budgets over
        a stack of layers, applied by :func:`flsmem.compress`
        (:func:`~flsmem.policies.pyramid`); None for the same budget in every layer.
    """

    name: str
    score: ScoreFn
    fold: FoldFn | None = None
    init_evidence: InitEvidenceFn | None = None
    init_aux: InitAuxFn | None = None
    fallback_score: ScoreFn | None = None
    monitor: MonitorFn | None = None
    evidence_shapes: tuple[tuple[int, ...], ...] = ((),)
    params: Params | None = None
    sinks: int = 0
    recent: int = 0
    lag: int = 0
    normalise_by_age: bool = False
    head_reduction: str = "mean"
    needs_future: bool = False
    evicts: bool = True
    score_when_due: bool = False
    fold_queries: FoldQueriesFn | None = None
    head_budget: "HeadBudget | None" = None
    layer_schedule: "LayerSchedule | None" = None

    def __post_init__(self):
        validate.nonneg_int("sinks", self.sinks)
        validate.nonneg_int("recent", self.recent)
        validate.nonneg_int("lag", self.lag)
        shapes = self.evidence_shapes
        validate.require(
            isinstance(shapes, tuple) and len(shapes) >= 1 and all(
                isinstance(shape, tuple) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 1
                                                 for d in shape) for shape in shapes),
            f"evidence_shapes must be a non-empty tuple of tuples of ints >= 1 (one trailing shape per "
            f"evidence array), got {shapes!r}",
        )
        validate.one_of("head_reduction", self.head_reduction, HEAD_REDUCTIONS)
        validate.boolean("normalise_by_age", self.normalise_by_age)
        validate.boolean("score_when_due", self.score_when_due)
        validate.require(
            self.params is None or isinstance(self.params, Params),
            f"params must be a flsmem.policies.Params or None, got {type(self.params).__name__}",
        )

    @property
    def num_evidence(self) -> int:
        """How many evidence arrays the policy keeps."""
        return len(self.evidence_shapes)

    def zero_evidence(self, rows: tuple[int, ...]) -> tuple[Array, ...]:
        """Evidence of zeros for items laid out ``rows`` (``[B, K, S]`` or ``[B, K, Q]``)."""
        return tuple(jnp.zeros(tuple(rows) + shape, jnp.float32) for shape in self.evidence_shapes)

    @property
    def protected_age(self) -> int:
        """Slots with ``age <= protected_age`` are protected."""
        return max(self.recent, self.lag)

    def replace(self, **changes) -> "Policy":
        """A copy with some fields changed, validated again."""
        return dataclasses.replace(self, **changes)

    def with_params(self, **changes) -> "Policy":
        """A copy with some of its typed parameters changed, checked again.

        Raises:
          ValueError: a name is not one of this policy's parameters; the message lists
            the names that are.
        """
        if self.params is None:
            validate.require(not changes, f"policy {self.name!r} has no parameters, got {tuple(changes)}")
            return self
        return self.replace(params=self.params.replace(**changes))


def weight(weighted: bool, obs: Observation) -> Float[Array, "B 1 1"]:
    """The correctness weight of the query, or 1 for an unweighted policy."""
    w = obs.weight if weighted else jnp.ones_like(obs.weight)
    return w[:, None, None]


def score_first(policy: Policy, view: SlotView, aux: PyTree) -> Float[Array, "B K S"]:
    """The score held in the first evidence array."""
    return view.evidence[0]


def with_column(view: SlotView, new: Float[Array, "B K S"]) -> tuple[Float[Array, "B K S"]]:
    """One-array evidence: ``new`` where the slot is present, the old value elsewhere
    (:func:`with_columns` of one array)."""
    return with_columns(view, [new])


def with_columns(view: SlotView, arrays: list[Array]) -> tuple[Array, ...]:
    """The evidence with its arrays replaced by ``arrays`` where the slot is present,
    each kept apart so that XLA updates it in place."""
    present = view.present
    return tuple(jnp.where(present.reshape(present.shape + (1,) * (new.ndim - 3)), new, old)
                 for new, old in zip(arrays, view.evidence, strict=True))
