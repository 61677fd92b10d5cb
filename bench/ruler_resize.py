"""What resizing the cut memory saves ``flsmem ruler``: the question read and the answer
decoded in the slots they need (:func:`flsmem.resize`) against the slots of the prompt.

Under the prefilling protocols the memory holds the whole prompt until the cut; after
it the runner moves the kept items into a memory of ``budget + 2 * evict_every - 1``
slots. Per round (one RULER sample) this times every arm's answers, after one shared
prefill, both ways (the cut memory resized, and left at the prompt's size), back to
back in alternating order after a warm-up that compiles both, and counts the arms
whose answer differs (the attention sums over fewer slots, so the two agree to float
rounding, not bit for bit). The figure is the ratio of the two times in each round.

    python -m bench.ruler_resize --cores 1                 # SmolLM2, 1,024 tokens
    python -m bench.ruler_resize --cores 1 --length 4096 --rounds 2 --out ruler-resize-4k
"""

from __future__ import annotations

import time

from bench.ruler_share import finish, prepare
from flsmem.harness.ruler import protocols


def main(argv=None):
    args, model, arms, configs, samples = prepare(argv, "python -m bench.ruler_resize", __doc__, "ruler-resize")
    rounds, differ, answered = [], 0, 0
    for index, ids, tables, kwargs in samples:
        order = ("resized", "prompt-sized") if index % 2 else ("prompt-sized", "resized")
        seconds, found = {}, {}
        for way in order:
            begin = time.perf_counter()
            found[way] = {i: tokens for i, tokens, _ in protocols.answers(model, configs, *ids, tables=tables,
                                                                          resize=way == "resized", **kwargs)}
            seconds[way] = time.perf_counter() - begin
        changed = [arms[i] for i in range(len(arms)) if found["resized"][i] != found["prompt-sized"][i]]
        label = "warm-up (compiles)" if index == 0 else f"round {index}"
        ratio = seconds["prompt-sized"] / seconds["resized"]
        print(f"{label}: {len(arms)} arms in the prompt's slots {seconds['prompt-sized']:.1f} s, resized "
              f"{seconds['resized']:.1f} s: x{ratio:.2f}; answers that differ: {changed or 'none'}", flush=True)
        differ, answered = differ + len(changed), answered + len(arms)
        if index:
            rounds.append(ratio)
    finish(args, arms, rounds, "resizing the cut memory", differ, answered)


if __name__ == "__main__":
    main()
