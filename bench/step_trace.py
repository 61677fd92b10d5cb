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
"""

from __future__ import annotations

import argparse
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


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.step_trace", description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=4096, help="items per row")
    parser.add_argument("--rows", type=int, default=90)
    parser.add_argument("--evict-every", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--policy", choices=tuple(POLICIES), default="h2o")
    parser.add_argument("--top", type=int, default=20, help="operations to print")
    common.add_timing_options(parser)
    args = parser.parse_args(argv)
    if min(args.n, args.rows, args.evict_every, args.steps, args.top) < 1:
        parser.error("--n, --rows, --evict-every, --steps and --top must be >= 1")
    common.set_timing(args)
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
