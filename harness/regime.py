"""The regime map: where measuring (demonstrated utility) beats accumulating attention.

One harness, one model per setting, every policy side by side (``flsmem regime``):

* **map**: ``rmm``, ``h2o``, ``tova``, ``streaming_llm``, ``snapkv``, ``ema``, ``kalman``
  and the oracle at every budget, on the controlled tasks of :mod:`flsmem.models.tasks` (the
  task-trained tiny decoder, answer accuracy after the gap) and on natural text (the
  tiny decoder and SmolLM2-135M, NLL increase over the full cache). Task examples are
  drawn in independent seeds, so every accuracy comes with its spread over seeds;
* **lag sweep**: ``rmm(lag=H)`` with no other recent window, so the H newest items are
  protected and the lag's slots are paid out of the budget; H >= budget is not
  possible (the lag alone would fill the memory) and is left empty;
* **signals**: ``rmm`` weighted by each correctness signal of
  :data:`flsmem.harness.evaluate.CORRECTNESS`, teacher-forced and serving proxies, against the
  teacher-forced hard signal.

Every run writes ``regime.json`` (all rows), text tables and the plots into ``--out``.
``--quick`` runs a subset (one seed, fewer budgets, no SmolLM2) that reproduces the
ordering of the policies in a few minutes; ``tests/test_regime.py`` checks that it does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from fractions import Fraction
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from flsmem import policies as P
from flsmem.harness.arguments import checking, make_parser
from flsmem.validate import require

__all__ = ["MAP_POLICIES", "LAGS", "SIGNALS", "Plan", "FULL", "QUICK", "tasks_model", "task_setting", "run", "winners",
           "check_output", "main"]

MAP_POLICIES = ("oracle", "rmm", "h2o", "tova", "streaming_llm", "snapkv", "ema", "kalman")
RETENTION_POLICIES = ("oracle", "rmm", "h2o")
ITEMS = ("early answer", "pair used", "pair unused")
LAGS = (0, 4, 16, 64, 256)
SIGNALS = ("hard", "soft", "confidence", "certainty", "sampled", "none")
CHUNK = 16


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one run measures.

    Attributes:
      tasks: controlled tasks (names from :data:`flsmem.models.tasks.TASKS`).
      seeds: independent draws of task examples; spreads are over these.
      examples: task examples per seed.
      task_context, text_context: tokens per window of the tasks and of the prose.
      fractions: memory budgets of the map, as fractions of the context (the budget is
        the tokens kept per layer and KV head).
      text_windows: windows of held-out prose per natural-text model.
      text_models: natural-text models (``tiny``, ``smollm2-135m``).
      lag_settings: settings of the lag sweep (task names and ``text:tiny``).
      lag_fractions: budgets of the lag sweep.
      signal_settings, signal_fractions: the same for the correctness signals.
      retention_settings, retention_fractions: tasks and budgets at which to record
        which items the memories still hold when the last query comes.
      policies: the policies of the map (names for :func:`flsmem.harness.evaluate.make_policy`).
      estimator: checkpoint directory of the learned policies (None: the shipped one).
    """

    tasks: tuple[str, ...]
    seeds: tuple[int, ...]
    examples: int
    task_context: int
    text_context: int
    fractions: tuple[float, ...]
    text_windows: int
    text_models: tuple[str, ...]
    lag_settings: tuple[str, ...]
    lag_fractions: tuple[float, ...]
    signal_settings: tuple[str, ...]
    signal_fractions: tuple[float, ...]
    retention_settings: tuple[str, ...] = ()
    retention_fractions: tuple[float, ...] = ()
    policies: tuple[str, ...] = MAP_POLICIES
    estimator: str | None = None

    def __post_init__(self):
        from flsmem.models.tasks import TASKS

        unknown = sorted(set(self.tasks) - set(TASKS))
        if unknown:
            raise ValueError(f"tasks must be among {TASKS}, got {unknown}")
        if self.tasks and (not self.seeds or self.examples < 1):
            raise ValueError(f"tasks need seeds and examples >= 1, got seeds={self.seeds}, examples={self.examples}")
        for name in ("task_context", "text_context"):
            if getattr(self, name) < 1 or getattr(self, name) % CHUNK:
                raise ValueError(f"{name} must be a positive multiple of {CHUNK}, got {getattr(self, name)}")
        for name in ("fractions", "lag_fractions", "signal_fractions", "retention_fractions"):
            if not all(0 < f < 1 for f in getattr(self, name)):
                raise ValueError(f"{name} must lie in (0, 1), got {getattr(self, name)}")
        from flsmem.harness.evaluate import LEARNED_NAMES, POLICY_NAMES, check_policies, is_policy_name, split_settings

        unknown = [p for p in self.policies
                   if not (p in LEARNED_NAMES or (is_policy_name(p) and split_settings(p)[0] in POLICY_NAMES))]
        if not self.policies or unknown:
            raise ValueError(f"policies must be among {POLICY_NAMES + LEARNED_NAMES}, or those with settings as in "
                             f"adaptive(horizon=256), got {self.policies}")
        check_policies("policy", self.policies, max(1, int(min(self.fractions) * self.task_context)))


FULL = Plan(
    tasks=("passkey", "recall", "repeat", "chain"), seeds=(0, 1, 2), examples=32, task_context=256, text_context=512,
    fractions=(1 / 16, 1 / 8, 1 / 4, 1 / 2), text_windows=8, text_models=("tiny", "smollm2-135m"),
    lag_settings=("recall", "repeat", "chain", "text:tiny"), lag_fractions=(1 / 8, 1 / 4, 1 / 2, 3 / 4),
    signal_settings=("recall", "repeat", "chain", "text:tiny"), signal_fractions=(1 / 8,),
    retention_settings=("recall", "repeat", "chain"), retention_fractions=(1 / 8, 1 / 2),
)
QUICK = Plan(
    tasks=("repeat",), seeds=(3,), examples=48, task_context=256, text_context=512,
    fractions=(1 / 8,), text_windows=4, text_models=("tiny",),
    lag_settings=(), lag_fractions=(), signal_settings=(), signal_fractions=(),
)


def tasks_model():
    """The decoder trained on the controlled tasks (``checkpoints/tiny-tasks``)."""
    from flsmem.models.tiny import TASKS_CHECKPOINT_DIR, load_tiny

    return load_tiny(TASKS_CHECKPOINT_DIR)[0]


def _text_model(name: str):
    from flsmem.models import catalog

    return catalog.load(name)


class _Setting:
    """Windows of one setting and how to score a run on them.

    ``score(nll, hit)`` gives per-window values of the setting's metric (answer accuracy
    after the gap for tasks, mean NLL for text); ``higher_is_better`` says which way.
    """

    def __init__(self, name: str, model, windows: np.ndarray, score: Callable, higher_is_better: bool,
                 groups: np.ndarray, answer: np.ndarray | None = None):
        self.name, self.model, self.windows, self.answer = name, model, windows, answer
        self.context = windows.shape[1] - 1
        self.score, self.higher_is_better, self.groups = score, higher_is_better, groups
        self._futures = None

    def futures(self):
        from flsmem.harness.evaluate import future_attention

        if self._futures is None:
            self._futures = future_attention(self.model, self.windows, CHUNK)
        return self._futures

    def measure(self, policy: P.Policy, budget: int, correctness: str = "hard") -> dict:
        """Metric of ``policy`` at ``budget``: mean over windows, and per group (seed)."""
        from flsmem.harness.evaluate import evaluate_windows

        futures = self.futures() if policy.needs_future else None
        nll, hit, _ = evaluate_windows(self.model, self.windows, policy, budget, chunk=CHUNK,
                                       correctness=correctness, futures=futures)
        values = self.score(nll, hit)
        per_group = [float(values[self.groups == g].mean()) for g in np.unique(self.groups)]
        return {"value": float(values.mean()), "per_seed": per_group}


def task_setting(kind: str, plan: Plan, model) -> _Setting:
    """The test-split examples of task ``kind`` that ``plan`` draws (``plan.examples`` per
    seed of ``plan.seeds``), scored by answer accuracy after the gap."""
    from flsmem.models.data import ByteTokenizer, load_split
    from flsmem.models.tasks import LATE, make_tasks

    text = ByteTokenizer().encode(load_split("test"))
    batches = [make_tasks(kind, text, plan.examples, plan.task_context, seed=seed) for seed in plan.seeds]
    tokens = np.concatenate([b.tokens for b in batches])
    groups = np.repeat(np.arange(len(batches)), plan.examples)

    def score(nll, hit):
        return np.concatenate([b.accuracy(hit[i * plan.examples:(i + 1) * plan.examples], LATE)
                               for i, b in enumerate(batches)])

    return _Setting(kind, model, tokens, score, True, groups, np.concatenate([b.answer for b in batches]))


def _text_setting(name: str, plan: Plan) -> _Setting:
    from flsmem.models.data import cut_windows, load_book

    model, tokenizer = _text_model(name)
    windows = cut_windows(tokenizer.encode(load_book("persuasion")), plan.text_context, plan.text_windows,
                          spacing="spread", exact=True)
    return _Setting(f"text:{name}", model, windows, lambda nll, hit: nll.mean(axis=1), False,
                    np.zeros(len(windows), np.int64))


def _row(kind: str, setting: _Setting, policy: str, fraction: float, measured: dict, **extra) -> dict:
    return {"experiment": kind, "setting": setting.name, "policy": policy, "fraction": fraction,
            "budget": _budget(setting, fraction), "context": setting.context,
            "metric": "accuracy" if setting.higher_is_better else "nll", **measured, **extra}


def _budget(setting: _Setting, fraction: float) -> int:
    return int(round(fraction * setting.context))


def run(plan: Plan, progress: Callable[[str], None] = lambda msg: None) -> list[dict]:
    """Every measurement of ``plan``, as rows (see :func:`main` for the files)."""
    from flsmem.harness.evaluate import make_policy

    rows: list[dict] = []
    settings = []
    model = tasks_model() if plan.tasks else None
    settings += [(lambda kind=kind: task_setting(kind, plan, model)) for kind in plan.tasks]
    settings += [(lambda name=name: _text_setting(name, plan)) for name in plan.text_models]
    for make in settings:
        setting = make()
        progress(f"{setting.name}: full cache")
        full = setting.measure(P.full(), setting.context)
        rows.append(_row("map", setting, "full", 1.0, full))
        for fraction in plan.fractions:
            budget = _budget(setting, fraction)
            for name in plan.policies:
                progress(f"{setting.name}: {name} @ {budget}")
                rows.append(_row("map", setting, name, fraction, setting.measure(make_policy(name, budget, estimator=plan.estimator), budget)))
        if setting.name in plan.lag_settings:
            for fraction in plan.lag_fractions:
                budget = _budget(setting, fraction)
                for lag in LAGS:
                    if lag >= budget:
                        continue
                    progress(f"{setting.name}: rmm(lag={lag}) @ {budget}")
                    measured = setting.measure(P.rmm(lag=lag), budget)
                    rows.append(_row("lag", setting, "rmm", fraction, measured, lag=lag))
                # The same protection without the correctness weights: h2o with no window.
                progress(f"{setting.name}: h2o(recent=0) @ {budget}")
                rows.append(_row("lag", setting, "h2o", fraction, setting.measure(P.h2o(), budget), lag=0))
        if setting.name in plan.signal_settings:
            for fraction in plan.signal_fractions:
                budget = _budget(setting, fraction)
                for signal in SIGNALS:
                    progress(f"{setting.name}: rmm[{signal}] @ {budget}")
                    measured = setting.measure(make_policy("rmm", budget), budget, correctness=signal)
                    rows.append(_row("signal", setting, "rmm", fraction, measured, signal=signal))
        if setting.name in plan.retention_settings:
            for fraction in plan.retention_fractions:
                for name in RETENTION_POLICIES:
                    progress(f"{setting.name}: what {name} holds @ {_budget(setting, fraction)}")
                    for item, held in retention(setting, name, fraction).items():
                        rows.append(_row("retention", setting, name, fraction, held, item=item))
        setting._futures = None  # free the oracle's table before the next setting
        # Every policy and budget compiles its own decode loop, used once. Dropping them
        # keeps a long run under the kernel's limit on memory mappings (each compiled
        # program holds some; a full run passed 65,530, Linux's default, and failed).
        jax.clear_caches()
    return rows


def _item_positions(tokens: np.ndarray, answer: np.ndarray) -> dict[str, list[int]]:
    """Positions, in one task example, of the digits of the early answers, of the pairs
    those answers used, and of the pairs no early query used."""
    from flsmem.models.tasks import EARLY

    digit = (tokens >= 48) & (tokens <= 57)
    early = [int(t) + 1 for t in np.flatnonzero(answer == EARLY) if digit[t + 1]]  # target t is token t + 1
    # "=K7" statements before the first early answer are the pairs (pointers "=KQ" are not
    # items a digit answer reads); each binds the key before its digit.
    eq = ord("=")
    pairs = {int(tokens[i - 1]): i for i in range(2, min(early))
             if digit[i] and tokens[i - 2] == eq and 65 <= tokens[i - 1] <= 90}
    used = [pairs[int(tokens[i - 1])] for i in early]
    return {"early answer": early, "pair used": used,
            "pair unused": [i for i in pairs.values() if i not in used]}


def retention(setting: _Setting, name: str, fraction: float) -> dict[str, dict]:
    """Which items the memories of ``name`` hold when the last chunk (holding the late
    answers) comes: for each kind of item, the fraction of (layer, KV head) memories
    that hold it, averaged over items and examples (and per seed)."""
    from flsmem.harness.evaluate import evaluate_windows, make_policy

    budget = _budget(setting, fraction)
    windows = setting.windows[:, :-CHUNK]  # stop before the chunk of the late answers
    futures = setting.futures()[..., :-CHUNK, :-CHUNK] if name == "oracle" else None
    _, _, stats = evaluate_windows(setting.model, windows, make_policy(name, budget), budget, chunk=CHUNK,
                                   futures=futures)
    held = np.asarray(stats["held"])  # [L, W, K, S]
    out = {}
    for item in ITEMS:
        per_window = []
        for w in range(len(windows)):
            positions = _item_positions(setting.windows[w], setting.answer[w])[item]
            held_w = np.moveaxis(held[:, w], 0, 1).reshape(-1, held.shape[-1])  # [L * K, S]
            per_window.append(np.mean([(held_w == p).any(axis=-1).mean() for p in positions]))
        per_window = np.asarray(per_window)
        out[item] = {"value": float(per_window.mean()),
                     "per_seed": [float(per_window[setting.groups == g].mean()) for g in np.unique(setting.groups)]}
    return out


def winners(rows: list[dict]) -> dict[tuple[str, float], tuple[str, float]]:
    """``(setting, budget fraction) -> (best non-oracle policy, its margin over the runner-up)``
    on the map; the margin is in the setting's metric (accuracy or nats). A tie for
    first place is named ``"tie"`` (margin 0)."""
    out = {}
    cells = {(r["setting"], r["fraction"]) for r in rows if r["experiment"] == "map" and r["policy"] != "full"}
    for setting, fraction in sorted(cells):
        at = [r for r in rows if r["experiment"] == "map" and r["setting"] == setting
              and r["fraction"] == fraction and r["policy"] not in ("oracle", "full")]
        sign = 1.0 if at[0]["metric"] == "accuracy" else -1.0
        ranked = sorted(at, key=lambda r: -sign * r["value"])
        margin = sign * (ranked[0]["value"] - ranked[1]["value"])
        out[(setting, fraction)] = (ranked[0]["policy"] if margin > 0 else "tie", margin)
    return out


def seed_margins(rows: list[dict]):
    """``(task, fraction, [rmm - h2o per seed])`` for the accuracy settings of the map."""
    at = {(r["setting"], r["policy"], r["fraction"]): r for r in rows if r["experiment"] == "map"}
    for setting, policy, fraction in sorted(at):
        if policy == "rmm" and at[(setting, policy, fraction)]["metric"] == "accuracy":
            mine, other = at[(setting, "rmm", fraction)], at[(setting, "h2o", fraction)]
            yield setting, fraction, [a - b for a, b in zip(mine["per_seed"], other["per_seed"])]


def budget_multiples(rows: list[dict]):
    """For each setting and budget fraction f: rmm at f against h2o at 2f and 4f, as
    ``(setting, f, "rmm x | h2o@2B y (yes/no) | h2o@4B z (yes/no)")``; "yes" when rmm is
    at least as good (on text, within 0.001 nats)."""
    at = {(r["setting"], r["policy"], r["fraction"]): r for r in rows if r["experiment"] == "map"}
    for setting, policy, fraction in sorted(at):
        if policy != "rmm":
            continue
        mine = at[(setting, "rmm", fraction)]
        accuracy = mine["metric"] == "accuracy"
        parts = [f"rmm {mine['value']:.4f}"]
        for k in (2, 4):
            other = at.get((setting, "h2o", fraction * k)) or (at.get((setting, "full", 1.0)) if fraction * k >= 1 else None)
            if other is None:
                continue
            ok = mine["value"] >= other["value"] if accuracy else mine["value"] <= other["value"] + 0.001
            parts.append(f"h2o@{k}B {other['value']:.4f} ({'yes' if ok else 'no'})")
        yield setting, fraction, " | ".join(parts)


def _fraction(f: float) -> str:
    return str(Fraction(f).limit_denominator(64))


def _map_policies(rows: list[dict]) -> list[str]:
    """The map's policies in the order they were run (the full cache aside)."""
    return [n for n in dict.fromkeys(r["policy"] for r in rows if r["experiment"] == "map") if n != "full"]


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
        width = max([16] + [len(name) for name in _map_policies(mine)])
        lines.append(f"{'policy':<{width}}" + "".join(f" | {'B=' + str(b):>13}" for b in budgets))
        for name in _map_policies(mine):
            cells = []
            for b in budgets:
                r = next(r for r in mine if r["experiment"] == "map" and r["policy"] == name and r["budget"] == b)
                if metric == "accuracy":
                    cells.append(f" | {r['value']:>6.3f} ±{np.std(r['per_seed']):.3f}")
                else:
                    cells.append(f" | {r['value'] - full['value']:>+13.4f}")
            lines.append(f"{name:<{width}}" + "".join(cells))
        lags = [r for r in mine if r["experiment"] == "lag"]
        if lags:
            lag_budgets = sorted({r["budget"] for r in lags})
            lines += ["", f"lag sweep, rmm(lag=H) ({'accuracy' if metric == 'accuracy' else 'NLL increase'}):",
                      f"{'H':<6}" + "".join(f" | {'B=' + str(b):>9}" for b in lag_budgets)]
            for lag in LAGS:
                cells = []
                for b in lag_budgets:
                    r = next((r for r in lags if r["policy"] == "rmm" and r["lag"] == lag and r["budget"] == b), None)
                    value = "" if r is None else (f"{r['value']:.3f}" if metric == "accuracy"
                                                  else f"{r['value'] - full['value']:+.4f}")
                    cells.append(f" | {value:>9}")
                lines.append(f"{lag:<6}" + "".join(cells))
            cells = []
            for b in lag_budgets:
                r = next(r for r in lags if r["policy"] == "h2o" and r["budget"] == b)
                cells.append(f" | {r['value'] if metric == 'accuracy' else r['value'] - full['value']:>+9.4f}")
            lines.append("h2o, no window (H=0 without correctness weights):")
            lines.append(f"{'':<6}" + "".join(cells))
        signals = [r for r in mine if r["experiment"] == "signal"]
        if signals:
            lines += ["", "correctness signals, rmm (difference from the teacher-forced hard signal):"]
            for b in sorted({r["budget"] for r in signals}):
                hard = next(r for r in signals if r["signal"] == "hard" and r["budget"] == b)
                for r in (r for r in signals if r["budget"] == b):
                    shown = r["value"] if metric == "accuracy" else r["value"] - full["value"]
                    lines.append(f"  B={b:<4} {r['signal']:<11} {shown:+.4f}  ({r['value'] - hard['value']:+.4f})")
    kept = [r for r in rows if r["experiment"] == "retention"]
    if kept:
        lines += ["", "## what the memories hold when the last query comes (fraction of layer x KV-head memories)", ""]
        for setting, fraction in dict.fromkeys((r["setting"], r["fraction"]) for r in kept):
            lines.append(f"{setting} B={_fraction(fraction)}: " + " | ".join(
                f"{name}: " + ", ".join(f"{r['item']} {r['value']:.2f}" for r in kept
                                        if r["setting"] == setting and r["fraction"] == fraction and r["policy"] == name)
                for name in RETENTION_POLICIES))
    margins = list(seed_margins(rows))
    if margins:
        lines += ["", "## rmm - h2o at equal budget, accuracy per seed (mean ± sd over seeds)", ""]
        for setting, fraction, per_seed in margins:
            shown = " ".join(f"{m:+.3f}" for m in per_seed)
            spread = np.std(per_seed, ddof=1) if len(per_seed) > 1 else 0.0
            lines.append(f"{setting:<18} B={_fraction(fraction):<5} {np.mean(per_seed):+.3f} ±{spread:.3f}  ({shown})")
    lines += ["", "## does rmm at budget B match h2o at 2B and 4B? (map rows; value of rmm@B, h2o@2B, h2o@4B)", ""]
    for setting, fraction, line in budget_multiples(rows):
        lines.append(f"{setting:<18} B={_fraction(fraction):<5} {line}")
    table = winners(rows)
    lines += ["", "## winners (best policy other than the oracle, margin over the runner-up)", ""]
    for (setting, fraction), (name, margin) in table.items():
        lines.append(f"{setting:<18} B={_fraction(fraction):<5} {name:<14} {margin:+.4f}")
    return "\n".join(lines).lstrip("\n")


def plot_map(rows: list[dict], path: str) -> None:
    """The regime map: setting x budget, coloured by the winning policy, with its margin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = winners(rows)
    settings = list(dict.fromkeys(s for s, _ in table))
    fractions = sorted({f for _, f in table})
    names = [n for n in _map_policies(rows) if n != "oracle"]
    colours = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(1.6 * len(fractions) + 3, 0.7 * len(settings) + 1.5))
    for i, setting in enumerate(settings):
        for j, fraction in enumerate(fractions):
            if (setting, fraction) not in table:
                continue
            name, margin = table[(setting, fraction)]
            unit = "pts" if next(r["metric"] for r in rows if r["setting"] == setting) == "accuracy" else "nats"
            shown = 100 * margin if unit == "pts" else margin
            colour = "lightgrey" if name == "tie" else colours(names.index(name))
            ax.add_patch(plt.Rectangle((j, i), 1, 1, color=colour, alpha=0.75))
            label = name if name == "tie" else f"{name}\n+{shown:.3g} {unit}"
            ax.text(j + 0.5, i + 0.5, label, ha="center", va="center", fontsize=8)
    ax.set_xlim(0, len(fractions))
    ax.set_ylim(0, len(settings))
    ax.set_xticks(np.arange(len(fractions)) + 0.5, [_fraction(f) for f in fractions])
    ax.set_yticks(np.arange(len(settings)) + 0.5, settings)
    ax.invert_yaxis()
    ax.set_xlabel("budget (fraction of the context kept per layer and KV head)")
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
        for k, name in enumerate(_map_policies(mine)):
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
    parser = make_parser("flsmem regime", __doc__)
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="the small subset that reproduces the ordering")
    parser.add_argument("--out", default="results/regime", help="folder for regime.json, the tables and plots")
    parser.add_argument("--policies", default=None,
                        help="comma-separated policies for the map alone (the full cache is always there); the lag "
                             "sweep, the correctness signals and the retention, which study rmm's own settings, "
                             "are left out")
    parser.add_argument("--render", action="store_true",
                        help="measure nothing: rewrite the tables and plots from the JSON already in --out")


def measure_or_render(plan: Plan, out: Path, stem: str, render: bool) -> tuple[list[dict], float]:
    """``(rows, seconds)``: measured by :func:`run` and saved as ``out/stem.json``, or,
    with ``render``, read back from that file without measuring."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}.json"
    if render:
        saved = json.loads(path.read_text())
        return saved["rows"], saved["seconds"]
    begin = time.perf_counter()
    rows = run(plan, progress=lambda msg: print(f"  {msg}", file=sys.stderr, flush=True))
    elapsed = time.perf_counter() - begin
    path.write_text(json.dumps({"plan": dataclasses.asdict(plan), "seconds": elapsed, "rows": rows}, indent=1) + "\n")
    return rows, elapsed


def check_output(args: argparse.Namespace, stem: str) -> Path:
    """``--out`` as a path, once it can take the results (and, with ``--render``, holds
    ``stem.json`` to render from).

    Raises:
      ValueError: a bad argument, named first in the message.
    """
    out = Path(args.out)
    require(not out.exists() or out.is_dir(), f"--out must be a folder, got the file {args.out!r}")
    saved = out / f"{stem}.json"
    require(not args.render or saved.is_file(),
            f"--render needs the results of a run in --out, but {str(saved)!r} does not exist; run without --render")
    return out


def plan_for(args: argparse.Namespace) -> Plan:
    """The plan the arguments ask for: the full or quick one, or its map alone with
    ``--policies``.

    Raises:
      ValueError: ``--policies`` names a policy the map cannot run.
    """
    plan = QUICK if args.quick else FULL
    if args.policies is None:
        return plan
    from flsmem.harness.evaluate import split_policies

    names = tuple(split_policies(args.policies))
    try:
        return dataclasses.replace(plan, policies=names, lag_settings=(), signal_settings=(), retention_settings=())
    except ValueError as error:
        raise ValueError(f"--policies: {error}") from None


def run_cli(args: argparse.Namespace) -> list[dict]:
    stem = "quick" if args.quick else "regime"
    with checking("flsmem regime"):
        out = check_output(args, stem)
        plan = plan_for(args)
    rows, elapsed = measure_or_render(plan, out, stem, args.render)
    options = (" --quick" if args.quick else "")
    if args.policies:
        options += f" --policies {shlex.quote(','.join(plan.policies))}"
    text = f"flsmem regime{options} ({elapsed:.0f} s)\n\n" + format_tables(rows)
    print(text)
    (out / f"{stem}.txt").write_text(text + "\n")
    plot_map(rows, str(out / f"{stem}-map.png"))
    plot_curves(rows, str(out / f"{stem}-curves.png"))
    return rows


if __name__ == "__main__":
    main()
