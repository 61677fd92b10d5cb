"""Where the serving loop's compile time goes.

``bench.overhead`` reports the first call of the flsmem loop (trace, compile and one
run) over the plain loop's. This benchmark takes that ratio apart. It compiles, with no
compilation cached, the plain loop and the flsmem loop under policies that add one
part at a time:

* ``full``: the memory's bookkeeping (write, the visible mask, observe), nothing
  evicted (the policy never evicts);
* ``window``: + eviction, ranked by recency alone;
* ``h2o``, ``rmm``, ...: + the policy's scores.

Beside them, the library calls that the loop makes each step, compiled alone on the
loop's own memory: ``flsmem.place`` (the write's bookkeeping for every layer) and
``flsmem.update_layers`` (observe, smooth and evict), and the parts of the update
(``observe``, ``smooth``, ``evict``) on the layers folded into rows, as the update runs
them. For each program: the time to trace and lower it, the time XLA takes to compile
it (median over rounds) and the instructions of the compiled program.

    python -m bench.compile_time                 # tiny, batch 1, evict_every 8
    python -m bench.compile_time --model smollm2
"""

from __future__ import annotations

import statistics
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

import flsmem
from bench import common
from bench.loops import plain_cache, run_flsmem, run_plain, steady_memories
from bench.overhead import BUDGET
from flsmem import layers, policies
from flsmem.harness.arguments import make_parser

POLICIES = {
    "full": lambda: policies.make("full"),
    "window": lambda: policies.make("window"),
    "h2o": lambda: policies.make("h2o", recent=16),
    "rmm": lambda: policies.make("rmm", lag=16),
    "ema": lambda: policies.make("ema", recent=16),
    "kalman": lambda: policies.make("kalman", lag=16),
}


def parse(argv=None):
    parser = make_parser("python -m bench.compile_time", __doc__)
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--policies", type=common.choices(tuple(POLICIES)), default=["full", "window", "h2o", "rmm"],
                        help="the loop is compiled under each; the library calls under the last")
    parser.add_argument("--evict-every", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="compilations of each program; the median is reported")
    parser.add_argument("--out", default="compile-time", help="name of the results/bench/<name>.json file")
    common.add_timing_options(parser)
    args = parser.parse_args(argv)
    if min(args.batch, args.evict_every, args.rounds) < 1:
        parser.error(f"--batch, --evict-every and --rounds must be >= 1, got {args.batch}, {args.evict_every} "
                     f"and {args.rounds}")
    return args


def instructions(hlo: str) -> int:
    """Instructions of a compiled program's HLO text (its fused computations included)."""
    return sum(1 for line in hlo.splitlines() if " = " in line and not line.lstrip().startswith(("//", "HloModule")))


def compile_cost(fn, args: tuple, rounds: int, **static) -> dict[str, float]:
    """Median seconds to trace and lower ``jax.jit(fn)`` and to compile it, each
    round with no compilation cached, and the compiled program's instructions."""
    jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
    lower_s, compile_s = [], []
    for _ in range(rounds):
        jax.clear_caches()
        begin = time.perf_counter()
        lowered = jitted.trace(*args, **static).lower()
        middle = time.perf_counter()
        compiled = lowered.compile()
        lower_s.append(middle - begin)
        compile_s.append(time.perf_counter() - middle)
    return {"lower_s": statistics.median(lower_s), "compile_s": statistics.median(compile_s),
            "instructions": instructions(compiled.as_text())}


def _folded(memories: flsmem.MemoryState) -> flsmem.MemoryState:
    """Stacked memories ``[L, B, ...]`` as the one memory of ``L * B`` rows that
    ``flsmem.update_layers`` runs a step on (the payload left out, as it leaves it). The
    library's own fold, so that a policy state the rows share keeps its layer axis."""
    flat, _, _ = layers.fold_layers(memories.replace(payload=None))
    return flat


def measure(args) -> list[dict]:
    model = common.load_model(args.model)
    graphdef, params = nnx.split(model)
    cfg = model.cfg
    budget = BUDGET[args.model]
    start, steps = 2 * budget, args.evict_every
    key = jax.random.key(0)
    logits = jax.random.normal(key, (args.batch, cfg.vocab_size))
    cache = plain_cache(cfg, args.batch, budget + args.evict_every, start, key)
    rows = [{"program": "plain loop", **compile_cost(run_plain, (graphdef, params, cache, logits, start),
                                                     args.rounds, steps=steps)}]
    for name in args.policies:
        config = flsmem.MemoryConfig(policy=POLICIES[name](), budget=budget, evict_every=args.evict_every)
        memories = steady_memories(cfg, config, args.batch, start, key)
        rows.append({"program": f"loop: {name}", **compile_cost(run_flsmem, (graphdef, params, memories, logits,
                                                                            start), args.rounds, steps=steps)})
        print(f"{rows[-1]['program']:14} compile {rows[-1]['compile_s']:.2f} s", flush=True)
    stacked = memories.evictable
    position = jnp.full((args.batch, 1), start, jnp.int32)
    attention = jnp.full(stacked.valid.shape, 1.0 / stacked.valid.shape[-1], jnp.float32)
    flat = _folded(stacked)
    calls = {
        "place": (flsmem.place, (stacked, position)),
        "update_layers": (flsmem.update_layers, (stacked, attention)),
        "observe": (flsmem.observe, (flat, attention.reshape(flat.valid.shape))),
        "smooth": (flsmem.smooth, (flat,)),
        "evict": (flsmem.evict, (flat,)),
    }
    for call, (fn, call_args) in calls.items():
        rows.append({"program": f"{call} ({args.policies[-1]})", **compile_cost(fn, call_args, args.rounds)})
    plain = rows[0]
    for row in rows:
        row["compile_ratio"] = row["compile_s"] / plain["compile_s"]
    return rows


def main(argv=None):
    args = parse(argv)
    common.set_timing(args)
    rows = measure(args)
    print(f"{'program':24} {'trace+lower s':>13} {'compile s':>9} {'x plain':>7} {'instructions':>12}")
    for row in rows:
        print(f"{row['program']:24} {row['lower_s']:13.2f} {row['compile_s']:9.2f} {row['compile_ratio']:7.2f} "
              f"{row['instructions']:12d}")
    common.save(args.out, {"model": args.model, "batch": args.batch, "evict_every": args.evict_every,
                           "rounds": args.rounds, "rows": rows})


if __name__ == "__main__":
    sys.exit(main())
