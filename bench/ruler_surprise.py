"""What the model's surprise sees of a RULER needle: how much of a context the model
mispredicts, and whether the needle's answer is among it.

A causal score must choose what to keep before the question arrives. Accumulated
attention (H2O) does not single out a needle that nothing reads until then; this
measures whether the model's own prediction does. For each sample it runs the full
context through the model once (full cache, teacher-forced, as the stream protocol
weighs each prediction) and counts the tokens whose argmax prediction missed them:

* ``context missed``: their share of the context's tokens;
* ``missed beyond window``: how many of them lie further from the end of the prompt
  than the recent window (half the budget), where a score has to keep them, against
  the other half of the budget that the score fills;
* ``answer missed``: the share of the answer's tokens (the tokens between the encodings
  of the context up to the answer and through it) that the model mispredicted;
* ``answer's surprisal rank``: where the answer's tokens beyond the window stand among
  all the context's tokens beyond it, ranked by surprisal (the negative log-probability
  the model gave the token), and how many of them a reserve of an eighth of the
  budget (``surprise_reserve``'s) would hold if it ranked by surprisal, not by the
  miss alone.

When the missed tokens beyond the window fit the scored half of the budget and the
answer's tokens are among them, a policy that keeps mispredicted items first
(``surprise``) holds the needle; when the haystack itself is mostly mispredicted, the
needle is one surprise among thousands.

    python -m bench.ruler_surprise --tasks niah_single_1,niah_single_2 --samples 10
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from flsmem.harness.arguments import make_parser
from flsmem.harness.evaluate import make_policy
from flsmem.harness.ruler.tasks import TASKS, make_sample
from flsmem.models import catalog

# The tasks whose answer is one string that occurs once in the context.
ONE_ANSWER = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
              "niah_multikey_3")


@nnx.jit
def _surprise(model, tokens):
    """``([T] bool, [T] float)``: whether token t was not the argmax prediction from the
    tokens before it, and its surprisal in nats (token 0, which nothing predicts, counts
    as predicted, with surprisal 0)."""
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    logp = jax.nn.log_softmax(model(tokens, positions, None)[0][0][:-1], axis=-1)
    hit = jnp.argmax(logp, axis=-1) == tokens[0, 1:]
    surprisal = -jnp.take_along_axis(logp, tokens[0, 1:, None], axis=-1)[:, 0]
    return jnp.concatenate([jnp.zeros((1,), bool), ~hit]), jnp.concatenate([jnp.zeros((1,)), surprisal])


def answer_span(context: str, answer: str, tokenizer) -> tuple[int, int]:
    """``(first, stop)``: the tokens of ``context`` that hold the first ``answer`` in it,
    between the encodings of the context up to the answer and through it."""
    start = context.index(answer)
    return len(tokenizer.encode(context[:start])), len(tokenizer.encode(context[:start + len(answer)]))


def measure(model, tokenizer, sample: dict, budget: float) -> dict:
    """The figures of one sample (a :func:`make_sample` dict) at ``budget``, a fraction
    of the prompt."""
    context = sample["context"]
    ids = np.asarray(tokenizer.encode(context), np.int32)
    prompt = len(ids) + len(tokenizer.encode(sample["question"]))
    missed, surprisal = map(np.asarray, _surprise(model, jnp.asarray(ids)[None]))
    first, stop = answer_span(context, sample["answers"][0], tokenizer)
    # The window and the reserve that flsmem eval and flsmem ruler give surprise_reserve.
    preset = make_policy("surprise_reserve", int(budget * prompt))
    window = preset.recent
    beyond = max(0, prompt - window)
    # 1-based rank by surprisal among the tokens beyond the window, most surprising first.
    rank = np.empty(min(beyond, len(ids)), np.int64)
    rank[np.argsort(-surprisal[:beyond], kind="stable")] = np.arange(1, len(rank) + 1)
    answer_ranks = rank[first:min(stop, beyond)]
    return {"context_missed": float(missed.mean()), "beyond": int(missed[:beyond].sum()),
            "scored_half": int(budget * prompt) - window, "answer_missed": float(missed[first:stop].mean()),
            "reserve": preset.params.reserve, "answer_ranks": answer_ranks.tolist()}


def main(argv=None):
    parser = make_parser("python -m bench.ruler_surprise", __doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--tasks", default="niah_single_1,niah_single_2,niah_single_3,niah_multikey_1",
                        help=f"comma-separated, among {', '.join(ONE_ANSWER)}")
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", type=float, default=0.25, help="fraction of the prompt kept")
    args = parser.parse_args(argv)
    tasks = args.tasks.split(",")
    unknown = [t for t in tasks if t not in ONE_ANSWER]
    if unknown:
        parser.error(f"--tasks must be among {', '.join(ONE_ANSWER)} (of {', '.join(TASKS)}), got {unknown}")
    if not 0 < args.budget <= 1:
        parser.error(f"--budget must be in (0, 1], got {args.budget}")
    if args.samples < 1:
        parser.error(f"--samples must be at least 1, got {args.samples}")
    model, tokenizer = catalog.load(args.model)
    rows = {}
    with tqdm(total=len(tasks) * args.samples, unit="sample") as bar:
        for task in tasks:
            rows[task] = []
            for index in range(args.samples):
                sample = make_sample(task, args.length, index, tokenizer, args.seed)
                rows[task].append(measure(model, tokenizer, sample, args.budget))
                bar.update()
    print(f"{args.model}, {args.length} tokens, budget {args.budget:g} (scored half: the budget less its "
          f"recent window), samples 0-{args.samples - 1} of seed {args.seed}; mean [min, max] over samples\n")
    print("| task | context missed | missed beyond window | scored half | answer missed | samples whose "
          "missed tokens fit the scored half | answer's surprisal rank beyond the window | answer's tokens a "
          "reserve ranked by surprisal holds |")
    print("|---|---|---|---|---|---|---|---|")
    for task, found in rows.items():
        def span(key, fmt):
            values = [r[key] for r in found]
            return f"{fmt(np.mean(values))} [{fmt(min(values))}, {fmt(max(values))}]"
        fits = sum(r["beyond"] <= r["scored_half"] for r in found)
        print(f"| {task} | {span('context_missed', lambda v: f'{100 * v:.0f}%')} | "
              f"{span('beyond', lambda v: f'{v:.0f}')} | {found[0]['scored_half']} | "
              f"{span('answer_missed', lambda v: f'{100 * v:.0f}%')} | {fits} of {len(found)} | "
              f"{_ranks(found)} |")


def _ranks(found: list[dict]) -> str:
    """The answer's ranks by surprisal over the samples whose answer lies beyond the
    window, and how many of its tokens fall within the reserve."""
    ranked = [r for r in found if r["answer_ranks"]]
    if not ranked:
        return "– (every answer inside the window) | –"
    ranks = np.concatenate([r["answer_ranks"] for r in ranked])
    held = sum(int(np.sum(np.asarray(r["answer_ranks"]) <= r["reserve"])) for r in ranked)
    return (f"median {np.median(ranks):.0f} [{ranks.min()}, {ranks.max()}] ({len(ranked)} samples) | "
            f"{held} of {len(ranks)} (reserve {ranked[0]['reserve']})")


if __name__ == "__main__":
    main()
