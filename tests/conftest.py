"""Test settings shared by the suite: shape bugs fail loudly, and every process of a run
shares one on-disk cache of compiled programs."""

import os
import shutil
import tempfile

# The suite compiles the same programs in many processes: the xdist workers (which also
# drop their in-memory caches after each module, below), the training and CLI runs the
# tests start as subprocesses (often the same command twice, to check a resume), and the
# notebook kernels. They inherit these settings before any of them imports jax, so each
# program is compiled once per run and read back elsewhere; a cached program is the
# compiler's own output, so results do not change. The folder is the run's own and is
# removed when the run ends.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ  # else a parent's, or the user's
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="flsmem-test-compiles-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE:
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop jit caches after each test module, so the suite's one process does not hold
    every program it compiled (a run on a loaded machine once crashed inside XLA's
    compiler late in the suite)."""
    yield
    jax.clear_caches()
