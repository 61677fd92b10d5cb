"""The learned estimator against the heuristics, in the regime map's harness.

``flsmem learned`` runs :func:`flsmem.harness.regime.run` with the three learned variants at
commit lag H = 0 (pretrained and still learning, pretrained and frozen, learning from a
fresh network) beside ``rmm``, ``h2o``, ``tova``, ``snapkv`` and the oracle, at equal
budgets, on the controlled tasks and on natural text. It writes ``learned.json``, the
tables (with the learned estimator's margin over ``rmm`` and ``h2o`` per seed, and the
acceptance checks of the target) and a plot into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

from flsmem.harness import regime
from flsmem.harness.arguments import checking

__all__ = ["POLICIES", "FULL", "QUICK", "targets", "format_report", "main"]

POLICIES = ("oracle", "learned", "learned_offline", "learned_scratch", "rmm", "h2o", "tova", "snapkv")
HEURISTICS = ("rmm", "h2o", "tova", "snapkv")
# The endogenous-reuse tasks of flsmem.models.tasks.
ENDOGENOUS = ("repeat", "chain")
_NONE: tuple = ()

FULL = dataclasses.replace(
    regime.FULL, policies=POLICIES, lag_settings=_NONE, lag_fractions=_NONE, signal_settings=_NONE,
    signal_fractions=_NONE, retention_settings=_NONE, retention_fractions=_NONE,
)
# The endogenous tasks and tiny prose at every budget: the loop for trying an estimator.
QUICK = dataclasses.replace(regime.QUICK, tasks=ENDOGENOUS, fractions=regime.FULL.fractions,
                            policies=("learned", "learned_offline", "rmm", "h2o"))


def _map(rows):
    return {(r["setting"], r["policy"], r["fraction"]): r for r in rows if r["experiment"] == "map"}


def margins(rows: list[dict], name: str = "learned"):
    """``(setting, fraction, other, [name - other per seed])`` on the accuracy settings."""
    at = _map(rows)
    for setting, policy, fraction in sorted(at):
        if policy != name or at[(setting, policy, fraction)]["metric"] != "accuracy":
            continue
        for other in ("rmm", "h2o"):
            if (setting, other, fraction) in at:
                mine, theirs = at[(setting, name, fraction)], at[(setting, other, fraction)]
                yield setting, fraction, other, [a - b for a, b in zip(mine["per_seed"], theirs["per_seed"])]


def targets(rows: list[dict]) -> list[tuple[str, bool]]:
    """The issue's target as checks: ``learned`` beats ``rmm`` and ``h2o`` on the
    endogenous-reuse tasks at every budget, and on natural text at budget 1/8 its NLL
    is within 1% of the best heuristic's."""
    at = _map(rows)
    checks = []
    for (setting, policy, fraction), mine in sorted(at.items()):
        if policy != "learned":
            continue
        if setting in ENDOGENOUS:
            for other in ("rmm", "h2o"):
                theirs = at[(setting, other, fraction)]["value"]
                checks.append((f"{setting} B={regime._fraction(fraction)}: learned {mine['value']:.3f} > "
                               f"{other} {theirs:.3f}", mine["value"] > theirs))
        elif mine["metric"] == "nll" and abs(fraction - 1 / 8) < 1e-9:
            best_name, best = min(((n, at[(setting, n, fraction)]["value"]) for n in HEURISTICS
                                   if (setting, n, fraction) in at), key=lambda x: x[1])
            checks.append((f"{setting} B=1/8: learned NLL {mine['value']:.4f} <= 1.01 x {best_name} {best:.4f}",
                           mine["value"] <= 1.01 * best))
    return checks


def format_report(rows: list[dict]) -> str:
    lines = [regime.format_tables(rows), "", "## learned - rmm and learned - h2o, accuracy per seed", ""]
    for setting, fraction, other, per_seed in margins(rows):
        spread = np.std(per_seed, ddof=1) if len(per_seed) > 1 else 0.0
        shown = " ".join(f"{m:+.3f}" for m in per_seed)
        lines.append(f"{setting:<10} B={regime._fraction(fraction):<5} vs {other:<4} {np.mean(per_seed):+.3f} "
                     f"±{spread:.3f}  ({shown})")
    lines += ["", "## target", ""]
    lines += [f"{'holds ' if ok else 'FAILS '} {text}" for text, ok in targets(rows)]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="repeat and chain (one seed) and tiny prose, every budget, learned against rmm and h2o")
    parser.add_argument("--estimator", default=None, metavar="DIR",
                        help="estimator checkpoint of the learned policies (default: checkpoints/estimator)")
    parser.add_argument("--out", default="results/learned", help="folder for learned.json, the tables and the plot")
    parser.add_argument("--render", action="store_true", help="measure nothing: rewrite from the JSON in --out")


def run_cli(args: argparse.Namespace) -> list[dict]:
    from flsmem.harness.evaluate import check_estimator

    stem = "quick" if args.quick else "learned"
    with checking("flsmem learned"):
        out = regime.check_output(args, stem)
        check_estimator(args.estimator)
    plan = dataclasses.replace(QUICK if args.quick else FULL, estimator=args.estimator)
    rows, elapsed = regime.measure_or_render(plan, out, stem, args.render)
    text = f"flsmem learned{' --quick' if args.quick else ''} ({elapsed:.0f} s)\n\n" + format_report(rows)
    print(text)
    (out / f"{stem}.txt").write_text(text + "\n")
    regime.plot_curves(rows, str(out / f"{stem}-curves.png"))
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="flsmem learned", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    main()
