"""``flsmem eval``: load a model and text, run every policy, print, plot, save."""

from __future__ import annotations

import argparse
import json
import sys
import time
from fractions import Fraction
from pathlib import Path

import numpy as np

from flsmem.harness.arguments import checking, read_text
from flsmem.models import catalog
from flsmem.validate import one_of, positive_int, require

__all__ = ["add_arguments", "check_arguments", "run", "parse_budgets", "eval_windows",
           "summarise_stats", "format_stats"]

COMMAND = "flsmem eval"
# ``--quick``: enough to see the table, the gap closed and the plot, in about a minute.
QUICK = {"windows": 1, "context": 128, "budgets": "1/8,1/4", "policies": "streaming_llm,h2o,rmm,oracle"}
QUICK_HELP = "1 window of 128 tokens, budgets 1/8 and 1/4, streaming_llm, h2o, rmm and the oracle"


def parse_budgets(text: str, context: int) -> list[int]:
    """Budgets as ints or fractions of the context: "1/16,1/8,1/4" or "32,64".

    Raises:
      ValueError: a part is not an int or a fraction, or its budget is not in ``[1, context]``.
    """
    budgets = []
    for part in text.split(","):
        try:
            value = Fraction(part.strip())
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"--budgets must be ints or fractions like 1/8, got {part!r}") from None
        budget = int(value * context) if value < 1 else int(value)
        if budget < 1 or budget > context:
            raise ValueError(f"--budgets must lie in [1, --context={context}], got {part!r} -> {budget}")
        budgets.append(budget)
    return budgets


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from flsmem.harness.evaluate import CORRECTNESS, POLICY_NAMES

    parser.add_argument("--model", default="tiny", help=f"one of {', '.join(catalog.MODELS)}, or a .gguf file")
    parser.add_argument("--text", default="persuasion",
                        help="a bundled book (persuasion is held out; see data/PROVENANCE.md), the path of a UTF-8 "
                             "text file, or - for standard input")
    parser.add_argument("--context", type=int, default=512, help="tokens scored per window")
    parser.add_argument("--budgets", default="1/16,1/8,1/4", help="ints or fractions of the context")
    parser.add_argument("--policies", default=",".join(POLICY_NAMES),
                        help="comma-separated policy names (default: every policy but the learned ones and "
                             "expected_attention)")
    parser.add_argument("--evict-every", type=int, default=16, help="chunk length and eviction period")
    parser.add_argument("--windows", type=int, default=4, help="windows of the text, evaluated as a batch")
    parser.add_argument("--correctness", default="hard", help=f"one of {', '.join(CORRECTNESS)}")
    parser.add_argument("--protocol", default="stream", help="stream or prefill")
    parser.add_argument("--prefill-fraction", type=float, default=0.75,
                        help="with --protocol prefill, the part of each window prefilled in full, in (0, 1)")
    parser.add_argument("--plot", default="flsmem-eval.png", help="PNG path ('' for none)")
    parser.add_argument("--json", default=None, help="write the rows as JSON here")
    parser.add_argument("--quick", action="store_true",
                        help=f"a one-minute smoke run: {QUICK_HELP} (overrides those options)")
    parser.add_argument("--estimator", default=None, metavar="DIR",
                        help="estimator checkpoint of the learned policies (default: the one shipped for --model, "
                             "checkpoints/estimator-smollm2 for smollm2-135m, else checkpoints/estimator)")
    parser.add_argument("--stats", action="store_true",
                        help="also print each policy's memory statistics (flsmem.summary: evictions, mean age and "
                             "score of evicted items, fallbacks, estimator loss, ...); runs every policy once more")


def check_arguments(args: argparse.Namespace) -> tuple[list[str], list[int], int]:
    """``(policies, budgets, prefill)`` from ``flsmem eval``'s arguments (``prefill``: the
    tokens prefilled in full under ``--protocol prefill``, a multiple of ``--evict-every``).

    Raises:
      ValueError: a bad argument, named first in the message.
    """
    from flsmem.harness.evaluate import (BUDGET_WRAPPERS, CORRECTNESS, LEARNED_NAMES, PEER_NAMES, POLICY_NAMES,
                                         check_estimator, check_policies, is_policy_name,
                                         split_policies)
    from flsmem.models.data import books

    catalog.check(args.model)
    if args.text not in books() and args.text != "-" and not Path(args.text).exists():
        raise ValueError(f"--text must be a bundled book ({', '.join(books())}), a UTF-8 text file or - "
                         f"(standard input), got {args.text!r}: no such book or file")
    one_of("--correctness", args.correctness, tuple(CORRECTNESS))
    one_of("--protocol", args.protocol, ("stream", "prefill"))
    context, every = positive_int("--context", args.context), positive_int("--evict-every", args.evict_every)
    require(context % every == 0, f"--context must be a multiple of --evict-every ({every}), got {context}")
    positive_int("--windows", args.windows)
    known = POLICY_NAMES + LEARNED_NAMES + PEER_NAMES
    policies = split_policies(args.policies)
    unknown = [p for p in policies if not is_policy_name(p)]
    require(policies and not unknown, f"--policies must be comma-separated names among {', '.join(known)}, or those "
                                      f"wrapped by {' or '.join(BUDGET_WRAPPERS)} as in adakv(h2o), or with settings "
                                      f"as in adaptive(horizon=256); "
                                      f"got {args.policies!r}" + (f", unknown {unknown}" if unknown else ""))
    pyramids = [p for p in policies if "pyramid(" in p]
    require(args.protocol == "prefill" or not pyramids,
            f"--policies {', '.join(pyramids)}: layer budgets apply when a prefix is compressed; use --protocol prefill")
    budgets = parse_budgets(args.budgets, context)
    check_policies("--policies", policies, min(budgets))
    fraction = args.prefill_fraction
    require(0.0 < fraction < 1.0, f"--prefill-fraction must lie in (0, 1), got {fraction}")
    prefill = int(round(context * fraction / every)) * every
    require(args.protocol != "prefill" or 0 < prefill < context,
            f"--prefill-fraction {fraction} leaves no prefix or no continuation at --context {context}: "
            f"the prefix is rounded to a multiple of --evict-every ({every}), here {prefill}")
    check_estimator(args.estimator)
    for option in ("plot", "json"):
        path = getattr(args, option)
        require(not path or Path(path).absolute().parent.is_dir(),
                f"--{option} must be a file in an existing folder, got {path!r}")
    return policies, budgets, prefill


def eval_windows(args: argparse.Namespace, tokenizer) -> np.ndarray:
    """The evaluation windows of ``args`` (``context``, ``windows``, ``text``) in
    ``tokenizer``'s tokens; for a tokenizer that adds a BOS, each starts with it in place
    of its first token, as llama.cpp's perplexity does for models that expect one (Gemma)."""
    from flsmem.models.data import cut_windows

    tokens = tokenizer.encode(load_text(args.text))
    try:
        windows = cut_windows(tokens, args.context, args.windows, spacing="spread", exact=True)
    except ValueError as error:
        raise ValueError(f"--windows {args.windows} windows of --context {args.context} + 1 tokens need "
                         f"{args.windows * (args.context + 1)} tokens, but --text {args.text} has {len(tokens)} "
                         f"tokens of the model's tokenizer") from error
    if tokenizer.add_bos:
        windows = windows.copy()
        windows[:, 0] = tokenizer.bos_id
    return windows


def load_text(source: str) -> str:
    """The text ``--text`` names: a bundled book, a UTF-8 file, or ``-`` for standard input."""
    from flsmem.models.data import books, load_book

    return load_book(source) if source in books() else read_text("--text", source)


def run(args: argparse.Namespace) -> list:
    from flsmem.harness.evaluate import estimator_for, run_comparison
    if args.quick:
        vars(args).update(QUICK)
    with checking(COMMAND):
        policies, budgets, prefill = check_arguments(args)
    begin = time.perf_counter()
    # The model file and the windows are checked against the text before the model loads.
    with checking(COMMAND):
        tokenizer = catalog.load_tokenizer(args.model)
        windows = eval_windows(args, tokenizer)
    model, _ = catalog.load(args.model)
    byte_counts = np.array([
        [len(tokenizer.decode(w[1:]).encode()), len(tokenizer.decode(w[1 + prefill:]).encode())] for w in windows
    ])
    stats = {}

    def keep_stats(name: str, budget: int, summary: dict) -> None:
        stats[(name, budget)] = summarise_stats(summary)

    rows = run_comparison(
        model, windows, byte_counts, budgets, policies, chunk=args.evict_every,
        correctness=args.correctness, protocol=args.protocol, prefill_fraction=args.prefill_fraction,
        progress=lambda msg: print(f"  {msg}", file=sys.stderr, flush=True),
        on_stats=keep_stats if args.stats else None,
        estimator=str(args.estimator or estimator_for(args.model)),
    )
    elapsed = time.perf_counter() - begin
    # Files are named by their name alone: a table should not carry the machine's folders.
    model, text = Path(args.model).name, "standard input" if args.text == "-" else Path(args.text).name
    title = (f"{model} on {text}: {args.windows} windows x {args.context} tokens, protocol "
             f"{args.protocol}, evict_every {args.evict_every}, correctness {args.correctness} ({elapsed:.0f} s)")
    print(format_table(rows, budgets, title))
    if args.stats:
        print()
        print(format_stats(stats))
    if args.plot:
        plot(rows, budgets, args.plot, title)
        print(f"plot written to {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({
                "model": model, "text": text, "context": args.context, "protocol": args.protocol,
                "evict_every": args.evict_every, "windows": args.windows, "correctness": args.correctness,
                "rows": [vars(r) for r in rows],
                **({"stats": {f"{name}@{budget}": figures for (name, budget), figures in stats.items()}}
                   if stats else {}),
            }, f, indent=1)
    return rows


def format_table(rows, budgets, title: str) -> str:
    names = list(dict.fromkeys(r.policy for r in rows if r.policy != "full"))
    full = next(r for r in rows if r.policy == "full")
    lines = [title, f"full cache: nll {full.nll:.4f} nats/token, {full.bits_per_byte:.4f} bits/byte", ""]
    width = max([14] + [len(name) for name in names])
    # The gap closed needs streaming_llm (the floor) and the oracle (the ceiling) in the run.
    gap = any(np.isfinite(r.gap_closed) for r in rows if r.policy != "full")
    header = f"{'policy':<{width}}" + "".join(f" | B={b:<5} {'nll':>7} {'+full':>7}" + (f" {'gap':>6}" if gap else "")
                                              for b in budgets)
    lines += [header, "-" * len(header)]
    for name in names:
        cells = []
        for b in budgets:
            r = next((r for r in rows if r.policy == name and r.budget == b), None)
            shown = f"{r.nll:>7.4f} {r.delta_vs_full:>+7.4f}" + (f" {r.gap_closed:>+6.2f}" if gap else "") if r else \
                " " * (22 if gap else 15)
            cells.append(" | " + " " * 8 + shown)
        lines.append(f"{name:<{width}}" + "".join(cells))
    return "\n".join(lines)


def plot(rows, budgets, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    full = next(r for r in rows if r.policy == "full")
    names = list(dict.fromkeys(r.policy for r in rows if r.policy != "full"))
    colours = plt.get_cmap("tab20")
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, name in enumerate(names):
        pts = [(r.budget, r.delta_vs_full) for r in rows if r.policy == name]
        style = dict(color="k", linestyle="--") if name == "oracle" else dict(color=colours(i), marker="o", markersize=3)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, **style)
    ax.axhline(0.0, color="grey", linewidth=0.8, label=f"full cache ({full.nll:.3f})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("symlog", linthresh=0.01)
    ax.set_xticks(list(budgets), [str(b) for b in budgets])
    ax.set_xlabel("budget (tokens kept per layer and KV head)")
    ax.set_ylabel("NLL increase over full cache (nats/token)")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# Counters are summed over layers and windows; the means of evicted items are weighted
# by how many each memory evicted; figures of the policy's own state (the learned
# estimator's loss and counters, one per layer) are averaged (floats) or summed (counts)
# over layers.
_COUNTERS = ("evictions", "fallbacks", "forced_writes", "nonfinite_inputs")
_WEIGHTED = ("mean_evicted_age", "mean_evicted_score")
_SKIP = ("step", "occupancy", "held", "aux")


def summarise_stats(stats: dict) -> dict[str, float]:
    """One figure per name from :func:`flsmem.harness.evaluate.evaluate_windows`' summary
    (``[L, W]`` arrays: layers by windows)."""
    out: dict[str, float] = {}
    evictions = np.asarray(stats["evictions"], np.float64)
    for name in _COUNTERS:
        out[name] = float(np.sum(stats[name]))
    for name in _WEIGHTED:
        values = np.asarray(stats[name], np.float64)
        total = evictions.sum()
        out[name] = float(np.sum(np.where(evictions > 0, values * evictions, 0.0)) / total) if total else float("nan")
    out["occupancy"] = float(np.mean(stats["occupancy"]))
    for name, value in stats.items():
        if name in out or name in _SKIP or name in _WEIGHTED:
            continue
        per_layer = np.asarray(value)[:, 0]  # the policy's figures are the same for every window
        out[name] = float(np.nanmean(per_layer)) if np.issubdtype(per_layer.dtype, np.floating) else float(per_layer.sum())
    return out


def format_stats(stats: dict) -> str:
    """``{(policy, budget): summarise_stats(...)}`` as a table, one line per policy and budget."""
    names = list(dict.fromkeys(k for figures in stats.values() for k in figures))
    header = f"{'policy':<16}{'budget':>7}" + "".join(f" {n:>{max(10, len(n))}}" for n in names)
    lines = ["memory statistics (flsmem.summary): counters summed over layers and windows, "
             "means of evicted items weighted by evictions", header, "-" * len(header)]
    for (policy, budget), figures in stats.items():
        cells = "".join(f" {figures.get(n, float('nan')):>{max(10, len(n))}.4g}" for n in names)
        lines.append(f"{policy:<16}{budget:>7}{cells}")
    return "\n".join(lines)
