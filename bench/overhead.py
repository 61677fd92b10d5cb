"""Per-step overhead of flsmem in the jitted decode loop, and its compile time.

For each model, batch size, policy and ``evict_every``: the library's serving loop
(:func:`flsmem.models.generate.decode_loop`, write + attend + observe + smooth + evict when
due) against the same decoder with a plain fixed-size ring cache of the same resident
size (``budget + evict_every`` slots, no scores, no eviction), both in steady state at
position ``2 * budget``. Overhead = median over rounds of (flsmem time / plain time) - 1,
the two loops timed back to back in every round. A timed call is ``steps`` decode steps (a
multiple of every ``evict_every``, so each call holds the same number of evictions).

    python -m bench.overhead            # the full table (tiny and SmolLM2, batch 1 and 8)
    python -m bench.overhead --quick    # SmolLM2, batch 1, rmm, evict_every 8: < 2 min

On a 2-core CPU, pass ``--cores 1`` to compare the work of the two loops: with two
threads, how fast XLA's second thread wakes for each parallel operation moves a step's
time by more than flsmem's work does (bench/NOTES.md). ``--quick`` runs on one core
unless ``--cores`` says otherwise.

Each model and batch size is saved to ``results/bench/partial/`` as it finishes, so a
stopped run keeps them: the same command at the same commit resumes after them.
"""

from __future__ import annotations

import sys

import jax
from flax import nnx

import flsmem
from bench import common
from bench.loops import plain_cache, run_flsmem, run_plain, steady_memories
from flsmem import estimator, policies
from flsmem.harness.arguments import make_parser
from flsmem.harness.evaluate import ESTIMATOR_DIR

POLICIES = {
    "rmm": lambda: policies.make("rmm", lag=16),
    "h2o": lambda: policies.make("h2o", recent=16),
    "ema": lambda: policies.make("ema", recent=16),
    "kalman": lambda: policies.make("kalman", lag=16),
    # The shipped estimator, learning while it serves (as `learned` in results/LEARNED.md).
    "learned": lambda: estimator.from_checkpoint(ESTIMATOR_DIR, online=True, learning_rate=1e-4, recent=16),
    # The same network frozen: no snapshots to keep up, no learning branch.
    "learned_offline": lambda: estimator.from_checkpoint(ESTIMATOR_DIR, online=False, recent=16),
    # Budgets shared by the KV heads by score (the library's default ceiling: each head's
    # slots allocated for twice its uniform share, which the loop attends over).
    "adakv(rmm)": lambda: policies.adakv(policies.make("rmm", lag=16)),
    "adakv(h2o)": lambda: policies.adakv(policies.make("h2o", recent=16)),
}
DEFAULT_POLICIES = ["rmm", "h2o"]
BUDGET = {"tiny": 256, "smollm2": 512}


def parse(argv=None):
    parser = make_parser("python -m bench.overhead", __doc__)
    parser.add_argument("--models", type=common.choices(("tiny", "smollm2")), default=["tiny", "smollm2"])
    parser.add_argument("--batch", type=common.positive_ints, default=[1, 8], help="batch sizes, e.g. 1,8")
    parser.add_argument("--policies", type=common.choices(tuple(POLICIES)), default=DEFAULT_POLICIES)
    parser.add_argument("--evict-every", type=common.positive_ints, default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=32, help="decode steps per timed call")
    parser.add_argument("--rounds", type=int, default=9, help="rounds of back-to-back pairs; the median is reported")
    parser.add_argument("--quick", action="store_true",
                        help="SmolLM2, batch 1, rmm, evict_every 8, 9 rounds, one core; the last line is the overhead")
    parser.add_argument("--out", default="overhead", help="name of the results/bench/<name>.json file")
    common.add_timing_options(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.batch, args.policies, args.evict_every, args.rounds = ["smollm2"], [1], ["rmm"], [8], 9
        args.cores = 1 if args.cores is None else args.cores
        if args.out == "overhead":
            args.out = "overhead-quick"
    if args.steps < 1 or args.rounds < 1:
        parser.error(f"--steps and --rounds must be >= 1, got {args.steps} and {args.rounds}")
    bad = [e for e in args.evict_every if args.steps % e]
    if bad:
        parser.error(f"--steps ({args.steps}) must be a multiple of every --evict-every value, not of {bad}")
    return args


def measure(model, name: str, batch: int, pols: list[str], evict_every: list[int], steps: int, rounds: int):
    """Rows of the overhead table for one model and batch size."""
    graphdef, params = nnx.split(model)
    cfg = model.cfg
    budget = BUDGET[name]
    start = 2 * budget
    key = jax.random.key(0)
    logits = jax.random.normal(key, (batch, cfg.vocab_size))
    fns, compile_s = {}, {}
    for ee in evict_every:
        cache = plain_cache(cfg, batch, budget + ee, start, key)
        fns[f"plain/{ee}"] = (common.fresh(cache),
                              lambda c: run_plain(graphdef, params, c, logits, start, steps=steps))
        for pol in pols:
            config = flsmem.MemoryConfig(policy=POLICIES[pol](), budget=budget, evict_every=ee)
            memories = steady_memories(cfg, config, batch, start, key)
            fns[f"{pol}/{ee}"] = (common.fresh(memories),
                                  lambda m: run_flsmem(graphdef, params, m, logits, start, steps=steps))
    # First call of each loop (trace, compile and one run), with no compilation cached.
    for label, fn in fns.items():
        jax.clear_caches()
        compile_s[label] = common.time_once(fn)
    r = {}
    for ee in evict_every:
        variants = {f"{pol}/{ee}": fns[f"{pol}/{ee}"] for pol in pols}
        r.update(common.paired(fns[f"plain/{ee}"], variants, rounds))
    rows = []
    for ee in evict_every:
        for pol in pols:
            label = f"{pol}/{ee}"
            rows.append({
                "model": name, "batch": batch, "policy": pol, "evict_every": ee, "budget": budget,
                "slots": budget + ee, "steps": steps, "rounds": rounds,
                "overhead": r[label]["median"] - 1.0, "overhead_low": r[label]["low"] - 1.0,
                "overhead_high": r[label]["high"] - 1.0,
                # A 95% interval for the median overhead, and every round's.
                "overhead_median_low": r[label]["median_low"] - 1.0,
                "overhead_median_high": r[label]["median_high"] - 1.0,
                "overhead_rounds": [x - 1.0 for x in r[label]["rounds"]],
                # First call (trace + compile + one run) over the plain loop's first call.
                "first_call_ratio": compile_s[label] / compile_s[f"plain/{ee}"],
            })
    return rows


def main(argv=None):
    args = parse(argv)
    common.set_timing(args)  # before the first computation: it may pin the cores
    partial = common.Partial(args.out)
    rows = []
    for name in args.models:
        model = None
        for batch in args.batch:
            part = f"{name}, batch {batch}"
            new_rows = partial.get(part)
            if new_rows is None:
                if model is None:
                    model = common.load_model(name)
                new_rows = measure(model, name, batch, args.policies, args.evict_every, args.steps, args.rounds)
                partial.put(part, new_rows)
            else:
                print(f"{part}: measured by an earlier run of this command, from {partial.path}", flush=True)
            rows += new_rows
            for row in new_rows:
                print(f"{row['model']:8} B={row['batch']} {row['policy']:4} evict_every={row['evict_every']:3} "
                      f"overhead {100 * row['overhead']:+6.2f}% (95% interval of the median "
                      f"{100 * row['overhead_median_low']:+.2f}% .. {100 * row['overhead_median_high']:+.2f}%; "
                      f"rounds {100 * row['overhead_low']:+.2f}% .. {100 * row['overhead_high']:+.2f}%), "
                      f"first call x{row['first_call_ratio']:.2f}", flush=True)
    common.save(args.out, {"rows": rows})
    partial.finish()
    if args.quick:
        print(f"overhead {100 * rows[0]['overhead']:+.2f}%")


if __name__ == "__main__":
    sys.exit(main())
