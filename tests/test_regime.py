"""The regime map: winners and margins, and the quick run against the committed full run."""

import itertools
import json
from pathlib import Path

import pytest

from flsmem.harness import regime

FULL_RESULTS = Path(__file__).resolve().parents[1] / "results" / "regime" / "regime.json"
# Differences in the full run larger than these are "an ordering" the quick run must keep:
# 10 accuracy points on a task, 0.005 nats/token on text.
CLEAR = {"accuracy": 0.10, "nll": 0.005}


def row(setting, policy, fraction, value, metric="accuracy"):
    return {"experiment": "map", "setting": setting, "policy": policy, "fraction": fraction,
            "budget": int(512 * fraction), "metric": metric, "value": value, "per_seed": [value]}


def test_winners_and_ties():
    rows = [row("repeat", "rmm", 1 / 8, 0.9), row("repeat", "h2o", 1 / 8, 0.6), row("repeat", "oracle", 1 / 8, 1.0),
            row("repeat", "rmm", 1 / 4, 1.0), row("repeat", "h2o", 1 / 4, 1.0),
            row("text", "rmm", 1 / 8, 2.01, "nll"), row("text", "h2o", 1 / 8, 2.00, "nll")]
    table = regime.winners(rows)
    assert table[("repeat", 1 / 8)] == ("rmm", pytest.approx(0.3))  # the oracle is not a contender
    assert table[("repeat", 1 / 4)] == ("tie", 0.0)
    assert table[("text", 1 / 8)] == ("h2o", pytest.approx(0.01))  # lower NLL wins
    assert "repeat             B=1/8   rmm" in regime.format_tables(rows + [
        dict(row("repeat", "full", 1.0, 1.0), budget=512)] + [
        row("repeat", name, f, 0.5) for name in regime.MAP_POLICIES for f in (1 / 8, 1 / 4)
        if name not in ("rmm", "h2o", "oracle")] + [
        dict(row("text", "full", 1.0, 2.0, "nll"), budget=512)] + [
        row("text", name, 1 / 8, 2.5, "nll") for name in regime.MAP_POLICIES if name not in ("rmm", "h2o")] + [
        row("repeat", "oracle", 1 / 4, 1.0)])


def clear_orderings(rows, setting, budget, metric):
    at = {r["policy"]: r["value"] for r in rows
          if r["experiment"] == "map" and r["setting"] == setting and r["budget"] == budget}
    sign = 1 if metric == "accuracy" else -1
    return {(a, b): sign * (at[a] - at[b]) > 0 for a, b in itertools.permutations(at, 2)
            if abs(at[a] - at[b]) > CLEAR[metric]}


@pytest.mark.skipif(not FULL_RESULTS.exists(), reason="results/regime/regime.json not generated yet")
def test_quick_run_reproduces_the_ordering_of_the_full_run():
    """``flsmem regime --quick`` (other task examples, fewer text windows) orders the
    policies as the committed full run does wherever the full run's gap is clear."""
    full = json.loads(FULL_RESULTS.read_text())["rows"]
    quick = regime.run(regime.QUICK)
    compared = 0
    for setting, budget in {(r["setting"], r["budget"]) for r in quick if r["policy"] != "full"}:
        metric = next(r["metric"] for r in quick if r["setting"] == setting)
        expected = clear_orderings(full, setting, budget, metric)
        at = {r["policy"]: r["value"] for r in quick
              if r["experiment"] == "map" and r["setting"] == setting and r["budget"] == budget}
        sign = 1 if metric == "accuracy" else -1
        for (a, b), a_first in expected.items():
            assert (sign * (at[a] - at[b]) > 0) == a_first, (setting, budget, a, b, at[a], at[b])
            compared += 1
    assert compared >= 10, "too few clear orderings to check"


def test_plan_rejects_bad_settings():
    import dataclasses

    with pytest.raises(ValueError, match="tasks must be among"):
        dataclasses.replace(regime.QUICK, tasks=("needle",))
    with pytest.raises(ValueError, match="fractions must lie in"):
        dataclasses.replace(regime.QUICK, fractions=(0.0,))
    with pytest.raises(ValueError, match="task_context must be a positive multiple of 16"):
        dataclasses.replace(regime.QUICK, task_context=250)


def test_policies_option_runs_the_map_alone():
    import argparse

    args = argparse.Namespace(quick=False, policies="h2o, rmm,adaptive")
    plan = regime.plan_for(args)
    assert plan.policies == ("h2o", "rmm", "adaptive") and plan.tasks == regime.FULL.tasks
    assert plan.lag_settings == plan.signal_settings == plan.retention_settings == ()
    assert regime.plan_for(argparse.Namespace(quick=True, policies=None)) is regime.QUICK
    with pytest.raises(ValueError, match=r"^--policies: policies must be among .*'nope'"):
        regime.plan_for(argparse.Namespace(quick=True, policies="h2o,nope"))
