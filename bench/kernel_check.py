"""Correctness of the compiled top-k kernel on this machine's accelerator.

The Pallas kernel (compiled, not interpreted, unless ``--interpret``) against the jnp
reference on random rows and on hand cases: ties, all equal, +-inf, NaN, -0.0, k = 0,
k = N, per-row k, N not a power of two, with and without a tiebreak. Exits non-zero
on the first disagreement.

    python -m bench.kernel_check              # on a GPU or TPU
    python -m bench.kernel_check --interpret  # anywhere (the Pallas interpreter)
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from flsmem.harness.arguments import make_parser
from flsmem.kernels.topk import topk_mask, topk_mask_reference

NAN, INF = float("nan"), float("inf")


def cases(rng):
    """(scores, k, tiebreak) triples."""
    for rows, cols in ((8, 128), (3, 100), (16, 1000), (8, 4096), (5, 65536)):
        x = rng.normal(size=(rows, cols)).astype(np.float32)
        yield x, cols // 2, None
        yield x, np.asarray(rng.integers(0, cols + 1, size=rows), np.int32), None
        ties = rng.integers(-2, 3, size=(rows, cols)).astype(np.float32)
        for value, p in ((NAN, 0.1), (INF, 0.05), (-INF, 0.05), (-0.0, 0.1)):
            ties[rng.random((rows, cols)) < p] = value
        yield ties, max(cols - 8, 0), None
        yield ties, cols // 3, rng.integers(-2, 3, size=(rows, cols)).astype(np.int32)
        yield np.zeros((rows, cols), np.float32), cols // 2, None  # all equal
        yield x, 0, None
        yield x, cols, None


def main(argv=None):
    parser = make_parser("python -m bench.kernel_check", __doc__)
    parser.add_argument("--interpret", action="store_true", help="run the kernel in the Pallas interpreter")
    args = parser.parse_args(argv)
    backend = jax.default_backend()
    if backend not in ("gpu", "tpu") and not args.interpret:
        parser.error(f"no accelerator here (backend {backend!r}); pass --interpret to check in the interpreter")
    count = 0
    for scores, k, tiebreak in cases(np.random.default_rng(0)):
        k = jnp.asarray(k) if isinstance(k, np.ndarray) else k
        tb = None if tiebreak is None else jnp.asarray(tiebreak)
        got = topk_mask(jnp.asarray(scores), k, tiebreak=tb, implementation="pallas", interpret=args.interpret)
        want = topk_mask_reference(jnp.asarray(scores), k, tb)
        if not bool(jnp.array_equal(got, want)):
            print(f"MISMATCH: scores {scores.shape}, k {k}, tiebreak {tiebreak is not None}")
            return 1
        count += 1
    print(f"kernel == reference on {count} cases ({'interpret' if args.interpret else backend})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
