"""Which expert the adaptive policy follows, per layer: measure or accumulate, as each
layer of a real model answers it online.

Streams the windows ``flsmem eval`` streams (the same text, context and spacing, and
the same BOS for models that expect one) under ``adaptive`` at each budget, and prints
each expert's weight at the end of the window, averaged over windows and KV heads, for
every layer; the plot shows the same as one panel per budget.

    python -m bench.adaptive_weights --model smollm2-135m --out results/adaptive/weights-smollm2
    python -m bench.adaptive_weights --policy "adaptive(judge='evicted')" --out results/adaptive/evicted/weights-smollm2
"""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np

from flsmem.harness.arguments import make_parser
from flsmem.harness.evaluate import evaluate_nll, make_policy, split_settings
from flsmem.harness.report import eval_windows
from flsmem.models import catalog
from flsmem.policies.adaptive import expert_names


def layer_weights(model, windows: np.ndarray, budget: int, chunk: int,
                  name: str = "adaptive") -> tuple[tuple[str, ...], np.ndarray, float]:
    """``(experts, weights [L, N], nll)``: each expert's final weight per layer (mean over
    windows and KV heads) and the mean NLL of the run, under the adaptive policy ``name``
    (``adaptive`` or with settings, ``adaptive(judge='evicted')``)."""
    policy = make_policy(name, budget, model=model.cfg)
    nll, stats = evaluate_nll(model, windows, policy, budget, chunk=chunk)
    n = len(policy.params.decays)
    losses = np.asarray(stats["aux"])[..., :n]  # [L, W, K, N]
    weights = np.asarray(jax.nn.softmax(-policy.params.rate * losses, axis=-1)).mean(axis=(1, 2))
    return expert_names(policy.params), weights, float(nll.mean())


def main(argv=None):
    parser = make_parser("python -m bench.adaptive_weights", __doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--text", default="persuasion", help="a bundled book")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--budgets", default="64,128,256", help="comma-separated item counts")
    parser.add_argument("--evict-every", type=int, default=16)
    parser.add_argument("--policy", default="adaptive",
                        help="adaptive, or adaptive with settings, as in adaptive(judge='evicted')")
    parser.add_argument("--out", required=True, help="path stem: writes STEM.json and STEM.png")
    args = parser.parse_args(argv)
    try:
        base, _ = split_settings(args.policy)
    except ValueError as error:
        parser.error(str(error))
    if base != "adaptive":
        parser.error(f"--policy must be adaptive, or adaptive with settings, got {args.policy!r}")
    model, tokenizer = catalog.load(args.model)
    windows = eval_windows(args, tokenizer)
    runs = {}
    for budget in (int(b) for b in args.budgets.split(",")):
        experts, weights, nll = layer_weights(model, windows, budget, args.evict_every, args.policy)
        runs[budget] = {"experts": experts, "weights": weights.tolist(), "nll": nll}
        print(f"{args.policy} at {budget} of {args.context} (nll {nll:.4f}): final weight of each expert per layer")
        print("layer  " + "  ".join(f"{name:>7}" for name in experts))
        for layer, row in enumerate(weights):
            print(f"{layer:5d}  " + "  ".join(f"{w:7.3f}" for w in row))
        print("mean   " + "  ".join(f"{w:7.3f}" for w in weights.mean(axis=0)))
        print()
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"model": args.model, "policy": args.policy, "text": args.text,
                                                    "context": args.context, "windows": args.windows, "runs": runs},
                                                   indent=1) + "\n")
    plot(runs, args, out.with_suffix(".png"))


def plot(runs: dict, args, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(3.4 * len(runs), 3.2), squeeze=False, sharey=True)
    for ax, (budget, run) in zip(axes[0], runs.items()):
        weights = np.asarray(run["weights"])
        for k, name in enumerate(run["experts"]):
            ax.plot(np.arange(len(weights)), weights[:, k], marker="o", ms=3, label=name)
        ax.set_title(f"budget {budget} of {args.context}", fontsize=9)
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("final weight (mean over windows, KV heads)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"{args.policy} on {args.model}, {args.windows} x {args.context} tokens of {args.text}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
