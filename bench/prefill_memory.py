"""Long context in bounded memory: peak resident memory of a prefill against its length.

Each run prefills a prefix of *Persuasion* in chunks of 16 tokens (each chunk's
attention folded into the memories as it comes), cuts it to the budget at once (the
kvpress protocol) and then scores the next tokens, for the full cache (every position
kept) and for eviction (h2o at budget 512). Every run is a fresh process, so its peak
resident set size (``ru_maxrss`` from ``wait4``, what ``/usr/bin/time -v`` reports as
maximum resident set size) is that run's alone. Time is given as a ratio: each run's
wall time over the full cache's at the shortest prefix.

    python -m bench.prefill_memory                                  # SmolLM2, 1k to 32k
    python -m bench.prefill_memory --model tiny --prefixes 256,512 --scored 64
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench import common
from flsmem.harness.arguments import make_parser

BUDGET, CHUNK = 512, 16
POLICIES = ("full", "h2o")


def parse(argv=None):
    parser = make_parser("python -m bench.prefill_memory", __doc__)
    parser.add_argument("--model", choices=("tiny", "smollm2-135m"), default="smollm2-135m")
    parser.add_argument("--prefixes", type=common.positive_ints, default=[1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--scored", type=int, default=1024, help="tokens scored after the prefix")
    parser.add_argument("--out", default="prefill-memory", help="name of the results/bench/<name>.json file")
    parser.add_argument("--child", nargs=2, metavar=("PREFIX", "POLICY"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.scored < CHUNK or args.scored % CHUNK or any(p % CHUNK for p in args.prefixes):
        parser.error(f"--scored and every prefix must be multiples of {CHUNK}")
    return args


def child(model_name: str, prefix: int, policy_name: str, scored: int) -> None:
    """One run, in this process: prints its NLL over the scored tokens."""
    import numpy as np

    from flsmem.harness.evaluate import evaluate_nll, make_policy
    from flsmem.models import catalog
    from flsmem.models.data import load_book

    model, tokenizer = catalog.load(model_name)
    tokens = np.asarray(tokenizer.encode(load_book("persuasion")), np.int32)
    need = prefix + scored + 1
    if len(tokens) < need:
        sys.exit(f"Persuasion has {len(tokens)} tokens of {model_name}'s tokenizer; {need} needed")
    nll, _ = evaluate_nll(model, tokens[None, :need], make_policy(policy_name, BUDGET), BUDGET, chunk=CHUNK,
                          prefill=prefix)
    print(json.dumps({"nll": float(nll[0, prefix:].mean())}))


def run_one(model_name: str, prefix: int, policy: str, scored: int) -> dict:
    """One run in a fresh process: its peak resident memory, wall time and NLL."""
    command = [sys.executable, "-m", "bench.prefill_memory", "--model", model_name, "--scored", str(scored),
               "--child", str(prefix), policy]
    begin = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    out = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - begin
    if status:
        raise RuntimeError(f"{' '.join(command)} failed with status {status}")
    return {"prefix": prefix, "policy": policy, "peak_mb": usage.ru_maxrss / 1024, "seconds": seconds,
            **json.loads(out.strip().splitlines()[-1])}


def main(argv=None):
    args = parse(argv)
    if args.child:
        return child(args.model, int(args.child[0]), args.child[1], args.scored)
    rows = []
    for prefix in sorted(args.prefixes):
        for policy in POLICIES:
            row = run_one(args.model, prefix, policy, args.scored)
            rows.append(row)
            print(f"prefix {prefix:6d} {policy:5s}: peak {row['peak_mb']:8.0f} MB, {row['seconds']:7.1f} s, "
                  f"nll {row['nll']:.4f}", flush=True)
            for done in rows:
                done["time_vs_first_full"] = done["seconds"] / rows[0]["seconds"]
            # Saved after every run: the longest prefixes take the better part of an hour.
            path = common.save(args.out, {"model": args.model, "budget": BUDGET, "chunk": CHUNK,
                                          "scored": args.scored, "rows": rows})
            plot(rows, path.with_suffix(".png"))
    print(f"wrote {path} and its plot")


def plot(rows: list[dict], path) -> None:
    """Peak resident memory against the prefix length, full cache and eviction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for policy in POLICIES:
        mine = [r for r in rows if r["policy"] == policy]
        label = "full cache" if policy == "full" else f"{policy}, budget {BUDGET}"
        ax.plot([r["prefix"] for r in mine], [r["peak_mb"] / 1024 for r in mine], "o-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prefix length (tokens)")
    ax.set_ylabel("peak resident memory (GiB)")
    ax.set_title("Prefill in chunks, then the cut: peak memory")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
