"""Online learning under a distribution shift: does serving-time learning close the gap?

``flsmem shift`` deploys an estimator pretrained on one family of streams (the
*shifted* one, for example prose only) on another family, and compares, on the same
examples:

* the shifted estimator frozen (``offline``),
* the shifted estimator learning online as it serves (``online``, at each learning rate),
* an estimator pretrained on the target family (``in_family``), frozen and online.

Two target families (``--family``):

* ``tasks``: the controlled tasks of :mod:`flsmem.models.tasks`, served by the task
  model; the shifted estimators were pretrained on the tiny model's prose;
* ``ruler``: RULER's needle tasks served by SmolLM2-135M, teacher-forced
  (:mod:`flsmem.harness.ruler.forced`: a sample counts where every token of its gold
  answer is predicted), with essay haystacks of the held-out books; the shifted
  estimators are the ones pretrained on SmolLM2's prose, the in-family ones on SmolLM2's
  teacher-forced needle tasks with training-split haystacks and other seeds
  (``train_estimator --sources ruler``).

The test examples arrive as one **stream of requests**: batches of ``--batch`` windows,
one after another, as a server would see them. A learning estimator carries what it
learned from one request to the next (:func:`flsmem.estimator.carry_over`), and labels
what it still has in flight when a request ends (:func:`flsmem.estimator.flush`), as
pretraining does. That is the only way it can learn from these windows at all: with
the horizon it was trained with (256 queries), no label matures inside a 256-token
window, so an estimator that forgets between requests never takes a step.

By default each task is its own stream. ``--order sequential`` serves every task in one
stream, one after another; ``--order interleaved`` serves them in one stream whose every
request holds an equal share of each task, so every optimizer step learns from the
whole family. ``--optimizer pretrained`` starts online learning from the Adam state the
checkpoints' pretraining ended with, instead of a fresh one. ``--against DIR`` adds
each online variant's difference from another run on the same examples.

The goal: online updates recover at least half of the gap between the shifted and the
in-family estimator, ``(online - offline) / (in_family - offline)``, pooled over tasks
and budgets, within the one stream. Each pretraining seed of the shifted family is
paired with the same seed of the in-family one; the figure is given per seed, as mean
± sd, and with a 95% bootstrap interval over examples.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from fractions import Fraction
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
from tqdm.auto import tqdm

from flsmem.harness.arguments import checking, make_parser
from flsmem.validate import require

__all__ = ["ShiftPlan", "QUICK", "RULER", "stream", "run", "references", "target_tasks", "recovered", "against", "format_report", "format_against", "main"]

CHUNK = 16
RESAMPLES = 10_000
OPTIMIZERS = ("fresh", "pretrained")
ORDERS = ("per-task", "sequential", "interleaved")
FAMILIES = ("tasks", "ruler")


@dataclasses.dataclass(frozen=True)
class ShiftPlan:
    """What one shift experiment measures.

    Attributes:
      shifted, in_family: estimator checkpoints, one per pretraining seed; the i-th of
        each are paired.
      family: the target family: ``"tasks"`` (the controlled tasks, the task model) or
        ``"ruler"`` (RULER's needle tasks, SmolLM2-135M).
      tasks: tasks of the family the estimators are deployed on.
      fractions: memory budgets, as fractions of the task window.
      learning_rates: Adam step sizes of the online variants.
      seeds, examples: the test examples (``examples`` per seed), streamed in this order.
      batch: windows per request of the stream.
      task_context: tokens per task window.
      optimizer: the optimizer state online learning starts from: ``"fresh"`` Adam
        moments, or the ``"pretrained"`` ones each checkpoint's pretraining ended with.
      order: how the tasks' windows make streams: ``"per-task"``, one stream per task;
        ``"sequential"``, one stream serving the tasks one after another;
        ``"interleaved"``, one stream whose every request holds ``batch / len(tasks)``
        windows of each task.
      references: policies measured on the same examples and budgets for scale
        (:func:`references`), for example the full cache, h2o and the oracle.
    """

    shifted: tuple[str, ...]
    in_family: tuple[str, ...]
    tasks: tuple[str, ...] = ("passkey", "recall", "repeat", "chain")
    fractions: tuple[float, ...] = (1 / 16, 1 / 8, 1 / 4)
    learning_rates: tuple[float, ...] = (1e-3, 1e-2)
    seeds: tuple[int, ...] = (0, 1, 2)
    examples: int = 32
    batch: int = 8
    task_context: int = 256
    optimizer: str = "fresh"
    order: str = "per-task"
    family: str = "tasks"
    references: tuple[str, ...] = ()

    def __post_init__(self):
        from flsmem.harness.ruler.tasks import NIAH
        from flsmem.models.tasks import TASKS

        require(self.family in FAMILIES, f"--family must be one of {', '.join(FAMILIES)}, got {self.family!r}")
        require(self.optimizer in OPTIMIZERS, f"--optimizer must be one of {', '.join(OPTIMIZERS)}, "
                                              f"got {self.optimizer!r}")
        require(len(self.shifted) >= 1 and len(self.shifted) == len(self.in_family),
                f"--shifted and --in-family must name the same number (>= 1) of checkpoints, one per pretraining "
                f"seed, got {len(self.shifted)} and {len(self.in_family)}")
        for name, paths in (("--shifted", self.shifted), ("--in-family", self.in_family)):
            for path in paths:
                require((Path(path) / "params").is_dir(),
                        f"{name} must name estimator checkpoints (folders holding params/), got {path!r}")
                require(self.optimizer == "fresh" or (Path(path) / "optimizer").is_dir(),
                        f"--optimizer pretrained needs checkpoints saved with their optimizer state "
                        f"(train/train_estimator.py --out saves it); {path!r} has none")
        # The estimators differ only in what they were pretrained on: one policy serves all.
        first = _estimator_settings(self.shifted[0])
        for path in self.shifted[1:] + self.in_family:
            require(_estimator_settings(path) == first,
                    f"--in-family and --shifted checkpoints must share the estimator's settings (horizon, label, "
                    f"width, ...); {path!r} differs from {self.shifted[0]!r}")
        known = TASKS if self.family == "tasks" else tuple(NIAH)
        unknown = sorted(set(self.tasks) - set(known))
        require(self.tasks and not unknown, f"--tasks must be among {', '.join(known)} for --family {self.family}, "
                                            f"got {','.join(self.tasks)}")
        require(self.fractions and all(0 < f < 1 for f in self.fractions),
                f"--fractions must lie in (0, 1), got {self.fractions}")
        require(self.learning_rates and all(lr > 0 for lr in self.learning_rates),
                f"--learning-rates must be positive, got {self.learning_rates}")
        require(self.seeds and self.examples >= 1, f"seeds and examples >= 1 are needed, got {self.seeds}, "
                                                   f"{self.examples}")
        total = len(self.seeds) * self.examples
        require(1 <= self.batch and total % self.batch == 0,
                f"--batch must divide the {total} examples of a task's stream, got {self.batch}")
        require(self.order in ORDERS, f"--order must be one of {', '.join(ORDERS)}, got {self.order!r}")
        from flsmem.harness.evaluate import is_policy_name

        bad = [name for name in self.references if not is_policy_name(name)]
        require(not bad, f"references must be policy names, got {bad}")
        if self.order == "interleaved":
            share = self.batch // len(self.tasks)
            require(share >= 1 and share * len(self.tasks) == self.batch and total % share == 0,
                    f"--order interleaved needs --batch a multiple of the {len(self.tasks)} tasks whose share divides "
                    f"the {total} examples of each task, got {self.batch}")


def _estimator_settings(path: str) -> dict:
    """The settings of a checkpoint that make its policy (what :func:`flsmem.estimator.from_checkpoint` reads)."""
    from flsmem import estimator as E

    settings = E.load_settings(path)
    return {k: settings.get(k) for k in ("hidden", "horizon", "snapshots", "label", "loss", "prior")}


def _rates(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(r) for r in text.split(",") if r.strip())
    except ValueError:
        raise ValueError(f"--learning-rates must be comma-separated numbers like 1e-3,1e-2, got {text!r}") from None


def _paths(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


SHIFTED = tuple(f"results/shift/estimators/prose-seed{s}" for s in range(4))
IN_FAMILY = tuple(f"results/shift/estimators/tasks-seed{s}" for s in range(4))
# Two tasks, one budget, one seed of examples, the larger rate: minutes.
QUICK = dict(tasks=("repeat", "chain"), fractions=(1 / 8,), learning_rates=(1e-2,), seeds=(3,), examples=32)
# The RULER family on SmolLM2: its own checkpoints and a smaller plan, fixed before the
# run. Two needle tasks whose answers the full cache gives at 256 tokens, half the
# window kept (where the oracle answers and h2o nearly never does), one interleaved
# stream of 12 requests, the rate that recovered most on the tiny model.
RULER = dict(
    shifted=("checkpoints/estimator-smollm2",) + tuple(f"results/learned-smollm2/estimators/seed{s}" for s in (1, 2, 3)),
    in_family=tuple(f"results/shift/smollm2/estimators/ruler-seed{s}" for s in range(4)),
    tasks=("niah_single_2", "niah_multikey_1"), fractions=(1 / 2,), learning_rates=(1e-2,), seeds=(0,), examples=48,
    order="interleaved", references=("full", "h2o", "rmm", "oracle"))


def _start(path: str, optimizer: str = "fresh") -> dict:
    """The estimator at ``path`` as the state a stream starts from (parameters and the
    ``optimizer`` state, fresh or pretrained, in :func:`flsmem.estimator.carry_over` form)."""
    from flsmem import estimator as E

    policy = E.from_checkpoint(path)
    start = E.carry_over(policy.init_aux(policy, 1, 1, 1), layers_axis=False)
    return start | {"opt": E.load_optimizer(path, policy)} if optimizer == "pretrained" else start


def stream(model, windows: np.ndarray, policy, budget: int, start: dict,
           batch: int) -> tuple[np.ndarray, np.ndarray, int]:
    """``windows`` served as consecutive requests of ``batch`` windows under ``policy``
    (a learned policy) at ``budget``, the estimator starting from ``start``.

    With ``policy.params.online`` the estimator learns as it serves, labels what is in
    flight at the end of each request (:func:`flsmem.estimator.flush`) and carries
    what it learned to the next; frozen, every request starts from ``start``.

    Returns:
      ``(nll, hit, updates)``: per-token NLL and hits ``[W, T]`` (as
      :func:`flsmem.harness.evaluate.evaluate_windows`), and the optimizer steps taken.
    """
    from flsmem import estimator as E
    from flsmem.harness.evaluate import evaluate_windows

    learned, nll, hit = start, [], []
    for first in range(0, len(windows), batch):
        n, h, stats = evaluate_windows(model, windows[first:first + batch], policy, budget, chunk=CHUNK, aux=learned)
        nll.append(n)
        hit.append(h)
        if policy.params.online:
            learned = E.carry_over(E.flush(policy, stats["aux"]))
    return np.concatenate(nll), np.concatenate(hit), int(learned["updates"])


def _variants(plan: ShiftPlan) -> list[float | None]:
    """Learning rates of the variants; None is the frozen one."""
    return [None, *plan.learning_rates]


def run(plan: ShiftPlan, progress: bool = True, targets: tuple | None = None) -> list[dict]:
    """Every variant of every estimator on every task and budget, as rows with the
    per-example accuracies (``targets``: :func:`target_tasks` of the plan, made here
    when not given)."""
    from flsmem import estimator as E

    model, settings = targets or target_tasks(plan)
    estimators = [("shifted", i, path) for i, path in enumerate(plan.shifted)]
    estimators += [("in_family", i, path) for i, path in enumerate(plan.in_family)]
    starts = {path: _start(path, plan.optimizer) for _, _, path in estimators}
    # Each stream: the tasks it serves and, per task, where its windows sit in the stream.
    per_task = len(settings[plan.tasks[0]].windows)
    if plan.order == "per-task":
        streams = [((task,), np.arange(per_task)[None]) for task in plan.tasks]
    else:
        share = per_task if plan.order == "sequential" else plan.batch // len(plan.tasks)
        streams = [(plan.tasks, _stream_order(len(plan.tasks), per_task, share))]
    total = len(streams) * len(plan.fractions) * len(estimators) * len(_variants(plan))
    bar = tqdm(total=total, desc="shift", unit="stream", disable=not progress)
    rows = []
    for tasks, order in streams:
        first = settings[tasks[0]]
        windows = np.empty((order.size,) + first.windows.shape[1:], first.windows.dtype)
        for task, places in zip(tasks, order):
            windows[places] = settings[task].windows
        for fraction in plan.fractions:
            budget = int(round(fraction * first.context))
            for rate in _variants(plan):
                # One policy per variant and budget: each estimator enters as its starting
                # state, so every checkpoint shares one compiled loop (a frozen one's rate
                # is never used).
                policy = E.from_checkpoint(plan.shifted[0], online=rate is not None, learning_rate=rate or 1e-3,
                                           recent=budget // 2)
                for family, index, path in estimators:
                    bar.set_postfix_str(f"{'+'.join(tasks)} B={budget} {family}[{index}] {rate or 'offline'}")
                    nll, hit, updates = stream(model, windows, policy, budget, starts[path], plan.batch)
                    for task, places in zip(tasks, order):
                        per_example = settings[task].score(nll[places], hit[places])
                        rows.append({"task": task, "fraction": fraction, "budget": budget, "estimator": family,
                                     "pretraining": index, "learning_rate": rate, "updates": updates,
                                     "value": float(per_example.mean()), "per_example": per_example.tolist()})
                    bar.update(1)
    bar.close()
    # A stream of several tasks yields their rows at once; the report reads them task by task.
    rows.sort(key=lambda r: (plan.tasks.index(r["task"]), plan.fractions.index(r["fraction"])))
    return rows


def references(plan: ShiftPlan, progress: bool = True, targets: tuple | None = None) -> list[dict]:
    """``plan.references`` on the same examples and budgets as :func:`run` (``targets``
    as there), each request served on its own (no policy here carries anything between
    requests), as rows ``{task, fraction, budget, policy, value, per_example}``."""
    from flsmem.harness.evaluate import evaluate_windows, future_attention, make_policy

    if not plan.references:
        return []
    model, settings = targets or target_tasks(plan)
    bar = tqdm(total=len(plan.tasks) * len(plan.fractions) * len(plan.references), desc="references",
               unit="policy", disable=not progress)
    rows = []
    for task in plan.tasks:
        setting = settings[task]
        for fraction in plan.fractions:
            budget = int(round(fraction * setting.context))
            for name in plan.references:
                bar.set_postfix_str(f"{task} B={budget} {name}")
                policy = make_policy(name, budget)
                hits = []
                for first in range(0, len(setting.windows), plan.batch):
                    windows = setting.windows[first:first + plan.batch]
                    futures = future_attention(model, windows, CHUNK) if policy.needs_future else None
                    hits.append(evaluate_windows(model, windows, policy, budget, chunk=CHUNK, futures=futures)[1])
                per_example = setting.score(None, np.concatenate(hits))
                rows.append({"task": task, "fraction": fraction, "budget": budget, "policy": name,
                             "value": float(per_example.mean()), "per_example": per_example.tolist()})
                bar.update(1)
    bar.close()
    return rows


class _Task(NamedTuple):
    """One task's test examples: ``windows [N, T + 1]``, ``context`` (T),
    ``score(nll, hit)``, the per-example accuracy, and for RULER's tasks the answer's
    targets ``[N, T]``."""

    windows: np.ndarray
    context: int
    score: Callable
    answer: np.ndarray | None = None


def target_tasks(plan: ShiftPlan) -> tuple[object, dict[str, _Task]]:
    """The target family's model and each task's test examples (``plan.examples`` per
    seed of ``plan.seeds``, one seed after another)."""
    if plan.family == "tasks":
        from flsmem.harness import regime

        model = regime.tasks_model()
        setting_plan = dataclasses.replace(regime.QUICK, tasks=plan.tasks, seeds=plan.seeds,
                                           examples=plan.examples, task_context=plan.task_context)
        settings = [regime.task_setting(task, setting_plan, model) for task in plan.tasks]
        return model, {task: _Task(s.windows, s.context, s.score) for task, s in zip(plan.tasks, settings)}
    from flsmem.harness.ruler.forced import ForcedBatch, forced_batch
    from flsmem.models.smollm2 import load_smollm2

    model, tokenizer = load_smollm2()
    tasks = {}
    for task in plan.tasks:
        parts = [forced_batch(task, plan.task_context, plan.examples, tokenizer, seed=seed) for seed in plan.seeds]
        batch = ForcedBatch(task, np.concatenate([b.tokens for b in parts]), np.concatenate([b.answer for b in parts]))
        tasks[task] = _Task(batch.tokens, plan.task_context, lambda nll, hit, batch=batch: batch.accuracy(hit),
                            batch.answer)
    return model, tasks


def _stream_order(tasks: int, windows: int, share: int) -> np.ndarray:
    """``[tasks, windows]``: where each task's windows sit in one stream that takes
    ``share`` consecutive windows of each task in turn (``share = windows``: the tasks
    one after another)."""
    turn, within = np.divmod(np.arange(windows), share)
    return np.stack([turn * tasks * share + task * share + within for task in range(tasks)])


def _cells(rows: list[dict]) -> list[tuple[str, float]]:
    return list(dict.fromkeys((r["task"], r["fraction"]) for r in rows))


def _values(rows: list[dict], family: str, rate: float | None) -> np.ndarray:
    """Per-example accuracies ``[seeds, cells, examples]`` of one variant."""
    at = {(r["estimator"], r["learning_rate"], r["pretraining"], r["task"], r["fraction"]): r["per_example"]
          for r in rows}
    seeds = sorted({r["pretraining"] for r in rows})
    return np.asarray([[at[(family, rate, s, task, fraction)] for task, fraction in _cells(rows)] for s in seeds])


def recovered(rows: list[dict], rate: float, seed: int = 0) -> dict:
    """The share of the gap that online learning at ``rate`` recovers:
    ``mean(online - offline) / mean(in_family - offline)`` of the shifted start,
    pooled over cells and examples, per pretraining seed and over all seeds, with the
    gain and the gap themselves; intervals are 95% bootstrap intervals that resample
    each task's examples (one draw for all its budgets and seeds, since every variant
    saw the same examples).

    Returns:
      ``{"ratio", "gain", "gap"}``, each ``(value, low, high)``, and ``"per_seed"``, the
      ratio of each pretraining seed.
    """
    offline = _values(rows, "shifted", None)
    gain = _values(rows, "shifted", rate) - offline
    gap = _values(rows, "in_family", None) - offline

    def ratio(a, b):
        # A gap of 0 or below leaves nothing to recover: no ratio.
        return float(a / b) if b > 0 else float("nan")

    per_seed = [ratio(g.mean(), d.mean()) for g, d in zip(gain, gap)]
    gains, gaps = _resampled(rows, [gain, gap], seed)
    ratios = np.divide(gains, gaps, out=np.full_like(gains, np.nan), where=gaps != 0)
    return {"ratio": _summary(ratio(gain.mean(), gap.mean()), ratios), "gain": _summary(gain.mean(), gains),
            "gap": _summary(gap.mean(), gaps), "per_seed": per_seed}


def _resampled(rows: list[dict], arrays: list[np.ndarray], seed: int) -> list[np.ndarray]:
    """Bootstrap means of each ``[seeds, cells, examples]`` array of ``rows``' cells:
    each task's examples are drawn afresh in every resample, one draw for all its
    budgets and seeds and for every array (every variant saw the same examples)."""
    tasks = [task for task, _ in _cells(rows)]
    rng = np.random.default_rng(seed)
    examples = arrays[0].shape[-1]
    draw = {task: rng.integers(examples, size=(RESAMPLES, examples)) for task in dict.fromkeys(tasks)}
    picks = np.stack([draw[task] for task in tasks], axis=1)  # [resamples, cells, examples]
    return [np.take_along_axis(a.mean(axis=0)[None], picks, axis=-1).mean(axis=(1, 2)) for a in arrays]


def _summary(value, draws) -> tuple[float, float, float]:
    low, high = np.nanpercentile(draws, [2.5, 97.5])
    return float(value), float(low), float(high)


def against(rows: list[dict], base: list[dict], seed: int = 0) -> list[dict]:
    """Each online variant of ``rows`` against the same variant of another run
    ``base`` on the same examples and estimators (for example another optimizer
    start): the pooled difference ``rows - base`` over the whole stream and each of
    its halves, with 95% bootstrap intervals over examples (as :func:`recovered`).

    Raises:
      ValueError: the runs' frozen estimators differ, so they did not serve the same
        examples from the same checkpoints.
    """
    def layout(run):
        return _cells(run), sorted({r["pretraining"] for r in run})

    if layout(rows) != layout(base):
        raise ValueError("--against must name a run on the same examples and checkpoints; its tasks, budgets or "
                         "pretraining seeds differ")
    for family in ("shifted", "in_family"):
        if not np.array_equal(_values(rows, family, None), _values(base, family, None)):
            raise ValueError(f"--against must name a run on the same examples and checkpoints; its {family} "
                             f"offline accuracies differ")
    rates = sorted({r["learning_rate"] for r in rows if r["learning_rate"] is not None}
                   & {r["learning_rate"] for r in base if r["learning_rate"] is not None})
    compared = []
    for family in ("shifted", "in_family"):
        for rate in rates:
            diff = _values(rows, family, rate) - _values(base, family, rate)
            half = diff.shape[-1] // 2
            for part, kept in (("whole", slice(None)), ("first", slice(0, half)), ("second", slice(half, None))):
                value = diff[..., kept]
                (draws,) = _resampled(rows, [value], seed)
                compared.append({"family": family, "rate": rate, "half": part,
                                 "difference": _summary(value.mean(), draws)})
    return compared


def _fraction(f: float) -> str:
    return str(Fraction(f).limit_denominator(64))


def _label(family: str, rate: float | None) -> str:
    return f"{family} {'offline' if rate is None else f'online {rate:g}'}"


def format_report(rows: list[dict], reference_rows: list[dict] = ()) -> str:
    """Accuracy per task and budget (mean ± sd over pretraining seeds), the optimizer
    steps taken, the gap recovered per learning rate, the goal's check, and the
    reference policies' accuracy on the same examples where :func:`references` gave it."""
    rates = sorted({r["learning_rate"] for r in rows if r["learning_rate"] is not None})
    present = {(r["estimator"], r["learning_rate"]) for r in rows}
    variants = [(family, rate) for family in ("shifted", "in_family") for rate in [None, *rates]
                if (family, rate) in present]
    seeds = len({r["pretraining"] for r in rows})
    lines = [f"## accuracy after the gap, mean ± sd over {seeds} pretraining seeds", "",
             "| task | budget | " + " | ".join(_label(f, r) for f, r in variants) + " |",
             "|---|---|" + "---|" * len(variants)]
    for task, fraction in _cells(rows):
        cells = []
        for family, rate in variants:
            values = [r["value"] for r in rows if (r["task"], r["fraction"], r["estimator"], r["learning_rate"])
                      == (task, fraction, family, rate)]
            cells.append(f"{np.mean(values):.3f} ± {np.std(values, ddof=1) if len(values) > 1 else 0:.3f}")
        budget = next(r["budget"] for r in rows if (r["task"], r["fraction"]) == (task, fraction))
        lines.append(f"| {task} | {budget} ({_fraction(fraction)}) | " + " | ".join(cells) + " |")
    steps = {rate: sorted({r["updates"] for r in rows if r["learning_rate"] == rate}) for rate in rates}
    lines += ["", "optimizer steps taken over one stream: " + ", ".join(
        f"online {rate:g}: {'/'.join(map(str, s))}" for rate, s in steps.items()) + "; offline: 0"]
    lines += ["", "## gap recovered by online learning, from the shifted start (accuracy, pooled over tasks, budgets "
                  "and examples; [95% bootstrap over examples])", "",
              "| learning rate | gap: in_family - offline | gain: online - offline | recovered: gain / gap | "
              "per pretraining seed | mean ± sd over seeds |", "|---|---|---|---|---|---|"]

    def shown(value, low, high, digits=4):
        return f"{value:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}]"

    checks = []
    for rate in rates:
        got = recovered(rows, rate)
        per_seed = np.asarray(got["per_seed"])
        spread = np.std(per_seed, ddof=1) if len(per_seed) > 1 else 0.0
        # A ratio to a gap of 0 or below (none, or the shifted estimator ahead) means nothing.
        positive = got["gap"][0] > 0
        ratio = shown(*got["ratio"], digits=2) if positive else "n/a: no gap"
        seeds = ", ".join("n/a" if np.isnan(v) else f"{v:+.2f}" for v in per_seed)
        over_seeds = "n/a" if np.isnan(per_seed).any() else f"{np.mean(per_seed):+.2f} ± {spread:.2f}"
        lines.append(f"| {rate:g} | {shown(*got['gap'])} | {shown(*got['gain'])} | {ratio} | {seeds} | {over_seeds} |")
        # A gap whose interval reaches 0 leaves nothing measurable to recover.
        measurable = got["gap"][1] > 0
        if positive:
            text = (f"online {rate:g} recovers {got['ratio'][0]:+.2f} of the gap (goal >= 0.5)"
                    + ("" if measurable else "; no measurable gap: its interval reaches 0"))
        else:
            text = f"online {rate:g}: no gap to recover (in_family - offline is {got['gap'][0]:+.4f}; goal >= 0.5 of it)"
        checks.append((text, measurable and got["ratio"][0] >= 0.5))
    lines += ["", "## along the stream: each half of every task's stream (accuracy, pooled over tasks, budgets, "
                  "examples and seeds)", "",
              "| learning rate | half | shifted offline | shifted online | in_family offline | in_family online | "
              "recovered: gain / gap |", "|---|---|---|---|---|---|---|"]
    offline, target = _values(rows, "shifted", None), _values(rows, "in_family", None)
    for rate in rates:
        online = _values(rows, "shifted", rate)
        target_online = _values(rows, "in_family", rate) if ("in_family", rate) in present else None
        half = offline.shape[-1] // 2
        for name, part in (("first", slice(0, half)), ("second", slice(half, None))):
            gap = (target - offline)[..., part].mean()
            cells = [offline[..., part].mean(), online[..., part].mean(), target[..., part].mean()]
            cells = [f"{v:.3f}" for v in cells]
            cells.append("" if target_online is None else f"{target_online[..., part].mean():.3f}")
            ratio = f"{(online - offline)[..., part].mean() / gap:+.2f}" if gap > 0 else "n/a: no gap"
            lines.append(f"| {rate:g} | {name} | " + " | ".join(cells) + f" | {ratio} |")
    if reference_rows:
        names = list(dict.fromkeys(r["policy"] for r in reference_rows))
        value = {(r["task"], r["fraction"], r["policy"]): r for r in reference_rows}
        lines += ["", "## the same examples under other policies (accuracy; each request served on its own)", "",
                  "| task | budget | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
        for task, fraction in dict.fromkeys((r["task"], r["fraction"]) for r in reference_rows):
            budget = value[(task, fraction, names[0])]["budget"]
            lines.append(f"| {task} | {budget} ({_fraction(fraction)}) | "
                         + " | ".join(f"{value[(task, fraction, n)]['value']:.3f}" for n in names) + " |")
    lines += ["", "## goal", ""] + [f"{'holds ' if ok else 'FAILS '} {text}" for text, ok in checks]
    return "\n".join(lines)


def format_against(compared: list[dict], base: str) -> str:
    """The table of :func:`against`, ``base`` naming the other run."""
    lines = [f"## against {base}: this run minus that one, same examples and checkpoints (accuracy, pooled over "
             f"tasks, budgets, examples and seeds; [95% bootstrap over examples])", "",
             "| variant | whole stream | first half | second half |", "|---|---|---|---|"]
    for family, rate in dict.fromkeys((c["family"], c["rate"]) for c in compared):
        cells = {c["half"]: "{:+.3f} [{:+.3f}, {:+.3f}]".format(*c["difference"]) for c in compared
                 if (c["family"], c["rate"]) == (family, rate)}
        lines.append(f"| {_label(family, rate)} | {cells['whole']} | {cells['first']} | {cells['second']} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--family", default="tasks", metavar="|".join(FAMILIES),
                        help="the target family: the controlled tasks on the task model, or RULER's needle tasks on "
                             "SmolLM2-135M (teacher-forced; its own defaults for every option below)")
    parser.add_argument("--shifted", metavar="DIRS",
                        help="comma-separated estimator checkpoints pretrained off the target family, one per seed "
                             f"(tasks: {','.join(SHIFTED)}; ruler: {','.join(RULER['shifted'])})")
    parser.add_argument("--in-family", metavar="DIRS",
                        help="the same number of checkpoints pretrained on the target family "
                             f"(tasks: {','.join(IN_FAMILY)}; ruler: {','.join(RULER['in_family'])})")
    parser.add_argument("--tasks", metavar="TASKS", help="comma-separated tasks of the family "
                                                        f"(tasks: {','.join(ShiftPlan.tasks)}; ruler: "
                                                        f"{','.join(RULER['tasks'])})")
    parser.add_argument("--fractions", metavar="FRACTIONS",
                        help="comma-separated budgets as fractions of the window, like 1/8,1/4 (tasks: 1/16,1/8,1/4; "
                             "ruler: 1/2)")
    parser.add_argument("--learning-rates", metavar="RATES",
                        help="comma-separated Adam step sizes of the online variants (tasks: 1e-3,1e-2; ruler: 1e-2)")
    parser.add_argument("--batch", type=int, default=ShiftPlan.batch, help="windows per request of the stream")
    parser.add_argument("--optimizer", default=ShiftPlan.optimizer, metavar="|".join(OPTIMIZERS),
                        help="the optimizer state online learning starts from: fresh Adam moments, or those each "
                             "checkpoint's pretraining ended with (checkpoints saved with them)")
    parser.add_argument("--order", metavar="|".join(ORDERS),
                        help="one stream per task, or one stream of every task: one task after another, or each "
                             "request holding an equal share of each task's windows (tasks: per-task; ruler: "
                             "interleaved)")
    parser.add_argument("--quick", action="store_true",
                        help="repeat and chain, budget 1/8, one seed of examples (3, which the full run does not "
                             "use), learning rate 1e-2")
    parser.add_argument("--out", help="folder for shift.json and shift.txt (tasks: results/shift; ruler: "
                                      "results/shift/smollm2)")
    parser.add_argument("--render", action="store_true", help="measure nothing: rewrite from the JSON in --out")
    parser.add_argument("--against", metavar="DIR",
                        help="another run's --out folder, on the same examples and checkpoints: add each online "
                             "variant's difference from it")


def _plan(args: argparse.Namespace) -> ShiftPlan:
    """The plan the options ask for: the family's defaults, then ``--quick``'s, then
    each option given."""
    require(args.family in FAMILIES, f"--family must be one of {', '.join(FAMILIES)}, got {args.family!r}")
    require(not (args.quick and args.family != "tasks"), "--quick is a plan of --family tasks; for ruler give "
                                                         "--tasks, --fractions and --learning-rates instead")
    fields = ({"shifted": SHIFTED, "in_family": IN_FAMILY} if args.family == "tasks" else dict(RULER))
    fields |= QUICK if args.quick else {}
    given = {"shifted": args.shifted and _paths(args.shifted), "in_family": args.in_family and _paths(args.in_family),
             "tasks": args.tasks and _paths(args.tasks), "fractions": args.fractions and _fractions(args.fractions),
             "learning_rates": args.learning_rates and _rates(args.learning_rates)}
    fields |= {name: value for name, value in given.items() if value is not None}
    if args.order is not None:
        fields["order"] = args.order
    return ShiftPlan(family=args.family, batch=args.batch, optimizer=args.optimizer, **fields)


def _fractions(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(Fraction(f.strip())) for f in text.split(",") if f.strip())
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"--fractions must be comma-separated fractions like 1/8,1/4, got {text!r}") from None


def run_cli(args: argparse.Namespace) -> list[dict]:
    from flsmem.harness.regime import check_output

    stem = "quick" if args.quick else "shift"
    if args.out is None:
        args.out = {"ruler": "results/shift/smollm2"}.get(args.family, "results/shift")
    with checking("flsmem shift"):
        out = check_output(args, stem)
        base = None
        if args.against is not None:
            saved = Path(args.against) / f"{stem}.json"
            try:
                base = json.loads(saved.read_text()).get("rows")
            except (OSError, ValueError, AttributeError):
                base = None
            require(isinstance(base, list),
                    f"--against must name a folder holding a run's {stem}.json, got {args.against!r}")
        plan = None if args.render else _plan(args)
    if args.render:
        saved = json.loads((out / f"{stem}.json").read_text())
        rows, elapsed, optimizer = saved["rows"], saved["seconds"], saved["plan"].get("optimizer", "fresh")
        reference_rows = saved.get("references", [])
        order, batch = saved["plan"].get("order", "per-task"), saved["plan"]["batch"]
        family = saved["plan"].get("family", "tasks")
        tasks, fractions = tuple(saved["plan"]["tasks"]), tuple(saved["plan"]["fractions"])
    else:
        begin = time.perf_counter()
        targets = target_tasks(plan)  # the model and examples, loaded once for both
        rows = run(plan, targets=targets)
        reference_rows = references(plan, targets=targets)
        optimizer, order, batch, family = plan.optimizer, plan.order, plan.batch, plan.family
        tasks, fractions = plan.tasks, plan.fractions
        elapsed = time.perf_counter() - begin
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{stem}.json").write_text(json.dumps(
            {"plan": dataclasses.asdict(plan), "seconds": elapsed, "rows": rows, "references": reference_rows}) + "\n")
    flags = ((f" --family {family}" if family != "tasks" else "") + (" --quick" if args.quick else "")
             + (f" --optimizer {optimizer}" if optimizer != "fresh" else "")
             + (f" --order {order}" if order != "per-task" else "")
             + (f" --batch {batch}" if batch != ShiftPlan.batch else ""))
    if not args.quick:
        default = RULER if family == "ruler" else {"tasks": ShiftPlan.tasks, "fractions": ShiftPlan.fractions}
        flags += ((f" --tasks {','.join(tasks)}" if tasks != default["tasks"] else "")
                  + (f" --fractions {','.join(map(_fraction, fractions))}" if fractions != default["fractions"] else ""))
    text = f"flsmem shift{flags} ({elapsed:.0f} s)\n\n" + format_report(rows, reference_rows)
    if base is not None:
        with checking("flsmem shift"):
            compared = against(rows, base)
        text += "\n\n" + format_against(compared, args.against)
    print(text)
    (out / f"{stem}.txt").write_text(text + "\n")
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = make_parser("flsmem shift", __doc__)
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    main()
