"""Test settings shared by the suite: shape bugs fail loudly, programs compile fast."""

import os

# The suite is bound by compiling many small programs, not by running them: XLA's
# backend at optimisation level 0 without LLVM's expensive passes spends about a third
# less CPU time on a compile-bound test. Set before jax is imported, and inherited by the
# command-line runs and notebook kernels the tests start.
_FAST_COMPILE = ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]
_flags = os.environ.get("XLA_FLAGS", "").split()
os.environ["XLA_FLAGS"] = " ".join(_flags + [f for f in _FAST_COMPILE if f not in _flags])

import jax  # noqa: E402
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop jit caches after each test module, so the suite's one process does not hold
    every program it compiled (a run on a loaded machine once crashed inside XLA's
    compiler late in the suite)."""
    yield
    jax.clear_caches()

