"""The RULER report: accuracy tables and a plot from the rows of ``flsmem ruler``.

For each prompt length: a summary of the average accuracy per policy and budget under
each protocol, then per protocol a table of every task. A cell is the mean score in
percent over the samples with its 95% interval: a percentile bootstrap over the samples
(2,000 resamples, seeded; for the average, the samples of each task are resampled
within the task). A task whose full-cache score is below 20% is beyond the model: it
is marked and left out of the averages, since no eviction can be judged on it. Every
policy is then paired with each reference that was run, accumulation (h2o) and recency
(streaming_llm), on the same samples, at the same budget and at twice it.
Last, per length, how much of the benchmark's grid the file holds: each protocol, budget
and default policy, and whether every task within the model has its samples.
The plot shows the average accuracy against the budget, one panel per length and
protocol.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from flsmem.harness.ruler.protocols import PROTOCOLS
from flsmem.harness.ruler.tasks import TASKS

__all__ = ["KEY", "BEYOND", "REFERENCES", "RESAMPLES", "GRID_BUDGETS", "GRID_SAMPLES", "row_key", "load",
           "format_report", "plot", "write"]

# The fields that name one answer in a results file: the runner does not redo a row
# with the same values, and the report keeps the last of them. ``estimator`` (the
# checkpoint's folder name) is set for the learned policies only.
KEY = ("model", "task", "length", "index", "seed", "policy", "protocol", "budget", "evict_every", "estimator")
# Below this full-cache accuracy a task is beyond the model.
BEYOND = 0.2
# The baselines every other policy is paired against: accumulation and recency.
REFERENCES = ("h2o", "streaming_llm")
RESAMPLES = 2000
# The benchmark's grid at each length: every protocol at these budgets, each policy that
# ``flsmem ruler`` answers by default, and at least this many samples of every task
# within the model. The runner's defaults are these.
GRID_BUDGETS = (0.125, 0.25, 0.5)
GRID_SAMPLES = 50


def row_key(row: dict) -> tuple:
    """The :data:`KEY` of a row (None for a field it lacks, as ``estimator`` outside
    the learned policies).

    Raises:
      KeyError: when the row lacks a field that every row has.
    """
    return tuple(row[k] if k != "estimator" else row.get(k) for k in KEY)


def load(path: Path) -> list[dict]:
    """The rows of a results file, the last one of each answer when repeated; a line
    cut short by an interruption is skipped. A policy answered with several estimator
    checkpoints is reported once per checkpoint, as ``policy (checkpoint)``, its row
    keeping the policy's own name as ``base``."""
    rows = {}
    for line in Path(path).read_text().splitlines():
        try:
            row = json.loads(line)
            rows[row_key(row)] = row
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    estimators = defaultdict(set)
    for row in rows.values():
        estimators[row["policy"]].add(row.get("estimator"))
    return [{**row, "policy": f"{row['policy']} ({row.get('estimator')})", "base": row["policy"]}
            if len(estimators[row["policy"]]) > 1 else row for row in rows.values()]


def _policies(rows: list[dict]) -> list[str]:
    from flsmem.harness.evaluate import LEARNED_NAMES, POLICY_NAMES

    order = {name: i for i, name in enumerate(POLICY_NAMES + LEARNED_NAMES)}
    # Names outside the registry (wrapped ones) by name, so that the order is the same every run.
    return sorted({r["policy"] for r in rows}, key=lambda name: (order.get(name, len(order)), name))


def _by_sample(rows: list[dict]) -> dict[tuple, dict[str, dict[int, float]]]:
    """``{(length, protocol, policy, budget): {task: {sample index: score}}}``."""
    found: dict[tuple, dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        found[(r["length"], r["protocol"], r["policy"], r["budget"])][r["task"]][r["index"]] = r["score"]
    return found


def _scores(rows: list[dict]) -> dict[tuple, dict[str, np.ndarray]]:
    """``{(length, protocol, policy, budget): {task: scores in sample order}}``."""
    return {arm: {task: np.array([s[i] for i in sorted(s)]) for task, s in tasks.items()}
            for arm, tasks in _by_sample(rows).items()}


def _interval(per_task: list[np.ndarray]) -> tuple[float, float, float]:
    """Mean over tasks of each task's mean, and its 95% percentile-bootstrap interval
    (seeded here, so a figure that appears twice in a report has one interval)."""
    rng = np.random.default_rng(0)
    mean = float(np.mean([s.mean() for s in per_task]))
    draws = np.mean([s[rng.integers(len(s), size=(RESAMPLES, len(s)))].mean(axis=1) for s in per_task], axis=0)
    low, high = np.percentile(draws, [2.5, 97.5])
    return mean, float(low), float(high)


def _cell(per_task: list[np.ndarray] | None) -> str:
    if not per_task:
        return "–"
    mean, low, high = _interval(per_task)
    return f"{100 * mean:.0f} [{100 * low:.0f}–{100 * high:.0f}]"


def _average(got: dict[str, np.ndarray], tasks: list[str], most: dict[str, int],
             full: dict[str, np.ndarray] | None = None) -> str:
    """The average of ``got`` over ``tasks`` (the kept tasks the table holds). Its
    figure cannot be set beside the others' when it lacks some of those tasks, or has
    fewer samples of one than some other arm (``most``: the largest count per task): it
    says over how many tasks and how many samples a task it is, and, lacking tasks, what
    the full cache (``full``) scores on the ones it has."""
    have = [t for t in tasks if t in got]
    if not have:
        return _cell(None)
    notes = []
    if len(have) < len(tasks):
        notes.append(f"{len(have)} of {len(tasks)} tasks")
        if full and all(t in full for t in have):
            notes.append(f"full {100 * np.mean([full[t].mean() for t in have]):.0f} on them")
    counts = sorted({len(got[t]) for t in have})
    if any(len(got[t]) < most[t] for t in have):
        spread = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"
        notes.append(f"{spread} samples a task")
    return _cell([got[t] for t in have]) + (f" ({', '.join(notes)})" if notes else "")


def _most_samples(scores: dict, length: int) -> dict[str, int]:
    """The largest number of samples any arm of ``length`` has of each task."""
    most: dict[str, int] = defaultdict(int)
    for (n, *_), tasks in scores.items():
        if n == length:
            for task, s in tasks.items():
                most[task] = max(most[task], len(s))
    return most


def _present(scores: dict, length: int, kept: list[str], protocol: str | None = None) -> list[str]:
    """The kept tasks that some policy answered at ``length`` (under ``protocol``)."""
    found = {t for (n, proto, _, _), tasks in scores.items() if n == length and protocol in (None, proto)
             for t in tasks}
    return [t for t in kept if t in found]


def _beyond(scores: dict, length: int) -> set[str]:
    """Tasks of ``length`` whose full-cache accuracy is below :data:`BEYOND`."""
    full = [tasks for (n, _, policy, _), tasks in scores.items() if n == length and policy == "full"]
    if not full:
        return set()
    return {task for task, s in full[0].items() if s.mean() < BEYOND}


def _arms(scores: dict, length: int, protocol: str, policies: list[str]) -> list[tuple[str, float]]:
    found = {(p, b) for (n, proto, p, b) in scores if n == length and proto == protocol}
    return sorted(found, key=lambda arm: (policies.index(arm[0]), arm[1]))


def _summary(scores, length, policies, kept, most) -> list[str]:
    """Average accuracy: a row per policy, a column per protocol and budget. Every
    average is over the tasks answered at ``length`` under any protocol, so that one
    over fewer (a protocol not run on some tasks) says so, as within a protocol."""
    columns = sorted({(proto, b) for (n, proto, p, b) in scores if n == length and p != "full"},
                     key=lambda c: (PROTOCOLS.index(c[0]) if c[0] in PROTOCOLS else 9, c[1]))
    lines = ["| policy | " + " | ".join(f"{proto} {b:g}" for proto, b in columns) + " |",
             "|---" * (len(columns) + 1) + "|"]
    for policy in policies:
        cells = []
        for proto, b in columns:
            # The full cache answers alike under every protocol and budget: its one figure in every column.
            tasks = scores.get((length, proto, policy, 1.0 if policy == "full" else b), {})
            full = scores.get((length, proto, "full", 1.0))
            cells.append(_average(tasks, _present(scores, length, kept), most, full) if tasks else "–")
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    return lines


def _protocol_table(scores, length, protocol, policies, kept, beyond, most) -> list[str]:
    """Every task: a row per policy and budget, a column per task and the average."""
    tasks = [t for t in TASKS if any(t in s for (n, proto, _, _), s in scores.items()
                                     if n == length and proto == protocol)]
    header = [t + (" †" if t in beyond else "") for t in tasks]
    lines = ["| policy | budget | " + " | ".join(header) + " | average |", "|---" * (len(tasks) + 3) + "|"]
    for policy, budget in _arms(scores, length, protocol, policies):
        got = scores[(length, protocol, policy, budget)]
        cells = [_cell([got[t]] if t in got else None) for t in tasks]
        average = _average(got, [t for t in tasks if t in kept], most, scores.get((length, protocol, "full", 1.0)))
        lines.append(f"| {policy} | {'full' if policy == 'full' else f'{budget:g}'} | " + " | ".join(cells)
                     + f" | {average} |")
    return lines


def _difference(arm: dict, reference: dict, kept: list[str]) -> str:
    """``arm`` minus ``reference`` on the samples both answered, averaged over the kept
    tasks, with its paired 95% interval and the number of pairs."""
    pairs = []
    for task in kept:
        common = sorted(set(arm.get(task, {})) & set(reference.get(task, {})))
        if common:
            pairs.append(np.array([arm[task][i] - reference[task][i] for i in common]))
    if not pairs:
        return "–"
    mean, low, high = _interval(pairs)
    return f"{100 * mean:+.0f} [{100 * low:+.0f}, {100 * high:+.0f}] ({sum(map(len, pairs))})"


def _paired(by_sample, length, policies, kept, reference) -> list[str]:
    """Every other evicting policy against ``reference`` at the same budget and at twice
    it, paired over samples; nothing when no policy could be paired with it."""
    arms = sorted(((proto, p, b) for (n, proto, p, b) in by_sample
                   if n == length and p not in ("full", reference)),
                  key=lambda a: (PROTOCOLS.index(a[0]) if a[0] in PROTOCOLS else 9, policies.index(a[1]), a[2]))
    if not any(n == length and p == reference for (n, _, p, _) in by_sample):
        return []
    lines = [f"### Paired against {reference}", "",
             f"Percentage points, a policy's score minus {reference}'s on the same samples, averaged over the "
             "tasks both answered (those beyond the model left out), with a 95% bootstrap interval over "
             f"samples (resampled within each task) and, in parentheses, the number of pairs. {reference} at "
             f"twice the budget asks whether a policy does with B slots what {reference} does with 2B.", "",
             f"| protocol | policy | budget | minus {reference} | minus {reference} at twice the budget |",
             "|---|---|---|---|---|"]
    rows = []
    for protocol, policy, budget in arms:
        cells = [_difference(by_sample[(length, protocol, policy, budget)], by_sample[key], kept)
                 if key in by_sample else "–"
                 for key in ((length, protocol, reference, budget), (length, protocol, reference, 2 * budget))]
        if cells != ["–", "–"]:  # an arm with no pair at either budget says nothing
            rows.append(f"| {protocol} | {policy} | {budget:g} | " + " | ".join(cells) + " |")
    return lines + rows + [""] if rows else []


def _across_protocols(by_sample, length, policies, kept) -> list[str]:
    """Each evicting arm answered under several protocols: every later protocol minus the
    first (in :data:`PROTOCOLS`' order, question-agnostic first), paired over samples;
    nothing when no arm was."""
    found = defaultdict(list)
    for (n, protocol, policy, budget) in by_sample:
        if n == length and policy != "full":
            found[(policy, budget)].append(protocol)
    lines = []
    for (policy, budget), protocols in sorted(found.items(), key=lambda a: (policies.index(a[0][0]), a[0][1])):
        protocols = sorted(protocols, key=lambda p: PROTOCOLS.index(p) if p in PROTOCOLS else 9)
        first = by_sample[(length, protocols[0], policy, budget)]
        for later in protocols[1:]:
            difference = _difference(by_sample[(length, later, policy, budget)], first, kept)
            lines.append(f"| {policy} | {budget:g} | {later} minus {protocols[0]} | {difference} |")
    if not lines:
        return []
    return ["### Across protocols", "",
            "Percentage points, a policy's score under one protocol minus its score under another on the same "
            "samples and budget, averaged over the tasks both answered, with a 95% bootstrap interval over "
            "samples and, in parentheses, the number of pairs.", "",
            "| policy | budget | protocols | difference |", "|---|---|---|---|", *lines, ""]


def _checkpoints(rows, scores, length, kept) -> list[str]:
    """A policy answered with several estimator checkpoints: each checkpoint's average
    over the tasks every one of them answered, and their mean and standard deviation
    (ddof 1) over checkpoints; nothing when no policy was."""
    groups = defaultdict(dict)
    for r in rows:
        if r["length"] == length and "base" in r:
            groups[(r["protocol"], r["base"], r["budget"])][r["estimator"]] = r["policy"]
    lines = []
    for (protocol, policy, budget), labels in sorted(groups.items()):
        if len(labels) < 2:
            continue
        checkpoints = sorted(labels, key=str)
        arms = [scores[(length, protocol, labels[c], budget)] for c in checkpoints]
        shared = [t for t in kept if all(t in arm for arm in arms)]
        if not shared:
            continue
        averages = [100 * float(np.mean([arm[t].mean() for t in shared])) for arm in arms]
        cells = ", ".join(f"{c} {a:.0f}" for c, a in zip(checkpoints, averages))
        lines.append(f"| {protocol} | {policy} | {budget:g} | {len(shared)} | {cells} | "
                     f"{np.mean(averages):.1f} ± {np.std(averages, ddof=1):.1f} |")
    if not lines:
        return []
    return ["### Over estimator checkpoints", "",
            "A learned policy answered with several estimator checkpoints (pretraining seeds): each one's "
            "average accuracy over the tasks all of them answered, and the mean ± standard deviation over "
            "checkpoints.", "",
            "| protocol | policy | budget | tasks | each checkpoint | mean ± sd |", "|---|---|---|---|---|---|",
            *lines, ""]


def _coverage(by_sample, length, beyond) -> list[str]:
    """The grid's cells (:data:`GRID_BUDGETS`, every protocol, the runner's default
    policies): for each, the fewest samples of a task within the model that it holds,
    bold when it holds :data:`GRID_SAMPLES` of every one of them, and how many cells are
    complete. A task the full cache has not answered at ``length`` counts as within the
    model. The full cache answers alike under every budget: a cell per protocol."""
    from flsmem.harness.evaluate import POLICY_NAMES

    needed = [t for t in TASKS if t not in beyond]
    columns = [(protocol, budget) for protocol in PROTOCOLS for budget in GRID_BUDGETS]
    lines, complete, cells_in_all = [], 0, 0
    for policy in POLICY_NAMES:
        cells = []
        for protocol, budget in columns:
            got = by_sample.get((length, protocol, policy, 1.0 if policy == "full" else budget), {})
            have = [t for t in needed if t in got]
            least = min((len(got[t]) for t in have), default=0)
            done = len(have) == len(needed) and least >= GRID_SAMPLES
            if policy != "full" or budget == GRID_BUDGETS[0]:
                complete, cells_in_all = complete + done, cells_in_all + 1
            cells.append("–" if not have else f"**{least}**" if done else
                         f"{least}" + ("" if len(have) == len(needed) else f" ({len(have)} of {len(needed)} tasks)"))
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    budgets = ", ".join(f"{b:g}" for b in GRID_BUDGETS)
    return ["### Coverage of the grid", "",
            f"The fewest samples of a task that each cell holds, over the tasks within the model ({len(needed)}; "
            f"a task the full cache has not answered counts as within it); bold where every one of them has at "
            f"least {GRID_SAMPLES}. The grid: every protocol at budgets {budgets} and each policy `flsmem ruler` "
            "answers by default (the full cache once per protocol); arms outside it (other budgets, policies "
            f"given arguments, the learned ones) are in the tables above but not here. **Complete: {complete} of "
            f"{cells_in_all} cells.**", "",
            "| policy | " + " | ".join(f"{protocol} {budget:g}" for protocol, budget in columns) + " |",
            "|---" * (len(columns) + 1) + "|", *lines, ""]


def format_report(rows: list[dict], title: str) -> str:
    """The markdown report of ``rows``."""
    by_sample, scores, policies = _by_sample(rows), _scores(rows), _policies(rows)
    lines = [f"# {title}", "",
             "Accuracy in percent (RULER's string match: the share of the gold answers found in the answer), "
             f"mean over samples with a 95% percentile-bootstrap interval ({RESAMPLES} resamples). Budgets are "
             f"fractions of the prompt length kept per layer and KV head; the full cache keeps everything. "
             f"Tasks marked † score below {100 * BEYOND:.0f}% with the full cache: they are beyond the model and "
             "left out of the averages.", ""]
    for length in sorted({r["length"] for r in rows}):
        beyond = _beyond(scores, length)
        kept = [t for t in TASKS if t not in beyond]
        samples = sorted({len(s) for (n, *_), tasks in scores.items() if n == length for s in tasks.values()})
        lines += [f"## {length} tokens", "",
                  f"Samples per task: {', '.join(map(str, samples))}. Beyond the model: "
                  f"{', '.join(sorted(beyond)) or 'none'}.", "", "### Average accuracy", ""]
        most = _most_samples(scores, length)
        lines += _summary(scores, length, policies, kept, most) + [""]
        for protocol in [p for p in PROTOCOLS if any(k[0] == length and k[1] == p for k in scores)]:
            lines += [f"### {protocol}", ""]
            lines += _protocol_table(scores, length, protocol, policies, kept, beyond, most) + [""]
        for reference in REFERENCES:
            lines += _paired(by_sample, length, policies, kept, reference)
        lines += _across_protocols(by_sample, length, policies, kept)
        lines += _checkpoints(rows, scores, length, kept)
        lines += _coverage(by_sample, length, beyond)
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Average accuracy against the budget: a panel per length and protocol, a line per
    policy, the full cache dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scores, policies = _scores(rows), _policies(rows)
    lengths = sorted({r["length"] for r in rows})
    protocols = [p for p in PROTOCOLS if any(r["protocol"] == p for r in rows)]
    fig, axes = plt.subplots(len(lengths), len(protocols), figsize=(4.5 * len(protocols), 3.6 * len(lengths)),
                             squeeze=False, sharey=True)
    colours = plt.get_cmap("tab20")
    for row, length in enumerate(lengths):
        kept = [t for t in TASKS if t not in _beyond(scores, length)]
        for col, protocol in enumerate(protocols):
            ax, panel = axes[row][col], _present(scores, length, kept, protocol)
            for i, policy in enumerate(policies):
                _plot_policy(ax, scores, length, protocol, policy, panel, colours(i))
            ax.set_xscale("log", base=2)
            ax.set_title(f"{protocol}, {length} tokens", fontsize=9)
            ax.set_xlabel("budget (fraction of the prompt)")
            ax.grid(alpha=0.3)
        axes[row][0].set_ylabel("average accuracy (%)")
    if axes[0][-1].get_legend_handles_labels()[0]:
        axes[0][-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _plot_policy(ax, scores, length, protocol, policy, kept, colour) -> None:
    """``kept``: the tasks of the panel; a line over fewer of them says so in its label."""
    covered = set()

    def average(budget):
        tasks = scores.get((length, protocol, policy, budget), {})
        present = [t for t in kept if t in tasks]
        covered.update(present)
        return 100 * float(np.mean([tasks[t].mean() for t in present])) if present else None

    if policy == "full":
        value = average(1.0)
        if value is not None:
            ax.axhline(value, color="k", linestyle="--", linewidth=1, label="full")
        return
    points = [(b, average(b)) for (n, proto, p, b) in sorted(scores) if (n, proto, p) == (length, protocol, policy)]
    points = [(b, v) for b, v in points if v is not None]
    if points:
        style = {"color": "k", "linewidth": 2} if policy == "oracle" else {"color": colour}
        label = policy if len(covered) == len(kept) else f"{policy} ({len(covered)} of {len(kept)} tasks)"
        ax.plot(*zip(*points), marker="o", markersize=3, label=label, **style)


def write(results: Path) -> Path:
    """Write the report of ``results`` (JSON lines) beside it, as ``.md`` and ``.png``;
    returns the markdown's path."""
    results = Path(results)
    rows = load(results)
    models = sorted({Path(r["model"]).name for r in rows})
    title = f"RULER under eviction: {', '.join(models) or 'no results'}"
    markdown = results.with_suffix(".md")
    markdown.write_text(format_report(rows, title) + "\n")
    if rows:
        plot(rows, results.with_suffix(".png"), title)
    return markdown
