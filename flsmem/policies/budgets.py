"""Budgets that are not the same everywhere: per KV head (AdaKV) and per layer (PyramidKV).

Both wrap any scoring policy and change only how many items each memory keeps, never
how items are scored:

* :func:`adakv`: at each eviction one sequence's budget, ``K * budget`` items over its
  K KV heads, goes to the highest scores over all heads jointly (Feng et al., 2024,
  arXiv 2407.11550), with a floor per head so that no head is emptied and a ceiling
  per head because each head's slots are allocated in advance. Scores must be
  comparable across heads; attention-based scores are (each query head's attention
  sums to one).
* :func:`pyramid`: the total budget of a layer stack spread linearly from more in the
  lowest layer to fewer in the highest (Cai et al., 2024, arXiv 2406.02069), with the
  same total; :func:`layer_budgets` turns it, or a list, into one budget per layer.
  It applies where a stack of memories is cut at once, :func:`flsmem.compress`, as
  PyramidKV is a prefill method.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from flsmem import validate
from flsmem.policies.base import Policy

__all__ = ["HeadBudget", "LayerSchedule", "adakv", "pyramid", "layer_budgets", "head_share"]


@dataclasses.dataclass(frozen=True)
class HeadBudget:
    """How :func:`flsmem.evict` shares one sequence's budget among its KV heads.

    Attributes:
      floor: each head keeps at least ``int(floor * budget)`` of its highest-scored
        items (AdaKV's safeguard, 0.2 in kvpress).
      ceiling: each head keeps at most ``ceil(ceiling * budget)`` items; its slots are
        allocated for that many. With K heads, ``ceiling >= K - (K - 1) * floor``
        never binds.
    """

    floor: float = 0.2
    ceiling: float = 2.0

    def __post_init__(self):
        validate.unit("floor", self.floor)
        ok = isinstance(self.ceiling, (int, float)) and not isinstance(self.ceiling, bool) and self.ceiling >= 1.0
        validate.require(ok, f"ceiling must be a number >= 1 (a multiple of the uniform share), got {self.ceiling!r}")


@dataclasses.dataclass(frozen=True)
class LayerSchedule:
    """A named schedule of budgets over a stack of layers (see :func:`layer_budgets`).

    Attributes:
      name: "pyramid".
      beta: the top layer keeps ``1 / beta`` of the mean budget (PyramidKV's beta, 20).
    """

    name: str = "pyramid"
    beta: float = 20.0

    def __post_init__(self):
        validate.one_of("schedule", self.name, ("pyramid",))
        ok = isinstance(self.beta, (int, float)) and not isinstance(self.beta, bool) and self.beta >= 1.0
        validate.require(ok, f"beta must be a number >= 1, got {self.beta!r}")


def adakv(policy: Policy, floor: float = 0.2, ceiling: float = 2.0) -> Policy:
    """``policy`` with its budget shared among KV heads by score (AdaKV).

    At each eviction the ``K * budget`` highest priorities over the K heads of a
    sequence are kept, after each head's top ``int(floor * budget)`` are made safe and
    anything beyond its top ``ceil(ceiling * budget)`` is excluded. Protected items
    (sinks, recent window, commit lag) stay protected in every head. ``floor = ceiling
    = 1`` is the plain policy exactly. The memory allocates ``ceil(ceiling * budget)``
    kept slots per head instead of ``budget``; the items held stay ``K * budget``.
    """
    validate.require(isinstance(policy, Policy), f"adakv wraps a Policy, got {type(policy).__name__}")
    validate.require(policy.head_budget is None, f"policy {policy.name!r} already has head budgets")
    validate.require(policy.evicts, "adakv needs a policy that evicts, not the full cache")
    return policy.replace(name=f"adakv({policy.name})", head_budget=HeadBudget(floor, ceiling))


def pyramid(policy: Policy, beta: float = 20.0) -> Policy:
    """``policy`` with PyramidKV's layer budgets when a stack of memories is
    compressed (:func:`flsmem.compress`): more items in lower layers, fewer in higher
    ones, the same total (:func:`layer_budgets`)."""
    validate.require(isinstance(policy, Policy), f"pyramid wraps a Policy, got {type(policy).__name__}")
    validate.require(policy.layer_schedule is None, f"policy {policy.name!r} already has a layer schedule")
    return policy.replace(name=f"pyramid({policy.name})", layer_schedule=LayerSchedule("pyramid", beta))


def head_share(policy: Policy, budget: int) -> int:
    """Most items one head keeps after an eviction at ``budget``: ``budget``, or for
    head-adaptive budgets ``ceil(ceiling * budget)``."""
    if policy.head_budget is None:
        return budget
    return math.ceil(policy.head_budget.ceiling * budget)


def layer_budgets(
    budget: int, layers: int, schedule: LayerSchedule | Sequence[int] | None, *, minimum: int = 0,
    maximum: int | None = None,
) -> tuple[int, ...]:
    """One budget per layer of a stack whose mean budget is ``budget``.

    ``schedule`` None gives ``budget`` everywhere; a sequence is taken as it is (its
    length must be ``layers`` and its sum ``layers * budget``); "pyramid" falls
    linearly from ``2 * budget - low`` in the lowest layer to ``low = budget / beta``
    in the highest, as PyramidKV allocates, rounded so that the total is exactly
    ``layers * budget`` (the largest remainders get the spare items). ``low`` is raised
    to ``minimum`` (a layer must hold its protected items) and the top lowered to
    ``maximum`` (what a layer holds), the slope flattening to keep the total; kvpress
    instead falls back to uniform budgets whenever ``budget / beta`` is below its
    observation window. When no slope fits, every layer gets ``budget``.
    """
    budget, layers = validate.positive_int("budget", budget), validate.positive_int("layers", layers)
    total = budget * layers
    if schedule is None:
        return (budget,) * layers
    if not isinstance(schedule, LayerSchedule):
        values = tuple(validate.nonneg_int("layer budget", b) for b in schedule)
        validate.require(len(values) == layers, f"layer budgets must give one budget per layer ({layers}), "
                                                f"got {len(values)}")
        validate.require(sum(values) == total, f"layer budgets must sum to layers * budget = {total}, "
                                               f"got {sum(values)}")
        validate.require(min(values) >= minimum, f"every layer budget must be >= {minimum} (the protected items), "
                                                 f"got {min(values)}")
        return values
    low = max(budget / schedule.beta, float(minimum))
    high = 2 * budget - low
    if maximum is not None and high > maximum:
        high = float(maximum)
        low = 2 * budget - high
    if layers == 1 or low < minimum or low > high:
        return (budget,) * layers
    step = (high - low) / (layers - 1)
    exact = [high - i * step for i in range(layers)]
    floors = [math.floor(x) for x in exact]
    spare = total - sum(floors)
    order = sorted(range(layers), key=lambda i: (-(exact[i] - floors[i]), i))
    for i in order[:spare]:
        floors[i] += 1
    return tuple(floors)
