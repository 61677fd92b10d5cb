"""Assemble ``results/BENCHMARKS.md`` from the ``results/bench/*.json`` files.

Every figure in the report is read from a file written by one benchmark command, and
the command is printed beside its table. Missing files are reported as not run.

    python -m bench.report
"""

from __future__ import annotations

import json
import pathlib
import shlex
import sys

from bench import prefill_memory
from bench.common import RESULTS
from flsmem.harness.arguments import make_parser

OUT = pathlib.Path("results") / "BENCHMARKS.md"

# Goals of issue 7 on the 2-core CPU.
OVERHEAD_GOAL = 0.03
SPEEDUP_GOAL = {1: 1.4, 8: 4.5}
PYTHON_GOAL = 1000.0
FLAT_TOLERANCE = 0.10
# Goals of issue 21 (eviction at the speed of one pass over the scores).
FLOOR_GOAL = 4.0  # the whole step, in floors, at N >= FLOOR_GOAL_FROM
FLOOR_GOAL_FROM = 4096
SERVING_POLICIES = ("rmm", "h2o", "ema", "kalman")
# (model, batch, evict_every) -> most overhead; SmolLM2 at evict_every 1 allows 5% at any batch.
SERVING_GOAL = {("smollm2", 1, 8): 0.02, ("smollm2", 8, 8): 0.03, ("smollm2", 1, 1): 0.05, ("smollm2", 8, 1): 0.05,
                ("tiny", 1, 8): 0.10, ("tiny", 8, 8): 0.10}
LEARNED_GOAL = {("smollm2", "learned"): 0.08, ("smollm2", "learned_offline"): 0.04, ("tiny", "learned"): 0.50}
COMPILE_GOAL = 1.5


def load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def machine_line(record: dict) -> str:
    m = record["machine"]
    devices = ", ".join(sorted(set(m["devices"])))
    return (f"{m['cpu_cores']}-core {m['cpu']} CPU ({m['os']}), backend {m['backend']} ({devices}), "
            f"jax {m['jax']}, Python {m['python']}")


def command_block(record: dict) -> list[str]:
    clock = record.get("clock", "wall")
    m = record["machine"]
    cores = f"{m['cores_used']} of {m['cpu_cores']} cores" if "cores_used" in m else "all cores"
    return ["", f"Command (clock: {clock}; {cores}; code at commit {record.get('commit', 'not recorded')}):", "",
            "```", record["command"], "```", ""]


def overhead_verdict(row, goal: float = OVERHEAD_GOAL) -> str:
    """A goal of a few percent is decided by a 95% interval for the median overhead
    (``bench.common.median_interval``): it holds when the whole interval lies at or below
    the goal, does not hold when it lies above, and is not resolved when it contains it.
    The spread of single rounds decides nothing: it grows with their number."""
    if "overhead_median_low" not in row:
        return "not decided: the run recorded no interval for its median"
    low, high = row["overhead_median_low"], row["overhead_median_high"]
    if high <= goal:
        return "holds"
    if low > goal:
        return "does not hold"
    return f"not resolved: the 95% interval of the median, {pct(low)} .. {pct(high)}, contains {pct(goal)}"


def overhead_figure(row) -> str:
    """The median overhead with its 95% interval and the range of the rounds."""
    interval = f"95% interval {median_interval_text(row)}; " if "overhead_median_low" in row else ""
    return f"{pct(row['overhead'])} ({interval}rounds {pct(row['overhead_low'])} .. {pct(row['overhead_high'])})"


def median_interval_text(row) -> str:
    if "overhead_median_low" not in row:
        return "–"
    return f"{pct(row['overhead_median_low'])} .. {pct(row['overhead_median_high'])}"


def issue21_goals(records: dict) -> list[str]:
    """Each goal of issue 21 with its figure and verdict, from the records that exist."""
    goals = []
    for row in (records["pyref"] or {}).get("rows", []):
        if row["n"] >= FLOOR_GOAL_FROM:
            goals.append(f"- Per step against the Python implementation, N = {row['n']}, evict_every "
                         f"{row['evict_every']}: {row['speedup']:.0f}x (rounds {row['speedup_low']:.0f}x .. "
                         f"{row['speedup_high']:.0f}x; the floor {row['floor_speedup']:.0f}x) against at least "
                         f"{PYTHON_GOAL:,.0f}x: **{'holds' if row['speedup'] >= PYTHON_GOAL else 'does not hold'}**.")
            goals.append(f"- The whole step within {FLOOR_GOAL:.0f} floors, N = {row['n']}, evict_every "
                         f"{row['evict_every']}: {row['floors']:.1f} floors: "
                         f"**{'holds' if row['floors'] <= FLOOR_GOAL else 'does not hold'}**.")
    serving = [*(records["overhead"] or {}).get("rows", []), *(records["overhead-tiny"] or {}).get("rows", [])]
    for row in serving:
        goal = SERVING_GOAL.get((row["model"], row["batch"], row["evict_every"]))
        if goal is not None and row["policy"] in SERVING_POLICIES:
            goals.append(f"- Serving overhead <= {100 * goal:.0f}%, {row['model']} batch {row['batch']} "
                         f"{row['policy']} evict_every {row['evict_every']}: {overhead_figure(row)}: "
                         f"**{overhead_verdict(row, goal)}**.")
    for row in (records["overhead-learned"] or {}).get("rows", []):
        goal = LEARNED_GOAL.get((row["model"], row["policy"]))
        if goal is not None:
            goals.append(f"- Learned estimator overhead <= {100 * goal:.0f}%, {row['model']} {row['policy']}: "
                         f"{overhead_figure(row)}: **{overhead_verdict(row, goal)}**.")
    if serving:
        worst = max(serving, key=lambda r: r["first_call_ratio"])
        goals.append(f"- Compile time (first call) within {COMPILE_GOAL}x of the plain loop's, worst of the "
                     f"serving tables: x{worst['first_call_ratio']:.2f} ({worst['model']} batch {worst['batch']} "
                     f"{worst['policy']} evict_every {worst['evict_every']}): "
                     f"**{'holds' if worst['first_call_ratio'] <= COMPILE_GOAL else 'does not hold'}**.")
    return goals


def overhead_section(record, quick=None, quick_all_cores=None, title=None) -> tuple[list[str], list[str]]:
    title = title or ", ".join(sorted({row["model"] for row in record["rows"]}))
    lines = [f"## Per-step overhead of flsmem in the decode loop ({title})", "",
             "The serving loop (`flsmem.models.generate.decode_loop`: write, attend, observe, smooth, evict when "
             "due) against the same decoder with a plain ring cache of the same resident size "
             "(`budget + evict_every` slots, no scores, no eviction), both in steady state at position "
             "2 x budget (budget 256 for tiny, 512 for SmolLM2). Overhead = median over rounds of the time "
             "ratio of back-to-back calls, minus 1, with a distribution-free 95% interval for the median "
             "(`bench.common.median_interval`; with fewer than 6 rounds, the whole range); the range is the "
             "lowest and highest round. "
             "First call = trace + compile + one run of the flsmem loop over the same for the plain loop "
             "(the compile-time ratio).", "",
             "| model | batch | policy | evict_every | overhead | 95% interval of the median | rounds range | "
             "first call (compile) |",
             "|---|---|---|---|---|---|---|---|"]
    goals = []
    for row in record["rows"]:
        lines.append(f"| {row['model']} | {row['batch']} | {row['policy']} | {row['evict_every']} | "
                     f"{pct(row['overhead'])} | {median_interval_text(row)} | {pct(row['overhead_low'])} .. "
                     f"{pct(row['overhead_high'])} | x{row['first_call_ratio']:.2f} |")
        if row["model"] == "smollm2" and row["evict_every"] == 8:
            goals.append(f"- Overhead <= 3% at evict_every=8, SmolLM2, batch {row['batch']}, {row['policy']}: "
                         f"{overhead_figure(row)}: **{overhead_verdict(row)}**.")
    lines += command_block(record)
    if quick:
        row = quick["rows"][0]
        lines += ["Quick form (SmolLM2, batch 1, rmm, evict_every 8; under 2 minutes; its last line is the "
                  f"overhead): overhead {pct(row['overhead'])} (rounds {pct(row['overhead_low'])} .. "
                  f"{pct(row['overhead_high'])})."]
        lines += command_block(quick)
    if quick_all_cores:
        row = quick_all_cores["rows"][0]
        lines += [f"The same quick form on all {quick_all_cores['machine']['cores_used']} cores: overhead "
                  f"{pct(row['overhead'])} (rounds {pct(row['overhead_low'])} .. {pct(row['overhead_high'])}); "
                  "see \"Two threads\" below for why the one-core figure is the one that measures flsmem's work."]
        lines += command_block(quick_all_cores)
    return lines, goals


def profile_section(record) -> list[str]:
    lines = ["## Profile: where the per-step overhead goes", "",
             "Shares of a plain decode step (SmolLM2, rmm, budget 512), each from loops timed back to back "
             "against the plain loop (see `bench/profile.py`): write + attention mask = the flsmem decoder "
             "without `update`; observe + smooth = `update` with no eviction due; evict = one eviction per "
             "call, amortised over its steps.", "",
             "| batch | steps per eviction | write + mask | observe + smooth | evict | total |", "|---|---|---|---|---|---|"]
    for row in record["rows"]:
        lines.append(f"| {row['batch']} | {row['steps']} | {pct(row['share_write'])} | "
                     f"{pct(row['share_observe_smooth'])} | {pct(row['share_evict'])} | {pct(row['overhead'])} |")
    return lines + command_block(record)


def longctx_section(record) -> tuple[list[str], list[str]]:
    lines = ["## Long context: full cache against budget 512", "",
             f"Model {record['model']}. flsmem: rmm (lag 16), budget 512, evict_every 8. Full cache: the "
             "plain loop with a slot for every position. Cost = step time over the flsmem loop's at the "
             "first position (same batch), back-to-back pairs, median; speedup = tokens per second of "
             "flsmem over the full cache = cost(full) / cost(flsmem). Peak memory = what XLA plans for the "
             "compiled loop (arguments + outputs + temporaries - aliased), a property of the program.", "",
             "| batch | position | cost flsmem | cost full | tokens/s flsmem / full | peak MB flsmem | peak MB full |",
             "|---|---|---|---|---|---|---|"]
    goals = []
    by_batch: dict[int, list] = {}
    for row in record["rows"]:
        by_batch.setdefault(row["batch"], []).append(row)
        lines.append(f"| {row['batch']} | {row['position']} | x{row['cost_flsmem']:.2f} | x{row['cost_full']:.2f} | "
                     f"{row['speedup']:.2f}x | {row['peak_mb_flsmem']:.0f} | {row['peak_mb_full']:.0f} |")
    for batch, rows in by_batch.items():
        last = max(rows, key=lambda r: r["position"])
        goal = SPEEDUP_GOAL.get(batch)
        if goal is not None and last["position"] >= 8192:
            ok = last["speedup"] >= goal
            goals.append(f"- Tokens/s over the full cache at {last['position']} context, batch {batch}: "
                         f"{last['speedup']:.2f}x against a goal of {goal}x: **{'holds' if ok else 'does not hold'}**.")
        flat = last["cost_flsmem"] / min(rows, key=lambda r: r["position"])["cost_flsmem"]
        goals.append(f"- Flat per-step cost, batch {batch}: flsmem's step at {last['position']} costs "
                     f"x{flat:.2f} its step at {min(r['position'] for r in rows)} (full cache: "
                     f"x{last['cost_full'] / min(rows, key=lambda r: r['position'])['cost_full']:.2f}): "
                     f"**{'holds' if abs(flat - 1) <= FLAT_TOLERANCE else 'does not hold'}** "
                     f"(criterion: within {100 * FLAT_TOLERANCE:.0f}%).")
    return lines + command_block(record), goals


def prefill_memory_section(record) -> list[str]:
    lines = ["## Long context in bounded memory: peak resident memory of a prefill", "",
             f"Model {record['model']}. Each run, a fresh process, prefills a prefix of *Persuasion* in chunks "
             f"of {record['chunk']} tokens (each chunk's attention folded as it comes), cuts it to the budget at "
             f"once (the kvpress protocol) and scores the next {record['scored']} tokens; full cache: every "
             f"position kept; eviction: h2o at budget {record['budget']}. Peak = maximum resident set size of "
             "the process (`wait4`'s `ru_maxrss`, what `/usr/bin/time -v` reports), model load included. Time = "
             "wall time over the full cache's at the shortest prefix, the same run. Plot: "
             "[bench/prefill-memory.png](bench/prefill-memory.png).", "",
             "| prefix | policy | peak resident MB | time vs first full | NLL of the scored tokens |",
             "|---|---|---|---|---|"]
    for row in record["rows"]:
        lines.append(f"| {row['prefix']} | {row['policy']} | {row['peak_mb']:.0f} | "
                     f"x{row['time_vs_first_full']:.2f} | {row['nll']:.4f} |")
    # The table is saved after every run, so a stopped run leaves the prefixes its command asked for undone.
    asked = prefill_memory.parse(shlex.split(record["command"])[3:]).prefixes
    undone = sorted(set(asked) - {row["prefix"] for row in record["rows"]})
    if undone:
        lines += ["", f"The run was stopped before it reached {', '.join(map(str, undone))} tokens (bench/NOTES.md)."]
    return lines + command_block(record)


def prefill_chunk_section(record, before) -> list[str]:
    lines = ["## One prefill chunk against the plain forward", "",
             f"Model {record['model']}: one chunk of {record['rows'][0]['chunk']} tokens through memories of N "
             "slots (h2o's evidence folded, as a prefilling protocol does), over the plain causal forward of the "
             "same tokens (no memory, no evidence), median of back-to-back pairs; the plain forward attends over "
             "the chunk only, so part of the ratio is the attention over N slots that any prefill pays. "
             "Beside each ratio, the costliest XLA operation of the chunk (its share of the chunk's operation "
             "time, `jax.profiler`) and the JAX operations it was fused from. *Before* is the same benchmark "
             "run on the library of the commit it names.", "",
             "| slots | version | chunk / plain forward | costliest operation | share | fused from |",
             "|---|---|---|---|---|---|"]
    for name, rec in (("before", before), ("now", record)):
        for row in (rec or {"rows": []})["rows"]:
            op, r = row["operations"][0], row["vs_plain"]
            lines.append(f"| {row['slots']} | {name} ({rec['commit']}) | x{r['median']:.2f} "
                         f"(x{r['low']:.2f} .. x{r['high']:.2f}) | `{op['operation']}` | {100 * op['share']:.0f}% | "
                         f"{op['from'][:60]} |")
    return lines + command_block(record) + (command_block(before) if before else [])


# The RULER runner's speed-ups: record names, title, what a round compares, the ratio's column.
RULER_SPEEDS = {
    ("ruler-share", "ruler-share-4k"): (
        "RULER: one prefill for every policy and budget of a sample",
        "Under the prefilling protocols `flsmem ruler` answers every policy and budget of a sample after one "
        "shared prefill (`flsmem.harness.ruler.protocols.answers`). Each round is one RULER sample: the "
        "arms answered together against the same arms answered one by one, back to back in alternating "
        "order after a warm-up that compiles both; the answers are checked to be the same both ways. "
        "The oracle's table is made outside both timings.", "alone / shared"),
    ("ruler-resize", "ruler-resize-4k"): (
        "RULER: the cut memory resized for the question and the answer",
        "After the cut `flsmem ruler` moves the kept items into the slots that the rest needs "
        "(`flsmem.resize`: the budget and two eviction periods), not the prompt's. Each round is one RULER "
        "sample: every arm answered after one shared prefill with the cut memory resized, against the same "
        "with it left at the prompt's size, back to back in alternating order after a warm-up that "
        "compiles both. The attention then sums over fewer slots, so the two agree to float rounding; the "
        "answers that differ are counted.", "prompt-sized / resized"),
    ("ruler-batch", "ruler-batch-fwe", "ruler-batch-stream"): (
        "RULER: a batch of samples decoded together",
        "`flsmem ruler --batch K` answers K samples of a task in one call "
        "(`flsmem.harness.ruler.protocols.batch_answers`): each sample's prefill shared by the arms, then "
        "each arm's K answers decoded as one batch, a row per sample at its own positions; each arm also "
        "feeds the pieces of the K prompts that they have alike (streamed, the first ones; after the cut, "
        "the questions') as one batch. Each round is K "
        "RULER samples: every arm's answers so, against the same samples answered one at a time (each "
        "sharing its prefill), back to back in alternating order after a warm-up round that compiles both. "
        "The model's products then run over the batch, so the two agree to float rounding; the answers "
        "that differ are counted. The oracle's tables are made outside both timings.",
        "one at a time / batched"),
}


def ruler_speed_section(title: str, text: str, column: str, records) -> list[str]:
    batched = any("batch" in record for record in records)
    counted = any("answers_differing" in record for record in records)
    head = ["model", "length", "task", "protocol", "arms"] + (["samples a round"] if batched else []) + [column, "rounds"] + (
        ["answers that differ"] if counted else [])
    lines = [f"## {title}", "", text, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for record in records:
        arms = ", ".join(f"{policy} {budget:g}" for policy, budget in record["arms"])
        r = record["speedup"]
        cells = [record["model"], str(record["length"]), record.get("task", "–"), record["protocol"], arms]
        cells += [str(record.get("batch", 1))] if batched else []
        cells += [f"x{r['median']:.2f} (x{r['low']:.2f} .. x{r['high']:.2f})", str(len(r["rounds"]))]
        cells += [f"{record['answers_differing']} of {record['answers']}"] if counted else []
        lines.append("| " + " | ".join(cells) + " |")
    for record in records:
        lines += command_block(record)
    return lines


def pyref_section(record) -> tuple[list[str], list[str]]:
    lines = ["## Against a per-step Python implementation", "",
             "The Python implementation (`bench/pyref.py`): a dict of slots per row, a Python loop adding "
             "each slot's attention to its score, `min` over the unprotected slots for the victim; H2O with a "
             "recent window of 16, one item in and one out per step. flsmem: the same rule "
             "(`h2o(recent=16)`), write + update in a jitted scan. Both hold N items in each of the rows "
             f"({record['rows'][0]['rows']} rows: SmolLM2's 30 layers x 3 KV heads at batch 1) and see the "
             "same attention at every step (in the jitted loops scaled by a factor that grows with the step, "
             "so that XLA cannot hoist work on it out of the loop). Figure: "
             "Python's time per step over flsmem's, median of back-to-back pairs. Floor: Python's time per "
             "step over that of a jitted loop that only adds each step's attention to every score "
             "(`scores += attention`, one pass over the rows), timed in the same pairs: the largest speed-up "
             "any implementation that reads each item's attention once per step could show here. The last "
             "columns profile flsmem's step in floors (its time over the floor's), each stage including the "
             "ones before it: the write alone, + observe, + smooth (no eviction due), the whole step, and the "
             "whole step of the learned estimator (a fresh network learning online, evict_every 32).", "",
             "| N | flsmem evict_every | faster per step | rounds range | floor | write | + observe | + smooth "
             "| whole step | learned |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    goals = []
    worst = {}
    for row in record["rows"]:
        floor = f"{row['floor_speedup']:.0f}x" if "floor_speedup" in row else "not measured"
        profile = " | ".join(f"{row[k]:.1f}" if k in row else "not measured"
                             for k in ("floors_write", "floors_observe", "floors_no_evict", "floors",
                                       "floors_learned"))
        lines.append(f"| {row['n']} | {row['evict_every']} | {row['speedup']:.0f}x | "
                     f"{row['speedup_low']:.0f}x .. {row['speedup_high']:.0f}x | {floor} | {profile} |")
        if row["evict_every"] not in worst or row["speedup"] < worst[row["evict_every"]]["speedup"]:
            worst[row["evict_every"]] = row
    for ee, row in sorted(worst.items()):
        floor = f"; the floor at that N: {row['floor_speedup']:.0f}x" if "floor_speedup" in row else ""
        goals.append(f"- At least 1,000x faster per step than the Python implementation (evict_every {ee}): "
                     f"lowest over N {row['speedup']:.0f}x (N = {row['n']}{floor}): "
                     f"**{'holds' if row['speedup'] >= PYTHON_GOAL else 'does not hold'}**.")
    return lines + command_block(record), goals


def kernel_section(record) -> list[str]:
    lines = ["## The top-k kernel against `lax.top_k`", "",
             "Time of each `flsmem.kernels.topk_mask` implementation over a mask built from `lax.top_k` "
             "(jitted, k fixed; back-to-back pairs, median). `reference` is the jnp sort, the CPU default; "
             "`few_dropped` is the reference given `max_dropped` (what `evict` uses on schedule); `pallas` is "
             f"the radix-select kernel, mode `{'interpret' if record['backend'] == 'cpu' else record['backend']}`"
             + (": on CPU it runs in the Pallas interpreter, so these figures say nothing about its speed on "
                "an accelerator." if record["backend"] == "cpu" else "."), "",
             "| rows | N | k | implementation | mode | time / lax.top_k |", "|---|---|---|---|---|---|"]
    for row in record["rows"]:
        lines.append(f"| {row['rows']} | {row['n']} | {row['k']} | {row['implementation']} | {row['mode']} | "
                     f"{row['time_vs_lax_top_k']:.2f} |")
    return lines + command_block(record)


def compile_time_section(record) -> list[str]:
    lines = [f"## Compile time, part by part ({record['model']})", "",
             f"Each program compiled with no compilation cached, {record['rounds']} times (median): the plain "
             f"loop, the flsmem loop (batch {record['batch']}, evict_every {record['evict_every']}) under policies "
             "that add one part at a time (`full`: the memory's write, visible mask and observe, nothing evicted; "
             "`window`: + eviction by recency; then policies with scores), and the library calls of one step "
             "compiled alone on the loop's memory (`place`, `update_layers`; `observe`, `smooth` and `evict` "
             "on the layers folded into rows, as the update runs them). Instructions: of the compiled HLO, "
             "fused computations included (see `bench/compile_time.py`).", "",
             "| program | trace + lower s | compile s | compile / plain loop's | instructions |",
             "|---|---|---|---|---|"]
    for row in record["rows"]:
        lines.append(f"| {row['program']} | {row['lower_s']:.2f} | {row['compile_s']:.2f} | "
                     f"x{row['compile_ratio']:.2f} | {row['instructions']} |")
    return lines + command_block(record)


def learned_flops_section(record) -> list[str]:
    lines = ["## The learned estimator's arithmetic against the model's", "",
             "Per decode step at batch 1, the shipped estimator at the overhead tables' budgets: the model's "
             "floating-point operations (two per weight of its matrices, the attention's two products over the "
             "slots), and XLA's cost analysis of the network's forward over every slot of every layer and KV "
             "head (taken when an eviction is due, every `evict_every` queries) and of one learning step over "
             "them (every `horizon / snapshots` queries online), each as a share of the model's step "
             "(see `bench/learned_flops.py`). The shares are the part of the learned rows' overhead that no "
             "fusion removes.", "",
             "| model | evict_every | model's step MFLOP | slots scored | forward MFLOP | learning step MFLOP | "
             "scoring share | learning share (online) |",
             "|---|---|---|---|---|---|---|---|"]
    for row in record["rows"]:
        lines.append(f"| {row['model']} | {row['evict_every']} | {row['model_flops'] / 1e6:.1f} | "
                     f"{row['network_slots']:,} | {row['forward_flops'] / 1e6:.1f} | {row['learn_flops'] / 1e6:.1f} | "
                     f"{100 * row['scoring_share']:.1f}% | {100 * row['learning_share']:.1f}% (every "
                     f"{row['learn_period']}) |")
    return lines + command_block(record)


def evidence_layout_section(record) -> list[str]:
    base = next(iter(record["ratios"]))
    lines = ["## Evidence of several columns: its layout", "",
             f"The fixed Kalman filter's fold (three columns) over {record['rows']} rows of {record['n']:,} slots, "
             f"a jitted loop of {record['steps']} queries donating its evidence, in three layouts, the same numbers "
             "in each (see `bench/evidence_layout.py`): time per query against the first layout's in the same "
             f"round ({record['rounds']} rounds, median and range), and the arrays XLA copies in each compiled loop.",
             "", f"| evidence layout | time / {base}'s | arrays copied |", "|---|---|---|"]
    for layout, ratio in record["ratios"].items():
        copied = ", ".join(f"`{shape}`" for shape in record["copies"][layout]) or "none"
        lines.append(f"| {layout} | x{ratio['median']:.2f} (x{ratio['low']:.2f} .. x{ratio['high']:.2f}) | {copied} |")
    if record.get("step_copies"):
        lines += ["", "The slot-sized arrays that each policy's whole compiled step copies (write + update, no "
                      "eviction due; a memory of 6 rows of 576 slots, the copies do not depend on the size): `pred` "
                      "arrays are masks, `f32` ones evidence or scores.", "",
                  "| policy | arrays its step copies |", "|---|---|"]
        lines += [f"| {name} | {', '.join(f'`{shape}`' for shape in shapes) or 'none'} |"
                  for name, shapes in record["step_copies"].items()]
    return lines + command_block(record)


def build() -> str:
    records = {name: load(name) for name in
               ("overhead-tiny", "overhead", "overhead-quick", "overhead-quick-all-cores", "overhead-learned",
                "learned-flops", "overhead-adakv", "profile", "longctx", "prefill-memory", "prefill-chunk",
                "prefill-chunk-before", "pyref", "evidence-layout", "kernel", "compile-time",
                "compile-time-smollm2") + sum(RULER_SPEEDS, ())}
    any_record = next((r for r in records.values() if r), None)
    lines = ["# Benchmarks (issues 7 and 21)", "",
             "Generated by `python -m bench.report` from `results/bench/*.json`; `bash bench/run_all.sh` runs "
             "every command below and then the report. Every speed figure is a ratio of two loops timed back "
             "to back in one run (never a bare time): each pair of calls gives one ratio, the median over "
             "rounds is reported with the lowest and highest. The overhead and profile tables ran on one core "
             "(`--cores 1`; why: bench/NOTES.md, \"Two threads\"); some runs shared the machine with other "
             "jobs, so single rounds can stray; read the medians.", ""]
    if any_record:
        lines += [f"Machine: {machine_line(any_record)}. No accelerator.", ""]
    gpu = {name: load(name) for name in ("gpu-kernel", "gpu-overhead")}
    if not any(gpu.values()):
        lines += ["GPU: no GPU was lent to this task, so `bench/gpu_check.sh` (kernel correctness, kernel "
                  "against `lax.top_k`, decode overhead, on one GPU in under 5 minutes) has not been run and "
                  "there are no GPU figures here.", ""]
    goals = []
    sections = []
    for name in ("overhead-tiny", "overhead"):
        if records[name]:
            quick = (records["overhead-quick"], records["overhead-quick-all-cores"]) if name == "overhead" else ()
            s, g = overhead_section(records[name], *quick)
            sections += s
            goals += g
    if records["overhead-learned"]:
        # The goals are the heuristics'; the learned estimator's cost is reported beside rmm's.
        sections += overhead_section(records["overhead-learned"], title="learned estimator")[0]
    if records["learned-flops"]:
        sections += learned_flops_section(records["learned-flops"])
    if records["overhead-adakv"]:
        # Budgets shared by KV heads against the same policies with uniform budgets, in one run.
        sections += overhead_section(records["overhead-adakv"], title="head-adaptive budgets")[0]
    if records["profile"]:
        sections += profile_section(records["profile"])
    for name in ("compile-time", "compile-time-smollm2"):
        if records[name]:
            sections += compile_time_section(records[name])
    if records["longctx"]:
        s, g = longctx_section(records["longctx"])
        sections += s
        goals += g
    if records["prefill-memory"]:
        sections += prefill_memory_section(records["prefill-memory"])
    if records["prefill-chunk"]:
        sections += prefill_chunk_section(records["prefill-chunk"], records["prefill-chunk-before"])
    for names, (title, text, column) in RULER_SPEEDS.items():
        found = [records[name] for name in names if records[name]]
        if found:
            sections += ruler_speed_section(title, text, column, found)
    if records["pyref"]:
        s, g = pyref_section(records["pyref"])
        sections += s
        goals += g
    if records["evidence-layout"]:
        sections += evidence_layout_section(records["evidence-layout"])
    if records["kernel"]:
        sections += kernel_section(records["kernel"])
    for name, record in gpu.items():
        if record:
            body = kernel_section(record) if name == "gpu-kernel" else overhead_section(record, None)[0]
            sections += [f"## GPU ({machine_line(record)})", ""] + body
    missing = [name for name, r in records.items() if r is None]
    lines += ["## Goals of issue 21", ""] + (issue21_goals(records) or ["- no results yet"]) + [""]
    lines += ["## Goals of issue 7", ""] + (goals or ["- no results yet"]) + [""]
    if missing:
        lines += [f"Not run yet: {', '.join(missing)}.", ""]
    notes = pathlib.Path("bench") / "NOTES.md"
    lines += sections
    if notes.exists():
        lines += ["", notes.read_text().strip(), ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None):
    parser = make_parser("python -m bench.report", __doc__)
    parser.add_argument("--out", default=str(OUT), help="where to write the report")
    args = parser.parse_args(argv)
    text = build()
    pathlib.Path(args.out).write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
