"""``flsmem ruler``: RULER's tasks under every eviction policy, budget and protocol.

For each prompt length, task and sample (:mod:`.tasks`, sized to the model's
tokenizer), every policy answers at every budget (a fraction of the length: the items
each layer's memory row keeps) under every protocol (:mod:`.protocols`), decoding
greedily up to the task's token limit; the answer is scored as RULER scores it
(:mod:`.score`). The full cache never evicts, so its answer is the same under every
protocol: it is computed once per sample and recorded for each protocol at budget 1,
and a protocol added to a file that holds the full cache's answer under another one
copies that answer rather than computing it again. Under the prefilling protocols
nothing is evicted before the cut, so the prefill is the same forward pass for every
policy and budget: the runner answers those a few samples at a time, every policy and
budget of a sample sharing one prefill, and streaming policy by policy. The samples of
a task answered together (``--batch``) decode as one batch under each policy and
budget (:func:`.protocols.batch_answers`; the answers are those of separate runs).

The answers of a batch are appended as one JSON line each to ``--out`` as soon as it
is answered; a run given the same file skips what it holds, so an interrupted run
resumes where it stopped. ``--shard K/N``
answers every N-th job of the plan, from the K-th: N processes (one per core, or per
accelerator) given the same plan and file share its work, each appending whole lines.
The report (:mod:`.report`) is written next to the file at the end, or alone with
``--report``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import re
import time
from fractions import Fraction
from pathlib import Path
from typing import Iterator

import numpy as np

from flsmem.harness.arguments import checking
from flsmem.harness.ruler import report
from flsmem.harness.ruler.protocols import PROTOCOLS
from flsmem.harness.ruler.report import row_key
from flsmem.harness.ruler.tasks import MAX_NEW_TOKENS, TASKS, make_sample
from flsmem.models import catalog
from flsmem.validate import fail, nonneg_int, positive_int, require

__all__ = ["Answerer", "Plan", "QUICK", "make_samples", "run", "add_arguments", "check_arguments", "run_cli"]

COMMAND = "flsmem ruler"
# ``--quick``: one sample of the easiest task, the full cache and h2o at a quarter of the
# length, every protocol: a smoke run of the whole pipeline. On SmolLM2-135M at 4,096
# tokens an answer takes minutes on a 2-core CPU (a prefill attends over every slot).
QUICK = {"tasks": "niah_single_1", "policies": "full,h2o", "budgets": "1/4", "samples": 1}
# The oracle's table and the memories make room for the longest answer of any task, so
# one compilation serves every task.
MAX_NEW = max(MAX_NEW_TOKENS.values())


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one run measures.

    Attributes:
      model: a model name or GGUF path (:mod:`flsmem.models.catalog`).
      lengths: prompt lengths, in the model's tokens.
      tasks: names from :data:`flsmem.harness.ruler.tasks.TASKS`.
      policies: names from :data:`flsmem.harness.evaluate.POLICY_NAMES` (or the learned ones).
      budgets: fractions of the length kept per layer and KV head.
      protocols: names from :data:`flsmem.harness.ruler.protocols.PROTOCOLS`.
      samples: samples per task and length.
      seed: seed of the samples.
      evict_every: items that arrive between two evictions.
      estimator: checkpoint folder of the learned policies; None, the one shipped for
        ``model`` (:func:`flsmem.harness.evaluate.estimator_for`), as ``flsmem eval`` does.
      shard: ``(K, N)``: answer the jobs (a policy and a sample) whose place in the plan's
        order is K modulo N; the place counts the jobs already answered too, so a shard
        resumes the same jobs. A prefill is shared by the policies of a sample that
        one shard answers.
      batch: samples of a task answered together: each policy and budget decodes
        their answers as one batch.
    """

    model: str
    lengths: tuple[int, ...]
    tasks: tuple[str, ...]
    policies: tuple[str, ...]
    budgets: tuple[float, ...]
    protocols: tuple[str, ...]
    samples: int
    seed: int = 0
    evict_every: int = 16
    estimator: str | None = None
    shard: tuple[int, int] = (0, 1)
    batch: int = 8


def _done(out: Path) -> dict[tuple, dict]:
    """The rows already in ``out`` by their key (a line cut short by an interruption is skipped)."""
    if not out.is_file():
        return {}
    done = {}
    for line in out.read_text().splitlines():
        try:
            row = json.loads(line)
            done[row_key(row)] = row
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    return done


def _append(out: Path, row: dict) -> None:
    with out.open("a+") as f:
        f.seek(0, 2)
        if f.tell():
            f.seek(f.tell() - 1)
            if f.read(1) != "\n":  # the line an interruption cut short stays apart
                f.write("\n")
        f.write(json.dumps(row) + "\n")


def _estimator(plan: Plan) -> Path:
    """The estimator checkpoint of the plan's learned policies."""
    from flsmem.harness.evaluate import estimator_for

    return Path(plan.estimator or estimator_for(plan.model))


def _jobs(plan: Plan, samples: list[dict], done: dict[tuple, dict]
          ) -> Iterator[tuple[str, dict, list[tuple[str, float]], dict | None]]:
    """``(policy, sample, [(protocol, budget), ...], answered)`` still to answer, policy by
    policy; ``answered`` is the full cache's row of the sample under a protocol outside
    the list, when ``done`` holds one (its answer is every protocol's), else None."""
    for place, (policy, sample) in enumerate(itertools.product(plan.policies, samples)):
        if place % plan.shard[1] != plan.shard[0]:
            continue
        arms = [(p, 1.0) for p in plan.protocols] if policy == "full" else [
            (p, b) for p in plan.protocols for b in plan.budgets]
        base = {"model": plan.model, "policy": policy, "evict_every": plan.evict_every,
                **{k: sample[k] for k in ("task", "length", "index", "seed")},
                **({"estimator": _estimator(plan).name} if "learned" in policy else {})}
        todo = [(p, b) for p, b in arms if row_key({**base, "protocol": p, "budget": b}) not in done]
        if todo:
            answered = None
            if policy == "full":
                keys = (row_key({**base, "protocol": p, "budget": 1.0}) for p in PROTOCOLS)
                answered = next((done[k] for k in keys if k in done), None)
            yield policy, sample, todo, answered


def make_samples(plan: Plan, tokenizer) -> list[dict]:
    """Every sample of ``plan``, length by length, task by task.

    Raises:
      ValueError: naming ``--length``, when a sample's fixed part (its needles, keys and
        question, which vary from sample to sample) does not fit its length.
    """
    found = []
    for length in plan.lengths:
        for task in plan.tasks:
            for index in range(plan.samples):
                try:
                    found.append(make_sample(task, length, index, tokenizer, plan.seed))
                except ValueError as error:
                    raise ValueError(f"--length {length}: {error} (sample {index})") from None
    return found


def run(plan: Plan, out: Path, *, model=None, tokenizer=None, samples: list[dict] | None = None,
        progress: bool = True) -> int:
    """Answer every sample of ``plan`` not yet in ``out``, appending a row per answer.

    Args:
      plan: what to measure.
      out: the JSON-lines file (created with its folder if missing).
      model, tokenizer: the loaded model; loaded from ``plan.model`` when needed.
      samples: :func:`make_samples` of ``plan``, when made already.
      progress: show a tqdm bar.

    Returns:
      The number of rows appended.
    """
    from tqdm.auto import tqdm

    tokenizer = tokenizer or catalog.load_tokenizer(plan.model)
    samples = samples if samples is not None else make_samples(plan, tokenizer)
    jobs = list(_jobs(plan, samples, _done(out)))
    written = 0
    for _, _, arms, answered in jobs:
        if answered is not None:
            for protocol, _ in arms:
                _append(out, {**answered, "protocol": protocol})
                written += 1
    jobs = [(policy, sample, arms) for policy, sample, arms, answered in jobs if answered is None]
    if not jobs:
        return written
    if model is None:
        model, _ = catalog.load(plan.model)
    out.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=sum(len(arms) for _, _, arms in jobs), disable=not progress, desc="ruler", unit="answer")
    answerer = Answerer(plan, model, tokenizer)
    last_policy = None
    for policy, protocol, arms, copies, unit in _units(jobs):
        if policy != last_policy:
            answerer.forget()
            last_policy = policy
        for begin in range(0, len(unit), plan.batch):
            for row in answerer.answer(unit[begin:begin + plan.batch], protocol, arms):
                for copy in copies:
                    _append(out, {**row, "protocol": copy})
                    written += 1
                    bar.set_postfix_str(f"{row['policy']} {row['task']} {copy} {row['budget']:g}", refresh=False)
                    bar.update(1)
    bar.close()
    return written


def _units(jobs: list[tuple[str, dict, list[tuple[str, float]]]]
           ) -> list[tuple[str | None, str, list[tuple[str, float]], tuple[str, ...], list[dict]]]:
    """The jobs as ``(policy, protocol, arms, copies, samples)``: the ``(policy, budget)``
    pairs of ``arms`` answer ``samples`` (of one task and length) under ``protocol``,
    each answer recorded under every protocol of ``copies``. The full cache answers once
    for all the protocols it is asked under; streaming runs policy by policy (``policy``
    names it); under a prefilling protocol every policy and budget of a sample shares
    its prefill (``policy`` None), and the samples of a task with the same arms go
    together."""
    units: dict[tuple, list] = {}
    for policy, sample, arms in jobs:
        where = (sample["task"], sample["length"])
        if policy == "full":
            copies = tuple(p for p, _ in arms)
            units.setdefault(("full", copies, where), ["full", copies[0], [("full", 1.0)], copies, []])[-1].append(sample)
            continue
        streamed = [(policy, b) for p, b in arms if p == "stream"]
        if streamed:
            units.setdefault((policy, tuple(streamed), where), [policy, "stream", streamed, ("stream",), []]
                             )[-1].append(sample)
    prefilled: dict[tuple, tuple[dict, list]] = {}
    for policy, sample, arms in jobs:
        for protocol, budget in arms:
            if policy != "full" and protocol != "stream":
                key = (protocol, sample["task"], sample["length"], sample["index"])
                prefilled.setdefault(key, (sample, []))[1].append((policy, budget))
    for (protocol, task, length, _), (sample, arms) in prefilled.items():
        units.setdefault((protocol, task, length, tuple(arms)), [None, protocol, arms, (protocol,), []])[-1].append(sample)
    return [tuple(unit) for unit in units.values()]


class Answerer:
    """Answers of one model: builds policies and memory settings, makes the oracle's
    table of each sample, and frees compiled programs between policies."""

    def __init__(self, plan: Plan, model, tokenizer):
        self.plan, self.model, self.tokenizer = plan, model, tokenizer
        self.estimator = str(_estimator(plan))
        self._tables: dict[tuple, np.ndarray] = {}

    def forget(self) -> None:
        import jax

        # Each policy compiles programs of its own; the next policy needs none of them.
        jax.clear_caches()

    def answer(self, samples: list[dict], protocol: str, arms: list[tuple[str, float]]) -> list[dict]:
        """A row per sample and ``(policy, budget)`` of ``arms`` under ``protocol``: a
        sample's prefill shared by the arms where it can be, an arm's answers to the
        samples decoded as one batch (:func:`~flsmem.harness.ruler.protocols.batch_answers`).
        The samples are of one task and length. Each row's ``seconds`` is its share of
        the whole call's time, ``batch`` the samples answered together."""
        from flsmem.harness.ruler.protocols import batch_answers
        from flsmem.harness.ruler.score import score

        plan = self.plan
        begin = time.perf_counter()
        ids = [self.ids(sample) for sample in samples]
        tables = [[self.oracle_table(sample, i) if policy == "oracle" else None for policy, _ in arms]
                  for sample, i in zip(samples, ids)]
        budgets, configs = self.configs(arms, protocol, samples[0]["length"])
        rows = []
        for place, index, generated, info in batch_answers(
                self.model, configs, ids, protocol=protocol, max_new=samples[0]["max_new_tokens"],
                eos_id=self.tokenizer.eos_id, tables=tables):
            sample, (policy, budget) = samples[place], arms[index]
            prediction = self.tokenizer.decode(np.asarray(generated, np.int32))
            rows.append({
                "model": plan.model, **{k: sample[k] for k in ("task", "length", "index", "seed")},
                "policy": policy, "protocol": protocol, "budget": budget, "evict_every": plan.evict_every,
                "budget_tokens": budgets[index] if policy != "full" else None,
                "prompt_tokens": sum(len(i) for i in ids[place]),
                "prediction": prediction, "answers": sample["answers"],
                "score": score(sample["task"], prediction, sample["answers"]),
                "generated_tokens": len(generated), "evictions": info["evictions"],
                **({"estimator": Path(self.estimator).name} if "learned" in policy else {}),
            })
        seconds = round((time.perf_counter() - begin) / max(1, len(rows)), 3)
        return [{**row, "seconds": seconds, "batch": len(samples)} for row in rows]

    def configs(self, arms: list[tuple[str, float]], protocol: str, length: int) -> tuple[list[int], list]:
        """The budget in items and the memory settings of each ``(policy, fraction)`` of
        ``arms`` for prompts of ``length`` tokens under ``protocol``."""
        budgets = [_budget_tokens(budget, length) for _, budget in arms]
        configs = [_config(policy, tokens, protocol, length + 1, self.plan.evict_every, self.model.cfg, self.estimator)
                   for (policy, _), tokens in zip(arms, budgets)]
        return budgets, configs

    def ids(self, sample: dict) -> list[np.ndarray]:
        """The token ids of ``sample``'s context and question."""
        ids = [np.asarray(self.tokenizer.encode(sample[part]), np.int32) for part in ("context", "question")]
        if self.tokenizer.add_bos:  # Gemma: BOS first, one token past the sample's length
            ids[0] = np.concatenate([[self.tokenizer.bos_id], ids[0]]).astype(np.int32)
        return ids

    def oracle_table(self, sample, ids) -> np.ndarray:
        """The oracle's table of ``sample`` (those of the last batch are kept: a
        sample's arms may come in several calls)."""
        from flsmem.harness.ruler.protocols import answer_attention

        key = (sample["task"], sample["length"], sample["index"], sample["seed"])
        if key not in self._tables:
            if len(self._tables) >= self.plan.batch:
                self._tables.clear()
            gold = np.asarray(self.tokenizer.encode(" " + ", ".join(sample["answers"]) + "."), np.int32)
            self._tables[key] = answer_attention(self.model, *ids, gold, evict_every=self.plan.evict_every,
                                                 width=sample["length"] + 1 + MAX_NEW)
        return self._tables[key]


def _budget_tokens(fraction: float, length: int) -> int:
    return max(1, int(fraction * length))


def _config(policy: str, tokens: int, protocol: str, length: int, evict_every: int, model=None,
            estimator: str | None = None):
    """The memory settings of ``policy`` at ``tokens`` items (ValueError when it
    cannot hold its protected items). ``model``: the decoder's configuration, for the
    policies built for its attention shape; before the model is loaded, a stand-in
    shape checks the budget. ``estimator``: the learned policies' checkpoint."""
    from flsmem.harness.evaluate import make_policy
    from flsmem.harness.ruler.protocols import memory_config
    from flsmem.models.decoder import TINY

    built = make_policy(policy, tokens, estimator=estimator, model=TINY if model is None else model)
    return memory_config(built, tokens, protocol, length=length, evict_every=evict_every, max_new=MAX_NEW)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from flsmem.harness.evaluate import POLICY_NAMES

    parser.add_argument("--model", default="smollm2-135m", help=f"one of {', '.join(catalog.MODELS)}, or a .gguf file")
    parser.add_argument("--length", type=int, default=None,
                        help="prompt length in the model's tokens, at most its trained context (default: 4096)")
    parser.add_argument("--lengths", default=None, help="several prompt lengths, comma-separated (instead of --length)")
    parser.add_argument("--tasks", default=",".join(TASKS),
                        help=f"comma-separated RULER tasks among {', '.join(TASKS)} (default: all of them)")
    parser.add_argument("--policies", default=",".join(POLICY_NAMES),
                        help="comma-separated eviction policies (as in flsmem eval; the learned ones too) (default: "
                             "every policy but the learned ones and expected_attention)")
    parser.add_argument("--budgets", default=",".join(str(Fraction(b)) for b in report.GRID_BUDGETS),
                        help="fractions of the length kept, comma-separated")
    parser.add_argument("--protocols", default=",".join(PROTOCOLS),
                        help=f"comma-separated, among {', '.join(PROTOCOLS)} (default: all three)")
    parser.add_argument("--samples", type=int, default=report.GRID_SAMPLES, help="samples per task and length")
    parser.add_argument("--seed", type=int, default=0, help="seed of the samples")
    parser.add_argument("--evict-every", type=int, default=16, help="items that arrive between two evictions")
    parser.add_argument("--out", default=None,
                        help="JSON-lines results, resumed if present (default: results/ruler/MODEL.jsonl, "
                             "MODEL-quick.jsonl with --quick); the report goes beside it (.md, .png)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 1 sample of niah_single_1, full and h2o at 1/4, every protocol "
                             "(it sets --tasks, --policies, --budgets and --samples: give none of them)")
    parser.add_argument("--estimator", default=None, metavar="DIR",
                        help="estimator checkpoint of the learned policies (default: the one shipped for --model, "
                             "as in flsmem eval)")
    parser.add_argument("--shard", default="0/1", metavar="K/N",
                        help="answer every N-th job (a policy and a sample) from the K-th, so that N processes given "
                             "the same arguments share one run and one --out")
    parser.add_argument("--batch", type=int, default=Plan.batch,
                        help="samples of a task answered together, each policy and budget decoding them as one batch "
                             "(the answers are those of one at a time; a larger batch holds more prefills)")
    parser.add_argument("--report", action="store_true", help="measure nothing: write the report from --out")


def _names(option: str, text: str, known: tuple[str, ...], accept=None) -> tuple[str, ...]:
    """Comma-separated names (commas inside parentheses do not split), each in ``known``
    or accepted by ``accept``."""
    names = tuple(dict.fromkeys(n.strip() for n in re.split(r",(?![^()]*\))", text) if n.strip()))
    unknown = [n for n in names if n not in known and not (accept and accept(n))]
    wrapped = " (or wrapped, as in adakv(h2o), or with settings, as in adaptive(horizon=256))" if accept else ""
    require(names and not unknown, f"{option} must be comma-separated names among {', '.join(known)}{wrapped}; got {text!r}"
                                   + (f", unknown {unknown}" if unknown else ""))
    return names


def _fractions(text: str) -> tuple[float, ...]:
    found = []
    for part in text.split(","):
        try:
            value = Fraction(part.strip())
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"--budgets must be fractions of the length like 1/8 or 0.25, got {part!r}") from None
        require(0 < value <= 1, f"--budgets must lie in (0, 1], got {part!r}")
        found.append(float(value))
    return tuple(dict.fromkeys(found))


def _shard(text: str) -> tuple[int, int]:
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard must be K/N, two ints like 0/2, got {text!r}") from None
    require(count >= 1 and 0 <= index < count, f"--shard K/N needs N >= 1 and 0 <= K < N, got {text!r}")
    return index, count


def _lengths(args: argparse.Namespace) -> tuple[int, ...]:
    require(args.length is None or args.lengths is None, "--length and --lengths: give one of them, not both")
    if args.lengths is None:
        return (positive_int("--length", 4096 if args.length is None else args.length),)
    try:
        lengths = tuple(int(v) for v in args.lengths.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"--lengths must be comma-separated ints, got {args.lengths!r}") from None
    require(lengths and min(lengths) >= 1, f"--lengths must be positive ints, got {args.lengths!r}")
    return tuple(dict.fromkeys(lengths))


def check_arguments(args: argparse.Namespace) -> tuple[Plan, Path]:
    """The plan and output file of ``flsmem ruler``'s arguments.

    Raises:
      ValueError: a bad argument, named first in the message.
    """
    from flsmem.harness.evaluate import (LEARNED_NAMES, PEER_NAMES, POLICY_NAMES, check_estimator, check_policies,
                                         is_policy_name)

    plan = Plan(
        model=catalog.check(args.model), lengths=_lengths(args), tasks=_names("--tasks", args.tasks, TASKS),
        policies=_names("--policies", args.policies, POLICY_NAMES + LEARNED_NAMES + PEER_NAMES, is_policy_name),
        budgets=_fractions(args.budgets), protocols=_names("--protocols", args.protocols, PROTOCOLS),
        samples=positive_int("--samples", args.samples), seed=nonneg_int("--seed", args.seed),
        evict_every=positive_int("--evict-every", args.evict_every), estimator=args.estimator,
        shard=_shard(args.shard), batch=positive_int("--batch", args.batch))
    check_estimator(plan.estimator)
    check_policies("--policies", plan.policies, _budget_tokens(min(plan.budgets), min(plan.lengths)))
    pyramids = [p for p in plan.policies if "pyramid(" in p]
    require(not pyramids, f"--policies {', '.join(pyramids)}: layer budgets hold until the next scheduled eviction, "
                          "and flsmem ruler evicts while it reads the question and answers, so they would be measured "
                          "as uniform budgets; use them with flsmem eval --protocol prefill")
    for length in plan.lengths:
        for policy in plan.policies:
            for budget in plan.budgets:
                try:
                    _config(policy, _budget_tokens(budget, length), plan.protocols[0], length, plan.evict_every,
                            estimator=plan.estimator)
                except ValueError as error:
                    raise ValueError(f"--budgets {budget:g} of --length {length} is too small for {policy}: "
                                     f"{error}") from None
    stem = Path(plan.model).stem + ("-quick" if args.quick else "")
    out = Path(args.out) if args.out else Path("results") / "ruler" / f"{stem}.jsonl"
    require(not out.is_dir(), f"--out must be a file, got the folder {str(out)!r}")
    require(not any(folder.is_file() for folder in out.parents),
            f"--out must be a file in a folder, but a file stands in its path {str(out)!r}")
    require(not args.report or out.is_file(), f"--report needs the results in --out, but {str(out)!r} does not exist")
    if out.is_file():  # resumed or reported: its rows are read as text, and a run appends to it
        try:
            out.read_text()
        except UnicodeDecodeError:
            fail(f"--out must be a results file of JSON lines (UTF-8 text), but {str(out)!r} is not text")
    return plan, out


def _check_quick(args: argparse.Namespace) -> None:
    """``--quick`` chooses the tasks, policies, budgets and samples itself: one of them
    given beside it would be silently replaced, so it is an error."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = vars(parser.parse_args([]))
    given = [f"--{name}" for name in QUICK if getattr(args, name) != defaults[name]]
    require(not given, f"--quick sets {', '.join('--' + name for name in QUICK)} itself; "
                       f"leave out {', '.join(given)}")


def run_cli(args: argparse.Namespace) -> Path:
    """``flsmem ruler``: measure (unless ``--report``), then write the report; returns
    the report's path."""
    with checking(COMMAND):
        if args.quick:
            _check_quick(args)
            vars(args).update(QUICK)
        plan, out = check_arguments(args)
        if not args.report:
            tokenizer = catalog.load_tokenizer(plan.model)
            # Past its trained context a model's accuracy measures RoPE extrapolation, not
            # the memory; and a mistyped length would spend minutes drawing haystacks first.
            limit = catalog.context_length(plan.model)
            for length in plan.lengths:
                require(length <= limit, f"--length {length} is past {plan.model}'s context of {limit} tokens; "
                                         "RULER lengths must fit the context the model was trained for")
            # A length too short for a sample is an argument error, found before the model loads.
            samples = make_samples(plan, tokenizer)
    if not args.report:
        begin = time.perf_counter()
        written = run(plan, out, tokenizer=tokenizer, samples=samples)
        print(f"{written} answers in {time.perf_counter() - begin:.0f} s, appended to {out}", flush=True)
    markdown = report.write(out)
    print(markdown.read_text())
    return markdown
