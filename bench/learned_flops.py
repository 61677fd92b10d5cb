"""The learned estimator's arithmetic against the model's, per decode step.

What the learned policy adds to a decode step has a floor that no fusion removes: its
network scores every slot of every layer and KV head when an eviction is due (every
``evict_every`` queries), and, learning online, it takes a gradient step over one
snapshot of those slots every ``horizon / snapshots`` queries. This script counts that
arithmetic against the model's own, for the shipped estimator at the budget
``bench.overhead`` times (batch 1):

* the model's step: two operations per weight of its matrices (a tied embedding table
  counted once, as the output projection; the input lookup is no arithmetic) and the
  attention's two products over ``budget + evict_every`` slots in every layer;
* the network's forward over all the slots, and one learning step (the loss, its
  gradient and the optimizer's update), from XLA's cost analysis of each compiled
  function. The model's figure is counted from its shapes instead: XLA's analysis
  counts the body of a loop once, and the decoder loops over its layers.

    python -m bench.learned_flops
    python -m bench.learned_flops --models tiny --evict-every 8
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
from flax import nnx

from bench import common
from bench.overhead import BUDGET
from flsmem import estimator
from flsmem.estimator import labels, network
from flsmem.estimator.evidence import FEATURES
from flsmem.harness.arguments import make_parser
from flsmem.harness.evaluate import ESTIMATOR_DIR


def parse(argv=None):
    parser = make_parser("python -m bench.learned_flops", __doc__)
    parser.add_argument("--models", type=common.choices(("tiny", "smollm2")), default=["tiny", "smollm2"])
    parser.add_argument("--evict-every", type=common.positive_ints, default=[1, 8, 32])
    parser.add_argument("--out", default="learned-flops", help="name of the results/bench/<name>.json file")
    return parser.parse_args(argv)


def model_flops(model, slots: int) -> int:
    """Floating-point operations of one decode step of ``model`` at batch 1 over
    ``slots`` cached items per layer and KV head."""
    cfg = model.cfg
    # The projections' kernels (stacked over layers), and the embedding table when it is
    # tied (it is then the output projection; an input table alone is looked up).
    matrix = ("kernel", "embedding") if cfg.tie_embeddings else ("kernel",)
    leaves = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))[0]
    weights = sum(x.size for path, x in leaves if getattr(path[-1], "key", None) in matrix)
    # Scores (q . k) and the weighted sum of values, two operations per multiply-add.
    attention = cfg.depth * cfg.q_heads * slots * cfg.head_dim * 2 * 2
    return 2 * weights + attention


def network_flops(policy, slots: int) -> tuple[float, float]:
    """XLA's count of the network's forward over ``slots`` feature rows, and of one
    learning step over them (every row labelled)."""
    params = network.init_params(policy.params.hidden, 0, policy.params.prior)
    x = jnp.zeros((slots, len(FEATURES)), jnp.float32)
    learned = {"params": params, "opt": labels.optimizer(policy).init(params), "loss": jnp.float32(0.0),
               "labels": jnp.int32(0), "updates": jnp.int32(0), "skipped": jnp.int32(0)}
    gathered, held = jnp.ones((slots,), jnp.float32), jnp.ones((slots,), jnp.bool_)

    def cost(fn, *args):
        return float(jax.jit(fn).lower(*args).compile().cost_analysis()["flops"])

    forward = cost(network.predict, params, x)
    learn = cost(lambda learned, x, g, h: labels.fit_one(policy, learned, x, g, h), learned, x, gathered, held)
    return forward, learn


def measure(name: str, evict_every: list[int]) -> list[dict]:
    model = common.load_model(name)
    cfg = model.cfg
    policy = estimator.from_checkpoint(ESTIMATOR_DIR, online=True)
    period = policy.params.horizon // policy.params.snapshots
    rows = []
    for ee in evict_every:
        slots = BUDGET[name] + ee
        step = model_flops(model, slots)
        scored = cfg.depth * cfg.kv_heads * slots
        forward, learn = network_flops(policy, scored)
        rows.append({"model": name, "evict_every": ee, "slots": slots, "network_slots": scored,
                     "hidden": policy.params.hidden, "learn_period": period, "model_flops": step,
                     "forward_flops": forward, "learn_flops": learn,
                     "scoring_share": forward / ee / step, "learning_share": learn / period / step})
    return rows


def main(argv=None):
    args = parse(argv)
    rows = [row for name in args.models for row in measure(name, args.evict_every)]
    print(f"{'model':8} {'evict_every':>11} {'model MFLOP':>11} {'slots':>6} {'forward MFLOP':>13} "
          f"{'learn MFLOP':>11} {'scoring':>8} {'learning':>8}  (shares of the model's step)")
    for r in rows:
        print(f"{r['model']:8} {r['evict_every']:11d} {r['model_flops'] / 1e6:11.1f} {r['network_slots']:6d} "
              f"{r['forward_flops'] / 1e6:13.1f} {r['learn_flops'] / 1e6:11.1f} {r['scoring_share']:8.1%} "
              f"{r['learning_share']:8.1%}")
    common.save(args.out, {"rows": rows})


if __name__ == "__main__":
    sys.exit(main())
