"""Test settings shared by the suite: shape bugs fail loudly."""

import jax
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop jit caches after each test module, so the suite's one process does not hold
    every program it compiled (a run on a loaded machine once crashed inside XLA's
    compiler late in the suite)."""
    yield
    jax.clear_caches()

