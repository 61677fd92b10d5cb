"""How much of each needle the shift experiment's memories still hold when it is asked for.

``flsmem shift --family ruler`` scores a sample 1 only where SmolLM2 predicts every
token of its answer. This asks the finer question behind it: at the end of each
teacher-forced window (the question and the answer streamed), what share of the needle
value's tokens does each layer's memory of each KV head still hold, under each frozen
estimator of the experiment (prose-pretrained and pretrained on the needle tasks) and
under h2o and the oracle, on the same samples and budget.

    python -m bench.shift_needle                  # the experiment's tasks at 1/2, 24 samples each
"""

from __future__ import annotations

import json
import os
from fractions import Fraction

import numpy as np
from tqdm.auto import tqdm

from flsmem import estimator as E
from flsmem.harness import shift
from flsmem.harness.arguments import make_parser
from flsmem.harness.evaluate import evaluate_windows, future_attention, make_policy


def needle_positions(tokens: np.ndarray, answer: np.ndarray) -> np.ndarray:
    """Positions (input indices) of the needle's value in the prompt of one forced
    window: the last earlier occurrence of the gold answer's tokens (the values of a
    sample with several are separated, so each value is found on its own)."""
    gold = tokens[1:][answer]
    end = int(np.flatnonzero(answer)[0]) + 1  # the answer's first token
    found = []
    # The longest tail of the answer that occurs earlier: all of it for one value;
    # the last value where several are joined by commas.
    for size in range(len(gold), 0, -1):
        piece = gold[len(gold) - size:]
        starts = [i for i in range(end - size) if np.array_equal(tokens[i:i + size], piece)]
        if starts:
            found = list(range(starts[-1], starts[-1] + size))
            break
    if not found:
        raise ValueError("the answer does not occur in the prompt")
    return np.asarray(found)


def retention(held: np.ndarray, needles: list[np.ndarray]) -> np.ndarray:
    """Share of each window's needle tokens held, per layer and KV head: ``[L, W, K]``
    from the positions each memory holds, ``held [L, W, K, S]`` (a position is held at
    most once per memory)."""
    return np.stack([np.isin(held[:, w], needle).sum(-1) / len(needle) for w, needle in enumerate(needles)], axis=1)


def main(argv=None):
    parser = make_parser("python -m bench.shift_needle", __doc__)
    parser.add_argument("--fraction", default="1/2", help="the budget, a fraction of the window")
    parser.add_argument("--examples", type=int, default=24, help="samples per task (seed 0, the first ones)")
    parser.add_argument("--json", default="results/shift/smollm2/needle.json")
    args = parser.parse_args(argv)
    try:
        fraction = Fraction(args.fraction)
    except (ValueError, ZeroDivisionError):
        fraction = None
    if fraction is None or not 0 < fraction < 1:
        parser.error(f"--fraction must be a fraction in (0, 1) like 1/2, got {args.fraction!r}")
    if args.examples < 1 or args.examples % 8:
        parser.error(f"--examples must be a positive multiple of 8 (the experiment's requests), got {args.examples}")
    if not os.path.isdir(os.path.dirname(args.json) or "."):
        parser.error(f"--json must be in an existing folder, got {args.json!r}")
    plan = shift.ShiftPlan(**{k: v for k, v in shift.RULER.items() if k != "references"} | {
        "fractions": (float(fraction),), "examples": args.examples, "family": "ruler"})
    model, tasks = shift.target_tasks(plan)
    budget = int(round(plan.fractions[0] * plan.task_context))
    candidates = [("h2o", None), ("oracle", None)]
    candidates += [(f"shifted[{i}]", path) for i, path in enumerate(plan.shifted)]
    candidates += [(f"in_family[{i}]", path) for i, path in enumerate(plan.in_family)]
    rows = []
    bar = tqdm(total=len(candidates) * len(plan.tasks), desc="needle", unit="policy")
    for name, path in candidates:
        policy = (make_policy(name, budget) if path is None
                  else E.from_checkpoint(path, online=False, recent=budget // 2))
        for task, setting in tasks.items():
            held, hits = [], []
            for first in range(0, len(setting.windows), plan.batch):
                windows = setting.windows[first:first + plan.batch]
                futures = future_attention(model, windows, shift.CHUNK) if policy.needs_future else None
                _, hit, stats = evaluate_windows(model, windows, policy, budget, chunk=shift.CHUNK, futures=futures)
                held.append(np.asarray(stats["held"]))
                hits.append(hit)
            held = np.concatenate(held, axis=1)
            needles = [needle_positions(t, a) for t, a in zip(setting.windows, setting.answer)]
            share = retention(held, needles)  # [L, W, K]
            rows.append({"policy": name, "task": task, "budget": budget,
                         "accuracy": float(setting.score(None, np.concatenate(hits)).mean()),
                         "held": float(share.mean()), "whole": float((share == 1).mean()),
                         "per_layer": share.mean(axis=(1, 2)).tolist()})
            bar.update(1)
    bar.close()
    with open(args.json, "w") as f:
        json.dump({"fraction": args.fraction, "examples": args.examples, "rows": rows}, f)
    print(f"needle tokens held at the end of each window, budget {budget} ({args.fraction}), {args.examples} samples "
          "per task: share over layers, KV heads and samples; 'whole': memories holding all of it")
    print("| policy | task | accuracy | needle tokens held | memories holding all of it |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['task']} | {r['accuracy']:.3f} | {r['held']:.3f} | {r['whole']:.3f} |")


if __name__ == "__main__":
    main()
