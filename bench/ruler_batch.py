"""What decoding a batch of samples saves ``flsmem ruler``: several samples' answers
decoded together under each policy and budget (streamed, the stretch of the prompts
that all of them have fed together too) against the same samples answered one at a
time.

``flsmem ruler --batch K`` answers K samples of a task in one call
(:func:`flsmem.harness.ruler.protocols.batch_answers`): each sample's prefill shared by
the arms, then each arm's K answers decoded as one batch, a row per sample at its own
positions, evicting on its own schedule. Per round (K RULER samples) this times every
arm's answers both ways, back to back in alternating order after a warm-up round that
compiles both, and counts the answers that differ (the model's products run over the
batch, so the two agree to float rounding, not bit for bit). The figure is the ratio of
the two times in each round (never a bare time).

    python -m bench.ruler_batch --cores 1 --batch 4 --rounds 2      # SmolLM2, 1,024 tokens, niah_single_2
    python -m bench.ruler_batch --cores 1 --batch 4 --rounds 2 --task fwe --out ruler-batch-fwe
    python -m bench.ruler_batch --cores 1 --batch 4 --rounds 2 --protocol stream --out ruler-batch-stream
"""

from __future__ import annotations

import time

from bench.ruler_share import finish, prepare
from flsmem.harness.ruler import protocols


def main(argv=None):
    args, model, arms, configs, samples = prepare(argv, "python -m bench.ruler_batch", __doc__, "ruler-batch",
                                                  batches=True)
    batch = args.batch
    samples = list(samples)
    rounds, differ, answered = [], 0, 0
    for number in range(args.rounds + 1):
        chunk = samples[number * batch:(number + 1) * batch]
        prompts, tables, kwargs = [ids for _, ids, _, _ in chunk], [t for _, _, t, _ in chunk], chunk[0][3]
        order = ("batched", "alone") if number % 2 else ("alone", "batched")
        seconds, found = {}, {}
        for way in order:
            begin = time.perf_counter()
            if way == "batched":
                found[way] = {(p, i): tokens for p, i, tokens, _ in protocols.batch_answers(
                    model, configs, prompts, tables=tables, **kwargs)}
            else:
                found[way] = {(p, i): tokens for p, (ids, table) in enumerate(zip(prompts, tables))
                              for i, tokens, _ in protocols.answers(model, configs, *ids, tables=table, **kwargs)}
            seconds[way] = time.perf_counter() - begin
        changed = sorted(key for key in found["alone"] if found["alone"][key] != found["batched"][key])
        label = "warm-up (compiles)" if number == 0 else f"round {number}"
        ratio = seconds["alone"] / seconds["batched"]
        print(f"{label}: {len(chunk)} samples x {len(arms)} arms one sample at a time {seconds['alone']:.1f} s, "
              f"as a batch {seconds['batched']:.1f} s: x{ratio:.2f}; answers that differ: "
              f"{[(chunk[p][0], arms[i]) for p, i in changed] or 'none'}", flush=True)
        differ, answered = differ + len(changed), answered + len(found["alone"])
        if number:
            rounds.append(ratio)
    finish(args, arms, rounds, f"decoding {batch} samples as a batch", differ, answered, batch=batch)


if __name__ == "__main__":
    main()
