"""The regime map: where measuring (demonstrated utility) beats accumulating attention.

One harness, one model per setting, every policy side by side (``flsmem regime``):

* **map**: ``rmm``, ``h2o``, ``tova``, ``streaming_llm``, ``snapkv``, ``ema``, ``kalman``
  and the oracle at every budget, on the controlled tasks of :mod:`models.tasks` (the
  task-trained tiny decoder, answer accuracy after the gap) and on natural text (the
  tiny decoder and SmolLM2-135M, NLL increase over the full cache). Task examples are
  drawn in independent seeds, so every accuracy comes with its spread over seeds;
* **lag sweep**: ``rmm(lag=H)`` with no other recent window, so the H newest items are
  protected and the lag's slots are paid out of the budget; H >= budget is not
  possible (the lag alone would fill the memory) and is left empty;
* **signals**: ``rmm`` weighted by each correctness signal of
  :data:`harness.evaluate.CORRECTNESS`, teacher-forced and serving proxies, against the
  teacher-forced hard signal.

Every run writes ``regime.json`` (all rows), text tables and the plots into ``--out``.
``--quick`` runs a subset (one seed, fewer budgets, no SmolLM2) that reproduces the
ordering of the policies in a few minutes; ``tests/test_regime.py`` checks that it does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from flsmem import policies as P

__all__ = ["MAP_POLICIES", "LAGS", "SIGNALS", "Plan", "FULL", "QUICK", "run", "winners", "main"]

MAP_POLICIES = ("oracle", "rmm", "h2o", "tova", "streaming_llm", "snapkv", "ema", "kalman")
LAGS = (0, 4, 16, 64, 256)
SIGNALS = ("hard", "soft", "confidence", "certainty", "sampled", "none")
CONTEXT = 512
CHUNK = 16


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one run measures.

    Attributes:
      tasks: controlled tasks (names from :data:`models.tasks.TASKS`).
      seeds: independent draws of task examples; spreads are over these.
      examples: task examples per seed.
      budgets: memory budgets of the map (tokens per layer and KV head).
      text_windows: windows of held-out prose per natural-text model.
      text_models: natural-text models (``tiny``, ``smollm2-135m``).
      lag_settings: settings of the lag sweep (task names and ``text:tiny``).
      lag_budgets: budgets of the lag sweep.
      signal_settings, signal_budgets: the same for the correctness signals.
    """

    tasks: tuple[str, ...]
    seeds: tuple[int, ...]
    examples: int
    budgets: tuple[int, ...]
    text_windows: int
    text_models: tuple[str, ...]
    lag_settings: tuple[str, ...]
    lag_budgets: tuple[int, ...]
    signal_settings: tuple[str, ...]
    signal_budgets: tuple[int, ...]


FULL = Plan(
    tasks=("passkey", "recall", "repeat"), seeds=(0, 1, 2), examples=32, budgets=(32, 64, 128, 256),
    text_windows=8, text_models=("tiny", "smollm2-135m"),
    lag_settings=("recall", "repeat", "text:tiny"), lag_budgets=(64, 128, 256),
    signal_settings=("recall", "repeat", "text:tiny"), signal_budgets=(64,),
)
QUICK = Plan(
    tasks=("repeat",), seeds=(3,), examples=48, budgets=(64,),
    text_windows=4, text_models=("tiny",),
    lag_settings=(), lag_budgets=(), signal_settings=(), signal_budgets=(),
)


def _tasks_model():
    from models.tiny import TASKS_CHECKPOINT_DIR, load_tiny

    return load_tiny(TASKS_CHECKPOINT_DIR)[0]


def _text_model(name: str):
    from harness.report import load_model

    return load_model(name)


class _Setting:
    """Windows of one setting and how to score a run on them.

    ``score(nll, hit)`` gives per-window values of the setting's metric (answer accuracy
    after the gap for tasks, mean NLL for text); ``higher_is_better`` says which way.
    """

    def __init__(self, name: str, model, windows: np.ndarray, score: Callable, higher_is_better: bool,
                 groups: np.ndarray):
        self.name, self.model, self.windows = name, model, windows
        self.score, self.higher_is_better, self.groups = score, higher_is_better, groups
        self._futures = None

    def futures(self):
        from harness.evaluate import future_attention

        if self._futures is None:
            self._futures = future_attention(self.model, self.windows, CHUNK)
        return self._futures

    def measure(self, policy: P.Policy, budget: int, correctness: str = "hard") -> dict:
        """Metric of ``policy`` at ``budget``: mean over windows, and per group (seed)."""
        from harness.evaluate import evaluate_windows

        futures = self.futures() if policy.needs_future else None
        nll, hit, _ = evaluate_windows(self.model, self.windows, policy, budget, chunk=CHUNK,
                                       correctness=correctness, futures=futures)
        values = self.score(nll, hit)
        per_group = [float(values[self.groups == g].mean()) for g in np.unique(self.groups)]
        return {"value": float(values.mean()), "per_seed": per_group}


def _task_setting(kind: str, plan: Plan, model) -> _Setting:
    from models.data import ByteTokenizer, load_split
    from models.tasks import LATE, make_tasks

    text = ByteTokenizer().encode(load_split("test"))
    batches = [make_tasks(kind, text, plan.examples, CONTEXT, seed=seed) for seed in plan.seeds]
    tokens = np.concatenate([b.tokens for b in batches])
    groups = np.repeat(np.arange(len(batches)), plan.examples)

    def score(nll, hit):
        return np.concatenate([b.accuracy(hit[i * plan.examples:(i + 1) * plan.examples], LATE)
                               for i, b in enumerate(batches)])

    return _Setting(kind, model, tokens, score, True, groups)


def _text_setting(name: str, plan: Plan) -> _Setting:
    from harness.report import make_windows
    from models.data import load_book

    model, tokenizer = _text_model(name)
    windows = make_windows(tokenizer.encode(load_book("persuasion")), CONTEXT, plan.text_windows)
    return _Setting(f"text:{name}", model, windows, lambda nll, hit: nll.mean(axis=1), False,
                    np.zeros(len(windows), np.int64))


def _row(kind: str, setting: _Setting, policy: str, budget: int, measured: dict, **extra) -> dict:
    return {"experiment": kind, "setting": setting.name, "policy": policy, "budget": budget,
            "metric": "accuracy" if setting.higher_is_better else "nll", **measured, **extra}


def run(plan: Plan, progress: Callable[[str], None] = lambda msg: None) -> list[dict]:
    """Every measurement of ``plan``, as rows (see :func:`main` for the files)."""
    from harness.evaluate import make_policy

    rows: list[dict] = []
    settings = []
    tasks_model = _tasks_model() if plan.tasks else None
    settings += [(lambda kind=kind: _task_setting(kind, plan, tasks_model)) for kind in plan.tasks]
    settings += [(lambda name=name: _text_setting(name, plan)) for name in plan.text_models]
    for make in settings:
        setting = make()
        progress(f"{setting.name}: full cache")
        full = setting.measure(P.full(), CONTEXT)
        rows.append(_row("map", setting, "full", CONTEXT, full))
        for budget in plan.budgets:
            for name in MAP_POLICIES:
                progress(f"{setting.name}: {name} @ {budget}")
                rows.append(_row("map", setting, name, budget, setting.measure(make_policy(name, budget), budget)))
        if setting.name in plan.lag_settings:
            for budget in plan.lag_budgets:
                for lag in LAGS:
                    if lag >= budget:
                        continue
                    progress(f"{setting.name}: rmm(lag={lag}) @ {budget}")
                    rows.append(_row("lag", setting, "rmm", budget, setting.measure(P.rmm(lag=lag), budget), lag=lag))
        if setting.name in plan.signal_settings:
            for budget in plan.signal_budgets:
                for signal in SIGNALS:
                    progress(f"{setting.name}: rmm[{signal}] @ {budget}")
                    measured = setting.measure(make_policy("rmm", budget), budget, correctness=signal)
                    rows.append(_row("signal", setting, "rmm", budget, measured, signal=signal))
        setting._futures = None  # free the oracle's table before the next setting
    return rows


def winners(rows: list[dict]) -> dict[tuple[str, int], tuple[str, float]]:
    """``(setting, budget) -> (best non-oracle policy, its margin over the runner-up)``
    on the map; the margin is in the setting's metric (accuracy or nats). A tie for
    first place is named ``"tie"`` (margin 0)."""
    out = {}
    cells = {(r["setting"], r["budget"]) for r in rows if r["experiment"] == "map" and r["policy"] != "full"}
    for setting, budget in sorted(cells):
        at = [r for r in rows if r["experiment"] == "map" and r["setting"] == setting and r["budget"] == budget
              and r["policy"] not in ("oracle", "full")]
        sign = 1.0 if at[0]["metric"] == "accuracy" else -1.0
        ranked = sorted(at, key=lambda r: -sign * r["value"])
        margin = sign * (ranked[0]["value"] - ranked[1]["value"])
        out[(setting, budget)] = (ranked[0]["policy"] if margin > 0 else "tie", margin)
    return out


def format_tables(rows: list[dict]) -> str:
    """The map, the lag sweep and the signals as plain-text tables."""
    lines = []
    for setting in dict.fromkeys(r["setting"] for r in rows):
        mine = [r for r in rows if r["setting"] == setting]
        metric = mine[0]["metric"]
        full = next(r for r in mine if r["policy"] == "full")
        budgets = sorted({r["budget"] for r in mine if r["experiment"] == "map" and r["policy"] != "full"})
        unit = "answer accuracy after the gap (mean ± sd over seeds)" if metric == "accuracy" else \
            "NLL increase over the full cache, nats/token"
        lines += ["", f"## {setting}: {unit}; full cache {full['value']:.4f}", ""]
        lines.append(f"{'policy':<14}" + "".join(f" | {'B=' + str(b):>13}" for b in budgets))
        for name in MAP_POLICIES:
            cells = []
            for b in budgets:
                r = next(r for r in mine if r["experiment"] == "map" and r["policy"] == name and r["budget"] == b)
                if metric == "accuracy":
                    cells.append(f" | {r['value']:>6.3f} ±{np.std(r['per_seed']):.3f}")
                else:
                    cells.append(f" | {r['value'] - full['value']:>+13.4f}")
            lines.append(f"{name:<14}" + "".join(cells))
        lags = [r for r in mine if r["experiment"] == "lag"]
        if lags:
            lag_budgets = sorted({r["budget"] for r in lags})
            lines += ["", f"lag sweep, rmm(lag=H) ({'accuracy' if metric == 'accuracy' else 'NLL increase'}):",
                      f"{'H':<6}" + "".join(f" | {'B=' + str(b):>9}" for b in lag_budgets)]
            for lag in LAGS:
                cells = []
                for b in lag_budgets:
                    r = next((r for r in lags if r["lag"] == lag and r["budget"] == b), None)
                    value = "" if r is None else (f"{r['value']:.3f}" if metric == "accuracy"
                                                  else f"{r['value'] - full['value']:+.4f}")
                    cells.append(f" | {value:>9}")
                lines.append(f"{lag:<6}" + "".join(cells))
        signals = [r for r in mine if r["experiment"] == "signal"]
        if signals:
            lines += ["", "correctness signals, rmm (difference from the teacher-forced hard signal):"]
            for b in sorted({r["budget"] for r in signals}):
                hard = next(r for r in signals if r["signal"] == "hard" and r["budget"] == b)
                for r in (r for r in signals if r["budget"] == b):
                    shown = r["value"] if metric == "accuracy" else r["value"] - full["value"]
                    lines.append(f"  B={b:<4} {r['signal']:<11} {shown:+.4f}  ({r['value'] - hard['value']:+.4f})")
    table = winners(rows)
    lines += ["", "## winners (best policy other than the oracle, margin over the runner-up)", ""]
    for (setting, budget), (name, margin) in table.items():
        lines.append(f"{setting:<18} B={budget:<4} {name:<14} {margin:+.4f}")
    return "\n".join(lines).lstrip("\n")


def plot_map(rows: list[dict], path: str) -> None:
    """The regime map: setting x budget, coloured by the winning policy, with its margin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = winners(rows)
    settings = list(dict.fromkeys(s for s, _ in table))
    budgets = sorted({b for _, b in table})
    names = [n for n in MAP_POLICIES if n != "oracle"]
    colours = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(1.6 * len(budgets) + 3, 0.7 * len(settings) + 1.5))
    for i, setting in enumerate(settings):
        for j, budget in enumerate(budgets):
            if (setting, budget) not in table:
                continue
            name, margin = table[(setting, budget)]
            unit = "pts" if next(r["metric"] for r in rows if r["setting"] == setting) == "accuracy" else "nats"
            shown = 100 * margin if unit == "pts" else margin
            colour = "lightgrey" if name == "tie" else colours(names.index(name))
            ax.add_patch(plt.Rectangle((j, i), 1, 1, color=colour, alpha=0.75))
            label = name if name == "tie" else f"{name}\n+{shown:.3g} {unit}"
            ax.text(j + 0.5, i + 0.5, label, ha="center", va="center", fontsize=8)
    ax.set_xlim(0, len(budgets))
    ax.set_ylim(0, len(settings))
    ax.set_xticks(np.arange(len(budgets)) + 0.5, [str(b) for b in budgets])
    ax.set_yticks(np.arange(len(settings)) + 0.5, settings)
    ax.invert_yaxis()
    ax.set_xlabel(f"budget (tokens kept per layer and KV head, of {CONTEXT})")
    ax.set_title("winning policy (oracle aside) and its margin over the runner-up", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_curves(rows: list[dict], path: str) -> None:
    """Each setting's metric against the budget, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(dict.fromkeys(r["setting"] for r in rows if r["experiment"] == "map"))
    fig, axes = plt.subplots(1, len(settings), figsize=(3.6 * len(settings), 3.4), squeeze=False)
    colours = plt.get_cmap("tab10")
    for ax, setting in zip(axes[0], settings):
        mine = [r for r in rows if r["experiment"] == "map" and r["setting"] == setting]
        full = next(r for r in mine if r["policy"] == "full")
        accuracy = full["metric"] == "accuracy"
        for k, name in enumerate(MAP_POLICIES):
            pts = sorted((r["budget"], r["value"] if accuracy else r["value"] - full["value"])
                         for r in mine if r["policy"] == name)
            style = dict(color="k", linestyle="--") if name == "oracle" else dict(color=colours(k), marker="o", ms=3)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, **style)
        ax.set_xscale("log", base=2)
        ax.set_title(setting, fontsize=9)
        ax.set_xlabel("budget")
        ax.set_ylabel("answer accuracy" if accuracy else "NLL increase over full (nats)")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="flsmem regime", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="the small subset that reproduces the ordering")
    parser.add_argument("--out", default="results/regime", help="folder for regime.json, the tables and plots")


def run_cli(args: argparse.Namespace) -> list[dict]:
    plan = QUICK if args.quick else FULL
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "quick" if args.quick else "regime"
    begin = time.perf_counter()
    rows = run(plan, progress=lambda msg: print(f"  {msg}", file=sys.stderr, flush=True))
    elapsed = time.perf_counter() - begin
    text = f"flsmem regime{' --quick' if args.quick else ''} ({elapsed:.0f} s)\n\n" + format_tables(rows)
    print(text)
    (out / f"{stem}.txt").write_text(text + "\n")
    (out / f"{stem}.json").write_text(json.dumps({"plan": dataclasses.asdict(plan), "seconds": elapsed,
                                                  "rows": rows}, indent=1) + "\n")
    plot_map(rows, str(out / f"{stem}-map.png"))
    plot_curves(rows, str(out / f"{stem}-curves.png"))
    return rows


if __name__ == "__main__":
    main()
