"""Soak test: a long decode with eviction, the memory's invariants checked as it goes.

Each policy decodes ``--steps`` tokens (100,000 by default) of a synthetic stream: per
step a new key and value are written, a query attends over the visible slots
(softmax of q.k, some keys made heavy hitters so that scores differ), the memory is
updated with that attention and a correctness weight, and evicts when due. Steps run
in jitted ``lax.scan`` blocks of ``--block`` (1,000); after every block the state is
checked on the host:

* clock: every row's ``step`` is exactly the steps run (no drift);
* budget: each row holds between ``budget`` and ``budget + evict_every - 1`` items
  once full, and never a forced write;
* slots: free slots hold position -1, held positions are distinct, already written,
  and carry their own payload and birth (the value vector encodes the position);
* protection: the recent window and the commit lag are all held;
* finiteness: no NaN or Inf in scores, evidence, payload or the policy's state, no
  fallback and no non-finite input counted;
* accounting: ``stats.evictions`` equals the items written minus the items held.

    python -m bench.soak                      # 100,000 steps for each default policy
    python -m bench.soak --steps 5000 --policies rmm

The last line reports the steps run and the invariant violations (0 when all held);
the exit status is 1 if any invariant failed.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import flsmem
from flsmem import estimator, policies
from flsmem.harness.arguments import make_parser

D = 8  # head dimension
POLICIES = {
    "rmm": lambda: policies.rmm(lag=16, recent=8, decay=0.999),
    "h2o": lambda: policies.h2o(recent=16),
    "kalman": lambda: policies.kalman(adaptive=True, lag=4, recent=8),
    "learned": lambda: estimator.learned(horizon=32, hidden=16, recent=8),
}


def _block(state, key, start, *, length: int):
    """``length`` decode steps from position ``start`` (jitted; one compile per config)."""
    b, k = state.batch, state.kv_heads

    def step(state, t):
        kk, kq, kh, kw = jax.random.split(jax.random.fold_in(key, t), 4)
        keys = jax.random.normal(kk, (b, k, D))
        # One item in 16 is a heavy hitter: its key points where the queries look.
        heavy = jax.random.bernoulli(kh, 1 / 16, (b, k, 1))
        keys = jnp.where(heavy, keys + 4.0, keys)
        values = jnp.broadcast_to(t.astype(jnp.float32), (b, k, D))  # encodes the position
        state = flsmem.write(state, {"k": keys, "v": values}, jnp.full((b,), t, jnp.int32))
        query = jax.random.normal(kq, (b, k, D)) + 1.0
        logits = jnp.einsum("bkd,bksd->bks", query, state.payload["k"]) / np.sqrt(D)
        attention = jax.nn.softmax(jnp.where(flsmem.visible(state), logits, -jnp.inf), axis=-1)
        correctness = jax.random.uniform(kw, (b,))
        return flsmem.update(state, attention, correctness), None

    return jax.lax.scan(step, state, start + jnp.arange(length, dtype=jnp.int32))[0]


def check(state, steps_run: int) -> list[str]:
    """The invariants after ``steps_run`` steps; a message for each one broken."""
    s = jax.device_get(state)
    config = state.config
    policy = config.policy
    problems = []

    def expect(ok, message):
        if not bool(np.all(ok)):
            problems.append(message)

    b, k, _ = s.valid.shape
    expect(s.step == steps_run, f"clock drifted: step {s.step.tolist()} after {steps_run} steps")
    held = s.valid.sum(-1)
    expect(held < config.high_water, f"a row holds {held.max()} >= budget + evict_every = {config.high_water}")
    if steps_run >= config.high_water:
        expect(held >= config.budget, f"a row holds {held.min()} < budget {config.budget}: over-eviction")
    expect(s.stats.forced_writes == 0, "forced writes: eviction missed its schedule")
    expect(np.where(s.valid, s.position >= 0, s.position == -1), "free slots must hold position -1")
    expect(~s.valid | (s.position < steps_run), "a slot holds a position never written")
    expect(~s.valid | (s.birth == s.position), "a slot's birth and position disagree")
    expect(~s.valid[..., None] | (s.payload["v"] == s.position[..., None]), "a slot's payload moved apart from it")
    for i in range(b):
        for j in range(k):
            positions = s.position[i, j][s.valid[i, j]]
            expect(len(np.unique(positions)) == len(positions), f"row ({i}, {j}) holds a position twice")
            window = min(policy.protected_age, steps_run)
            recent = np.arange(steps_run - window, steps_run)
            expect(np.isin(recent, positions), f"row ({i}, {j}) lost an item of its protected window")
    expect(~s.valid | np.isfinite(s.score), "a score is NaN or Inf")
    for array in s.evidence:
        finite = np.isfinite(array).reshape(array.shape[:3] + (-1,)).all(axis=-1)
        expect(~s.valid | finite, "evidence is NaN or Inf")
    for leaf in jax.tree.leaves((s.payload, s.aux)):
        if np.issubdtype(np.asarray(leaf).dtype, np.floating):
            expect(np.isfinite(leaf), "the payload or the policy's state has NaN or Inf")
    expect(s.stats.fallbacks == 0, f"fallbacks: {s.stats.fallbacks.tolist()}")
    expect(s.stats.nonfinite_inputs == 0, "non-finite inputs were counted")
    expect(s.stats.evictions == steps_run * k - held.sum(-1), "eviction counter drifted from items written - held")
    return problems


def soak(policy_name: str, steps: int, block: int, budget: int, evict_every: int, batch: int, kv_heads: int,
         seed: int, out=sys.stdout) -> tuple[int, int]:
    """Run one policy; returns (steps run, invariant violations)."""
    config = flsmem.MemoryConfig(POLICIES[policy_name](), budget=budget, evict_every=evict_every)
    state = flsmem.init(config, batch, kv_heads, {"k": (D,), "v": (D,)})
    run = jax.jit(_block, static_argnames="length")
    key = jax.random.key(seed)
    violations = 0
    started = time.perf_counter()
    done = 0
    while done < steps:
        length = min(block, steps - done)
        state = run(state, key, jnp.int32(done), length=length)
        done += length
        problems = check(state, done)
        violations += len(problems)
        for message in problems[:3]:
            print(f"  {policy_name} after {done} steps: {message}", file=out, flush=True)
    elapsed = time.perf_counter() - started
    summary = jax.device_get(flsmem.summary(state))
    print(f"{policy_name:<8} {done} steps in {elapsed:.0f} s, {violations} violations; evictions "
          f"{int(summary['evictions'].sum())}, mean evicted age {float(np.nanmean(summary['mean_evicted_age'])):.1f}",
          file=out, flush=True)
    return done, violations


def main(argv=None) -> int:
    parser = make_parser("python -m bench.soak", __doc__)
    parser.add_argument("--steps", type=int, default=100_000, help="decode steps per policy")
    parser.add_argument("--block", type=int, default=1_000, help="steps per jitted block; invariants checked after each")
    parser.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated, from {', '.join(POLICIES)}")
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--evict-every", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    unknown = sorted(set(names) - set(POLICIES))
    if unknown or not names:
        parser.error(f"--policies: unknown {unknown}; known: {', '.join(POLICIES)}")
    for name in ("steps", "block", "budget", "evict_every", "batch", "kv_heads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    total_steps = total_violations = 0
    for name in names:
        steps, violations = soak(name, args.steps, args.block, args.budget, args.evict_every, args.batch,
                                 args.kv_heads, args.seed)
        total_steps += steps
        total_violations += violations
    print(f"soak: {total_steps} decode steps run ({len(names)} policies x {args.steps}), "
          f"{total_violations} invariant violations")
    return 1 if total_violations else 0


if __name__ == "__main__":
    sys.exit(main())
