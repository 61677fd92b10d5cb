"""Paired differences between policies of one ``flsmem eval`` run, from its JSON.

Every policy of a run is scored on the same windows, so two policies are compared
window by window: the difference of their mean NLL per window, averaged over windows,
with a 95% percentile-bootstrap interval over windows (the windows are the independent
units; tokens within a window are not).

    python -m flsmem.harness.paired results/smollm2-peers.json "adakv(h2o)-h2o" "pyramid(snapkv)-snapkv"

prints a markdown table, one row per pair and budget (negative: the first policy is
better).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

__all__ = ["paired_difference", "table", "main"]

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


def table(run: dict, pairs: list[tuple[str, str]]) -> str:
    """Markdown rows ``| first - second | budget | difference [95% interval] | windows better |``."""
    rows = {(r["policy"], r["budget"]): r for r in run["rows"]}
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


def _pair(text: str) -> tuple[str, str]:
    # Names hold parentheses but no "-": split at the first "-" outside parentheses.
    depth = 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "-" and depth == 0:
            return text[:i].strip(), text[i + 1:].strip()
    raise argparse.ArgumentTypeError(f"a pair is FIRST-SECOND, as in adakv(h2o)-h2o, got {text!r}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flsmem.harness.paired", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="the JSON file of a flsmem eval run (--json)")
    parser.add_argument("pairs", nargs="+", type=_pair, help="FIRST-SECOND policy names, as in adakv(h2o)-h2o")
    args = parser.parse_args(argv)
    path = Path(args.run)
    try:
        run = json.loads(path.read_text())
        print(table(run, args.pairs))
    except (OSError, ValueError, KeyError) as error:
        print(f"paired: error: {args.run}: {error}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
