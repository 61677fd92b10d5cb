"""One table of the policies by name, and :func:`make` to build one from it.

The command line, the harness and the notebooks can read the same table; an unknown
name or keyword is refused with the list of what exists.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from flsmem import validate
from flsmem.policies.accumulate import ema, h2o, lag_window, rmm, tova, use_recency
from flsmem.policies.at_write import key_norm, random
from flsmem.policies.base import Policy
from flsmem.policies.kalman import kalman
from flsmem.policies.oracle import oracle
from flsmem.policies.recency import full, streaming_llm, window
from flsmem.policies.windowed import scissorhands, snapkv

__all__ = ["REGISTRY", "make"]

REGISTRY: dict[str, Callable[..., Policy]] = {
    "full": full,
    "window": window,
    "streaming_llm": streaming_llm,
    "h2o": h2o,
    "tova": tova,
    "ema": ema,
    "rmm": rmm,
    "scissorhands": scissorhands,
    "snapkv": snapkv,
    "key_norm": key_norm,
    "random": random,
    "kalman": kalman,
    "oracle": oracle,
    "lag_window": lag_window,
    "use_recency": use_recency,
}


def make(name: str, **params: Any) -> Policy:
    """The policy ``name`` of :data:`REGISTRY`, built with the keyword arguments of its
    factory (``make("rmm", lag=8, decay=0.9)`` is ``rmm(lag=8, decay=0.9)``).

    Raises:
      ValueError: ``name`` is not in the registry (the message lists the names that
        are), or a keyword is not one of its factory's (the message lists those).
    """
    validate.one_of("policy", name, REGISTRY)
    factory = REGISTRY[name]
    allowed = tuple(inspect.signature(factory).parameters)
    unknown = [key for key in params if key not in allowed]
    if unknown:
        validate.fail(f"policy {name!r} has no keyword {', '.join(map(repr, unknown))}; "
                      f"its keywords are {allowed}")
    return factory(**params)
