"""Measuring versus accumulating, from the scalar Kalman filter.

A slot's utility is modelled as a local level: ``x_t = x_{t-1} + w_t`` (process noise
of variance q: how fast the utility drifts) observed as ``z_t = x_t + v_t`` (measurement
noise of variance r: how noisy one query's attention is). The filter's gain settles to a
constant that depends only on ``q / r``, and its mean is then an exponential moving
average with decay ``1 - gain``:

* ``q / r -> 0``: gain -> 0, decay -> 1: accumulate (H2O's running sum, as a mean);
* ``q / r -> inf``: gain -> 1, decay -> 0: measure (TOVA's latest attention).

So the steady-state gain says which side of the map a stream belongs to, and which
``ema`` decay is optimal for it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from flsmem.typing import Array


def _checked(name: str, value, low: float, high: float, *, closed_high: bool = True) -> Array:
    """``value`` as float32; concrete values outside the domain raise ValueError
    (traced values are passed through: they cannot be inspected)."""
    x = jnp.asarray(value, jnp.float32)
    if not isinstance(x, jax.core.Tracer):
        v = np.asarray(x)
        ok = np.all(v >= low) & (np.all(v <= high) if closed_high else np.all(v < high))
        if not ok:
            bracket = "]" if closed_high else ")"
            raise ValueError(f"{name} must lie in [{low}, {high}{bracket}, got {v}")
    return x

__all__ = ["steady_state_gain", "steady_state_decay", "q_over_r_for_decay", "riccati_gains", "ema_error_variance", "crossover"]


def steady_state_gain(q_over_r) -> Array:
    """The limit of the gain ``P / (P + r)``.

    The predicted variance in units of r, ``p``, is the fixed point of
    ``p <- p / (p + 1) + x`` with ``x = q / r``, i.e. ``p^2 = x (p + 1)``, so
    ``p = (x + sqrt(x^2 + 4x)) / 2`` and the gain ``p / (p + 1)`` simplifies to
    ``(sqrt(x^2 + 4x) - x) / 2``.
    """
    x = _checked("q_over_r", q_over_r, 0.0, np.inf)
    return 0.5 * (jnp.sqrt(x * x + 4.0 * x) - x)


def steady_state_decay(q_over_r) -> Array:
    """The EMA decay the steady-state filter implies: ``1 - gain``."""
    return 1.0 - steady_state_gain(q_over_r)


def q_over_r_for_decay(decay) -> Array:
    """The noise ratio whose steady-state filter is an EMA with this ``decay``:
    from ``gain = 1 - decay``, ``x = gain^2 / (1 - gain)``."""
    gain = 1.0 - _checked("decay", decay, 0.0, 1.0)
    return gain * gain / (1.0 - gain)


def riccati_gains(q: float, r: float, steps: int) -> Array:
    """The gains of the first ``steps`` updates of a filter started from its first
    measurement (``P = r``), by iterating the Riccati recursion."""
    if not (q >= 0 and r > 0 and isinstance(steps, int) and steps >= 1):
        raise ValueError(f"need q >= 0, r > 0 and steps an int >= 1, got q={q!r}, r={r!r}, steps={steps!r}")
    gains = []
    var = r
    for _ in range(steps):
        pred = var + q
        gain = pred / (pred + r)
        gains.append(gain)
        var = (1.0 - gain) * pred
    return jnp.asarray(gains, jnp.float32)


def ema_error_variance(decay, q_over_r) -> Array:
    """Steady-state variance, in units of r, of ``x_t - m_t`` for the EMA
    ``m_t = decay * m_{t-1} + (1 - decay) * z_t`` tracking the local level.

    With gain ``g = 1 - decay`` the error obeys ``e_t = (1 - g)(e_{t-1} + w_t) - g v_t``,
    so ``Var = ((1 - g)^2 x + g^2) / (g (2 - g))`` with ``x = q / r``; it is smallest at
    the steady-state Kalman gain. Add ``x`` for the error of predicting ``x_{t+1}``.
    """
    g = 1.0 - _checked("decay", decay, 0.0, 1.0, closed_high=False)
    x = _checked("q_over_r", q_over_r, 0.0, np.inf)
    return ((1.0 - g) ** 2 * x + g * g) / (g * (2.0 - g))


def crossover(decay_a, decay_b) -> Array:
    """The ``q / r`` at which two EMA decays track the level equally well; below it the
    larger decay (more accumulating) wins, above it the smaller (more measuring)."""
    ga = 1.0 - _checked("decay_a", decay_a, 0.0, 1.0, closed_high=False)
    gb = 1.0 - _checked("decay_b", decay_b, 0.0, 1.0, closed_high=False)
    slope = (1.0 - ga) ** 2 / (ga * (2.0 - ga)) - (1.0 - gb) ** 2 / (gb * (2.0 - gb))
    offset = gb / (2.0 - gb) - ga / (2.0 - ga)
    return offset / slope
