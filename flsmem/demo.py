"""A model-free demo: stream synthetic attention through every policy and compare.

The stream is a causal attention table ``A[t, p]`` (what query t gives position p
with the full cache) with three kinds of structure: persistent heavy hitters, bursts of
re-use after a gap (an item quiet for a while is queried again), and noise. Each policy
runs a bounded memory over the stream; at query t it sees ``A[t]`` renormalised over the
items it holds (what attention would give with that cache). Its quality is the
*attention recall*: the share of the full cache's attention mass that falls on items
the memory still holds, averaged over queries. The oracle scores each item by the
attention it will get from later queries.
"""

from __future__ import annotations

import functools
import json
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import flsmem
from flsmem import policies as P
from flsmem import testing
from flsmem.oracle_future import discounted_future

__all__ = ["synthetic_stream", "attention_recall", "default_policies", "run_demo"]


def synthetic_stream(key: jax.Array, streams: int, steps: int) -> tuple[jax.Array, jax.Array]:
    """A causal attention table ``[B, 1, T, T]`` and correctness weights ``[B, T]``.

    Queries that re-use an item after a gap are right more often than the others, so
    correctness carries information about which attention mattered.
    """
    k_noise, k_heavy, k_burst, k_start, k_right = jax.random.split(key, 5)
    t = jnp.arange(steps)
    logits = 1.5 * jax.random.normal(k_noise, (streams, steps, steps))
    heavy = 2.5 * jax.random.bernoulli(k_heavy, 0.05, (streams, 1, steps))
    # A burst: item p is attended strongly during 8 queries starting 64-192 steps later.
    bursty = jax.random.bernoulli(k_burst, 0.1, (streams, 1, steps))
    start = t[None, None, :] + jax.random.randint(k_start, (streams, 1, steps), 64, 192)
    in_burst = (t[None, :, None] >= start) & (t[None, :, None] < start + 8) & bursty
    logits = logits + heavy + 5.0 * in_burst
    causal = t[:, None] >= t[None, :]
    table = jax.nn.softmax(jnp.where(causal[None], logits, -jnp.inf), axis=-1)
    reuse = jnp.any(in_burst, axis=-1)  # [B, T]: query t re-uses something
    right = jax.random.uniform(k_right, (streams, steps)) < jnp.where(reuse, 0.95, 0.6)
    return table[:, None], right.astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("config",))
def attention_recall(config: flsmem.MemoryConfig, table: jax.Array, correctness: jax.Array) -> jax.Array:
    """Mean share of each query's full-cache attention that falls on held items, ``[B]``."""
    b, _, steps, _ = table.shape
    future = discounted_future(table)
    state = flsmem.init(config, b, 1, {"position": ()})

    def body(state, t):
        position = jnp.full((b,), t)
        state = flsmem.write(state, {"position": position[:, None].astype(jnp.float32)}, position)
        held = testing.gather_attention(table, state)[:, :, 0]  # A[t] on held items
        recall = jnp.sum(held, axis=(1, 2))
        attention = held / jnp.maximum(jnp.sum(held, axis=-1, keepdims=True), 1e-30)
        fut = testing.gather_attention(future, state)[:, :, 0]
        state = flsmem.update(state, attention, correctness[:, t], future=fut)
        return state, recall

    _, recall = jax.lax.scan(body, state, jnp.arange(steps))
    return jnp.mean(recall, axis=0)


def default_policies(lag: int = 16) -> list[P.Policy]:
    """Every policy of :data:`flsmem.policies.REGISTRY` but ``full`` (the reference) and
    ``key_norm`` (the demo's items have no keys), with the protection their papers use
    scaled to the demo."""
    settings = {
        "streaming_llm": {"sinks": 4},
        "window": {},
        "h2o": {"recent": lag},
        "tova": {},
        "scissorhands": {"history": 32, "recent": lag},
        "snapkv": {"window": lag},
        "ema": {"decay": 0.9, "recent": lag},
        "rmm": {"lag": lag},
        "kalman": {"q": 0.01, "r": 1.0, "adaptive": True, "lag": lag},
        "lag_window": {"lag": lag},
        "use_recency": {"lag": lag},
        "random": {"seed": 0},
        "oracle": {},
    }
    return [P.make(name, **keywords) for name, keywords in settings.items()]


def run_demo(
    budgets: Sequence[int] = (32, 64, 128),
    steps: int = 512,
    streams: int = 8,
    seed: int = 0,
    plot: str | None = "flsmem-demo.png",
    json_path: str | None = None,
) -> list[dict]:
    """Run every policy at every budget on one synthetic stream; print a table."""
    table, correctness = synthetic_stream(jax.random.key(seed), streams, steps)
    policies = default_policies()
    rows = []
    begin = time.perf_counter()
    for budget in budgets:
        for policy in policies:
            config = flsmem.MemoryConfig(policy=policy, budget=budget)
            recall = np.asarray(attention_recall(config, table, correctness))
            rows.append({"policy": policy.name, "budget": budget,
                         "recall": float(recall.mean()), "recall_sd": float(recall.std())})
    for budget in budgets:
        at = {r["policy"]: r["recall"] for r in rows if r["budget"] == budget}
        floor, ceiling = at["streaming_llm"], at["oracle"]
        for r in rows:
            if r["budget"] == budget:
                r["gap_closed"] = (r["recall"] - floor) / (ceiling - floor) if ceiling > floor else float("nan")
    print(f"attention recall (share of full-cache attention on held items) and gap closed "
          f"(policy - streaming_llm) / (oracle - streaming_llm), {streams} synthetic streams "
          f"of {steps} steps, {time.perf_counter() - begin:.0f} s")
    print(f"{'policy':<14}" + "".join(f" {'recall@' + str(b):>11} {'gap@' + str(b):>8}" for b in budgets))
    for name in [p.name for p in policies]:
        cells = []
        for budget in budgets:
            r = next(r for r in rows if r["policy"] == name and r["budget"] == budget)
            cells.append(f" {r['recall']:>11.3f} {r['gap_closed']:>+8.2f}")
        print(f"{name:<14}" + "".join(cells))
    if plot:
        _plot(rows, budgets, [p.name for p in policies], plot, steps)
        print(f"plot written to {plot}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"steps": steps, "streams": streams, "seed": seed, "rows": rows}, f, indent=1)
    return rows


def _plot(rows, budgets, names, path, steps):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours = plt.get_cmap("tab20")
    for i, name in enumerate(names):
        ys = [next(r["recall"] for r in rows if r["policy"] == name and r["budget"] == b) for b in budgets]
        if name == "oracle":
            ax.plot(budgets, ys, "k--", label=name)
        else:
            ax.plot(budgets, ys, "-o", color=colours(i), label=name, markersize=3)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(budgets), [str(b) for b in budgets])
    ax.set_xlabel(f"budget (items kept, of {steps})")
    ax.set_ylabel("attention recall")
    ax.set_title("flsmem demo: synthetic attention stream")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
