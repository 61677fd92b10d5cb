"""Which memories still hold a RULER needle after the cut, per layer and KV head.

Prefills one ``niah_single_1`` sample (context and question, the question-aware
protocol), cuts it to the budget with the given policy, and counts, in each layer's
memory of each KV head, how many of the tokens around the needle are still held.

    python -m bench.ruler_needle                  # SmolLM2, 1,024 tokens, snapkv at 1/4, sample 0
"""

from __future__ import annotations

import functools

import numpy as np
from flax import nnx

from flsmem.harness.arguments import make_parser
from flsmem.harness.evaluate import make_policy
from flsmem.harness.ruler import protocols
from flsmem.harness.ruler.tasks import make_sample
from flsmem.models import catalog
from flsmem.models.decoder import init_memories


def main(argv=None):
    parser = make_parser("python -m bench.ruler_needle", __doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--policy", default="snapkv")
    parser.add_argument("--fraction", type=float, default=0.25)
    parser.add_argument("--index", type=int, default=0, help="the sample")
    args = parser.parse_args(argv)
    model, tokenizer = catalog.load(args.model)
    sample = make_sample("niah_single_1", args.length, args.index, tokenizer, 0)
    context, question = (np.asarray(tokenizer.encode(sample[k]), np.int32) for k in ("context", "question"))
    prompt = np.concatenate([context, question])
    answer = sample["answers"][0]
    # The needle's tokens: the first window of the context that decodes to the answer.
    span = next(n for n in range(1, 16) if any(answer in tokenizer.decode(context[i:i + n])
                                                for i in range(len(context) - n)))
    start = next(i for i in range(len(context)) if answer in tokenizer.decode(context[i:i + span]))
    budget = max(1, int(args.fraction * args.length))
    config = protocols.memory_config(make_policy(args.policy, budget), budget, "question-aware",
                                     length=len(prompt), evict_every=16, max_new=sample["max_new_tokens"])
    feed = functools.partial(protocols._feed_pieces, *nnx.split(model), prompt, None)
    memories, _ = feed(init_memories(model.cfg, config, 1), 0, len(prompt), (128, 16, 1), "observe",
                       known=len(prompt))
    held = protocols._compress(memories).evictable
    kept = np.asarray(held.valid & (held.position >= start) & (held.position < start + span)).sum(-1)[:, 0]
    print(f"{args.policy} at {budget} of {len(prompt)} tokens; the needle {answer!r} is tokens {start}..{start + span - 1}")
    print("needle tokens kept, per layer (rows) and KV head:")
    for layer, row in enumerate(kept):
        print(f"  layer {layer:2d}: {' '.join(f'{n}/{span}' for n in row)}")
    whole = kept == span
    print(f"all {span} kept in {int(whole.sum())} of {whole.size} memories; none in {int((kept == 0).sum())}")


if __name__ == "__main__":
    main()
