"""Static memory configuration: the policy, the budget and the eviction schedule."""

from __future__ import annotations

import dataclasses

from flsmem import validate
from flsmem.policies import Policy
from flsmem.policies.budgets import head_share

__all__ = ["MemoryConfig", "IMPLEMENTATIONS"]

IMPLEMENTATIONS = ("pallas", "xla", None)


@dataclasses.dataclass(frozen=True)
class MemoryConfig:
    """Frozen, hashable settings of a memory; a static argument under ``jax.jit``.

    Eviction is batched: a row is evicted down to ``budget`` items once it holds
    ``budget + evict_every`` (its high-water mark), so one item at a time arrives
    ``evict_every`` times between evictions and the per-step cost is amortised. A chunk
    of up to ``max_chunk`` items may be written at once before its queries are
    observed; the slot array has room for both.

    Attributes:
      policy: the eviction :class:`~flsmem.policies.Policy`.
      budget: items a row holds after eviction, protected ones included.
      evict_every: items that may arrive between two evictions (the headroom).
      max_chunk: most items one ``write`` may add (chunked prefill or teacher forcing).
      implementation: top-k implementation for ``evict``: "pallas", "xla" or None
        (best available; the jnp reference on CPU).
      interpret: run the Pallas kernel in interpret mode (needed on CPU).
    """

    policy: Policy
    budget: int
    evict_every: int = 1
    max_chunk: int = 1
    implementation: str | None = None
    interpret: bool = False

    def __post_init__(self):
        if not isinstance(self.policy, Policy):
            raise ValueError(
                f"policy must be a flsmem.policies.Policy (e.g. flsmem.policies.h2o()), "
                f"got {type(self.policy).__name__}"
            )
        for name in ("budget", "evict_every", "max_chunk"):
            object.__setattr__(self, name, validate.positive_int(name, getattr(self, name)))
        validate.boolean("interpret", self.interpret)
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"implementation must be one of {IMPLEMENTATIONS}, got {self.implementation!r}"
            )
        protected = self.policy.sinks + self.policy.protected_age
        if self.policy.evicts and protected > self.budget:
            raise ValueError(
                f"budget must hold every protected item: sinks ({self.policy.sinks}) + "
                f"max(recent, lag) ({self.policy.protected_age}) = {protected} > "
                f"budget ({self.budget})"
            )

    @property
    def capacity(self) -> int:
        """Slots per row: the most a row keeps after an eviction (``budget``, or
        :attr:`head_share` for head-adaptive budgets) plus room for what arrives
        between evictions."""
        return self.head_share + self.evict_every + self.max_chunk - 1

    @property
    def head_share(self) -> int:
        """Most items one row (KV head) keeps after an eviction: ``budget``, or for a
        policy with head-adaptive budgets (:func:`flsmem.policies.adakv`)
        ``ceil(ceiling * budget)``; a sequence's heads keep ``K * budget`` together."""
        return head_share(self.policy, self.budget)

    @property
    def high_water(self) -> int:
        """Present items at which a row is evicted back to ``budget`` (for head-adaptive
        budgets, ``K * high_water`` over a sequence's K heads)."""
        return self.budget + self.evict_every

    def replace(self, **changes) -> "MemoryConfig":
        """A copy with some fields changed, validated again."""
        return dataclasses.replace(self, **changes)
