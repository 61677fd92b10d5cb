"""The decode step keeps what it kept before it was made fast.

Every policy runs the same random streams (one item per step, and chunks of 4) and
the kept positions and committed scores of every row after every step are compared
with a record taken from the step before its speed work (``data/step_record.npz``).
A change to the step that is meant to change behaviour re-records it, and a new
policy adds its cases to it (the others are left as recorded):

    python tests/test_step_equality.py --record            # every case
    python tests/test_step_equality.py --record adaptive   # only these labels
"""

from __future__ import annotations

import inspect
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flsmem
from flsmem import estimator, policies, testing
from flsmem.oracle_future import discounted_future

RECORD = pathlib.Path(__file__).parent / "data" / "step_record.npz"
# The record was taken with XLA's default optimisation. The suite compiles with less
# (conftest.py), and the learned estimator's scores, after a few Adam steps, round
# differently by about 2e-5 of their value: the step compiles here as the record's did.
DEFAULT_COMPILE = {"xla_backend_optimization_level": 3, "xla_llvm_disable_expensive_passes": False}
BATCH, HEADS, STEPS, BUDGET = 2, 3, 28, 6
# (label, policy, evict_every, chunk[, settings]): every policy of the registry, the
# wrappers and the learned estimator, on the decode schedule; a few on chunks, on a
# longer schedule or with settings of their own.
CASES = [
    *[(name, name, 1, 1) for name in sorted(policies.REGISTRY)],
    ("adakv(h2o)", "adakv(h2o)", 1, 1),
    ("learned", "learned", 1, 1),
    ("learned_offline", "learned_offline", 1, 1),
    ("h2o/every4", "h2o", 4, 1),
    ("rmm/every4", "rmm", 4, 1),
    ("kalman/every4", "kalman", 4, 1),
    ("rmm/chunk4", "rmm", 4, 4),
    ("snapkv/chunk4", "snapkv", 4, 4),
    ("surprise/chunk4", "surprise", 4, 4),
    ("adakv(rmm)/every4", "adakv(rmm)", 4, 1),
    ("surprise(reserve=2)/every4", "surprise", 4, 1, {"reserve": 2}),
]


def build(name: str, **settings) -> policies.Policy:
    if name == "expected_attention":
        return policies.expected_attention(head_dim=testing.HEAD_DIM, group=1, rope_theta=10_000.0, future=8)
    if name in ("learned", "learned_offline"):
        return estimator.learned(online=name == "learned", horizon=4, snapshots=2)
    inner = name.split("(")[-1].rstrip(")")
    accepted = inspect.signature(policies.REGISTRY[inner]).parameters
    # Short windows and lags, so that a budget of a few items sees every rule at work.
    short = {"lag": 3, "recent": 2, "history": 4, "window": 4, "sinks": 1, "horizon": 4}
    return policies.make(name, **{**{key: value for key, value in short.items() if key in accepted}, **settings})


def run(name: str, evict_every: int, chunk: int, settings: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per step, per row: the score of each position the row holds (NaN where it holds
    none), and the held positions as a mask; ``[STEPS / chunk, B, K, STEPS]`` each."""
    policy = build(name, **(settings or {}))
    config = flsmem.MemoryConfig(policy=policy, budget=BUDGET, evict_every=evict_every, max_chunk=chunk)
    state = testing.tiny_memory(config, batch=BATCH, kv_heads=HEADS)
    key = jax.random.key(7)
    table = testing.attention_table(key, BATCH, HEADS, STEPS)
    future = discounted_future(table, 0.9) if policy.needs_future else None
    keys = jax.random.normal(jax.random.fold_in(key, 1), (BATCH, HEADS, STEPS, testing.HEAD_DIM))
    correctness = jax.random.uniform(jax.random.fold_in(key, 2), (BATCH, STEPS))

    @jax.jit(compiler_options=DEFAULT_COMPILE)
    def step(state, t0):
        item = jax.lax.dynamic_slice_in_dim(keys, t0, chunk, axis=2)
        positions = t0 + jnp.broadcast_to(jnp.arange(chunk, dtype=jnp.int32), (BATCH, chunk))
        state = flsmem.write(state, {"k": item, "v": item}, positions)
        attention = testing.gather_attention(table, state, chunk)
        fut = None if future is None else testing.gather_attention(future, state, chunk)
        w = jax.lax.dynamic_slice_in_dim(correctness, t0, chunk, axis=1)
        return flsmem.update(state, attention, w, fut)

    scores, held = [], []
    for t0 in range(0, STEPS, chunk):
        state = step(state, jnp.int32(t0))
        position = np.asarray(state.position)
        valid = np.asarray(state.valid)
        score = np.full((BATCH, HEADS, STEPS), np.nan, np.float32)
        b, k, s = np.nonzero(valid)
        score[b, k, position[b, k, s]] = np.asarray(state.score)[b, k, s]
        scores.append(score)
        held.append(~np.isnan(score))
    return np.stack(scores), np.stack(held)


@pytest.fixture(scope="module")
def record():
    if not RECORD.exists():
        pytest.fail(f"{RECORD.name} is missing: run python tests/{pathlib.Path(__file__).name} --record")
    return np.load(RECORD)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_same_kept_sets_and_scores_as_recorded(case, record):
    label, *how = case
    scores, held = run(*how)
    np.testing.assert_array_equal(held, record[f"{label}/held"], err_msg=f"{label}: kept sets changed")
    np.testing.assert_allclose(scores, record[f"{label}/scores"], rtol=1e-5, atol=1e-6, equal_nan=True,
                               err_msg=f"{label}: committed scores changed")


def main(argv: list[str]) -> int:
    labels = [case[0] for case in CASES]
    if argv[:1] != ["--record"] or any(label not in labels for label in argv[1:]):
        print(f"usage: python tests/{pathlib.Path(__file__).name} --record [LABEL ...]  (labels: "
              f"{', '.join(labels)})", file=sys.stderr)
        return 2
    chosen = argv[1:] or labels
    arrays = dict(np.load(RECORD)) if argv[1:] and RECORD.exists() else {}
    for label, *how in CASES:
        if label in chosen:
            arrays[f"{label}/scores"], arrays[f"{label}/held"] = run(*how)
            print(f"recorded {label}")
    RECORD.parent.mkdir(exist_ok=True)
    np.savez_compressed(RECORD, **arrays)
    print(f"wrote {RECORD} ({RECORD.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
