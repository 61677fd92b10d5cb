"""Where the needle was when a policy found it: RULER hits against the needle's distance
from the end of the prompt.

Reads a results file of ``flsmem ruler``, draws each answered sample again (same task,
length, index and seed: the generators are deterministic) and measures, in the model's
tokens, how far the needle's answer lies from the end of the prompt. As ``make_policy``
builds them, h2o, rmm, ema, kalman, adaptive, the learned policies and the oracle keep
the last half of their budget whatever their scores (a recent window), so a needle
closer to the end than that is kept by recency; a hit further back is one the score
found. StreamingLLM's recent window is its whole budget (less its sinks), so the
needles in the half-budget before the last are its recency's too; a policy whose window
is set by name, as ``rmm(recent=0.875)``, has the window it names. Each hit is counted
in one of three bands of the needle's distance from the end: the last half-budget, the
half-budget before it, and further back. Only the tasks with one answer (the
single-needle and multi-key tasks) count.

    python -m bench.ruler_depth results/ruler/smollm2-135m-4k.jsonl
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from flsmem.harness.arguments import make_parser
from flsmem.harness.ruler import report
from flsmem.harness.ruler.tasks import make_sample
from flsmem.models import catalog

# The tasks whose answer is one string that occurs once in the context.
ONE_ANSWER = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
              "niah_multikey_3")

# Bands of the needle's distance from the end of the prompt, in half-budgets B/2.
BANDS = ("< B/2", "B/2 to B", ">= B")


def band(distance: int, budget: int) -> int:
    """The index in :data:`BANDS` of a needle ``distance`` tokens from the end at ``budget``."""
    return 0 if distance < budget // 2 else 1 if distance < budget else 2


def distance_to_end(sample: dict, tokenizer) -> int:
    """Tokens of the prompt (context and question) after the needle's answer."""
    context = sample["context"]
    after = context[context.index(sample["answers"][0]) + len(sample["answers"][0]):]
    return len(tokenizer.encode(after)) + len(tokenizer.encode(sample["question"]))


def main(argv=None):
    parser = make_parser("python -m bench.ruler_depth", __doc__)
    parser.add_argument("results", type=Path, help="a JSON-lines file of flsmem ruler")
    args = parser.parse_args(argv)
    if not args.results.is_file():
        parser.error(f"results must be a file of flsmem ruler, got {str(args.results)!r}")
    rows = [r for r in report.load(args.results) if r["task"] in ONE_ANSWER]
    tokenizer = catalog.load_tokenizer(rows[0]["model"]) if rows else None
    distances = {}
    for r in rows:
        key = (r["task"], r["length"], r["index"], r["seed"])
        if key not in distances:
            task, length, index, seed = key
            distances[key] = distance_to_end(make_sample(task, length, index, tokenizer, seed), tokenizer)
    # (policy, protocol, budget tokens) -> [hits, samples] per band of distance
    counts = defaultdict(lambda: [[0, 0] for _ in BANDS])
    for r in rows:
        if r["policy"] == "full":
            continue
        distance = distances[(r["task"], r["length"], r["index"], r["seed"])]
        tally = counts[(r["policy"], r["protocol"], r["budget_tokens"])][band(distance, r["budget_tokens"])]
        tally[0] += r["score"]
        tally[1] += 1
    print(f"{args.results.name}: {len(distances)} samples of {', '.join(sorted({k[0] for k in distances}))}")
    print("hits / samples by the needle's distance from the end of the prompt, in half-budgets B/2: within "
          "the last (the recent window of every preset of make_policy but streaming_llm, whose window is B; a "
          "window set by name, as rmm(recent=224), is the one it names), the one before it, and further back")
    width = max([len("policy")] + [len(policy) for policy, _, _ in counts])
    print(f"{'policy':<{width}}  {'protocol':<17}  {'budget':>6}" + "".join(f"  {name:>10}" for name in BANDS))
    for (policy, protocol, budget), by in sorted(counts.items()):
        print(f"{policy:<{width}}  {protocol:<17}  {budget:>6}" + "".join(f"  {f'{h:g} / {n}':>10}" for h, n in by))


if __name__ == "__main__":
    main()
