"""``flsmem generate``: continue prompts with a bounded KV cache, printing tokens as they come.

One prompt (``--prompt``), or one per line of a file (``--prompt-file``, ``-`` for
standard input; with neither, standard input), generated together as a batch under one
policy and budget. At the end: tokens per second, the peak cache size and how many
items were evicted.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from flsmem.harness.arguments import read_text

__all__ = ["add_arguments", "run", "read_prompts"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from flsmem.harness.evaluate import LEARNED_NAMES, PEER_NAMES, POLICY_NAMES
    from flsmem.models.catalog import MODELS

    parser.add_argument("--model", default="tiny", help=f"one of {', '.join(MODELS)}, or a .gguf file")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="the prompt text")
    source.add_argument("--prompt-file", help="one prompt per line ('-' for standard input)")
    parser.add_argument("--steps", type=int, default=64, help="tokens to generate per prompt")
    choices = [name for name in POLICY_NAMES + LEARNED_NAMES + PEER_NAMES if name != "oracle"]
    parser.add_argument("--policy", default="h2o", metavar="POLICY",
                        help=f"eviction policy, as in flsmem eval: {', '.join(choices)}, or one of them wrapped "
                             "by adakv or pyramid, as in adakv(h2o)")
    parser.add_argument("--budget", type=int, default=64, help="items each layer's memory row keeps")
    parser.add_argument("--evict-every", type=int, default=8, help="items that arrive between two evictions")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 for greedy decoding")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling")


def read_prompts(args: argparse.Namespace) -> list[str]:
    """The prompts the arguments name, one per non-empty line of a file or stdin.

    Raises:
      ValueError: a missing, unreadable, binary or empty source, naming the argument.
    """
    if args.prompt is not None:
        prompts = [args.prompt]
    else:
        source = "-" if args.prompt_file is None else args.prompt_file
        argument = "--prompt-file" if args.prompt_file is not None else "standard input (no --prompt given)"
        prompts = read_text(argument, source).splitlines()
    prompts = [p for p in prompts if p.strip()]
    if not prompts:
        raise ValueError("--prompt: no prompt given: --prompt TEXT, --prompt-file FILE (one prompt per line) "
                         "or text on standard input")
    return prompts


def run(args: argparse.Namespace, fail) -> list[str]:
    """Generate and print; returns the continuations. ``fail(message)`` reports a bad
    argument (one line, exit status 2) before any model is loaded."""
    import flsmem
    from flsmem.harness.evaluate import is_policy_name, make_policy
    from flsmem.models import catalog
    from flsmem.models.decoder import TINY
    from flsmem.models.generate import stream

    if args.steps < 1:
        fail(f"--steps must be >= 1, got {args.steps}")
    if args.budget < 1 or args.evict_every < 1:
        fail(f"--budget and --evict-every must be >= 1, got {args.budget} and {args.evict_every}")
    if not args.temperature >= 0:
        fail(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        fail(f"--top-p must be in (0, 1], got {args.top_p}")
    try:
        catalog.load_tokenizer(args.model)  # an unsupported model file fails here, before its weights load
    except ValueError as error:
        fail(str(error))
    try:
        prompts = read_prompts(args)
    except ValueError as error:
        fail(str(error))
    def memory_config(model_config):
        policy = make_policy(args.policy, args.budget, model=model_config)
        return flsmem.MemoryConfig(policy=policy, budget=args.budget, evict_every=args.evict_every, max_chunk=16)

    if "pyramid(" in args.policy:
        fail(f"--policy {args.policy}: layer budgets apply when a prefix is compressed (flsmem eval --protocol "
             "prefill); generation evicts on a schedule, where every layer keeps the same budget")
    if not is_policy_name(args.policy) or args.policy == "oracle":
        fail(f"--policy must be a policy of flsmem eval other than the oracle (which needs the future), "
             f"as in h2o or adakv(rmm), got {args.policy!r}")
    try:
        memory_config(TINY)  # the budget checked before the model loads; built again for its shape below
    except ValueError as error:
        fail(f"--policy {args.policy} at --budget {args.budget}: {error}")
    model, tokenizer = catalog.load(args.model)
    config = memory_config(model.cfg)
    ids = [tokenizer.encode(p) for p in prompts]
    if min(len(i) for i in ids) < 1:
        fail("a prompt encodes to no tokens")
    if tokenizer.add_bos:  # Gemma is lost without its BOS token first
        ids = [np.concatenate([[tokenizer.bos_id], i]).astype(np.int32) for i in ids]
    out = [[] for _ in prompts]
    alone = len(prompts) == 1
    peak, shown, begin, emitted_then = 0, 0, None, 0
    for step in stream(model, config, ids, args.steps, temperature=args.temperature, top_p=args.top_p, seed=args.seed):
        if begin is None:  # the prefill and the first step compile: time the steps after them
            begin, emitted_then = time.perf_counter(), int(step.emitted.sum())
        peak = max(peak, step.held)
        for row in np.flatnonzero(step.emitted):
            out[row].append(int(step.tokens[row]))
        if alone and step.emitted[0]:
            shown = _print_new(tokenizer, out[0], shown)
    elapsed = time.perf_counter() - begin
    texts = [tokenizer.decode(np.asarray(o, np.int32)) for o in out]
    if not alone:
        for prompt, text in zip(prompts, texts):
            print(f"{prompt}{text}", flush=True)
    else:
        print(flush=True)
    # Head-adaptive budgets let one head hold up to its largest share.
    shared = f", up to {config.head_share} in one head" if config.policy.head_budget is not None else ""
    total = sum(len(o) for o in out)
    rate = (total - emitted_then) / elapsed if elapsed > 0 else float("nan")
    print(f"{total} tokens for {len(prompts)} prompt(s), {rate:.1f} tokens/s after the first step; "
          f"peak cache {peak} items per {'global ' if model.cfg.local_layers else ''}layer and KV head "
          f"(budget {args.budget}{shared} + evict_every {args.evict_every}); {step.evictions} items evicted",
          file=sys.stderr, flush=True)
    return texts


def _print_new(tokenizer, tokens: list[int], shown: int) -> int:
    """Print the decoded text past its first ``shown`` characters, unless it ends inside
    a character that the next token completes; returns how much is shown now."""
    text = tokenizer.decode(np.asarray(tokens, np.int32))
    if text.endswith("\ufffd"):
        return shown
    print(text[shown:], end="", flush=True)
    return len(text)
