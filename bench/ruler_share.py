"""What one shared prefill saves ``flsmem ruler``: a sample's policies and budgets
answered together against the same answers one by one.

Under the prefilling protocols every policy and budget of a sample shares one prefill
(:func:`flsmem.harness.ruler.protocols.answers`). For RULER samples this times, in
each round, the answers of every ``(policy, budget)`` arm given at once against the
same arms answered alone (:func:`~flsmem.harness.ruler.protocols.answer`), back to
back in alternating order after a warm-up that compiles both, and checks that every
arm's answer is the same both ways. The figure is the ratio of the two times in each
round (never a bare time); a round is one sample.

    python -m bench.ruler_share --cores 1                 # SmolLM2, 1,024 tokens
    python -m bench.ruler_share --cores 1 --length 4096 --rounds 2 --out ruler-share-4k
"""

from __future__ import annotations

import time

from bench.common import add_timing_options, save, set_timing, summarise
from flsmem.harness.arguments import make_parser
from flsmem.harness.ruler import protocols
from flsmem.harness.ruler.run import MAX_NEW

POLICIES = "h2o,streaming_llm,snapkv,rmm,tova,oracle"


def main(argv=None):
    args, model, arms, configs, samples = prepare(argv, "python -m bench.ruler_share", __doc__, "ruler-share")
    rounds = []
    for index, ids, tables, kwargs in samples:
        def shared_run():
            return {i: (tokens, info) for i, tokens, info in protocols.answers(model, configs, *ids, tables=tables,
                                                                               **kwargs)}

        def separate_run():
            return [protocols.answer(model, config, *ids, table=table, **kwargs)
                    for config, table in zip(configs, tables)]

        # Alternated, so that neither way always runs second (warmer caches, a quieter machine).
        order = ("shared", "separate") if index % 2 else ("separate", "shared")
        seconds, found = {}, {}
        for way in order:
            begin = time.perf_counter()
            found[way] = (shared_run if way == "shared" else separate_run)()
            seconds[way] = time.perf_counter() - begin
        together, alone, shared, separate = found["shared"], found["separate"], seconds["shared"], seconds["separate"]
        different = [arms[i] for i in range(len(arms)) if together[i] != alone[i]]
        if different:
            raise SystemExit(f"sample {index}: the shared prefill changed the answers of {different}")
        label = "warm-up (compiles)" if index == 0 else f"round {index}"
        print(f"{label}: {len(arms)} arms alone {separate:.1f} s, sharing one prefill {shared:.1f} s: "
              f"x{separate / shared:.2f}", flush=True)
        if index:
            rounds.append(separate / shared)
    finish(args, arms, rounds, "sharing the prefill", max_new=MAX_NEW)


def finish(args, arms, rounds: list[float], what: str, differ: int | None = None, answered: int | None = None,
           **extra) -> None:
    """The end of a RULER timing: the median ratio over ``rounds`` (and, when counted,
    the answers that differ) printed, and saved to ``--out`` with the run's settings and
    ``extra``."""
    summary = summarise(rounds)
    counted = "" if differ is None else f"; {differ} of {answered} answers differ"
    print(f"speed-up of {what}: x{summary['median']:.2f} "
          f"(rounds x{min(rounds):.2f} .. x{max(rounds):.2f}){counted}")
    save(args.out, {"model": args.model, "length": args.length, "task": args.task, "protocol": args.protocol,
                    "arms": [list(arm) for arm in arms], **extra, "speedup": summary,
                    **({} if differ is None else {"answers": answered, "answers_differing": differ})})


def prepare(argv, prog: str, doc: str, out: str, batches: bool = False):
    """A RULER timing's command line read and its work laid out: ``(args, model, arms,
    configs, samples)``, the options, the model, the ``(policy, budget)`` arms and
    their memory settings, and per sample (the warm-up's first; with ``batches``,
    ``--batch`` of them a round) ``(index, (context, question), oracle tables, keyword
    arguments of answer)``."""
    parser = make_parser(prog, doc)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--task", default="niah_single_2")
    parser.add_argument("--policies", default=POLICIES, help="comma-separated")
    parser.add_argument("--budgets", default="1/4", help="fractions of the length, comma-separated")
    parser.add_argument("--protocol", default="question-agnostic", choices=("question-agnostic", "question-aware")
                        + (("stream",) if batches else ()))
    if batches:
        parser.add_argument("--batch", type=int, default=8, help="samples answered together, a round")
    parser.add_argument("--rounds", type=int, default=3, help="samples timed, each a round (after one warm-up)")
    parser.add_argument("--out", default=out, help="results/bench/<out>.json")
    add_timing_options(parser)
    args = parser.parse_args(argv)
    if batches and args.batch < 2:
        parser.error(f"--batch must be an int >= 2 (samples answered together), got {args.batch}")
    per_round = args.batch if batches else 1
    set_timing(args)

    from fractions import Fraction

    from flsmem.harness.ruler.run import Answerer, Plan
    from flsmem.harness.ruler.tasks import make_sample
    from flsmem.models import catalog

    model, tokenizer = catalog.load(args.model)
    arms = [(policy, float(Fraction(budget))) for policy in args.policies.split(",")
            for budget in args.budgets.split(",")]
    plan = Plan(model=args.model, lengths=(args.length,), tasks=(args.task,), policies=(), budgets=(),
                protocols=(args.protocol,), samples=(args.rounds + 1) * per_round)
    helper = Answerer(plan, model, tokenizer)
    _, configs = helper.configs(arms, args.protocol, args.length)

    def samples():
        for index in range((args.rounds + 1) * per_round):
            sample = make_sample(args.task, args.length, index, tokenizer, 0)
            ids = helper.ids(sample)
            tables = [helper.oracle_table(sample, ids) if policy == "oracle" else None for policy, _ in arms]
            yield index, ids, tables, dict(protocol=args.protocol, max_new=sample["max_new_tokens"],
                                           eos_id=tokenizer.eos_id)

    return args, model, arms, configs, samples()


if __name__ == "__main__":
    main()
