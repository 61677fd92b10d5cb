"""The oracle's table of discounted future attention, against a direct loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flsmem import testing
from flsmem.oracle_future import discounted_future


def _direct(attention: np.ndarray, discount: float) -> np.ndarray:
    """``f[..., t, p] = sum_{s > t} discount^(s - t - 1) A[..., s, p]``, term by term."""
    steps = attention.shape[-2]
    f = np.zeros(attention.shape, np.float64)
    for t in range(steps):
        for s in range(t + 1, steps):
            f[..., t, :] += discount ** (s - t - 1) * attention[..., s, :].astype(np.float64)
    return f


@pytest.mark.parametrize("discount", [1.0, 0.98, 0.5, 0.0])
def test_matches_a_direct_loop(discount):
    table = testing.attention_table(jax.random.key(7), batch=2, kv_heads=3, steps=9)  # [B, K, T, T]
    f = discounted_future(table, discount)
    assert f.shape == table.shape and f.dtype == table.dtype
    np.testing.assert_allclose(np.asarray(f), _direct(np.asarray(table), discount), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(f[..., -1, :]), 0.0)  # no query after the last


def test_any_leading_axes():
    # The harness's table is [L, W, K, T, T]; the time axis is always the second last.
    attention = jax.random.uniform(jax.random.key(1), (2, 1, 3, 6, 6))
    np.testing.assert_allclose(np.asarray(discounted_future(attention, 0.9)),
                               _direct(np.asarray(attention), 0.9), rtol=1e-5, atol=1e-6)
    one = jnp.arange(16.0).reshape(4, 4)
    np.testing.assert_allclose(np.asarray(discounted_future(one)), _direct(np.asarray(one), 1.0))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="discount"):
        discounted_future(jnp.ones((4, 4)), 1.5)
    with pytest.raises(ValueError, match=r"attention must be \[\.\.\., T, T\]"):
        discounted_future(jnp.ones(4))
