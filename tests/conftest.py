"""Test settings shared by the suite: shape bugs fail loudly."""

import jax
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop jit caches after each test module: the suite compiles hundreds of programs
    and one process holding them all runs the 2-core CI machine short of memory."""
    yield
    jax.clear_caches()
