# %% [markdown]
# # flsmem quickstart: a bounded memory inside a jitted loop
#
# A decoder with a bounded memory (a KV cache of at most `budget` slots per layer and KV
# head) must keep deciding which items to keep. flsmem treats that as an estimation
# problem: a policy gathers **evidence** about each item (how much attention it got, from
# queries whose predictions were right or wrong), commits a **score** once the item has
# waited out the policy's **commit lag H**, and the memory evicts the lowest scores.
#
# This notebook runs the memory API on a synthetic stream, without a model:
#
# 1. the memory is an immutable pytree built by `flsmem.init` from a static `MemoryConfig`;
# 2. a decode step is `write` (the new item), `observe` (this step's attention and the
#    correctness of its prediction), `smooth` (commit scores) and `evict` (when due);
# 3. the whole stream runs as one `jax.lax.scan` under `jax.jit`, with no retracing;
# 4. policies differ in which items they keep; `flsmem.summary` reports what they did;
# 5. `flsmem.update` folds a chunk of queries at once and keeps exactly what per-token
#    steps keep.

# %%
import time

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from flsmem import policies

# Sizes of the synthetic stream: batch rows, KV heads, head dimension, steps, budget.
SIZES = {
    "small": dict(batch=4, kv_heads=2, head_dim=32, steps=512, budget=64),
    "large": dict(batch=32, kv_heads=8, head_dim=64, steps=4096, budget=256),
}[SIZE]
B, K, D, STEPS, BUDGET = (SIZES[name] for name in ("batch", "kv_heads", "head_dim", "steps", "budget"))
print(SIZES)

# %% [markdown]
# ## The memory is a pytree
#
# `MemoryConfig` holds the static settings: the policy, the budget, and the schedule. A
# row is evicted back to `budget` items once it holds `budget + evict_every`, so the cost
# of ranking is paid once every `evict_every` steps. The state holds fixed-shape arrays
# with leading axes `[B, K, S]` (batch, KV heads, slots); `S` is the capacity, the budget
# plus the headroom.

# %%
config = flsmem.MemoryConfig(policy=policies.rmm(lag=16), budget=BUDGET, evict_every=8)
memory = flsmem.init(config, B, K, {"k": (D,), "v": (D,)})
print(f"capacity S = {config.capacity} slots per row (budget {config.budget} + evict_every {config.evict_every})")
for name, leaf in jax.tree_util.tree_leaves_with_path(memory):
    print(f"{jax.tree_util.keystr(name):32s} {str(leaf.dtype):8s} {list(leaf.shape)}")

# %% [markdown]
# ## A stream with items worth keeping
#
# Every step brings a new item (its key and value) and a query. To make the choice of
# policy matter, the first `HOT` items of each row are *hot*: half of the queries look
# one of them up (the query is that item's key plus noise); the other half look at a
# random recent item. A policy that keeps the hot items serves those lookups; one that
# keeps only recent items loses them. The correctness of a step's prediction is 1 when
# the item its query looked for was still held, the signal a model would give when it
# predicts right.

# %%
HOT = 8
key = jax.random.key(0)
keys = jax.random.normal(jax.random.fold_in(key, 1), (STEPS, B, K, D))
values = jax.random.normal(jax.random.fold_in(key, 2), (STEPS, B, K, D))
is_hot = jax.random.bernoulli(jax.random.fold_in(key, 3), 0.5, (STEPS, B))
hot_target = jax.random.randint(jax.random.fold_in(key, 4), (STEPS, B), 0, HOT)
recent_target = jnp.arange(STEPS)[:, None] - jax.random.randint(jax.random.fold_in(key, 5), (STEPS, B), 0, 16)
target = jnp.where(is_hot, hot_target, jnp.maximum(recent_target, 0))  # [T, B] position looked up
noise = 0.3 * jax.random.normal(jax.random.fold_in(key, 6), (STEPS, B, K, D))
queries = 3.0 * keys[target, jnp.arange(B)[None, :]] + noise  # [T, B, K, D]

# %% [markdown]
# ## One decode step, and the whole stream in one `lax.scan`
#
# The step is the README's usage example: `write` the item at its position, attend over
# the slots that are `visible`, then `observe`, `smooth` and `evict`. `evict` does
# nothing until a row reaches its high-water mark. The step number lives in the state
# as an array, so one compiled program serves every step and every stream.

# %%
TRACES = {"count": 0}


def decode_step(memory, xs):
    t, k, v, q, look_for = xs
    TRACES["count"] += 1  # runs only while jax traces the function
    memory = flsmem.write(memory, {"k": k, "v": v}, position=jnp.full((B,), t))
    logits = jnp.einsum("BKD,BKSD->BKS", q, memory.payload["k"]) / jnp.sqrt(D)
    attention = jax.nn.softmax(jnp.where(flsmem.visible(memory), logits, -jnp.inf))
    held = jnp.any(memory.valid & (memory.position == look_for[:, None, None]), axis=(1, 2))
    correctness = held.astype(jnp.float32)  # [B]: was the item the query needed there?
    memory = flsmem.observe(memory, attention, correctness)
    memory = flsmem.smooth(memory)
    memory = flsmem.evict(memory)
    return memory, (correctness, flsmem.occupancy(memory))


@jax.jit
def run_stream(memory):
    xs = (jnp.arange(STEPS), keys, values, queries, target)
    return jax.lax.scan(decode_step, memory, xs)


begin = time.perf_counter()
final, (served, occupancy) = jax.block_until_ready(run_stream(memory))
first = time.perf_counter() - begin
begin = time.perf_counter()
final, (served, occupancy) = jax.block_until_ready(run_stream(memory))
second = time.perf_counter() - begin
print(f"{STEPS} steps: first call {first:.2f} s (tracing, compiling and running), second {second * 1e3:.1f} ms; "
      f"decode_step traced {TRACES['count']} time(s)")
assert TRACES["count"] == 1
print(f"items held per row: at most {int(occupancy.max())}, at the end {np.asarray(flsmem.occupancy(final)).ravel()[:4]} ... "
      f"(budget {BUDGET}, high-water mark {config.high_water})")
assert int(occupancy.max()) <= config.high_water

# %% [markdown]
# ## Policies side by side
#
# Every policy is a factory in `flsmem.policies`; swapping it changes only the static
# config, so each gets its own compiled program. `window` keeps the newest items;
# `streaming_llm` adds a few attention sinks (the first items); `h2o` accumulates
# attention since arrival; `tova` keeps what the current query attends; `rmm` (demonstrated
# utility) accumulates attention weighted by correctness, after protecting each new item
# for its commit lag. The table counts, at the end of the stream, how many of the hot
# items each memory still holds, and how often the lookups found their item.

# %%
CANDIDATES = {
    "window": policies.window(),
    "streaming_llm": policies.streaming_llm(sinks=4),
    "h2o": policies.h2o(recent=16),
    "tova": policies.tova(),
    "rmm": policies.rmm(lag=16),
}
results = {}
for name, policy in CANDIDATES.items():
    memory = flsmem.init(config.replace(policy=policy), B, K, {"k": (D,), "v": (D,)})
    end, (served, _) = run_stream(memory)
    hot_held = jnp.mean(jnp.sum(end.valid & (end.position < HOT) & (end.position >= 0), axis=-1))
    stats = flsmem.summary(end)
    results[name] = dict(
        hot_held=float(hot_held),
        served=float(jnp.mean(served[STEPS // 2:])),
        evictions=int(jnp.sum(stats["evictions"])),
        mean_evicted_age=float(jnp.nanmean(stats["mean_evicted_age"])),
        positions=np.asarray(jnp.where(end.valid, end.position, -1)[0, 0]),
    )
print(f"{'policy':14s} {'hot items held':>15s} {'lookups served':>15s} {'evictions':>10s} {'mean evicted age':>17s}")
for name, r in results.items():
    print(f"{name:14s} {r['hot_held']:>9.2f} of {HOT} {r['served']:>15.3f} {r['evictions']:>10d} {r['mean_evicted_age']:>17.1f}")
print("(lookups served: fraction of the second half's queries whose item was still held)")

# %% [markdown]
# Which positions does each memory hold at the end? (Row 0, KV head 0.) The newest
# items are at the right edge; the hot items are positions 0 to 7, at the left edge:
# which memories still hold them?

# %%
fig, ax = plt.subplots(figsize=(9, 2.8))
for i, (name, r) in enumerate(results.items()):
    held = np.sort(r["positions"][r["positions"] >= 0])
    ax.plot(held, np.full(held.shape, i), "|", markersize=12)
ax.set_yticks(range(len(results)), list(results))
ax.set_xlabel("position of the item held")
ax.set_xlim(-5, STEPS + 5)
ax.set_title(f"what each memory holds after {STEPS} steps (budget {BUDGET}; hot items are positions 0 to {HOT - 1})")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Chunks: `flsmem.update`
#
# During prefill or teacher forcing a model writes Q items at once and computes the Q
# queries' attention in one pass. `flsmem.update(memory, attention, correctness)` with
# `attention` of shape `[B, K, Q, S]` then observes, smooths and evicts query by query,
# so the result is exactly what Q single-token steps give. Below, the same stream is fed
# in chunks of 8 (after `write` of 8 items, the mask `flsmem.visible(memory, queries=8)`
# lets query q see the items that arrived up to its own step) and compared with the
# per-token run.

# %%
CHUNK = 8
chunk_config = config.replace(max_chunk=CHUNK)


def chunk_step(memory, xs):
    t0, k, v, q, correct = xs  # k, v, q: [CHUNK, B, K, D]; correct: [CHUNK, B]
    positions = jnp.broadcast_to(t0 + jnp.arange(CHUNK)[None, :], (B, CHUNK))
    memory = flsmem.write(memory, {"k": jnp.moveaxis(k, 0, 2), "v": jnp.moveaxis(v, 0, 2)}, position=positions)
    logits = jnp.einsum("QBKD,BKSD->BKQS", q, memory.payload["k"]) / jnp.sqrt(D)
    attention = jax.nn.softmax(jnp.where(flsmem.visible(memory, queries=CHUNK), logits, -jnp.inf))
    # The correctness of each query as the per-token run saw it (whether its item was held).
    return flsmem.update(memory, attention, correct.T), None


@jax.jit
def run_chunked(memory, correctness):
    split = lambda x: x.reshape((STEPS // CHUNK, CHUNK) + x.shape[1:])  # noqa: E731
    xs = (jnp.arange(0, STEPS, CHUNK), split(keys), split(values), split(queries), split(correctness))
    return jax.lax.scan(chunk_step, memory, xs)[0]


def per_token_with(memory_config):
    memory = flsmem.init(memory_config, B, K, {"k": (D,), "v": (D,)})
    end, (served, _) = jax.jit(lambda m: jax.lax.scan(decode_step, m, (
        jnp.arange(STEPS), keys, values, queries, target)))(memory)
    return end, served


per_token, served = per_token_with(chunk_config)
chunked = run_chunked(flsmem.init(chunk_config, B, K, {"k": (D,), "v": (D,)}), served)
kept = lambda m: np.sort(np.where(np.asarray(m.valid), np.asarray(m.position), -1), axis=-1)  # noqa: E731
same = np.array_equal(kept(per_token), kept(chunked))
print(f"chunks of {CHUNK} keep the same items as per-token steps in every row: {same}")
assert same
