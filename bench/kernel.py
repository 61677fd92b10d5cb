"""The top-k keep mask: each implementation against ``lax.top_k``.

For rows R and columns N, every implementation of ``flsmem.kernels.topk_mask`` is timed
back to back against a mask built from ``lax.top_k`` (indices scattered into a mask;
no tiebreak, the plain XLA op) on the same random float32 scores:

* ``reference``: the jnp reference (a sort on score, tiebreak and index), the CPU default;
* ``few_dropped``: the reference with ``max_dropped`` (a ``lax.top_k`` of the few
  entries left out, what ``evict`` uses on schedule), only when k >= N - 32;
* ``pallas``: the radix-select kernel. On CPU it runs in the Pallas interpreter,
  so its CPU figures say nothing about its speed on an accelerator.

Two values of k: half the row, and N - 8 (eviction on schedule with evict_every 8).

    python -m bench.kernel
    python -m bench.kernel --sizes 256,1024 --rows 8 --rounds 3
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
from jax import lax

from bench import common
from flsmem.harness.arguments import make_parser
from flsmem.kernels.topk import topk_mask

LEFT_OUT = 8


@functools.partial(jax.jit, static_argnames=("k",))
def lax_top_k_mask(scores, *, k):
    rows = jnp.arange(scores.shape[0])[:, None]
    return jnp.zeros(scores.shape, jnp.bool_).at[rows, lax.top_k(scores, k)[1]].set(True)


def implementations(backend: str) -> dict:
    interpret = backend not in ("gpu", "tpu")
    return {
        "reference": lambda s, k: topk_mask(s, k, implementation="xla"),
        "few_dropped": lambda s, k: topk_mask(s, k, implementation="xla", max_dropped=s.shape[1] - k),
        "pallas": lambda s, k: topk_mask(s, k, implementation="pallas", interpret=interpret),
    }


def parse(argv=None):
    parser = make_parser("python -m bench.kernel", __doc__)
    parser.add_argument("--sizes", type=common.positive_ints, default=[256, 1024, 4096, 16384, 65536], help="N")
    parser.add_argument("--rows", type=common.positive_ints, default=[8, 128], help="R")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip", type=common.choices(("reference", "few_dropped", "pallas")), default=[],
                        help="implementations to leave out")
    parser.add_argument("--out", default="kernel", help="name of the results/bench/<name>.json file")
    common.add_timing_options(parser)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    return args


def main(argv=None):
    args = parse(argv)
    common.set_timing(args)  # before the first computation: it may pin the cores
    backend = jax.default_backend()
    impls = {k: v for k, v in implementations(backend).items() if k not in args.skip}
    rows = []
    for r in args.rows:
        for n in args.sizes:
            scores = jax.random.normal(jax.random.key(n + r), (r, n))
            for k in sorted({n // 2, max(n - LEFT_OUT, 0)}):
                baseline = lambda s=scores, k=k: lax_top_k_mask(s, k=k)  # noqa: E731
                # Jitted with k fixed, so that only the compiled selections are compared.
                variants = {name: functools.partial(jax.jit(functools.partial(fn, k=k)), scores)
                            for name, fn in impls.items() if name != "few_dropped" or n - k <= 32}
                for name, fn in variants.items():  # every implementation must give lax.top_k's mask here
                    if not bool(jnp.array_equal(fn(), baseline())):
                        raise AssertionError(f"{name} disagrees with lax.top_k at R={r}, N={n}, k={k}")
                result = common.paired(baseline, variants, args.rounds)
                for name, ratio in result.items():
                    rows.append({"rows": r, "n": n, "k": k, "implementation": name,
                                 "mode": "interpret" if name == "pallas" and backend not in ("gpu", "tpu") else backend,
                                 "time_vs_lax_top_k": ratio["median"], "low": ratio["low"], "high": ratio["high"]})
                    print(f"R={r:4} N={n:6} k={k:6} {name:12} {rows[-1]['mode']:9} time / lax.top_k = "
                          f"{ratio['median']:8.2f} ({ratio['low']:.2f} .. {ratio['high']:.2f})", flush=True)
    common.save(args.out, {"backend": backend, "rows": rows})


if __name__ == "__main__":
    sys.exit(main())
