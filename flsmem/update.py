"""``update``: observe, smooth and evict query by query, the serving loop's step."""

from __future__ import annotations

from flsmem import validate
from flsmem.evict import evict
from flsmem.observe import observe_one, scan_queries
from flsmem.smooth import smooth
from flsmem.state import MemoryState
from flsmem.typing import Array, Float

__all__ = ["update"]


def _step(state, attention, correctness, future):
    return evict(smooth(observe_one(state, attention, correctness, future)))


def update(
    state: MemoryState,
    attention: Float[Array, "B K S"] | Float[Array, "B K Q S"],
    correctness: Float[Array, "B"] | Float[Array, "B Q"] | None = None,
    future: Float[Array, "B K S"] | Float[Array, "B K Q S"] | None = None,
) -> MemoryState:
    """``observe``, ``smooth`` and ``evict`` (when due) for each query in order.

    For one query this is the three calls in a row. For a chunk it gives exactly the
    kept set that one-query steps would give (items written as a chunk arrive one per
    query), so chunked teacher forcing and per-token decode agree. Arguments as in
    :func:`flsmem.observe`.
    """
    attention, correctness, future, _ = validate.observe_args(state, attention, correctness, future)
    return scan_queries(state, _step, attention, correctness, future)
