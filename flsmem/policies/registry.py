"""One table of the policies by name, and :func:`make` to build one from it.

The command line, the harness and the notebooks can read the same table; an unknown
name or keyword is refused with the list of what exists.
"""

from __future__ import annotations

import inspect
import re
from typing import Any, Callable

from flsmem import validate
from flsmem.policies.accumulate import ema, h2o, lag_window, rmm, tova, use_recency
from flsmem.policies.adaptive import adaptive
from flsmem.policies.at_write import key_norm, random
from flsmem.policies.base import Policy
from flsmem.policies.budgets import adakv, pyramid
from flsmem.policies.expected import expected_attention
from flsmem.policies.kalman import kalman
from flsmem.policies.oracle import oracle
from flsmem.policies.recency import full, streaming_llm, window
from flsmem.policies.surprise import surprise
from flsmem.policies.windowed import scissorhands, snapkv

__all__ = ["REGISTRY", "WRAPPERS", "make"]

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
    "adaptive": adaptive,
    "oracle": oracle,
    "lag_window": lag_window,
    "use_recency": use_recency,
    "surprise": surprise,
    "expected_attention": expected_attention,
}

# Wrappers that change how a policy's budget is shared, by name: "adakv(h2o)".
WRAPPERS: dict[str, Callable[..., Policy]] = {
    "adakv": adakv,
    "pyramid": pyramid,
}


def make(name: str, **params: Any) -> Policy:
    """The policy ``name`` of :data:`REGISTRY`, built with the keyword arguments of its
    factory (``make("rmm", lag=8, decay=0.9)`` is ``rmm(lag=8, decay=0.9)``). A name
    ``wrapper(inner)`` wraps the policy ``inner`` with one of :data:`WRAPPERS`
    (``make("adakv(h2o)", recent=32, floor=0.2)``): the wrapper takes the keywords that
    are its own, the inner policy the rest.

    Raises:
      ValueError: ``name`` is not in the registry (the message lists the names that
        are), or a keyword is not one of its factory's (the message lists those).
    """
    wrapped = re.fullmatch(r"(\w+)\((.+)\)", name) if isinstance(name, str) else None
    if wrapped:
        outer, inner = wrapped.groups()
        validate.one_of("policy wrapper", outer, WRAPPERS)
        own = [key for key in inspect.signature(WRAPPERS[outer]).parameters if key != "policy"]
        settings = {key: params.pop(key) for key in own if key in params}
        return WRAPPERS[outer](make(inner, **params), **settings)
    validate.one_of("policy", name, REGISTRY)
    factory = REGISTRY[name]
    signature = inspect.signature(factory).parameters
    allowed = tuple(signature)
    unknown = [key for key in params if key not in allowed]
    if unknown:
        validate.fail(f"policy {name!r} has no keyword {', '.join(map(repr, unknown))}; "
                      f"its keywords are {allowed}")
    missing = [key for key, p in signature.items() if p.default is inspect.Parameter.empty and key not in params]
    if missing:
        validate.fail(f"policy {name!r} needs the keyword {', '.join(map(repr, missing))} "
                      "(the model's attention shape)")
    return factory(**params)
