"""Drifting utilities: where measuring beats accumulating, theory against the library.

Each slot's utility follows the local-level model of :mod:`flsmem.theory`: a level
that drifts, ``x_t = x_{t-1} + w_t`` (variance q), seen through noisy measurements
``z_t = x_t + v_t`` (variance r = 1). The ratio q/r sweeps from 1e-4 (the level barely
moves: accumulate, average everything) to 10 (it moves more than the noise: measure,
trust the latest value). The measurements go through flsmem's own machinery, one query
per step (``write``, then ``observe`` and ``smooth``), for:

* ``ema(decay)`` at a grid of decays: the theory-optimal decay of every q/r on the grid
  (so the best fixed choice is as good as a fixed decay can be), plus 0.5 and 0.99;
* ``kalman(adaptive=True)``, started from the defaults q = 0.01, r = 1, which has to
  find q/r by itself, at the default ``beta`` 0.01 and at 0.05. Its estimate averages
  over about 1 / beta queries; at q/r = 1e-4 the filter itself remembers about
  1 / sqrt(q/r) = 100, and an estimate averaged over fewer is too noisy there.

The error measured is that of predicting the next level ``x_{t+1}`` from the score at
step t (``ema`` keeps a decayed sum: ``(1 - decay)`` times it is the average), in units
of r, after a burn-in; the error of predicting the next measurement ``z_{t+1}`` is
this plus 1 and is reported too. Three claims are checked:

1. each decay's measured error is ``theory.ema_error_variance(decay, q/r) + q/r``;
2. the measured curves of the accumulating 0.99 and the measuring 0.5 cross where
   ``theory.crossover`` says (their difference is affine in q/r, so linear
   interpolation between the two grid points around the sign change is exact);
3. the adaptive filter comes within 2% of the best fixed decay at every q/r.

Every policy sees the same streams (the same random key), so ratios are paired.
Standard errors (jackknife, so that ratios and the crossover get one too) are over
batch means: independent replicate rows (KV heads, each pooling ``slots`` slots, as
one row of a cache would) times blocks of queries.

    python -m flsmem.harness.drift [--quick] [--json PATH] [--plot PATH]
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import flsmem
from flsmem import policies as P
from flsmem import theory
from flsmem.harness.arguments import make_parser

__all__ = ["Plan", "FULL", "QUICK", "Q_OVER_R", "CROSSOVER", "BETAS", "decay_grid", "run", "format_table", "plot", "main"]

# Half decades from accumulating (1e-4) to measuring (10).
Q_OVER_R = tuple(10.0 ** (k / 2) for k in range(-8, 3))
# The accumulating and the measuring decay whose crossover is checked: they cross at
# q/r = 0.0067, between the grid points 10^-2.5 and 10^-2.
CROSSOVER = (0.99, 0.5)
# beta of the adaptive filter: the policy's default 0.01, and 0.05 (too short a memory
# at the accumulating end).
BETAS = (0.01, 0.05)


@dataclasses.dataclass(frozen=True)
class Plan:
    """How much is simulated.

    Attributes:
      q_over_r: the noise ratios, one row of the memory's batch each.
      betas: rates of the adaptive filter's estimate.
      slots: slots per row, pooled by the adaptive filter's estimate.
      replicates: independent rows per q/r.
      steps: queries per stream.
      burn_in: queries before errors are counted: the filters settle within a few
        hundred, the adaptive estimate needs a few times 1 / beta.
      blocks: the counted queries are cut into this many blocks; standard errors are
        over the replicates x blocks batch means (blocks are longer than the errors'
        correlation time, at most about 100 queries here).
      seed: the streams' random key.
    """

    q_over_r: tuple[float, ...]
    betas: tuple[float, ...]
    slots: int
    replicates: int
    steps: int
    burn_in: int
    blocks: int = 8
    seed: int = 0

    def __post_init__(self):
        if not (self.q_over_r and all(x > 0 for x in self.q_over_r) and list(self.q_over_r) == sorted(self.q_over_r)):
            raise ValueError(f"q_over_r must be positive and increasing, got {self.q_over_r!r}")
        if not all(0 < b <= 1 for b in self.betas):
            raise ValueError(f"betas must lie in (0, 1], got {self.betas!r}")
        for name in ("slots", "replicates", "steps", "burn_in", "blocks"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if (self.steps - self.burn_in - 1) % self.blocks:
            raise ValueError(f"steps - burn_in - 1 must be a multiple of blocks, got steps={self.steps}, "
                             f"burn_in={self.burn_in}, blocks={self.blocks}")

    @property
    def counted(self) -> int:
        """Queries whose prediction error is counted."""
        return self.steps - self.burn_in - 1


FULL = Plan(Q_OVER_R, BETAS, slots=512, replicates=8, steps=6001, burn_in=1000)
# Whole decades and the two points around the crossover; fewer compiles and queries.
QUICK = Plan((1e-4, 1e-3, 10 ** -2.5, 1e-2, 1e-1, 1.0, 10.0), BETAS[:1], slots=256, replicates=3,
             steps=2001, burn_in=800)


def decay_grid(q_over_r=Q_OVER_R) -> tuple[float, ...]:
    """The theory-optimal decay of every q/r (3 decimals) and the crossover pair."""
    optimal = np.asarray(theory.steady_state_decay(np.asarray(q_over_r)))
    return tuple(sorted({round(float(d), 3) for d in optimal} | set(CROSSOVER)))


@functools.partial(jax.jit, static_argnames=("policy", "plan"))
def _errors(policy: P.Policy, q_over_r: jax.Array, plan: Plan):
    """Squared one-step-ahead errors of ``policy`` on the drifting streams.

    Returns ``[Q, R * blocks, 2]`` mean squared errors (of the next level, of the next
    measurement) per q/r and (replicate row, block of queries), and the adaptive
    filter's mean log(q/r) estimate ``[Q, R]`` over the counted queries (zeros for
    other policies).
    """
    rows, reps, slots = q_over_r.shape[0], plan.replicates, plan.slots
    config = flsmem.MemoryConfig(policy=policy, budget=slots)
    state = flsmem.init(config, rows, reps, {"v": ()})
    # One item per write, all at step 0: every slot is present from the first query.
    empty = {"v": jnp.zeros((rows, reps))}
    state = jax.lax.fori_loop(0, slots, lambda i, s: flsmem.write(s, empty, jnp.full((rows,), i)), state)
    shape = (rows, reps, slots)
    free = jnp.zeros((rows, reps, config.capacity - slots))
    drift = jnp.sqrt(q_over_r)[:, None, None]
    scale = 1.0 - policy.params.decay if policy.name == "ema" else 1.0
    adaptive = isinstance(policy.params, P.KalmanParams) and policy.params.adaptive
    key = jax.random.key(plan.seed)

    def step(carry, t):
        state, level, prediction, squares, log_x = carry
        k_drift, k_noise = jax.random.split(jax.random.fold_in(key, t))
        # The level starts at 0, where the EMA's empty sum starts: no start-up bias.
        level = level + drift * jax.random.normal(k_drift, shape)
        z = level + jax.random.normal(k_noise, shape)
        counted = t > plan.burn_in  # the prediction was made at t - 1 >= burn_in
        error = jnp.stack([jnp.mean((level - prediction) ** 2, axis=-1),
                           jnp.mean((z - prediction) ** 2, axis=-1)], axis=-1)
        block = jnp.clip((t - plan.burn_in - 1) * plan.blocks // plan.counted, 0, plan.blocks - 1)
        squares = squares.at[block].add(jnp.where(counted, error, 0.0))
        state = flsmem.smooth(flsmem.observe(state, jnp.concatenate([z, free], axis=-1)))
        if adaptive:
            log_x = log_x + jnp.where(counted, state.aux[..., 0], 0.0)
        return (state, level, scale * state.score[..., :slots], squares, log_x), None

    zeros = jnp.zeros(shape)
    carry = (state, zeros, zeros, jnp.zeros((plan.blocks, rows, reps, 2)), jnp.zeros((rows, reps)))
    (_, _, _, squares, log_x), _ = jax.lax.scan(step, carry, jnp.arange(plan.steps))
    per_block = jnp.moveaxis(squares, 0, 2).reshape(rows, reps * plan.blocks, 2)
    return per_block / (plan.counted // plan.blocks), log_x / plan.counted


def _jackknife(statistic, *samples: np.ndarray) -> tuple[float, float]:
    """``statistic`` of the samples' means (samples on the last axis) and its jackknife
    standard error: the plain standard error for a mean, and it carries over to ratios
    and crossovers without a formula for each."""
    n = samples[0].shape[-1]
    value = statistic(*(s.mean(axis=-1) for s in samples))
    left_out = np.array([statistic(*((s.sum(axis=-1) - s[..., j]) / (n - 1) for s in samples))
                         for j in range(n)])
    se = np.sqrt((n - 1) / n * np.sum((left_out - left_out.mean()) ** 2))
    return float(value), float(se)


def _crossover(diff: np.ndarray, x: np.ndarray) -> float:
    """Where the affine ``diff(x)`` (decay a minus decay b) first turns positive, by
    linear interpolation in x between the grid points around it; nan if it never does."""
    for i in range(len(x) - 1):
        if diff[i] <= 0.0 < diff[i + 1]:
            return float(x[i] + (x[i + 1] - x[i]) * -diff[i] / (diff[i + 1] - diff[i]))
    return float("nan")


def run(quick: bool = False, progress=None) -> dict:
    """Run the experiment (``quick``: :data:`QUICK`, else :data:`FULL`); a JSON-able
    dict: per q/r row the error of every decay against theory and of the adaptive
    filter against the best decay, the crossover, and how well theory fits overall.
    Pairs are (value, standard error)."""
    if not isinstance(quick, bool):
        raise ValueError(f"quick must be a bool, got {quick!r}")
    plan = QUICK if quick else FULL
    say = progress or (lambda message: None)
    begin = time.perf_counter()
    x = np.asarray(plan.q_over_r)
    q_over_r = jnp.asarray(x, jnp.float32)
    decays = decay_grid(plan.q_over_r)

    ema = {}  # decay -> [Q, samples, 2]
    for decay in decays:
        ema[decay] = np.asarray(_errors(P.ema(decay), q_over_r, plan)[0], np.float64)
        say(f"ema({decay})")
    adaptive = {}  # beta -> ([Q, samples, 2], [Q, R])
    for beta in plan.betas:
        squares, log_x = _errors(P.kalman(adaptive=True, beta=beta), q_over_r, plan)
        adaptive[beta] = (np.asarray(squares, np.float64), np.asarray(log_x))
        say(f"kalman(adaptive=True, beta={beta})")

    def ratio(a, b):
        return a / b

    rows = []
    for i, qr in enumerate(plan.q_over_r):
        best = min(decays, key=lambda d: ema[d][i, :, 0].mean())
        optimal_decay = float(theory.steady_state_decay(qr))
        row = {
            "q_over_r": qr,
            "optimal_decay": optimal_decay,
            "optimal_level": float(theory.ema_error_variance(optimal_decay, qr) + qr),
            "ema": {},
            "best_decay": best,
            "best_level": _jackknife(np.asarray, ema[best][i, :, 0]),
            "adaptive": {},
        }
        for d in decays:
            level, se = _jackknife(np.asarray, ema[d][i, :, 0])
            row["ema"][str(d)] = {"level": level, "se": se, "theory": float(theory.ema_error_variance(d, qr) + qr)}
        for beta, (squares, log_x) in adaptive.items():
            level, se = _jackknife(np.asarray, squares[i, :, 0])
            row["adaptive"][str(beta)] = {
                "level": level,
                "se": se,
                # Paired: the same streams as the best decay.
                "ratio": _jackknife(ratio, squares[i, :, 0], ema[best][i, :, 0]),
                "ratio_next": _jackknife(ratio, squares[i, :, 1], ema[best][i, :, 1]),
                "q_over_r_estimate": float(np.exp(log_x[i].mean())),
            }
        rows.append(row)

    a, b = CROSSOVER
    crossover = {
        "decays": list(CROSSOVER),
        "theory": float(theory.crossover(a, b)),
        "measured": _jackknife(lambda d: _crossover(d, x), ema[a][:, :, 0] - ema[b][:, :, 0]),
    }
    deviations = [(d["level"] / d["theory"] - 1.0, (d["level"] - d["theory"]) / d["se"])
                  for row in rows for d in row["ema"].values()]
    theory_fit = {
        "max_relative_deviation": max(abs(r) for r, _ in deviations),
        "max_abs_z": max(abs(z) for _, z in deviations),
    }
    return {
        "plan": dataclasses.asdict(plan),
        "quick": quick,
        "decays": list(decays),
        "rows": rows,
        "crossover": crossover,
        "theory_fit": theory_fit,
        "seconds": time.perf_counter() - begin,
    }


def format_table(result: dict) -> str:
    """The printed report: errors per decay against theory, the adaptive filter against
    the best fixed decay, and the crossover."""
    decays = result["decays"]
    rows = result["rows"]
    plan = result["plan"]
    out = [
        f"Drifting utilities (local level), {plan['replicates']} rows x {plan['slots']} slots, "
        f"{plan['steps']} queries, errors after {plan['burn_in']} "
        f"(standard errors over {plan['replicates']} x {plan['blocks']} blocks); "
        f"{result['seconds']:.0f} s",
        "",
        "Error of predicting the next level, in units of r: measured / theory "
        "(theory = ema_error_variance + q/r)",
        "q/r      " + "".join(f"{d:>8.3f}" for d in decays),
    ]
    for row in rows:
        cells = "".join(f"{row['ema'][str(d)]['level'] / row['ema'][str(d)]['theory']:8.3f}" for d in decays)
        out.append(f"{row['q_over_r']:<9.1e}" + cells)
    fit = result["theory_fit"]
    out += [
        f"largest deviation from theory: {100 * fit['max_relative_deviation']:.1f}% "
        f"(largest |z| = {fit['max_abs_z']:.1f} standard errors)",
        "",
        "Best fixed decay on the grid against the adaptive filter (ratio = adaptive / best,",
        "paired per row, +- one standard error; 'next' = predicting the next measurement)",
    ]
    header = f"{'q/r':<9}{'opt.decay':>10}{'best':>7}{'best MSE':>10}"
    betas = result["plan"]["betas"]
    for beta in betas:
        header += f"{f'adapt({beta})':>13}{'ratio':>16}{'next':>8}{'q/r est':>10}"
    out.append(header)
    for row in rows:
        line = f"{row['q_over_r']:<9.1e}{row['optimal_decay']:>10.3f}{row['best_decay']:>7.3f}{row['best_level'][0]:>10.5f}"
        for beta in betas:
            a = row["adaptive"][str(beta)]
            ratio = f"{a['ratio'][0]:.4f}+-{a['ratio'][1]:.4f}"
            line += f"{a['level']:>13.5f}{ratio:>16}{a['ratio_next'][0]:>8.4f}{a['q_over_r_estimate']:>10.2e}"
        out.append(line)
    c = result["crossover"]
    out += [
        "",
        f"crossover of decays {c['decays'][0]} and {c['decays'][1]}: theory q/r = {c['theory']:.5f}, "
        f"measured {c['measured'][0]:.5f} +- {c['measured'][1]:.5f} "
        f"({100 * (c['measured'][0] / c['theory'] - 1):+.1f}%)",
    ]
    return "\n".join(out)


def plot(result: dict, path: str) -> None:
    """Left: measured error of each decay (points) on theory's curves (lines), the
    crossover marked. Right: the adaptive filter's error over the best fixed decay, and
    that of the crossover pair, in percent."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    x = np.array([row["q_over_r"] for row in rows])
    fine = np.geomspace(x[0], x[-1], 200)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    colours = plt.cm.viridis(np.linspace(0, 1, len(result["decays"])))
    for colour, d in zip(colours, result["decays"]):
        measured = [row["ema"][str(d)]["level"] for row in rows]
        left.plot(fine, np.asarray(theory.ema_error_variance(d, fine)) + fine, color=colour, lw=0.8)
        left.plot(x, measured, "o", color=colour, ms=3.5, label=f"ema {d}")
    betas = result["plan"]["betas"]
    adaptive = [row["adaptive"][str(betas[0])]["level"] for row in rows]
    left.plot(x, adaptive, "k+", ms=9, label=f"adaptive kalman (beta {betas[0]})")
    c = result["crossover"]
    left.axvline(c["theory"], color="grey", ls="--", lw=0.8, label=f"theory crossover {c['decays']}")
    left.axvline(c["measured"][0], color="red", ls=":", lw=1.0, label="measured crossover")
    left.set(xscale="log", yscale="log", xlabel="q / r", ylabel="error of the next level / r",
             title="measured (points) vs theory (lines)")
    left.legend(fontsize=6, ncol=2)
    # Excess over the best fixed decay, in percent, on a log scale (floored at 1e-3 %
    # where sampling noise makes it 0 or negative).
    best = np.array([row["best_level"][0] for row in rows])
    for colour, beta in zip(("k", "C3"), betas):
        excess = [100 * (row["adaptive"][str(beta)]["ratio"][0] - 1) for row in rows]
        error = [100 * row["adaptive"][str(beta)]["ratio"][1] for row in rows]
        right.errorbar(x, np.maximum(excess, 1e-3), yerr=error, fmt="o-", color=colour, ms=4,
                       label=f"adaptive kalman (beta {beta})")
    for d, colour in zip(c["decays"], ("C2", "C1")):
        excess = 100 * (np.array([row["ema"][str(d)]["level"] for row in rows]) / best - 1)
        right.plot(x, np.maximum(excess, 1e-3), ":", color=colour, label=f"ema {d}")
    right.axhline(2.0, color="grey", lw=0.8, ls="--", label="2%")
    right.set(xscale="log", yscale="log", xlabel="q / r", ylabel="error over the best fixed decay (%)",
              title="against the best decay of the grid at each q/r")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = make_parser("python -m flsmem.harness.drift", __doc__)
    parser.add_argument("--quick", action="store_true", help="fewer slots and steps (seconds, for tests)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write the plot as PNG")
    args = parser.parse_args(argv)
    result = run(args.quick, progress=lambda m: print(f"  {m}", file=sys.stderr, flush=True))
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    if args.plot:
        plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
