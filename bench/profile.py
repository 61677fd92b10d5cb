"""Where flsmem's per-step time goes in the decode loop, as shares of a plain step.

Four loops of ``steps`` decode steps (SmolLM2 by default, rmm, budget 512), each timed
back to back against the plain loop:

* ``write``: the flsmem decoder (write + attention over the memory's slots) without
  ``update``; ``evict_every`` is at least ``steps`` so every write finds a free slot;
* ``no_evict``: the serving loop with ``update`` (observe + smooth) but no eviction
  falling due during the call (``evict_every = 2 * steps``);
* ``serving``: the serving loop with ``evict_every = steps``: one eviction per call.

Shares of a plain step: write = write - 1, observe + smooth = no_evict - write,
evict = serving - no_evict (one eviction amortised over ``steps`` steps).

    python -m bench.profile --batch 1,8
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
from flax import nnx

import flsmem
from bench import common
from bench.loops import plain_cache, run_flsmem, run_plain, steady_memories
from flsmem import policies
from flsmem.harness.arguments import make_parser

BUDGET = 512


@functools.partial(jax.jit, static_argnames=("graphdef", "steps"), donate_argnums=(2,))
def run_write_only(graphdef, params, memories, logits, start, *, steps):
    """The flsmem decoder without ``update``: what writing and attending cost."""
    model = nnx.merge(graphdef, params)

    def decode(carry, t):
        memories, logits = carry
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        out, memories, _ = model(token[:, None], jnp.full((logits.shape[0], 1), t, jnp.int32), memories)
        return (memories, out[:, 0]), token

    return jax.lax.scan(decode, (memories, logits), start + jnp.arange(steps, dtype=jnp.int32))[0]


def parse(argv=None):
    parser = make_parser("python -m bench.profile", __doc__)
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="smollm2")
    parser.add_argument("--batch", type=common.positive_ints, default=[1, 8])
    parser.add_argument("--steps", type=int, default=8, help="decode steps per timed call")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", default="profile", help="name of the results/bench/<name>.json file")
    common.add_timing_options(parser)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.rounds < 1:
        parser.error(f"--steps and --rounds must be >= 1, got {args.steps} and {args.rounds}")
    return args


def main(argv=None):
    args = parse(argv)
    common.set_timing(args)  # before the first computation: it may pin the cores
    model = common.load_model(args.model)
    graphdef, params = nnx.split(model)
    cfg, steps, start = model.cfg, args.steps, 2 * BUDGET
    key = jax.random.key(0)
    rows = []
    for batch in args.batch:
        logits = jax.random.normal(key, (batch, cfg.vocab_size))
        config = lambda ee: flsmem.MemoryConfig(policy=policies.rmm(lag=16), budget=BUDGET, evict_every=ee)  # noqa: E731
        once, never = steady_memories(cfg, config(steps), batch, start, key), steady_memories(cfg, config(2 * steps), batch, start, key)
        plain = (common.fresh(plain_cache(cfg, batch, BUDGET + steps, start, key)),
                 lambda c: run_plain(graphdef, params, c, logits, start, steps=steps))
        variants = {
            "write": (common.fresh(once), lambda m: run_write_only(graphdef, params, m, logits, start, steps=steps)),
            "no_evict": (common.fresh(never), lambda m: run_flsmem(graphdef, params, m, logits, start, steps=steps)),
            "serving": (common.fresh(once), lambda m: run_flsmem(graphdef, params, m, logits, start, steps=steps)),
        }
        r = {name: v["median"] for name, v in common.paired(plain, variants, args.rounds).items()}
        row = {"model": args.model, "batch": batch, "steps": steps, "rounds": args.rounds, "ratios": r,
               "share_write": r["write"] - 1, "share_observe_smooth": r["no_evict"] - r["write"],
               "share_evict": r["serving"] - r["no_evict"], "overhead": r["serving"] - 1}
        rows.append(row)
        print(f"B={batch}: of a plain step, write + attention mask {100 * row['share_write']:+.2f}%, "
              f"observe + smooth {100 * row['share_observe_smooth']:+.2f}%, "
              f"evict (1 per {steps} steps) {100 * row['share_evict']:+.2f}%; total {100 * row['overhead']:+.2f}%",
              flush=True)
    common.save(args.out, {"rows": rows})


if __name__ == "__main__":
    sys.exit(main())
