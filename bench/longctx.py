"""Long context: decode speed and memory of the full cache against flsmem at budget 512.

At each position (2k, 4k, 8k tokens already in context) two loops decode ``steps``
tokens: the full cache (the plain loop of :mod:`bench.loops` with room for every
position) and the flsmem serving loop (rmm, lag 16, budget 512, evict_every 8). Every
loop is timed back to back against one reference, the flsmem loop at the first
position, so all costs are ratios from one run:

* cost: step time over the reference's (the cost curve against context length; flat
  for flsmem, growing for the full cache);
* speedup: tokens per second of flsmem over the full cache at the same position,
  cost(full) / cost(flsmem);
* peak memory: what XLA plans for the compiled loop (arguments + outputs + temporaries
  - aliased), in MB: a property of the program, not a timing.

    python -m bench.longctx                       # SmolLM2, batch 1 and 8
    python -m bench.longctx --model tiny --positions 512,1024 --batch 1 --steps 8
"""

from __future__ import annotations

import sys

import jax
from flax import nnx

import flsmem
from bench import common
from bench.loops import plain_cache, run_flsmem, run_plain, steady_memories
from flsmem import policies
from flsmem.harness.arguments import make_parser

BUDGET, EVICT_EVERY = 512, 8


def parse(argv=None):
    parser = make_parser("python -m bench.longctx", __doc__)
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="smollm2")
    parser.add_argument("--positions", type=common.positive_ints, default=[2048, 4096, 8192])
    parser.add_argument("--batch", type=common.positive_ints, default=[1, 8])
    parser.add_argument("--steps", type=int, default=8, help="decode steps per timed call (a multiple of 8)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of back-to-back pairs; the median is reported")
    parser.add_argument("--out", default="longctx", help="name of the results/bench/<name>.json file")
    common.add_timing_options(parser)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.steps % EVICT_EVERY or args.rounds < 1:
        parser.error(f"--steps must be a positive multiple of {EVICT_EVERY} and --rounds >= 1, "
                     f"got {args.steps} and {args.rounds}")
    return args


def peak_mb(jitted, *args, **static) -> float:
    """Memory XLA plans for one call of the compiled loop, in MB."""
    m = jitted.lower(*args, **static).compile().memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    return total / 1e6


def measure(model, batch: int, positions: list[int], steps: int, rounds: int) -> list[dict]:
    graphdef, params = nnx.split(model)
    cfg = model.cfg
    key = jax.random.key(0)
    logits = jax.random.normal(key, (batch, cfg.vocab_size))
    config = flsmem.MemoryConfig(policy=policies.rmm(lag=16), budget=BUDGET, evict_every=EVICT_EVERY)
    fns, peaks = {}, {}
    for p in positions:
        memories = steady_memories(cfg, config, batch, p, key)
        cache = plain_cache(cfg, batch, p + steps, p, key)  # room for every position: the full cache
        fns[f"flsmem/{p}"] = (common.fresh(memories),
                              lambda m, p=p: run_flsmem(graphdef, params, m, logits, p, steps=steps))
        fns[f"full/{p}"] = (common.fresh(cache), lambda c, p=p: run_plain(graphdef, params, c, logits, p, steps=steps))
        peaks[f"flsmem/{p}"] = peak_mb(run_flsmem, graphdef, params, memories, logits, p, steps=steps)
        peaks[f"full/{p}"] = peak_mb(run_plain, graphdef, params, cache, logits, p, steps=steps)
    reference = f"flsmem/{positions[0]}"
    others = {name: fn for name, fn in fns.items() if name != reference}
    cost = common.paired(fns[reference], others, rounds)
    cost[reference] = {"median": 1.0, "low": 1.0, "high": 1.0}
    rows = []
    for p in positions:
        full, ours = cost[f"full/{p}"]["median"], cost[f"flsmem/{p}"]["median"]
        rows.append({
            "batch": batch, "position": p, "budget": BUDGET, "evict_every": EVICT_EVERY, "steps": steps,
            "rounds": rounds, "cost_flsmem": ours, "cost_full": full, "speedup": full / ours,
            "peak_mb_flsmem": peaks[f"flsmem/{p}"], "peak_mb_full": peaks[f"full/{p}"],
        })
        print(f"B={batch} position {p:6}: flsmem cost x{ours:.2f}, full cache cost x{full:.2f} "
              f"(reference: flsmem at {positions[0]}); tokens/s flsmem / full = {full / ours:.2f}x; "
              f"peak memory {rows[-1]['peak_mb_flsmem']:.0f} MB vs {rows[-1]['peak_mb_full']:.0f} MB", flush=True)
    return rows


def main(argv=None):
    args = parse(argv)
    common.set_timing(args)  # before the first computation: it may pin the cores
    model = common.load_model(args.model)
    rows = []
    for batch in args.batch:
        rows += measure(model, batch, args.positions, args.steps, args.rounds)
    common.save(args.out, {"model": args.model, "rows": rows})


if __name__ == "__main__":
    sys.exit(main())
