"""flsmem against a per-step Python implementation of the same eviction.

The Python implementation is the kind the project's seed documents sketch: a dict of
slots per row, a Python loop that adds each slot's attention to its score, and ``min``
over the unprotected slots to pick the victim when the row holds more than its budget.
It runs H2O's rule with a recent window of 16 (the newest 16 items are never evicted),
one item in and one victim out per step. flsmem runs the same rule
(``policies.h2o(recent=16)``) as one jitted ``lax.scan`` of write + update, with
``evict_every`` 1 (the same schedule) and 32 (its batched eviction).

Both manage ``rows`` rows of N items (default 90, the 30 layers x 3 KV heads of
SmolLM2 at batch 1), in steady state, with the same attention every step (in the
jitted loops scaled by a factor that grows with the step, so that XLA cannot hoist
work on it out of the loop). Reported per N: the per-step time of the Python
implementation over flsmem's, the median of back-to-back pairs.

Beside them, the same pairs against a floor: a jitted loop that only adds each step's
attention to every item's score (``scores += attention``, one fused pass over
``[rows, N]``), the least any per-step scoring rule can do. Python over the floor is
the largest speed-up any implementation could show on this machine; when it is below
1,000x, a 1,000x goal is out of reach here whatever flsmem does. More loops profile
flsmem's step by stage, each a multiple of the floor's step, so that a slowdown in one
stage shows: the write alone; + observe; + smooth (no eviction falling due); the whole
step (``evict_every`` 1 and 32); and the learned estimator's whole step (``learned``,
a fresh network learning online, ``evict_every`` 32).

    python -m bench.pyref                          # N = 1k, 4k, 16k
    python -m bench.pyref --quick                  # N = 1k, 3 rounds: under a minute
    python -m bench.pyref --sizes 256 --rows 4     # a small check
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

import flsmem
from bench import common
from flsmem import estimator, policies
from flsmem.harness.arguments import make_parser

RECENT = 16


class PythonMemory:
    """H2O eviction with a dict of slots and Python loops, one row per dict.

    Each step: the new item takes a free slot, every resident item's score grows by
    the attention its slot received, and while a row holds more than ``budget`` items
    the lowest-scoring item older than the recent window is evicted (``min`` keeps the
    first, that is the oldest, among equal scores).
    """

    def __init__(self, rows: int, budget: int, recent: int = RECENT):
        self.budget, self.recent, self.t = budget, recent, 0
        self.rows = [{} for _ in range(rows)]  # slot -> {"position", "birth", "score", "item"}
        # budget + 1 slots: the budget and room for the one arriving item.
        self.free = [list(range(budget, -1, -1)) for _ in range(rows)]  # pop() gives the lowest

    def fill(self, count: int):
        """Start in steady state: ``count`` items already resident in every row."""
        for slots, free in zip(self.rows, self.free):
            for s in range(count):
                slots[free.pop()] = {"position": s, "birth": s, "score": 0.0, "item": None}
        self.t = count

    def step(self, items, attention):
        """One decode step. ``items``: one payload per row; ``attention``: per row a
        list of the attention each slot received (indexed by slot)."""
        for slots, free, item, weights in zip(self.rows, self.free, items, attention):
            slots[free.pop()] = {"position": self.t, "birth": self.t, "score": 0.0, "item": item}
            for slot, entry in slots.items():
                entry["score"] += weights[slot]
            if len(slots) > self.budget:
                old = [s for s, e in slots.items() if self.t + 1 - e["birth"] > self.recent]
                victim = min(old, key=lambda s: slots[s]["score"])
                del slots[victim]
                free.append(victim)
        self.t += 1

    def kept_positions(self) -> list[set[int]]:
        return [{e["position"] for e in slots.values()} for slots in self.rows]


def flsmem_memory(rows: int, budget: int, evict_every: int, filled: int, head_dim: int = 64, policy=None):
    """A flsmem memory of ``rows`` rows (one sequence, ``rows`` heads) holding
    ``filled`` items at positions 0 .. filled - 1, with key/value payloads; H2O with
    the Python implementation's recent window unless ``policy`` is given."""
    policy = policy or policies.h2o(recent=RECENT)
    config = flsmem.MemoryConfig(policy=policy, budget=budget, evict_every=evict_every)
    memory = flsmem.init(config, 1, rows, {"k": (head_dim,), "v": (head_dim,)})
    slot = jnp.arange(config.capacity, dtype=jnp.int32)
    here = jnp.broadcast_to(slot < filled, memory.valid.shape)
    position = jnp.where(here, slot, -1)
    return memory.replace(valid=here, position=position, birth=jnp.maximum(position, 0),
                          step=jnp.full((1,), filled, jnp.int32))


# The stages of a step, each including the ones before it.
STAGES = ("write", "observe", "smooth", "update")


@functools.partial(jax.jit, static_argnames=("steps", "stages"), donate_argnums=(0,))
def flsmem_steps(memory, attention, *, steps, stages="update"):
    """``steps`` steps of write + update, each with the attention ``[1, K, S]`` scaled by
    a factor that grows with the step;
    ``stages`` stops the step early for its profile: "write", "observe" (write +
    observe) or "smooth" (write + observe + smooth, never evicting)."""
    _, k, _ = memory.valid.shape
    d = memory.payload["k"].shape[-1]

    def step(memory, t):
        item = {"k": jnp.ones((1, k, d)), "v": jnp.ones((1, k, d))}
        memory = flsmem.write(memory, item, jnp.full((1,), t, jnp.int32))
        # Scaled by the step, as the floor's: work on an attention that is the same at
        # every step (its finiteness check) would be hoisted out of the loop by XLA.
        scaled = attention * (1.0 + t.astype(attention.dtype) / steps)
        if stages == "update":
            return flsmem.update(memory, scaled), None
        if stages != "write":
            memory = flsmem.observe(memory, scaled)
        return (flsmem.smooth(memory) if stages == "smooth" else memory), None

    return jax.lax.scan(step, memory, memory.step[0] + jnp.arange(steps, dtype=jnp.int32))[0]


@functools.partial(jax.jit, static_argnames=("steps",), donate_argnums=(0,))
def floor_steps(scores, attention, *, steps):
    """``steps`` steps of the least per-step work: every score grows by its attention.
    (Scaled by the step so that XLA cannot fold the steps into one.)"""

    def step(scores, t):
        return scores + attention * t.astype(scores.dtype), None

    return jax.lax.scan(step, scores, jnp.arange(steps, dtype=jnp.int32))[0]


def random_weights(rng, rows: int, n: int) -> np.ndarray:
    """Each row's attention over ``n + 1`` items: uniform random, summing to one (no
    ties, as real attention has none)."""
    weights = rng.random((rows, n + 1)).astype(np.float32)
    return weights / weights.sum(axis=1, keepdims=True)


def slot_attention(weights: np.ndarray, slots: int) -> jax.Array:
    """``weights [rows, n + 1]`` as a step's attention ``[1, rows, slots]`` (slots past
    the items get none)."""
    n = min(weights.shape[1], slots)
    return jnp.zeros((1, weights.shape[0], slots)).at[0, :, :n].set(weights[:, :n])


def parse(argv=None):
    parser = make_parser("python -m bench.pyref", __doc__)
    parser.add_argument("--sizes", type=common.positive_ints, default=[1024, 4096, 16384], help="N, items per row")
    parser.add_argument("--rows", type=int, default=90, help="rows (layers x KV heads x batch)")
    parser.add_argument("--evict-every", type=common.positive_ints, default=[1, 32])
    parser.add_argument("--steps", type=int, default=32, help="flsmem steps per timed call")
    parser.add_argument("--python-steps", type=int, default=2, help="Python steps per timed call")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="N = 1k, 3 rounds, one core: under a minute")
    parser.add_argument("--out", default="pyref", help="name of the results/bench/<name>.json file")
    common.add_timing_options(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.rounds = [1024], 3
        args.cores = 1 if args.cores is None else args.cores
        if args.out == "pyref":
            args.out = "pyref-quick"
    for name in ("rows", "steps", "python_steps", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    bad = [e for e in args.evict_every if args.steps % e]
    if bad:
        parser.error(f"--steps ({args.steps}) must be a multiple of every --evict-every value, not of {bad}")
    small = [n for n in args.sizes if n <= RECENT]
    if small:
        parser.error(f"--sizes must exceed the recent window ({RECENT}), got {small}")
    return args


def main(argv=None):
    args = parse(argv)
    common.set_timing(args)  # before the first computation: it may pin the cores
    rng = np.random.default_rng(0)
    rows = []
    for n in args.sizes:
        weights = random_weights(rng, args.rows, n)
        py_attention = weights.tolist()  # plain floats: the fastest input for a Python loop

        def python_call():
            memory = PythonMemory(args.rows, n)
            memory.fill(n)
            return memory

        def python_run(memory):
            for _ in range(args.python_steps):
                memory.step([None] * args.rows, py_attention)

        per_step = {"python": (lambda: (python_call(),), python_run)}
        variants = {}
        for ee in args.evict_every:
            memory = flsmem_memory(args.rows, n, ee, n)
            s = memory.slots
            variants[f"flsmem/{ee}"] = (common.fresh(memory),
                                        lambda m, a=slot_attention(weights, s): flsmem_steps(m, a, steps=args.steps))
        # The profile of a step by stage (no eviction falls due in these calls: with
        # evict_every twice the steps the rows never reach budget + evict_every), and
        # the learned estimator's whole step.
        learner = estimator.learned(online=True, recent=RECENT)
        profile = [(stage, 2 * args.steps, stage, None) for stage in STAGES[:3]]
        for stage, ee, stages, policy in profile + [("learned", 32, "update", learner)]:
            memory = flsmem_memory(args.rows, n, ee, n, policy=policy)
            variants[stage] = (common.fresh(memory),
                               lambda m, a=slot_attention(weights, memory.slots), st=stages:
                               flsmem_steps(m, a, steps=args.steps, stages=st))
        floor_attention = jnp.asarray(weights)
        variants["floor"] = (common.fresh(jnp.zeros_like(floor_attention)),
                             lambda s, a=floor_attention: floor_steps(s, a, steps=args.steps))
        # Pair the Python implementation with each flsmem schedule; both sides are
        # converted to one step before the ratio is taken.
        ratios = common.paired(per_step["python"], variants, args.rounds)
        # ratio = jitted call / python call; per step: python/step over jitted/step.
        speed = lambda x: args.steps / (x * args.python_steps)  # noqa: E731
        floor = speed(ratios["floor"]["median"])
        # Each loop's step as a multiple of the floor's step.
        passes = {name: floor / speed(r["median"]) for name, r in ratios.items()}
        for ee in args.evict_every:
            r = ratios[f"flsmem/{ee}"]
            row = {"n": n, "rows": args.rows, "evict_every": ee, "python_steps": args.python_steps,
                   "steps": args.steps, "rounds": args.rounds, "speedup": speed(r["median"]),
                   "speedup_low": speed(r["high"]), "speedup_high": speed(r["low"]), "floor_speedup": floor,
                   "floors_write": passes["write"], "floors_observe": passes["observe"],
                   "floors_no_evict": passes["smooth"], "floors_learned": passes["learned"],
                   "floors": passes[f"flsmem/{ee}"]}
            rows.append(row)
            print(f"N={n:6} rows={args.rows} flsmem evict_every={ee:3}: {row['speedup']:.0f}x faster per step "
                  f"than the Python implementation (rounds {row['speedup_low']:.0f}x .. {row['speedup_high']:.0f}x); "
                  f"the floor (scores += attention): {floor:.0f}x; the step costs {row['floors']:.1f} floors "
                  f"(write {row['floors_write']:.1f}, + observe {row['floors_observe']:.1f}, + smooth "
                  f"{row['floors_no_evict']:.1f}; learned {row['floors_learned']:.1f})", flush=True)
    common.save(args.out, {"rows": rows})


if __name__ == "__main__":
    sys.exit(main())
