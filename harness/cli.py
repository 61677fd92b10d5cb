"""The ``flsmem`` command line: ``demo``, ``eval``, ``generate``, ``regime``, ``learned``, ``shift`` and ``ruler``.

It drives the layers above the library (models and the evaluation harness), so it lives
with them; the library itself never imports it."""

from __future__ import annotations

import argparse
import functools
from typing import Sequence

__all__ = ["main"]


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive ints, got {text!r}")
    return values


def main(argv: Sequence[str] | None = None) -> None:
    from flsmem.harness.arguments import ShowDefaults

    parser = argparse.ArgumentParser(prog="flsmem", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    command = functools.partial(commands.add_parser, formatter_class=ShowDefaults)
    demo = command(
        "demo", help="stream synthetic attention through every policy; print a table and write a plot"
    )
    demo.add_argument("--budgets", type=_ints, default=[32, 64, 128], help="comma-separated budgets")
    demo.add_argument("--steps", type=int, default=512, help="length of each stream")
    demo.add_argument("--streams", type=int, default=8, help="independent streams (batch)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the synthetic attention")
    demo.add_argument("--plot", default="flsmem-demo.png", help="PNG path ('' for none)")
    demo.add_argument("--json", default=None, help="also write the rows as JSON here")
    evaluate = command(
        "eval", help="every policy on held-out text with a decoder; print a table and write a plot"
    )
    regime = command(
        "regime", help="the regime map: controlled tasks and text, every policy, lag sweep, correctness signals"
    )
    learned = command(
        "learned", help="the learned estimator against rmm, h2o, tova, snapkv and the oracle, tasks and text"
    )
    shift = command(
        "shift", help="an estimator pretrained off the tasks, served on them: does online learning close the gap?"
    )
    generate = command(
        "generate", help="continue prompts with a bounded KV cache, printing tokens as they come"
    )
    ruler = command(
        "ruler", help="RULER's synthetic tasks under every policy, budget and protocol; results resume; a report"
    )
    from flsmem.harness import generate as generate_module
    from flsmem.harness import learned as learned_module
    from flsmem.harness import regime as regime_module
    from flsmem.harness import shift as shift_module
    from flsmem.harness.arguments import usage_error
    from flsmem.harness.report import add_arguments
    from flsmem.harness.ruler import run as ruler_module

    add_arguments(evaluate)
    regime_module.add_arguments(regime)
    learned_module.add_arguments(learned)
    shift_module.add_arguments(shift)
    generate_module.add_arguments(generate)
    ruler_module.add_arguments(ruler)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from flsmem.demo import run_demo

        if args.steps < 2 or args.streams < 1:
            parser.error("--steps must be >= 2 and --streams >= 1")
        run_demo(args.budgets, args.steps, args.streams, args.seed, args.plot or None, args.json)
    elif args.command == "eval":
        from flsmem.harness.report import run

        run(args)
    elif args.command == "generate":
        generate_module.run(args, functools.partial(usage_error, "flsmem generate"))
    elif args.command == "learned":
        learned_module.run_cli(args)
    elif args.command == "shift":
        shift_module.run_cli(args)
    elif args.command == "ruler":
        ruler_module.run_cli(args)
    else:
        regime_module.run_cli(args)


if __name__ == "__main__":
    main()
