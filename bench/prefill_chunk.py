"""What one prefill chunk costs: the decoder over a memory of N slots, against the same
tokens through the plain decoder.

A prefilling protocol (``flsmem ruler``'s question-agnostic and question-aware, the
prefill protocol of ``flsmem eval``) feeds the prompt in chunks, each attending over a
memory sized to the whole prompt and folding its attention in as evidence
(``Memories.observe``). This times one such chunk (h2o's evidence) against the plain
causal forward of the same tokens (no memory, no evidence), back to back, and prints
the ratio; then, under ``jax.profiler``, the chunk's costliest XLA operations with the
JAX operations each was fused from. The plain forward attends over the chunk only, so
part of the ratio is the attention over N slots that any prefill of that length pays.

    python -m bench.prefill_chunk                              # SmolLM2, 1k and 4k slots
    python -m bench.prefill_chunk --model tiny --slots 256 --chunk 32 --rounds 2
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import flsmem
from bench import common
from bench.step_trace import operation_times
from flsmem import policies as P
from flsmem.harness.arguments import make_parser
from flsmem.models.decoder import init_memories


def chunk_functions(model, slots: int, chunk: int):
    """``(memories, prefill, plain, tokens)``: empty memories of ``slots`` slots, the
    jitted chunk through them (donating them), the jitted plain forward, the tokens."""
    # Capacity is budget + evict_every + max_chunk - 1: exactly ``slots``.
    config = flsmem.MemoryConfig(policy=P.h2o(), budget=slots - 2 * chunk + 1, evict_every=chunk, max_chunk=chunk)
    memories = init_memories(model.cfg, config, 1)
    graphdef, params = nnx.split(model)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, model.cfg.vocab_size, (1, chunk)), jnp.int32)

    @jax.jit
    def plain(params, tokens):
        return nnx.merge(graphdef, params)(tokens)[0][:, -1]

    @functools.partial(jax.jit, donate_argnums=(1,))
    def prefill(params, memories, tokens):
        positions = jnp.arange(chunk, dtype=jnp.int32)[None, :]
        logits, memories, attention = nnx.merge(graphdef, params)(tokens, positions, memories)
        return logits[:, -1], memories.observe(attention)

    return memories, functools.partial(prefill, params), functools.partial(plain, params), tokens


def top_operations(fn, args, top: int, calls: int = 2) -> list[dict]:
    """The ``top`` costliest operations of one call of ``fn(*args())`` (ms per call)."""
    per_call, origin = operation_times(fn.func, lambda: (*fn.args, *args()), calls)
    total = sum(per_call.values())
    return [{"operation": name, "ms": us / 1000, "share": us / total, "from": origin[name]}
            for name, us in per_call.most_common(top)]


def main(argv=None):
    parser = make_parser("python -m bench.prefill_chunk", __doc__)
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="smollm2")
    parser.add_argument("--slots", type=common.positive_ints, default=[1024, 4096], help="memory slots")
    parser.add_argument("--chunk", type=int, default=128, help="tokens per prefill chunk")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--top", type=int, default=8, help="operations to list per size")
    parser.add_argument("--out", default="prefill-chunk", help="name of the results/bench/<name>.json file")
    common.add_timing_options(parser)
    args = parser.parse_args(argv)
    if min(args.chunk, args.rounds, args.top) < 1:
        parser.error("--chunk, --rounds and --top must be >= 1")
    if any(s < 2 * args.chunk for s in args.slots):
        parser.error(f"every --slots must be at least twice --chunk ({2 * args.chunk})")
    common.set_timing(args)
    model = common.load_model(args.model)
    rows = []
    for slots in args.slots:
        memories, prefill, plain, tokens = chunk_functions(model, slots, args.chunk)
        fresh = lambda: (jax.tree.map(jnp.copy, memories), tokens)  # noqa: E731
        ratio = common.paired(lambda: plain(tokens), {"chunk": (fresh, prefill)}, args.rounds)["chunk"]
        operations = top_operations(prefill, fresh, args.top)
        rows.append({"slots": slots, "chunk": args.chunk, "vs_plain": ratio, "operations": operations})
        print(f"{slots} slots, chunk {args.chunk}: x{ratio['median']:.2f} the plain forward "
              f"(rounds x{ratio['low']:.2f} .. x{ratio['high']:.2f}); costliest operations:", flush=True)
        for op in operations:
            print(f"  {op['ms']:8.1f} ms {100 * op['share']:4.0f}%  {op['operation']:28s} {op['from'][:90]}")
    path = common.save(args.out, {"model": args.model, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
