"""Paired differences between policies of one ``flsmem eval`` run, from its JSON.

Every policy of a run is scored on the same windows, so two policies are compared
window by window: the difference of their mean NLL per window, averaged over windows,
with a 95% percentile-bootstrap interval over windows (the windows are the independent
units; tokens within a window are not).

    python -m flsmem.harness.paired results/smollm2-peers.json "adakv(h2o)-h2o" "pyramid(snapkv)-snapkv"

prints a markdown table, one row per pair and budget (negative: the first policy is
better).

A learned policy is pretrained with several seeds and each checkpoint is measured in
its own run on the same windows. With ``--seeds``, the first policy of each pair is read
from every seed's run and the second from the main run:

    python -m flsmem.harness.paired results/adaptive/smollm2-stream.json "learned-h2o" \
        --seeds results/learned-smollm2/seed0.json results/learned-smollm2/seed1.json ...

gives each seed's increase over the full cache, their mean ± sd, and the paired
difference of the seeds' mean NLL per window from the second policy's, with its
interval over windows. The runs must hold the same windows (their full-cache NLL per
window must agree).

Two recipes, each pretrained with several seeds, are compared by giving the second
recipe's runs as ``--against-seeds``: the second policy of each pair is then their mean
per window, as the first is over ``--seeds``:

    python -m flsmem.harness.paired results/adaptive/gemma3/stream.json "learned-learned" \
        --seeds results/adaptive/gemma3/stream-learned-gemma3-{0,1,2,3}.json \
        --against-seeds results/adaptive/gemma3/stream-learned-general-{0,1,2,3}.json

A policy measured later, in a run of its own on the same windows, is compared with
the main run's policies by joining its rows to them (``--join``): the pairs are then
read as from one run.

    python -m flsmem.harness.paired results/adaptive/smollm2-stream.json "adaptive(rate=1e-9)-rmm" \
        --join results/adaptive/evicted/equal-smollm2-stream.json

A goal set as "within 10% of the better of h2o and rmm" reads the ratio of each
policy's increase over the full cache to the smallest of the references' at the same
budget, from the unrounded NLLs (``--ratio-to``, with the policies in place of pairs):

    python -m flsmem.harness.paired results/adaptive/smollm2-stream.json adaptive --ratio-to h2o,rmm
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from flsmem.harness.arguments import make_parser

__all__ = ["paired_difference", "table", "seeds_table", "join", "ratio_table", "main"]

RESAMPLES = 10_000


def paired_difference(a: list[float], b: list[float], seed: int = 0) -> tuple[float, float, float]:
    """Mean of ``a - b`` over windows and its 95% percentile-bootstrap interval."""
    diff = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    if diff.ndim != 1 or len(diff) == 0:
        raise ValueError(f"paired values must be two lists of the same positive length, got {len(a)} and {len(b)}")
    rng = np.random.default_rng(seed)
    draws = diff[rng.integers(len(diff), size=(RESAMPLES, len(diff)))].mean(axis=1)
    low, high = np.percentile(draws, [2.5, 97.5])
    return float(diff.mean()), float(low), float(high)


def _by_policy(run: dict) -> dict[tuple[str, int], dict]:
    """A run's rows by ``(policy, budget)``."""
    return {(r["policy"], r["budget"]): r for r in run["rows"]}


def _full(run: dict) -> dict:
    full = next((row for row in run["rows"] if row["policy"] == "full"), None)
    if full is None:
        raise ValueError("a run has no full-cache row: it is not the JSON of a flsmem eval run")
    return full


def _check_same_windows(run: dict, other: dict, name: str) -> None:
    """Refuse ``other`` unless its full cache scored the same windows as ``run``'s."""
    try:
        theirs = _full(other)["window_nll"]
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None
    mine = _full(run)["window_nll"]
    if len(theirs) != len(mine) or not np.allclose(theirs, mine, rtol=0, atol=1e-5):
        raise ValueError(f"{name} holds other windows than the main run (its full-cache NLL per window differs)")


def join(run: dict, others: list[dict]) -> dict:
    """``run`` with the policies of ``others``, runs on the same windows, added to its rows.

    Raises:
      ValueError: a run holds other windows, or measures a policy at a budget that an
        earlier run already holds.
    """
    rows = list(run["rows"])
    seen = set(_by_policy(run))
    for i, other in enumerate(others):
        _check_same_windows(run, other, f"--join run {i + 1}")
        for row in other["rows"]:
            if row["policy"] == "full":
                continue
            key = (row["policy"], row["budget"])
            if key in seen:
                raise ValueError(f"--join run {i + 1} measures {row['policy']} at budget {row['budget']} again")
            seen.add(key)
            rows.append(row)
    return {**run, "rows": rows}


def table(run: dict, pairs: list[tuple[str, str]]) -> str:
    """Markdown rows ``| first - second | budget | difference [95% interval] | windows better |``."""
    rows = _by_policy(run)
    budgets = sorted({r["budget"] for r in run["rows"] if r["policy"] != "full"})
    lines = ["| pair | budget | difference in NLL (nats/token) | 95% interval | windows where the first is better |",
             "|---|---|---|---|---|"]
    for first, second in pairs:
        for budget in budgets:
            a, b = rows.get((first, budget)), rows.get((second, budget))
            if a is None or b is None:
                continue
            if not a.get("window_nll") or not b.get("window_nll"):
                raise ValueError(f"the run has no per-window NLL for {first} or {second}: rerun flsmem eval")
            mean, low, high = paired_difference(a["window_nll"], b["window_nll"])
            better = sum(x < y for x, y in zip(a["window_nll"], b["window_nll"]))
            lines.append(f"| {first} − {second} | {budget} | {mean:+.4f} | [{low:+.4f}, {high:+.4f}] | "
                         f"{better} of {len(a['window_nll'])} |")
    return "\n".join(lines)


def _mean_row(runs: list[dict], policy: str, budget: int) -> dict | None:
    """A policy's NLL and per-window NLL at ``budget``, averaged over ``runs`` (None
    where a run lacks it)."""
    rows = [_by_policy(r).get((policy, budget)) for r in runs]
    if any(row is None for row in rows):
        return None
    return {"nll": float(np.mean([row["nll"] for row in rows])),
            "window_nll": list(np.mean([row["window_nll"] for row in rows], axis=0))}


def seeds_table(run: dict, seed_runs: list[dict], pairs: list[tuple[str, str]],
                against_runs: list[dict] | None = None) -> str:
    """Markdown rows ``| first − second | budget | first's increase over full per seed |
    mean ± sd | difference of the seeds' mean [95% interval] | seeds better |``: the first
    policy of each pair from every run of ``seed_runs``, the second from ``run`` or, when
    ``against_runs`` are given, their mean (a seed is better when it beats that mean).

    Raises:
      ValueError: a seed run holds other windows than ``run``, or lacks a policy.
    """
    base = _by_policy(run)
    full = _full(run)
    seeds = [_by_policy(r) for r in seed_runs]
    for i, r in enumerate(seed_runs):
        _check_same_windows(run, r, f"--seeds run {i + 1}")
    for i, r in enumerate(against_runs or []):
        _check_same_windows(run, r, f"--against-seeds run {i + 1}")
    budgets = sorted({row["budget"] for row in run["rows"] if row["policy"] != "full"})
    lines = ["| pair | budget | increase over full, per seed | mean ± sd | difference of the seeds' mean | "
             "95% interval | seeds better |", "|---|---|---|---|---|---|---|"]
    for first, second in pairs:
        for budget in budgets:
            theirs = _mean_row(against_runs, second, budget) if against_runs else base.get((second, budget))
            ours = [s.get((first, budget)) for s in seeds]
            if theirs is None or any(o is None for o in ours):
                continue
            increase = np.array([o["nll"] - full["nll"] for o in ours])
            mean_windows = np.mean([o["window_nll"] for o in ours], axis=0)
            mean, low, high = paired_difference(list(mean_windows), theirs["window_nll"])
            better = sum(o["nll"] < theirs["nll"] for o in ours)
            per_seed = ", ".join(f"{x:+.4f}" for x in increase)
            lines.append(f"| {first} − {second} | {budget} | {per_seed} | {increase.mean():+.4f} ± "
                         f"{increase.std(ddof=1) if len(ours) > 1 else 0.0:.4f} | {mean:+.4f} | "
                         f"[{low:+.4f}, {high:+.4f}] | {better} of {len(ours)} |")
    return "\n".join(lines)


def ratio_table(run: dict, policies: list[str], references: list[str]) -> str:
    """Markdown rows ``| policy | budget | increase over full | best reference | its
    increase | ratio |``: each policy's increase over the full cache against the smallest
    increase among ``references`` at the same budget.

    Raises:
      ValueError: a policy or a reference is not in the run at some budget.
    """
    rows = _by_policy(run)
    full = _full(run)["nll"]
    budgets = sorted({r["budget"] for r in run["rows"] if r["policy"] != "full"})
    lines = [f"| policy | budget | increase over full | better of {', '.join(references)} | its increase | ratio |",
             "|---|---|---|---|---|---|"]
    for budget in budgets:
        missing = [name for name in (*policies, *references) if (name, budget) not in rows]
        if missing:
            raise ValueError(f"the run has no {', '.join(missing)} at budget {budget}")
        best = min(references, key=lambda name: rows[name, budget]["nll"])
        floor = rows[best, budget]["nll"] - full
        for name in policies:
            increase = rows[name, budget]["nll"] - full
            # A reference no worse than the full cache leaves no increase to be a share of.
            ratio = f"{increase / floor:.2f}" if floor > 0 else "n/a"
            lines.append(f"| {name} | {budget} | {increase:+.4f} | {best} | {floor:+.4f} | {ratio} |")
    return "\n".join(lines)


def _names(text: str) -> list[str]:
    from flsmem.harness.evaluate import split_policies  # here, not above: it brings in JAX

    names = split_policies(text)
    if not names:
        raise argparse.ArgumentTypeError("needs at least one policy name, as in h2o,rmm")
    return names


def _pair(text: str) -> tuple[str, str]:
    # Names hold parentheses but no "-": split at the first "-" outside parentheses.
    depth = 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "-" and depth == 0:
            return text[:i].strip(), text[i + 1:].strip()
    raise argparse.ArgumentTypeError(f"a pair is FIRST-SECOND, as in adakv(h2o)-h2o, got {text!r}")


def main(argv=None) -> None:
    parser = make_parser("python -m flsmem.harness.paired", __doc__)
    parser.add_argument("run", help="the JSON file of a flsmem eval run (--json)")
    parser.add_argument("pairs", nargs="+",
                        help="FIRST-SECOND policy names, as in adakv(h2o)-h2o; with --ratio-to, policy names")
    parser.add_argument("--seeds", nargs="+", default=None, metavar="JSON",
                        help="runs of one seed each: the first policy of each pair is read from them")
    parser.add_argument("--against-seeds", nargs="+", default=None, metavar="JSON",
                        help="with --seeds, runs of one seed each of another recipe: the second policy of each "
                             "pair is their mean")
    parser.add_argument("--join", nargs="+", default=[], metavar="JSON",
                        help="runs on the same windows whose policies are added to the main run's")
    parser.add_argument("--ratio-to", type=_names, default=None, metavar="POLICIES",
                        help="print each policy's increase over full as a ratio to the smallest of these, as h2o,rmm")
    args = parser.parse_args(argv)
    if args.ratio_to is not None and args.seeds is not None:
        parser.error("--ratio-to reads one run (and the runs it joins), not --seeds")
    if args.against_seeds is not None and args.seeds is None:
        parser.error("--against-seeds needs --seeds: it gives the second policy of a pair that --seeds gives the first")
    try:
        pairs = None if args.ratio_to is not None else [_pair(text) for text in args.pairs]
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    current = args.run
    try:
        run = json.loads(Path(current).read_text())
        others = []
        for current in args.join:
            others.append(json.loads(Path(current).read_text()))
        current = args.run
        run = join(run, others)
        if args.ratio_to is not None:
            print(ratio_table(run, args.pairs, args.ratio_to))
            return
        if args.seeds is None:
            print(table(run, pairs))
            return
        seed_runs, against_runs = [], []
        for current in args.seeds:
            seed_runs.append(json.loads(Path(current).read_text()))
        for current in args.against_seeds or []:
            against_runs.append(json.loads(Path(current).read_text()))
        current = args.run
        print(seeds_table(run, seed_runs, pairs, against_runs or None))
    except (OSError, ValueError, KeyError) as error:
        print(f"paired: error: {current}: {error}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
