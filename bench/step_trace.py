"""Where a decode step's time goes, operation by operation of the compiled program.

Runs ``bench.pyref``'s flsmem loop (write + update of a policy as ``bench.overhead``
builds it, over ``rows`` rows of N items) under
``jax.profiler``, then prints each XLA operation of the loop body with its time per
step and the JAX operations it was fused from (read from the compiled HLO's metadata),
largest first. On CPU the runtime may overlap independent operations, so the times are
each operation's own wall time and need not add up to the step's.

    python -m bench.step_trace                        # N = 4096, evict_every 64 (none due)
    python -m bench.step_trace --evict-every 1        # an eviction every step
    python -m bench.step_trace --policy kalman        # another policy's step

With ``--model`` it traces the serving loop of that model instead (``bench.overhead``'s
two loops, flsmem's and the plain ring cache's, batch ``--batch``, budget as there) and
prints, for each loop, the operations that ran per step and their summed time, then
flsmem's costliest operations: what a step of a small model pays for the memory is the
count of its operations as much as their size.
"""

from __future__ import annotations

import collections
import gzip
import json
import pathlib
import re
import sys
import tempfile

import jax
import numpy as np

from bench import common
from bench.overhead import POLICIES
from bench.pyref import flsmem_memory, flsmem_steps, random_weights, slot_attention
from flsmem.harness.arguments import make_parser


def fused_from(hlo: str) -> dict[str, str]:
    """Per operation of the compiled program, the JAX operations behind it."""
    bodies = {m.group(1): m.group(2) for m in re.finditer(r"\n(%[\w.\-]+) [^\n]*\{\n(.*?)\n\}", hlo, re.S)}
    origin = {}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (\S+)", line)
        if not m:
            continue
        called = re.search(r"calls=(%[\w.\-]+)", line)
        text = bodies.get(called.group(1), "") if called else line
        ops = sorted({name.rsplit("/", 1)[-1] for name in re.findall(r'op_name="([^"]*)"', text)})
        origin[m.group(1)] = f"{m.group(2).split('{')[0]} {', '.join(ops[:6]) or '(copy)'}"
    return origin


def operation_times(fn, args, calls: int, **static) -> tuple[collections.Counter, dict[str, str]]:
    """Microseconds per call of each XLA operation of the jitted ``fn(*args(), **static)``
    under ``jax.profiler`` (``calls`` calls after a warm-up), and the JAX operations each
    was fused from."""
    jax.block_until_ready(fn(*args(), **static))
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder, create_perfetto_trace=True):
            for _ in range(calls):
                jax.block_until_ready(fn(*args(), **static))
        events = json.load(gzip.open(next(pathlib.Path(folder).rglob("*.trace.json.gz"))))
    events = events["traceEvents"] if isinstance(events, dict) else events
    origin = fused_from(fn.lower(*args(), **static).compile().as_text())
    per_call = collections.Counter()
    for event in events:
        if event.get("ph") == "X" and event["name"] in origin:
            per_call[event["name"]] += event["dur"] / calls
    return per_call, origin


CONTROL = ("while", "cond", "call", "conditional")


def leaf_times(per_call: collections.Counter) -> collections.Counter:
    """The operations that do work: control flow (loops, conditionals, calls) left out,
    as its time is that of the operations it runs."""
    return collections.Counter({name: us for name, us in per_call.items() if not name.startswith(CONTROL)})


def trace_loops(model_name: str, batch: int, policy: str, evict_every: int, steps: int, top: int) -> None:
    """Per-step operations of the plain and the flsmem serving loop of ``model_name``."""
    from flax import nnx

    import flsmem
    from bench.loops import plain_cache, run_flsmem, run_plain, steady_memories
    from bench.overhead import BUDGET

    model = common.load_model(model_name)
    graphdef, params = nnx.split(model)
    budget = BUDGET[model_name]
    start = 2 * budget
    key = jax.random.key(0)
    logits = jax.random.normal(key, (batch, model.cfg.vocab_size))
    config = flsmem.MemoryConfig(policy=POLICIES[policy](), budget=budget, evict_every=evict_every)
    loops = {"plain": (run_plain, plain_cache(model.cfg, batch, budget + evict_every, start, key)),
             "flsmem": (run_flsmem, steady_memories(model.cfg, config, batch, start, key))}
    print(f"{model_name}, batch {batch}, {policy}, budget {budget}, evict_every {evict_every}: operations per step")
    for label, (fn, tree) in loops.items():
        fresh = common.fresh(tree)
        per_call, origin = operation_times(fn, lambda: (graphdef, params, *fresh(), logits, start), 3, steps=steps)
        leaves = leaf_times(per_call)
        print(f"{label:7} {len(leaves):4d} operations, {sum(leaves.values()) / steps:9.1f} us per step in all")
    print("the flsmem loop's costliest operations (us per step):")
    for name, us in leaves.most_common(top):
        print(f"{us / steps:9.1f}  {name:32s} {origin[name]}")


def main(argv=None):
    parser = make_parser("python -m bench.step_trace", __doc__)
    parser.add_argument("--n", type=int, default=4096, help="items per row")
    parser.add_argument("--rows", type=int, default=90)
    parser.add_argument("--evict-every", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--policy", choices=tuple(POLICIES), default="h2o")
    parser.add_argument("--top", type=int, default=20, help="operations to print")
    parser.add_argument("--model", choices=("tiny", "smollm2"), default=None,
                        help="trace this model's serving loop against the plain loop instead")
    parser.add_argument("--batch", type=int, default=1, help="with --model")
    common.add_timing_options(parser)
    args = parser.parse_args(argv)
    if min(args.n, args.rows, args.evict_every, args.steps, args.top, args.batch) < 1:
        parser.error("--n, --rows, --evict-every, --steps, --top and --batch must be >= 1")
    common.set_timing(args)
    if args.model is not None:
        return trace_loops(args.model, args.batch, args.policy, args.evict_every, args.steps, args.top)
    memory = flsmem_memory(args.rows, args.n, args.evict_every, args.n, policy=POLICIES[args.policy]())
    # The attention bench.pyref times (its first size's draw): random, so no scores tie.
    attention = slot_attention(random_weights(np.random.default_rng(0), args.rows, args.n), memory.slots)
    fresh = common.fresh(memory)
    per_call, origin = operation_times(flsmem_steps, lambda: (*fresh(), attention), 3, steps=args.steps)
    per_step = collections.Counter({name: us / args.steps for name, us in per_call.items()})
    print(f"{args.policy}, N={args.n} rows={args.rows} evict_every={args.evict_every}: time per step of each "
          "operation (us)")
    for name, us in per_step.most_common(args.top):
        print(f"{us:9.1f}  {name:32s} {origin[name]}")


if __name__ == "__main__":
    sys.exit(main())
