"""Argument checks, in one place: each raises ``ValueError`` naming the argument and
what is allowed, before any work is done. It imports nothing from flsmem, so every
module (policies and config included) can use it."""

from __future__ import annotations

import numbers
from typing import Any, Iterable

import jax.numpy as jnp
import numpy as np

__all__ = ["fail", "require", "positive_int", "nonneg_int", "positive", "unit", "boolean", "one_of",
           "shape", "is_int", "is_float"]


def fail(message: str):
    raise ValueError(message)


def require(ok: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``ok``."""
    if not ok:
        fail(message)


def _is_count(value: Any) -> bool:
    # numpy integers are counts too (a budget read from an array); bools and floats are not.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def positive_int(name: str, value: Any) -> int:
    """``value`` as an int >= 1."""
    require(_is_count(value) and value >= 1, f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def nonneg_int(name: str, value: Any) -> int:
    """``value`` as an int >= 0."""
    require(_is_count(value) and value >= 0, f"{name} must be a non-negative int, got {value!r}")
    return int(value)


def positive(name: str, value: Any) -> float:
    """``value`` as a float > 0."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and float(value) > 0.0
    require(ok, f"{name} must be a positive number, got {value!r}")
    return float(value)


def unit(name: str, value: Any) -> float:
    """``value`` as a float in [0, 1]."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and 0.0 <= float(value) <= 1.0
    require(ok, f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


def boolean(name: str, value: Any) -> bool:
    """``value`` if it is a bool (not an int or another truthy value)."""
    require(isinstance(value, bool), f"{name} must be a bool, got {value!r}")
    return value


def one_of(name: str, value: Any, allowed: Iterable[Any]) -> Any:
    """``value`` if it is one of ``allowed``."""
    allowed = tuple(allowed)
    require(value in allowed, f"{name} must be one of {allowed}, got {value!r}")
    return value


def shape(x) -> tuple[int, ...]:
    return tuple(np.shape(x))


def is_int(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.integer)


def is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)
