"""flsmem: KV-cache and test-time-memory eviction as fixed-lag estimation.

A memory is an immutable pytree (:class:`MemoryState`) changed by pure functions:
``init``, ``write``, ``observe``, ``smooth``, ``evict`` (and ``update``, which runs the
last three query by query). A :class:`MemoryConfig` holds the static settings, among
them the :mod:`flsmem.policies` policy.
"""

from flsmem import kernels, policies, theory
from flsmem.config import MemoryConfig
from flsmem.evict import evict, priority, protected
from flsmem.observe import observe, reduce_query_heads
from flsmem.smooth import smooth
from flsmem.state import MemoryState, MemoryStats, age, init, occupancy, present, summary, visible
from flsmem.update import update
from flsmem.write import write

__version__ = "0.1.0"

__all__ = [
    "MemoryConfig",
    "MemoryState",
    "MemoryStats",
    "age",
    "evict",
    "init",
    "kernels",
    "observe",
    "occupancy",
    "policies",
    "present",
    "priority",
    "protected",
    "reduce_query_heads",
    "smooth",
    "summary",
    "theory",
    "update",
    "visible",
    "write",
]
