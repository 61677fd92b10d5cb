"""The learned estimator against the heuristics, in the regime map's harness.

``flsmem learned`` runs :func:`flsmem.harness.regime.run` with the three learned variants at
commit lag H = 0 (pretrained and still learning, pretrained and frozen, learning from a
fresh network) beside ``rmm``, ``h2o``, ``tova``, ``snapkv`` and the oracle, at equal
budgets, on the controlled tasks and on natural text. It writes ``learned.json``, the
tables (with the learned estimator's margin over ``rmm`` and ``h2o`` per seed, and the
acceptance checks of the target) and a plot into ``--out``.

The estimator is pretrained with several seeds, each checkpoint measured by its own run
(``--estimator DIR --out RUN``); ``--seeds RUN RUN ...`` measures nothing and reports
the learned variants over those runs (``seeds.txt`` in ``--out``): each pretraining
seed's figure, their mean ± sd, and each seed's margin over ``rmm`` and ``h2o`` of its
own run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np

from flsmem.harness import regime
from flsmem.harness.arguments import checking, make_parser

__all__ = ["POLICIES", "FULL", "QUICK", "targets", "format_report", "format_seeds", "main"]

POLICIES = ("oracle", "learned", "learned_offline", "learned_scratch", "rmm", "h2o", "tova", "snapkv")
HEURISTICS = ("rmm", "h2o", "tova", "snapkv")
# The variants whose figures depend on the pretrained checkpoint.
VARIANTS = ("learned", "learned_offline")
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


def _figure(at: dict, setting: str, policy: str, fraction: float) -> float:
    """Accuracy, or the NLL increase over the full cache (the full cache's row is at fraction 1)."""
    row = at[(setting, policy, fraction)]
    if row["metric"] == "accuracy":
        return row["value"]
    return row["value"] - at[(setting, "full", 1.0)]["value"]


def _signed(value: float) -> str:
    """``value`` to four decimals with its sign, zero shown as +0.0000 (not -0.0000)."""
    return f"{round(value, 4) + 0.0:+.4f}"


def format_seeds(runs: dict[str, list[dict]]) -> str:
    """The learned variants over pretraining seeds, one ``flsmem learned`` run per seed
    (``runs``: a name per run, its rows), on the settings and budgets every run holds.

    Per setting and budget: each seed's figure, their mean ± sd; then each seed's margin
    over ``rmm`` and ``h2o`` as measured in its own run (accuracy: positive is better;
    NLL: negative is better) and how many seeds are better; then how far the runs'
    heuristics differ, which is what separates their examples and code."""
    maps = {name: _map(rows) for name, rows in runs.items()}
    shared = set.intersection(*(set(at) for at in maps.values()))
    settings = list(dict.fromkeys(s for s, _, _ in sorted(shared)))
    names = list(runs)
    lines = [f"# the learned estimator over {len(names)} pretraining seeds: " + ", ".join(names), ""]
    for setting in settings:
        fractions = sorted({f for s, p, f in shared if s == setting and p == "learned"})
        metric = maps[names[0]][(setting, "learned", fractions[0])]["metric"]
        unit = "accuracy" if metric == "accuracy" else "NLL increase over the full cache"
        lines += [f"## {setting}: {unit}", ""]
        for variant in VARIANTS:
            for fraction in fractions:
                if (setting, variant, fraction) not in shared:
                    continue
                values = [_figure(maps[n], setting, variant, fraction) for n in names]
                lines.append(f"{variant:<16} B={regime._fraction(fraction):<5} {_signed(np.mean(values))} "
                             f"± {np.std(values, ddof=1):.4f}  ({' '.join(_signed(v) for v in values)})")
        for other in ("oracle", "rmm", "h2o"):
            for fraction in fractions:
                if (setting, other, fraction) in shared:
                    lines.append(f"{other:<16} B={regime._fraction(fraction):<5} "
                                 f"{_signed(_figure(maps[names[0]], setting, other, fraction))}  (run {names[0]})")
        for other in ("rmm", "h2o"):
            for fraction in fractions:
                if (setting, other, fraction) not in shared:
                    continue
                margins = [_figure(maps[n], setting, "learned", fraction) - _figure(maps[n], setting, other, fraction)
                           for n in names]
                better = sum(m > 0 if metric == "accuracy" else m < 0 for m in margins)
                lines.append(f"learned - {other:<6} B={regime._fraction(fraction):<5} {_signed(np.mean(margins))} "
                             f"± {np.std(margins, ddof=1):.4f}  ({' '.join(_signed(m) for m in margins)})  "
                             f"{better} of {len(names)} seeds better")
        lines.append("")
    held = {name: targets(rows) for name, rows in runs.items()}
    lines.append("target (learned above rmm and h2o on repeat and chain at every budget; on prose at 1/8 "
                 "within 1% of the best heuristic's NLL), checks that hold per seed: "
                 + ", ".join(f"{name} {sum(ok for _, ok in checks)} of {len(checks)}" for name, checks in held.items()))
    spread = max((abs(maps[a][key]["value"] - maps[b][key]["value"]) for key in shared
                  if key[1] in HEURISTICS + ("full",) for a in names for b in names), default=0.0)
    lines.append(f"the heuristics' and the full cache's figures differ between the runs by at most {spread:.2g}")
    return "\n".join(lines)


def _seed_runs(folders: list[str]) -> dict[str, list[dict]]:
    """The rows of each ``flsmem learned`` run folder.

    Raises:
      ValueError: naming ``--seeds``, a folder without ``learned.json``.
    """
    runs = {}
    for folder in folders:
        path = Path(folder) / "learned.json"
        if not path.is_file():
            raise ValueError(f"--seeds must name folders of `flsmem learned` runs, each with a learned.json; "
                             f"{str(path)!r} does not exist")
        runs[folder] = json.loads(path.read_text())["rows"]
    if len(runs) < 2:
        raise ValueError(f"--seeds needs at least two run folders, got {len(runs)}")
    return runs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="repeat and chain (one seed) and tiny prose, every budget, learned against rmm and h2o")
    parser.add_argument("--estimator", default=None, metavar="DIR",
                        help="estimator checkpoint of the learned policies (default: checkpoints/estimator)")
    parser.add_argument("--out", default="results/learned", help="folder for learned.json, the tables and the plot")
    parser.add_argument("--render", action="store_true", help="measure nothing: rewrite from the JSON in --out")
    parser.add_argument("--seeds", nargs="+", default=None, metavar="RUN",
                        help="measure nothing: report the learned variants over these runs' folders "
                             "(one pretraining seed each) into --out/seeds.txt")


def run_cli(args: argparse.Namespace) -> list[dict]:
    from flsmem.harness.evaluate import check_estimator

    stem = "quick" if args.quick else "learned"
    if args.seeds is not None:
        with checking("flsmem learned"):
            runs = _seed_runs(args.seeds)
            out = regime.check_output(argparse.Namespace(out=args.out, render=False), stem)
        text = format_seeds(runs)
        print(text)
        out.mkdir(parents=True, exist_ok=True)
        (out / "seeds.txt").write_text(text + "\n")
        return [row for rows in runs.values() for row in rows]
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
    parser = make_parser("flsmem learned", __doc__)
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    main()
