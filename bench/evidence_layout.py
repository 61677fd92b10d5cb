"""What the evidence's layout costs a fold of several columns: the fixed Kalman filter's
fold on its three columns laid out in one ``[B, K, S, E]`` array (the library's layout
before its evidence became a tuple of arrays) and in one ``[B, K, E, S]`` array, against
the library's fold on one ``[B, K, S]`` array per column.

Each variant runs a jitted loop of queries over its evidence (donated, so XLA may update
it in place), with each query's score read back as the decode step reads it. It prints
the time per query of each variant against ``[B, K, S, E]``'s, over interleaved rounds,
and the arrays that XLA copies in each compiled loop (scalars left out): a fold whose
every output column reads the other columns of the same slot cannot overwrite its input
when the columns share one array, so XLA writes the new evidence elsewhere and copies it
back into the loop's carry; with one array per column each output reads only its own
index of each input. The three variants give the same numbers (checked before timing).

It then lists, for each policy of ``--policies``, the slot-sized arrays that its whole
compiled step copies (``bench.pyref``'s loop of write + update, no eviction due; the
copies do not depend on the sizes, so a small memory is compiled).

    python -m bench.evidence_layout --cores 1
"""

from __future__ import annotations

import functools
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench import common, pyref
from flsmem import policies as P
from flsmem.harness.arguments import make_parser
from flsmem.policies.base import Observation, SlotView

LAYOUTS = ("[B, K, S, E]", "[B, K, E, S]", "library: one array per column")
STEP_POLICIES = ("h2o", "rmm", "ema", "tova", "lag_window", "use_recency", "kalman", "surprise", "adaptive",
                 "scissorhands", "snapkv")


def kalman_columns(policy, m, var, n, z):
    """The fixed filter's update of (mean, variance, count) by the measurement ``z``,
    the arithmetic of ``flsmem.policies.kalman``."""
    q, r = policy.params.q, policy.params.r
    first = n == 0
    var_pred = var + q
    gain = jnp.where(first, 1.0, var_pred / (var_pred + r))
    return m + gain * (z - m), jnp.where(first, r, (1.0 - gain) * var_pred), n + 1.0


def folds(policy, present):
    """Per layout: ``(fold(evidence, z) -> evidence, score(evidence) -> [B, K, S])``."""
    zeros = jnp.zeros(present.shape, jnp.int32)

    def columns_last(evidence, z):
        # Stacked on a leading axis and moved last: a stack on the last axis is slower still.
        new = jnp.moveaxis(jnp.stack(kalman_columns(policy, *(evidence[..., k] for k in range(3)), z)), 0, -1)
        return jnp.where(present[..., None], new, evidence)

    def columns_second(evidence, z):
        new = jnp.stack(kalman_columns(policy, *(evidence[:, :, k] for k in range(3)), z), axis=2)
        return jnp.where(present[:, :, None], new, evidence)

    def library(evidence, z):
        view = SlotView(evidence, zeros, zeros, zeros, present, zeros[:, 0, 0])
        return policy.fold(policy, view, Observation(z, jnp.ones(z.shape[:1]), None), None)[0]

    return {
        LAYOUTS[0]: (columns_last, lambda e: e[..., 0]),
        LAYOUTS[1]: (columns_second, lambda e: e[:, :, 0]),
        LAYOUTS[2]: (library, lambda e: e[0]),
    }


def loop_of(fold, score, steps: int):
    """A jitted loop of ``steps`` queries, donating its evidence."""

    @functools.partial(jax.jit, donate_argnums=(0,))
    def loop(evidence, z):
        def query(evidence, t):
            evidence = fold(evidence, z * (1.0 + t.astype(jnp.float32)))
            return evidence, jnp.sum(score(evidence))

        return jax.lax.scan(query, evidence, jnp.arange(steps))

    return loop


def starting_evidence(layout: str, filled: jax.Array):
    """The same evidence in each layout: (mean, variance, count) from ``filled [3, B, K, S]``."""
    if layout == LAYOUTS[0]:
        return jnp.moveaxis(filled, 0, -1)
    if layout == LAYOUTS[1]:
        return jnp.moveaxis(filled, 0, 2)
    return tuple(filled)  # the library's


def copies(loop, *args) -> list[str]:
    """The shapes of the arrays that the compiled loop copies (scalars left out)."""
    text = loop.lower(*args).compile().as_text()
    return [shape for shape in re.findall(r"= (\w+\[[\d,]+\])\{[\d,]*\} copy\(", text)]


def step_copies(name: str, n: int = 512, rows: int = 6) -> list[str]:
    """The slot-sized arrays that policy ``name``'s compiled step copies: a jitted loop
    of 8 steps of write + update (``bench.pyref``'s), donating the memory."""
    memory = pyref.flsmem_memory(rows, n, 64, n, head_dim=8, policy=P.make(name))
    attention = pyref.slot_attention(pyref.random_weights(np.random.default_rng(0), rows, n), memory.slots)
    loop = jax.jit(functools.partial(pyref.flsmem_steps, steps=8), donate_argnums=(0,))
    return [shape for shape in copies(loop, memory, attention) if re.search(rf"[\[,]{memory.slots}[\],]", shape)]


def main(argv=None):
    parser = make_parser("python -m bench.evidence_layout", __doc__)
    parser.add_argument("--n", type=int, default=4096, help="slots per row")
    parser.add_argument("--rows", type=int, default=90)
    parser.add_argument("--steps", type=int, default=32, help="queries per timed call")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--policies", type=common.choices(STEP_POLICIES), default=list(STEP_POLICIES),
                        help="policies whose step's copies are listed")
    common.add_timing_options(parser)
    args = parser.parse_args(argv)
    if min(args.n, args.rows, args.steps, args.rounds) < 1:
        parser.error("--n, --rows, --steps and --rounds must be >= 1")
    common.set_timing(args)
    policy = P.kalman()
    rng = np.random.default_rng(0)
    shape = (1, args.rows, args.n)
    present = jnp.asarray(rng.random(shape) < 0.99)
    z = jnp.asarray(rng.random(shape), jnp.float32)
    filled = jnp.asarray(np.stack([rng.random(shape), rng.random(shape), rng.integers(0, 3, shape)]), jnp.float32)

    loops, results, counts = {}, {}, {}
    for layout, (fold, score) in folds(policy, present).items():
        loop = loop_of(fold, score, args.steps)
        counts[layout] = copies(loop, starting_evidence(layout, filled), z)
        results[layout] = np.asarray(loop(starting_evidence(layout, filled), z)[1])
        loops[layout] = loop
    for layout in LAYOUTS[1:]:
        np.testing.assert_allclose(results[layout], results[LAYOUTS[0]], rtol=1e-6)

    def call(layout):
        """(prepare, run): a fresh copy of the evidence each call, since the loop donates it."""
        return (lambda: (starting_evidence(layout, filled), z)), loops[layout]

    times = common.interleaved({layout: call(layout) for layout in LAYOUTS}, args.rounds)
    ratio = common.ratios(times, LAYOUTS[0])
    print(f"The fixed Kalman filter's fold, N={args.n} rows={args.rows}, {args.steps} queries a call, "
          f"{args.rounds} rounds")
    print(f"| evidence layout | time per query (us, median) | against {LAYOUTS[0]} (median, range) | arrays copied |")
    print("|---|---|---|---|")
    for layout in LAYOUTS:
        us = 1e6 * float(np.median(times[layout])) / args.steps
        r = ratio[layout]
        copied = ", ".join(counts[layout]) or "none"
        print(f"| {layout} | {us:.0f} | x{r['median']:.2f} (x{r['low']:.2f} .. x{r['high']:.2f}) | {copied} |")
    step = {name: step_copies(name) for name in args.policies}
    print()
    print("| policy | slot-sized arrays its step copies |")
    print("|---|---|")
    for name, shapes in step.items():
        print(f"| {name} | {', '.join(shapes) or 'none'} |")
    common.save("evidence-layout", {"n": args.n, "rows": args.rows, "steps": args.steps, "rounds": args.rounds,
                                    "seconds": times, "ratios": ratio, "copies": counts, "step_copies": step})


if __name__ == "__main__":
    sys.exit(main())
