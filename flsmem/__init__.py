"""flsmem: KV-cache and test-time-memory eviction as fixed-lag estimation.

A memory is an immutable pytree (:class:`MemoryState`) changed by pure functions:
``init``, ``write``, ``observe``, ``smooth``, ``evict`` (and ``update``, which runs the
last three query by query). An attention layer uses the door of :mod:`flsmem.attention`:
``init_kv`` makes a KV memory, ``attend`` writes a step's keys and values, attends and
folds the evidence, ``compress`` cuts a prefilled memory to its budget, and ``resize``
gives it the slots of the steps to come; :mod:`flsmem.layers` handles every layer's
memories stacked (``place``, ``update_layers``). A :class:`MemoryConfig` holds the
static settings, among them the :mod:`flsmem.policies` policy. :mod:`flsmem.checks`
runs the same functions with runtime value checks (checkify); :mod:`flsmem.checkpoint`
saves and restores a memory with orbax; :mod:`flsmem.sharding` places one on a device
mesh; :func:`discounted_future` builds the oracle's table of future attention.
"""

from flsmem import checkpoint, checks, kernels, oracle_future, policies, sharding, theory
from flsmem.attention import attend, compress
from flsmem.config import MemoryConfig
from flsmem.evict import evict, priority, protected
from flsmem.layers import init_kv, observe_layers, place, update_layers
from flsmem.observe import observe, reduce_query_heads
from flsmem.oracle_future import discounted_future
from flsmem.resize import resize
from flsmem.smooth import smooth
from flsmem.state import MemoryState, MemoryStats, age, check_state, init, occupancy, present, summary, visible
from flsmem.update import update
from flsmem.write import write

__version__ = "0.1.0"

__all__ = [
    "MemoryConfig",
    "MemoryState",
    "MemoryStats",
    "age",
    "attend",
    "check_state",
    "checkpoint",
    "compress",
    "checks",
    "discounted_future",
    "evict",
    "init",
    "init_kv",
    "kernels",
    "observe",
    "observe_layers",
    "occupancy",
    "oracle_future",
    "place",
    "policies",
    "present",
    "priority",
    "protected",
    "reduce_query_heads",
    "resize",
    "sharding",
    "smooth",
    "summary",
    "theory",
    "update",
    "update_layers",
    "visible",
    "write",
]
