#!/usr/bin/env bash
# Every benchmark behind results/BENCHMARKS.md, one after another (they would slow
# each other down), then the report. About an hour on a 2-core CPU, and 35 minutes more
# for the two RULER sharing figures.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python}
# The overhead is the work flsmem adds, so its loops run on one core (bench/NOTES.md,
# "Two threads"); the quick form once more on every core shows the difference.
# A goal of a few percent is decided by the 95% interval of the median ratio, which
# narrows with the rounds: 21 rounds give the 6th to the 16th (bench/NOTES.md).
$python -m bench.overhead --models tiny --batch 1,8 --rounds 21 --cores 1 --out overhead-tiny
# Issue 21's serving goals name rmm, h2o, ema and kalman at evict_every 8 and 1.
$python -m bench.overhead --models smollm2 --batch 1,8 --policies rmm,h2o,ema,kalman --evict-every 1,8 --rounds 21 --cores 1
$python -m bench.overhead --quick
$python -m bench.overhead --quick --cores all --out overhead-quick-all-cores
# The learned estimator (its network and online learning) beside rmm in the same run.
$python -m bench.overhead --models tiny,smollm2 --batch 1 --policies learned,learned_offline,rmm --evict-every 8 --rounds 41 --cores 1 --out overhead-learned
# Its network's arithmetic against the model's: the floor under those rows.
$python -m bench.learned_flops
# Budgets shared by KV heads (AdaKV) beside the same policies with uniform budgets.
$python -m bench.overhead --models smollm2 --batch 1,8 --policies 'rmm,adakv(rmm),h2o,adakv(h2o)' --evict-every 8 --rounds 9 --cores 1 --out overhead-adakv
$python -m bench.profile --batch 1,8 --cores 1
# The first call's ratio taken apart, and a small model's step operation by operation.
$python -m bench.compile_time --cores 1
$python -m bench.compile_time --model smollm2 --cores 1 --out compile-time-smollm2
$python -m bench.step_trace --model tiny --policy rmm --evict-every 8 --cores 1 --top 30 > results/bench/step-trace-tiny.txt
$python -m bench.step_trace --model tiny --policy learned --evict-every 8 --cores 1 --top 30 > results/bench/step-trace-tiny-learned.txt
$python -m bench.longctx --batch 1,8
$python -m bench.prefill_memory
# One prefill chunk against the plain forward; how its "before" rows were made: bench/NOTES.md.
$python -m bench.prefill_chunk --rounds 3
# RULER's prefilling protocols: one prefill for a sample's policies and budgets, against one each;
# then the cut memory resized for the question and answer, against the prompt's slots.
$python -m bench.ruler_share --cores 1
$python -m bench.ruler_share --cores 1 --length 4096 --rounds 2 --out ruler-share-4k
$python -m bench.ruler_resize --cores 1
$python -m bench.ruler_resize --cores 1 --length 4096 --rounds 2 --out ruler-resize-4k
$python -m bench.ruler_batch --cores 1 --batch 4 --rounds 2
$python -m bench.ruler_batch --cores 1 --batch 4 --rounds 2 --task fwe --out ruler-batch-fwe
$python -m bench.ruler_batch --cores 1 --batch 4 --rounds 2 --protocol stream --out ruler-batch-stream
$python -m bench.pyref --cores 1
$python -m bench.step_trace --cores 1
# What a fold of several evidence columns pays for their layout (the Kalman filter's).
$python -m bench.evidence_layout --cores 1 --rounds 21
$python -m bench.kernel --sizes 256,4096,65536 --rows 8,64 --rounds 3
$python -m bench.report
