# %% [markdown]
# # The regime map: when does measuring beat accumulating?
#
# Eviction policies that score an item by attention differ in how they weigh the past:
#
# * **accumulating** (H2O): sum every query's attention since the item arrived. Old
#   evidence counts as much as new;
# * **measuring** (TOVA, a fast `ema`): trust the latest attention. Only new evidence counts.
#
# Which is right depends on the stream. This notebook works through the answer in three
# steps: the theory of the scalar Kalman filter (`flsmem.theory`), the library's filters
# on simulated drifting utilities against that theory (`harness/drift.py`), and the regime
# map on controlled recall tasks with a real decoder (`harness/regime.py`). The measured
# results of the full runs, with the commands that made them, are in `results/REGIME.md`.

# %%
import dataclasses
import time

import matplotlib.pyplot as plt
import numpy as np

from flsmem import theory
from flsmem.harness import drift, regime

print(f"SIZE = {SIZE!r}: drift plan {'QUICK' if SIZE == 'small' else 'FULL'}")

# %% [markdown]
# ## 1. Theory: the local-level model
#
# Model one item's utility as a level that drifts, `x_t = x_{t-1} + w_t` (variance q: how
# fast the item's usefulness changes), seen through noisy measurements `z_t = x_t + v_t`
# (variance r: how noisy one query's attention is). The Kalman filter for this model
# settles to a constant gain that depends only on `q / r`, and its estimate is then an
# exponential moving average with decay `1 - gain`:
#
# * `q / r -> 0` (utility barely moves): gain -> 0, decay -> 1, **accumulate**;
# * `q / r -> inf` (utility moves more than the noise): gain -> 1, decay -> 0, **measure**.

# %%
q_over_r = np.array([1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0])
print(f"{'q/r':>8} {'gain':>8} {'decay':>8}   (steady state, from flsmem.theory)")
for x, gain, decay in zip(q_over_r, np.asarray(theory.steady_state_gain(q_over_r)),
                          np.asarray(theory.steady_state_decay(q_over_r))):
    print(f"{x:>8.0e} {gain:>8.3f} {decay:>8.3f}")

# %% [markdown]
# Every fixed decay is optimal at exactly one `q / r` and worse elsewhere.
# `theory.ema_error_variance(decay, q_over_r)` is its steady-state tracking error, and
# `theory.crossover(a, b)` the `q / r` where two decays do equally well: below it the more
# accumulating decay wins, above it the more measuring one.

# %%
fine = np.geomspace(1e-4, 10, 200)
fig, ax = plt.subplots(figsize=(7, 4))
for decay in (0.5, 0.9, 0.99):
    ax.plot(fine, np.asarray(theory.ema_error_variance(decay, fine)) + fine, label=f"ema decay {decay}")
optimal = np.asarray(theory.steady_state_decay(fine))
ax.plot(fine, np.asarray(theory.ema_error_variance(optimal, fine)) + fine, "k--", label="optimal decay (Kalman)")
cross = float(theory.crossover(0.99, 0.5))
ax.axvline(cross, color="grey", linewidth=0.8)
ax.set(xscale="log", yscale="log", xlabel="q / r", ylabel="error of predicting the next level / r",
       title=f"accumulating (0.99) and measuring (0.5) cross at q/r = {cross:.5f}")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 2. The library's filters on drifting utilities
#
# `flsmem.harness.drift.run` streams such utilities through flsmem's own `write`, `observe` and
# `smooth`, one query per step, under `ema` at a grid of decays and under the adaptive
# `kalman` policy, which starts from default noise settings and estimates `q / r` from its
# own innovations. It then checks the measured errors against `theory`. Small runs the
# harness's quick plan (fewer slots and steps); large runs the full one of
# `results/REGIME.md`.

# %%
begin = time.perf_counter()
result = drift.run(quick=SIZE == "small")
print(drift.format_table(result))

# %% [markdown]
# Measured errors (points) on the theory's curves (lines), and the adaptive filter (+),
# which finds the right side of the map by itself:

# %%
rows = result["rows"]
x = np.array([row["q_over_r"] for row in rows])
fine = np.geomspace(x[0], x[-1], 200)
fig, ax = plt.subplots(figsize=(7, 4.5))
colours = plt.cm.viridis(np.linspace(0, 1, len(result["decays"])))
for colour, decay in zip(colours, result["decays"]):
    ax.plot(fine, np.asarray(theory.ema_error_variance(decay, fine)) + fine, color=colour, linewidth=0.8)
    ax.plot(x, [row["ema"][str(decay)]["level"] for row in rows], "o", color=colour, markersize=4, label=f"ema {decay}")
beta = result["plan"]["betas"][0]
ax.plot(x, [row["adaptive"][str(beta)]["level"] for row in rows], "k+", markersize=10, label="adaptive kalman")
ax.set(xscale="log", yscale="log", xlabel="q / r", ylabel="error of the next level / r")
ax.legend(fontsize=7, ncol=2)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 3. The regime map on controlled recall tasks
#
# Real streams are not local levels. The regime map measures the policies with a decoder
# on tasks whose answers need an item from long before (`models/tasks.py`, embedded in
# held-out Austen prose): `=K7` binds key `K` to digit `7` and a later `=K` must be
# answered `7`.
#
# * **recall**: six pairs near the start, three queried a third of the way in, and the same
#   three queried again at the end. An item that was used is used again;
# * **repeat** (endogenous reuse): one pair queried a third of the way in; at the end `=@`
#   asks for the model's previous answer, whatever it was;
# * **chain** (endogenous reuse through a lookup): pointers `=KQ` and pairs `=Q7`; a third
#   of the way in the model follows a pointer and looks up its own answer (`=KQ =Q7`), and
#   at the end it follows the same chain again. Which pair must survive is decided by the
#   model's own earlier answer.
#
# The model is `checkpoints/tiny-tasks`, the tiny decoder fine-tuned on the tasks (it
# answers every example right with the full cache). The score is the accuracy of the
# answers after the gap. `rmm` (demonstrated utility) weighs each query's attention by
# whether its prediction was right; `h2o` weighs every query 1; both keep a recent window
# of half the budget, so correctness weighting is their only difference.

# %%
if SIZE == "small":
    plan = regime.Plan(
        tasks=("recall", "repeat", "chain"), seeds=(0,), examples=16, task_context=256, text_context=256,
        fractions=(1 / 2,), text_windows=4, text_models=(), policies=("oracle", "rmm", "h2o", "tova"),
        lag_settings=(), lag_fractions=(), signal_settings=(), signal_fractions=(),
    )
else:
    # The full map of results/REGIME.md, without SmolLM2 (it needs the `real` extra).
    plan = dataclasses.replace(regime.FULL, text_models=("tiny",))
begin = time.perf_counter()
map_rows = regime.run(plan)
print(f"({time.perf_counter() - begin:.0f} s)\n")
print(regime.format_tables(map_rows))

# %% [markdown]
# The same map as bars (accuracy after the gap, per task and policy, at each budget):

# %%
cells = [r for r in map_rows if r["experiment"] == "map" and r["metric"] == "accuracy" and r["policy"] != "full"]
settings = list(dict.fromkeys(r["setting"] for r in cells))
fractions = sorted({r["fraction"] for r in cells})
names = list(dict.fromkeys(r["policy"] for r in cells))
fig, axes = plt.subplots(1, len(settings), figsize=(4.5 * len(settings), 3.5), squeeze=False)
for ax, setting in zip(axes[0], settings):
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        values = [next((r["value"] for r in cells if r["setting"] == setting and r["policy"] == name
                        and r["fraction"] == f), np.nan) for f in fractions]
        ax.bar(np.arange(len(fractions)) + k * width, values, width, label=name,
               color="k" if name == "oracle" else plt.cm.tab10(k))
    ax.set_xticks(np.arange(len(fractions)) + 0.4 - width / 2, [f"budget {f:g} of the context" for f in fractions])
    ax.set(ylim=(0, 1.05), ylabel="answer accuracy after the gap", title=setting)
axes[0][-1].legend(fontsize=8)
fig.tight_layout()
plt.show()
for (setting, fraction), (name, margin) in regime.winners(map_rows).items():
    print(f"{setting:10s} at {fraction:g} of the context: best non-oracle policy {name}, by {margin:+.3f}")

# %% [markdown]
# What to look for, and what the full run (`results/REGIME.md`, three seeds of 32
# examples) found:
#
# * on **recall**, where an item that was read by a correct prediction is read again,
#   demonstrated utility keeps the used pairs and `rmm` beats `h2o` by a wide margin at
#   half the context;
# * on **repeat**, `h2o` wins: the item the repeat needs is the earlier *answer*, which is
#   attended mostly by the prose right after it, which the model often mispredicts, so
#   the hard correctness weight gives it almost no evidence;
# * on **chain**, the other endogenous task, the reuse reads the pair that the model's
#   correct earlier lookup read, and `rmm` beats `h2o` at a quarter and half of the
#   context;
# * the **lag sweep** (run at the large size) prices the commit lag: the H newest items
#   are protected, and their slots come out of the budget. On the tasks a lag costs slots
#   that should hold pairs; on prose a lag of 16 to 64 pays for itself.
#
# The small run here has one seed of 16 examples at one budget, so its margins are
# rougher than the full run's; `flsmem regime --quick` (under a minute) and `flsmem regime` (about 20 minutes)
# run the harness's own plans from the command line.
