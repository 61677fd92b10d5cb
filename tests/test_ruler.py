"""RULER in-tree: the generated tasks, the scores, the runner and the command."""

import collections
import dataclasses
import json
import re

import numpy as np
import pytest

from flsmem.harness.ruler import score, tasks
from flsmem.models.data import ByteTokenizer


class WordTokenizer:
    """One token per whitespace-separated word: a tokenizer unlike the byte one."""

    def encode(self, text):
        return [len(word) for word in text.split()]


# (tokenizer, length): long enough for every task's fixed part.
TOKENIZERS = {"bytes": (ByteTokenizer(), 2048), "words": (WordTokenizer(), 512)}
# The most tokens one haystack unit adds (a distractor needle with UUIDs, in bytes).
UNIT = {"bytes": 128, "words": 40}


@pytest.mark.parametrize("task", tasks.TASKS)
def test_samples_are_deterministic_and_differ_by_index(task):
    tokenizer, length = TOKENIZERS["words"]
    first = tasks.make_sample(task, length, 0, tokenizer, seed=3)
    assert first == tasks.make_sample(task, length, 0, tokenizer, seed=3)
    assert first["context"] != tasks.make_sample(task, length, 1, tokenizer, seed=3)["context"]
    assert first["answers"] != tasks.make_sample(task, length, 0, tokenizer, seed=4)["answers"]
    assert first["max_new_tokens"] == tasks.MAX_NEW_TOKENS[task]


@pytest.mark.parametrize("kind", list(TOKENIZERS))
@pytest.mark.parametrize("task", tasks.TASKS)
def test_the_prompt_fits_the_length_and_nearly_fills_it(task, kind):
    tokenizer, length = TOKENIZERS[kind]
    for index in range(2):
        sample = tasks.make_sample(task, length, index, tokenizer)
        used = len(tokenizer.encode(sample["context"])) + len(tokenizer.encode(sample["question"]))
        assert length - UNIT[kind] <= used <= length, (task, index, used)


def _resolve(context):
    """Each variable of the context's assignments mapped to the number it ends up holding."""
    assigned = dict(re.findall(r"Let ([A-Z]{5}) = (\w+)\.", context))
    value = lambda name: assigned[name] if assigned[name].isdigit() else value(assigned[name])  # noqa: E731
    return {name: value(name) for name in assigned}


def _counts(task, context):
    """How often each listed word (cwe: the numbered entries, the example's too) or
    coded word (fwe: the text after the instructions) occurs in the context."""
    if task == "cwe":
        return collections.Counter(re.findall(r"\d+\. ([a-z]+)", context))
    return collections.Counter(context.split("\n", 1)[1].split())


@pytest.mark.parametrize("task", tasks.TASKS)
def test_every_answer_is_really_in_its_context(task):
    tokenizer, length = TOKENIZERS["bytes"]
    for index in range(3):
        sample = tasks.make_sample(task, length, index, tokenizer)
        context, answers = sample["context"], sample["answers"]
        if task.startswith("niah"):
            for value in answers:
                needle = re.search(rf"The hidden \w+ for (\S+) is {re.escape(value)}\.", context)
                assert needle and needle.group(1) in sample["question"]
        elif task == "vt":
            value = re.search(r"value (\d+)", sample["question"]).group(1)
            held = _resolve(context)
            assert sorted(answers) == sorted(name for name in held if held[name] == value)
        else:
            counts = _counts(task, context)
            rest = [count for word, count in counts.items() if word not in answers and word != "..."]
            assert min(counts[word] for word in answers) > max(rest), (task, index)
            assert len(answers) == (10 if task == "cwe" else 3)


def test_a_length_too_short_for_the_task_is_refused():
    with pytest.raises(ValueError, match="too short for cwe"):
        tasks.make_sample("cwe", 64, 0, ByteTokenizer())
    with pytest.raises(ValueError, match="task must be one of"):
        tasks.make_sample("qa_1", 1024, 0, ByteTokenizer())


def test_scores_follow_ruler():
    answers = ["1234567", "ABCDE"]
    assert score.score("niah_multivalue", "The values are 1234567 and abcde.", answers) == 1.0
    assert score.score("niah_multivalue", "", answers) == 0.0
    assert score.score("niah_multivalue", " 1234567, then nothing", answers) == 0.5
    assert score.string_match_part("only abcde", answers) == 1.0
    assert score.string_match_part("none", answers) == 0.0
    for task in tasks.TASKS:
        sample = tasks.make_sample(task, 512, 0, WordTokenizer())
        gold = " " + ", ".join(sample["answers"]) + "."
        assert score.score(task, gold, sample["answers"]) == 1.0
        assert score.score(task, "", sample["answers"]) == 0.0


def _row(task, policy, protocol, budget, index, value):
    return {"model": "m", "task": task, "length": 256, "index": index, "seed": 0, "policy": policy,
            "protocol": protocol, "budget": budget, "evict_every": 16, "score": value}


def test_the_report_marks_tasks_beyond_the_model_and_leaves_them_out(tmp_path):
    from flsmem.harness.ruler import report

    rows = []
    for index in range(4):
        rows += [_row("vt", "full", "stream", 1.0, index, 1.0), _row("cwe", "full", "stream", 1.0, index, 0.1),
                 _row("vt", "h2o", "stream", 0.25, index, float(index % 2)),
                 _row("cwe", "h2o", "stream", 0.25, index, 0.0)]
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"cut short')
    text = report.write(path).read_text()
    assert "| policy | budget | vt | cwe † | average |" in text
    # h2o: vt half right, cwe left out of the average.
    assert "| h2o | 0.25 | 50 [0–100] | 0 [0–0] | 50 [0–100] |" in text
    assert "| full | full | 100 [100–100] | 10 [10–10] | 100 [100–100] |" in text
    assert (tmp_path / "m.png").is_file()



def test_the_report_pairs_a_policy_across_protocols():
    """h2o under two protocols on the same samples: question-aware minus question-agnostic,
    hand-computed: vt 1 - 0 on both samples, niah_single_1 0 - 0 and 1 - 0, so
    (100 + 50) / 2 = 75 points over 4 pairs; a protocol alone pairs with nothing."""
    from flsmem.harness.ruler import report

    rows = []
    for index in range(2):
        rows += [_row(task, "full", "stream", 1.0, index, 1.0) for task in ("vt", "niah_single_1")]
        rows += [_row("vt", "h2o", "question-agnostic", 0.25, index, 0.0),
                 _row("vt", "h2o", "question-aware", 0.25, index, 1.0),
                 _row("niah_single_1", "h2o", "question-agnostic", 0.25, index, 0.0),
                 _row("niah_single_1", "h2o", "question-aware", 0.25, index, float(index)),
                 _row("vt", "rmm", "stream", 0.25, index, 1.0)]
    text = report.format_report(rows, "t")
    # The interval: vt's pairs always differ by 1, niah_single_1's resample to 0, 1/2 or 1.
    assert "| h2o | 0.25 | question-aware minus question-agnostic | +75 [+50, +100] (4) |" in text
    assert "| rmm | 0.25 | stream" not in text


def test_an_average_over_fewer_tasks_says_so():
    """A policy run on some of the tasks has an average that cannot be set beside the
    others': the report says over how many tasks it is."""
    from flsmem.harness.ruler import report

    rows = []
    for index in range(2):
        rows += [_row(task, policy, "stream", 1.0 if policy == "full" else 0.25, index, 1.0)
                 for task in ("vt", "fwe") for policy in ("full", "h2o")]
        rows += [_row("vt", "rmm", "stream", 0.25, index, 0.0)]
    text = report.format_report(rows, "t")
    assert "| h2o | 0.25 | 100 [100–100] | 100 [100–100] | 100 [100–100] |" in text
    assert "| rmm | 0.25 | 0 [0–0] | – | 0 [0–0] (1 of 2 tasks, full 100 on them) |" in text
    assert "| rmm | 0 [0–0] (1 of 2 tasks, full 100 on them) |" in text
    assert "| h2o | 100 [100–100] |" in text


def test_a_protocol_run_on_fewer_tasks_has_averages_that_say_so():
    """Across the summary's columns too: a protocol run on vt alone, where the stream ran
    vt and fwe, has averages over one task of two, and says so."""
    from flsmem.harness.ruler import report

    rows = []
    for index in range(2):
        rows += [_row("vt", "full", "stream", 1.0, index, 1.0), _row("fwe", "full", "stream", 1.0, index, 0.5),
                 _row("vt", "h2o", "stream", 0.25, index, 0.0), _row("fwe", "h2o", "stream", 0.25, index, 0.0),
                 _row("vt", "full", "question-agnostic", 1.0, index, 1.0),
                 _row("vt", "h2o", "question-agnostic", 0.25, index, 0.5)]
    text = report.format_report(rows, "t")
    assert "| h2o | 50 [50–50] (1 of 2 tasks, full 100 on them) | 0 [0–0] |" in text
    assert "| full | 100 [100–100] (1 of 2 tasks, full 100 on them) | 75 [75–75] |" in text


def test_an_average_over_fewer_tasks_gives_the_full_caches_on_the_same_tasks():
    """Set beside an arm that lacks a task, the full cache's average over every task
    would mislead: the note gives its average over the arm's tasks, by hand 100 on vt
    alone where over vt and fwe it is (100 + 50) / 2 = 75."""
    from flsmem.harness.ruler import report

    rows = []
    for index in range(2):
        rows += [_row("vt", "full", "stream", 1.0, index, 1.0), _row("fwe", "full", "stream", 1.0, index, 0.5),
                 _row("vt", "rmm", "stream", 0.25, index, 0.0), _row("fwe", "h2o", "stream", 0.25, index, 0.0),
                 _row("vt", "h2o", "stream", 0.25, index, 0.0)]
    text = report.format_report(rows, "t")
    assert "| full | full | 100 [100–100] | 50 [50–50] | 75 [75–75] |" in text
    assert "| rmm | 0.25 | 0 [0–0] | – | 0 [0–0] (1 of 2 tasks, full 100 on them) |" in text
    assert "| rmm | 0 [0–0] (1 of 2 tasks, full 100 on them) |" in text
    assert "| h2o | 0.25 | 0 [0–0] | 0 [0–0] | 0 [0–0] |" in text


def test_an_average_over_fewer_samples_says_so():
    """An arm with fewer samples of a task than another arm of the same length has an
    average over other samples: the report says how many it has."""
    from flsmem.harness.ruler import report

    rows = [_row(task, policy, "stream", 1.0 if policy == "full" else 0.25, index, 1.0)
            for task in ("vt", "fwe") for policy in ("full", "h2o") for index in range(4)]
    rows += [_row("vt", "rmm", "stream", 0.25, index, 0.0) for index in range(2)]
    rows += [_row("fwe", "rmm", "stream", 0.25, index, 0.0) for index in range(3)]
    text = report.format_report(rows, "t")
    assert "| rmm | 0.25 | 0 [0–0] | 0 [0–0] | 0 [0–0] (2–3 samples a task) |" in text
    assert "| rmm | 0 [0–0] (2–3 samples a task) |" in text
    assert "| h2o | 0.25 | 100 [100–100] | 100 [100–100] | 100 [100–100] |" in text
    rows = [r for r in rows if not (r["policy"] == "rmm" and r["task"] == "fwe")]
    assert "| rmm | 0 [0–0] (1 of 2 tasks, full 100 on them, 2 samples a task) |" in report.format_report(
        rows, "t")


def test_the_report_says_which_cells_of_the_grid_are_complete():
    """The full cache fails every task but niah_single_1, so a cell needs 50 samples of
    that task alone: h2o streamed at 1/4 has them, at 1/2 one fewer, and snapkv has them
    of a task beyond the model only. Complete: the full cache under its three protocols
    and h2o at 1/4, of 17 evicting policies x 9 columns + 3."""
    from flsmem.harness.ruler import report

    rows = [_row(task, "full", protocol, 1.0, index, float(task == "niah_single_1"))
            for task in tasks.TASKS for protocol in ("question-agnostic", "question-aware", "stream")
            for index in range(50)]
    rows += [_row("niah_single_1", "h2o", "stream", 0.25, index, 0.0) for index in range(50)]
    rows += [_row("niah_single_1", "h2o", "stream", 0.5, index, 0.0) for index in range(49)]
    rows += [_row("vt", "snapkv", "stream", 0.25, index, 0.0) for index in range(50)]
    text = report.format_report(rows, "t")
    coverage = text[text.index("### Coverage of the grid"):]
    assert "over the tasks within the model (1;" in coverage
    assert "**Complete: 4 of 156 cells.**" in coverage
    assert "| full | " + " | ".join(["**50**"] * 9) + " |" in coverage
    assert "| h2o | " + " | ".join(["–"] * 7) + " | **50** | 49 |" in coverage
    assert "| snapkv | " + " | ".join(["–"] * 9) + " |" in coverage


def test_the_report_pairs_each_policy_with_h2o_on_the_same_samples(tmp_path):
    from flsmem.harness.ruler import report

    h2o, h2o_twice, rmm = [0, 1, 0, 1], [1, 1, 1, 1], [1, 1, 0, 1]
    rows = [_row("vt", "rmm", "stream", 0.25, 4, 1.0)]  # a sample h2o did not answer: not paired
    for index in range(4):
        rows += [_row("vt", "full", "stream", 1.0, index, 1.0), _row("cwe", "full", "stream", 1.0, index, 0.0),
                 _row("vt", "h2o", "stream", 0.25, index, h2o[index]),
                 _row("vt", "h2o", "stream", 0.5, index, h2o_twice[index]),
                 _row("vt", "rmm", "stream", 0.25, index, rmm[index]),
                 # cwe is beyond the model: its differences stay out of the average.
                 _row("cwe", "h2o", "stream", 0.25, index, 0.0), _row("cwe", "rmm", "stream", 0.25, index, 1.0)]
    text = report.format_report(rows, "t")
    line = next(line for line in text.splitlines() if line.startswith("| stream | rmm | 0.25 |"))
    same, twice = line.split(" | ")[3:5]
    # rmm - h2o on vt's four paired samples: (1 + 0 + 0 + 0) / 4; against h2o at 0.5: (0 + 0 - 1 + 0) / 4.
    assert same.startswith("+25 [") and same.endswith("] (4)")
    assert twice.startswith("-25 [") and twice.rstrip(" |").endswith("] (4)")
    low, high = (int(x) for x in same[same.index("[") + 1:same.index("]")].split(", "))
    assert low <= 25 <= high and low >= 0
    # h2o itself is the reference, and its 0.5 arm has no 1.0 arm to be paired with;
    # recency was not run, so nothing is paired against it.
    assert "| stream | h2o |" not in text
    assert "Paired against streaming_llm" not in text


def test_the_report_pairs_each_policy_with_recency_too():
    """With streaming_llm run, a second table pairs every other policy, h2o included,
    against it, on the samples both answered."""
    from flsmem.harness.ruler import report

    recency, h2o, rmm = [1, 1, 0, 1], [0, 1, 0, 0], [1, 1, 1, 1]
    rows = []
    for index in range(4):
        rows += [_row("vt", "full", "stream", 1.0, index, 1.0),
                 _row("vt", "streaming_llm", "stream", 0.25, index, recency[index]),
                 _row("vt", "h2o", "stream", 0.25, index, h2o[index]),
                 _row("vt", "rmm", "stream", 0.25, index, rmm[index]),
                 # Recency ran at no budget this arm could be paired with.
                 _row("vt", "h2o", "stream", 0.75, index, 1.0)]
    text = report.format_report(rows, "t")
    against_recency = text[text.index("### Paired against streaming_llm"):]
    against_h2o = text[text.index("### Paired against h2o"):text.index("### Paired against streaming_llm")]

    def difference(table, policy):
        line = next(line for line in table.splitlines() if line.startswith(f"| stream | {policy} | 0.25 |"))
        return line.split(" | ")[3]

    # h2o - streaming_llm: (-1 + 0 + 0 - 1) / 4; rmm - streaming_llm: (0 + 0 + 1 + 0) / 4.
    assert difference(against_recency, "h2o").startswith("-50 [")
    assert difference(against_recency, "rmm").startswith("+25 [")
    # streaming_llm - h2o, in the table against accumulation: +2 of 4.
    assert difference(against_h2o, "streaming_llm").startswith("+50 [")
    assert "| stream | streaming_llm |" not in against_recency
    assert "| stream | h2o | 0.75 |" not in against_recency
    # With no other policy to pair, no table.
    alone = [r for r in rows if r["policy"] in ("full", "h2o")]
    assert "### Paired against" not in report.format_report(alone, "t")


def test_a_learned_policy_over_several_checkpoints_is_reported_per_checkpoint(tmp_path):
    from flsmem.harness.ruler import report

    # Two pretraining seeds of the learned policy on the same samples: kept apart, not
    # one overwriting the other, and summarised over checkpoints.
    rows = []
    for index in range(4):
        rows += [_row("vt", "full", "stream", 1.0, index, 1.0), _row("vt", "h2o", "stream", 0.25, index, 0.0),
                 {**_row("vt", "learned", "stream", 0.25, index, 1.0), "estimator": "seed0"},
                 {**_row("vt", "learned", "stream", 0.25, index, float(index < 2)), "estimator": "seed1"}]
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded = report.load(path)
    assert len(loaded) == len(rows)
    text = report.format_report(loaded, "t")
    assert "| learned (seed0) | 0.25 | 100 [100–100] | 100 [100–100] |" in text
    assert "| learned (seed1) | 0.25 | 50 [0–100] | 50 [0–100] |" in text
    # Mean and sd (ddof 1) of 100 and 50 over the two checkpoints.
    assert "| stream | learned | 0.25 | 1 | seed0 100, seed1 50 | 75.0 ± 35.4 |" in text
    # One checkpoint only: the plain name.
    path.write_text("".join(json.dumps(r) + "\n" for r in rows if r.get("estimator") != "seed1"))
    assert "| learned | 0.25 |" in report.format_report(report.load(path), "t")


def test_the_runner_answers_under_every_protocol_and_resumes(tmp_path, monkeypatch):
    from flsmem.harness.ruler import protocols, run
    from flsmem.models import catalog

    # Prefill in pieces of evict_every: one program fewer to compile.
    monkeypatch.setattr(protocols, "PREFILL_CHUNK", 16)
    plan = run.Plan(model="tiny", lengths=(512,), tasks=("niah_single_1",), policies=("h2o",), budgets=(0.25,),
                    protocols=protocols.PROTOCOLS, samples=1)
    out = tmp_path / "tiny.jsonl"
    assert run.run(plan, out, progress=False) == 3
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["protocol"] for r in rows) == sorted(protocols.PROTOCOLS)
    for r in rows:
        assert r["budget_tokens"] == 128 and r["evictions"] > 0 and 0 < r["generated_tokens"] <= 128
        assert r["prompt_tokens"] <= 512 and r["score"] in (0.0, 1.0)
    monkeypatch.setattr(catalog, "load", lambda name: pytest.fail("a resumed run with nothing to do loads no model"))
    assert run.run(plan, out, progress=False) == 0


def test_a_protocol_added_to_a_file_copies_the_full_caches_answer(tmp_path, monkeypatch):
    """The full cache's answer, recorded under one protocol, is every protocol's: a later
    run that asks for other protocols copies it and loads no model; a sample it lacks is
    still answered."""
    from flsmem.harness.ruler import run
    from flsmem.models import catalog

    def full_row(index):
        return {"model": "tiny", "task": "niah_single_1", "length": 512, "index": index, "seed": 0,
                "policy": "full", "protocol": "stream", "budget": 1.0, "evict_every": 16,
                "prediction": "7", "score": 1.0, "seconds": 3.0}

    out = tmp_path / "tiny.jsonl"
    out.write_text(json.dumps(full_row(0)) + "\n")
    plan = run.Plan(model="tiny", lengths=(512,), tasks=("niah_single_1",), policies=("full",), budgets=(0.25,),
                    protocols=("question-agnostic", "question-aware", "stream"), samples=1)
    monkeypatch.setattr(catalog, "load", lambda name: pytest.fail("copying an answer loads no model"))
    assert run.run(plan, out, progress=False) == 2
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["protocol"] for r in rows] == ["stream", "question-agnostic", "question-aware"]
    assert all({**r, "protocol": "stream"} == full_row(0) for r in rows)
    with pytest.raises(pytest.fail.Exception, match="loads no model"):
        run.run(dataclasses.replace(plan, samples=2), out, progress=False)


def test_shards_split_the_plans_jobs_between_them():
    """Three shards answer every job of the plan once between them, each the same jobs
    whatever is already answered (a shard resumes its own)."""
    from flsmem.harness.ruler import run

    plan = run.Plan(model="tiny", lengths=(512,), tasks=("vt",), policies=("full", "h2o", "rmm"), budgets=(0.25,),
                    protocols=("stream",), samples=4)
    samples = [{"task": "vt", "length": 512, "index": i, "seed": 0} for i in range(4)]

    def jobs(shard, done=()):
        return [(policy, sample["index"]) for policy, sample, _, _ in
                run._jobs(dataclasses.replace(plan, shard=shard), samples, dict.fromkeys(done))]

    whole = jobs((0, 1))
    parts = [jobs((k, 3)) for k in range(3)]
    assert len(whole) == 12 and sorted(sum(parts, [])) == sorted(whole)
    assert parts[0] == [("full", 0), ("full", 3), ("h2o", 2), ("rmm", 1)]
    first = run.row_key({"model": "tiny", "task": "vt", "length": 512, "index": 0, "seed": 0, "policy": "full",
                         "protocol": "stream", "budget": 1.0, "evict_every": 16})
    assert jobs((0, 3), done=[first]) == parts[0][1:] and jobs((1, 3), done=[first]) == parts[1]


@pytest.mark.parametrize("batch", [8, 1])
def test_the_runner_shares_a_prefill_between_the_policies_and_budgets_of_a_sample(batch, tmp_path, monkeypatch):
    """Under a prefilling protocol every policy and budget of a sample is answered in
    one call (one prefill), and the samples of a task in the same call, up to
    ``batch`` of them; streaming answers policy by policy, and the full cache once for
    every protocol. The model and the answering are stand-ins: only the wiring is
    tested."""
    import types

    from flsmem.harness.ruler import protocols, run
    from flsmem.models.decoder import TINY

    calls = []

    def batch_answers(model, configs, prompts, *, protocol, **kwargs):
        calls.append((protocol, len(prompts), sorted((c.policy.name, c.budget) for c in configs)))
        return ((p, i, [], {"evictions": 0}) for i in reversed(range(len(configs))) for p in range(len(prompts)))

    monkeypatch.setattr(protocols, "batch_answers", batch_answers)
    plan = run.Plan(model="tiny", lengths=(512,), tasks=("niah_single_1",), policies=("full", "h2o", "rmm"),
                    budgets=(0.125, 0.25), protocols=("question-agnostic", "stream"), samples=2, batch=batch)
    out = tmp_path / "r.jsonl"
    assert run.run(plan, out, model=types.SimpleNamespace(cfg=TINY), tokenizer=ByteTokenizer(), progress=False) == 20
    arms = [("h2o", 64), ("h2o", 128), ("rmm", 64), ("rmm", 128)]
    together = min(batch, 2)
    units = [("question-agnostic", ["full"]), ("stream", ["h2o", "h2o"]), ("stream", ["rmm", "rmm"]),
             ("question-agnostic", [name for name, _ in arms])]
    assert [(protocol, [name for name, _ in configs]) for protocol, _, configs in calls] == [
        unit for unit in units for _ in range(2 // together)]
    assert {prompts for _, prompts, _ in calls} == {together} and calls[-1][2] == arms
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(collections.Counter((r["policy"], r["protocol"], r["budget"]) for r in rows).values()) == [2] * 10
    assert {r["batch"] for r in rows} == {together}
    assert run.run(plan, out, model=types.SimpleNamespace(cfg=TINY), tokenizer=ByteTokenizer(), progress=False) == 0


def test_the_learned_policies_get_the_models_own_estimator(monkeypatch):
    """As in ``flsmem eval``: SmolLM2's learned policies use the estimator pretrained on
    its traces unless ``--estimator`` names another, and each row says which. The model
    and the answering are stand-ins: only the wiring is tested."""
    import types

    from flsmem.harness import evaluate
    from flsmem.harness.ruler import protocols, run
    from flsmem.models.decoder import TINY

    given, make_policy = [], evaluate.make_policy

    def record(name, budget, lag=16, estimator=None, model=None):
        given.append(estimator)
        return make_policy("h2o", budget, lag, model=model)

    monkeypatch.setattr(evaluate, "make_policy", record)
    monkeypatch.setattr(protocols, "batch_answers", lambda model, configs, prompts, **kwargs: (
        (p, i, [], {"evictions": 0}) for i in range(len(configs)) for p in range(len(prompts))))
    sample = tasks.make_sample("niah_single_1", 2048, 0, ByteTokenizer(), 0)
    plan = run.Plan(model="smollm2-135m", lengths=(2048,), tasks=("niah_single_1",), policies=("learned",),
                    budgets=(0.25,), protocols=("stream",), samples=1)
    answered = []
    for estimator in (None, str(evaluate.ESTIMATOR_DIR)):
        answerer = run.Answerer(dataclasses.replace(plan, estimator=estimator), types.SimpleNamespace(cfg=TINY),
                                ByteTokenizer())
        answered += answerer.answer([sample], "stream", [("learned", 0.25)])
    assert given == [str(evaluate.MODEL_ESTIMATORS["smollm2-135m"]), str(evaluate.ESTIMATOR_DIR)]
    assert [row["estimator"] for row in answered] == ["estimator-smollm2", "estimator"]

# A decoder of global layers only, and one with local (sliding-window) layers too.
_GLOBAL = dict(vocab_size=64, width=32, depth=3, q_heads=4, kv_heads=2, head_dim=8, hidden=64, max_len=128)
_LOCAL = dict(_GLOBAL, depth=4, kv_heads=1, qk_norm=True, post_norms=True, sliding_window=5, local_layers=(0, 2),
              local_rope_theta=100.0, rope_theta=1e4)


@pytest.mark.parametrize("shape, arms, groups", [
    (_GLOBAL, [("h2o", 24), ("h2o", 40), ("snapkv", 24), ("key_norm", 24), ("expected_attention", 24),
               ("oracle", 24), ("rmm", 24), ("tova", 24), ("adaptive", 24), ("surprise_reserve", 24),
               ("streaming_llm", 24)], [[0, 1, 2, 3, 5, 6, 7, 8, 9, 10], [4]]),
    # The local layers' windows are sized by the pieces fed, not the budget: budgets apart share.
    (_LOCAL, [("h2o", 24), ("snapkv", 24), ("h2o", 40)], [[0, 1, 2]]),
])
def test_a_shared_prefill_leaves_each_policy_the_memory_it_builds_alone(shape, arms, groups, monkeypatch):
    """One prefill folded into every policy's and budget's memory leaves each exactly
    the memory (every array, the policy's state included) and the logits that a
    prefill of its own leaves; and the answers after it are those of each alone.
    ExpectedAttention, whose state folds the queries, prefills alone."""
    import jax
    from flax import nnx

    from flsmem.harness.evaluate import make_policy
    from flsmem.harness.ruler import protocols
    from flsmem.models.decoder import Decoder, DecoderConfig, init_memories

    monkeypatch.setattr(protocols, "PREFILL_CHUNK", 8)
    model = Decoder(DecoderConfig(**shape), nnx.Rngs(0))
    rng = np.random.default_rng(0)
    # Whole pieces of 8 up to the answer: one program per policy and piece.
    context, question = rng.integers(0, 64, 80).astype(np.int32), rng.integers(0, 64, 8).astype(np.int32)
    prompt = np.concatenate([context, question])
    configs = [protocols.memory_config(make_policy(name, budget, model=model.cfg), budget, "question-aware",
                                       length=100, evict_every=8, max_new=4) for name, budget in arms]
    oracle = [name == "oracle" for name, _ in arms]
    table = protocols.answer_attention(model, context, question, rng.integers(0, 64, 3), evict_every=8,
                                       width=104) if any(oracle) else None
    tables = [table if is_oracle else None for is_oracle in oracle]
    assert protocols._sharing(model.cfg, configs) == groups

    graphdef, params = nnx.split(model)
    for group in (g for g in groups if len(g) > 1):
        alone = {i: protocols._prefill(graphdef, params, prompt, len(prompt), protocols._empty(model.cfg, configs[i]),
                                       (), [tables[i]], 8) for i in group}
        followers = tuple(protocols._empty(model.cfg, configs[i]).evictable.replace(payload=None) for i in group[1:])
        lead, followed, logits = protocols._prefill(graphdef, params, prompt, len(prompt),
                                                    protocols._empty(model.cfg, configs[group[0]]), followers,
                                                    [tables[i] for i in group], 8)
        assert jax.tree.all(jax.tree.map(np.array_equal, lead, alone[group[0]][0]))
        np.testing.assert_array_equal(logits, alone[group[0]][2])
        for i, follower in zip(group[1:], followed):
            own = alone[i][0].evictable
            assert jax.tree.all(jax.tree.map(np.array_equal, follower, own.replace(payload=None)))
            assert jax.tree.all(jax.tree.map(np.array_equal, lead.evictable.payload, own.payload))
            assert follower.config == own.config and follower.evidence  # the policy's own, not the lead's

    if shape is _LOCAL:
        return  # the answers below take the same path whatever the layers
    # Then each answers with a memory of its own (the cut, decoding), as alone.
    shared = {i: answer for i, *answer in protocols.answers(model, configs, context, question,
                                                            protocol="question-aware", max_new=2, tables=tables)}
    assert sorted(shared) == list(range(len(arms)))
    for i, (config, table) in enumerate(zip(configs, tables)):
        alone = protocols.answer(model, config, context, question, protocol="question-aware", max_new=2, table=table)
        assert tuple(shared[i]) == alone, arms[i]


def test_the_local_layers_windows_hold_the_pieces_fed_not_the_prompt(monkeypatch):
    """Before the cut the global layers hold the whole prompt (100 slots); the windows
    evict as they go, so theirs is sized by the largest piece (5 + 8 + 8 - 1 = 20 slots,
    at every budget) and not by the prompt's (5 + 8 + 69 - 1 = 81 at budget 24). The
    prefill leaves them the same items and the model the same logits as the oversized
    windows do."""
    import jax
    from flax import nnx

    from flsmem.harness.evaluate import make_policy
    from flsmem.harness.ruler import protocols
    from flsmem.models.decoder import Decoder, DecoderConfig, init_memories

    monkeypatch.setattr(protocols, "PREFILL_CHUNK", 8)
    model = Decoder(DecoderConfig(**_LOCAL), nnx.Rngs(0))
    configs = {budget: protocols.memory_config(make_policy("h2o", budget, model=model.cfg), budget,
                                               "question-agnostic", length=100, evict_every=8, max_new=4)
               for budget in (24, 40)}
    assert {protocols._empty(model.cfg, c).windows.valid.shape[-1] for c in configs.values()} == {20}
    assert init_memories(model.cfg, configs[24], 1).windows.valid.shape[-1] == 81
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="window_chunk"):
            init_memories(model.cfg, configs[24], 1, window_chunk=bad)
    prompt = np.random.default_rng(0).integers(0, 64, 88).astype(np.int32)
    graphdef, params = nnx.split(model)
    small, _, logits = protocols._prefill(graphdef, params, prompt, len(prompt),
                                          protocols._empty(model.cfg, configs[24]), (), [None], 8)
    large, _, reference = protocols._prefill(graphdef, params, prompt, len(prompt),
                                             init_memories(model.cfg, configs[24], 1), (), [None], 8)
    np.testing.assert_allclose(logits, reference, rtol=1e-5, atol=1e-6)
    held = lambda w: [sorted(p[v]) for p, v in zip(np.asarray(w.position).reshape(-1, w.position.shape[-1]),
                                                   np.asarray(w.valid).reshape(-1, w.valid.shape[-1]))]
    assert held(small.windows) == held(large.windows)
    assert all(len(row) >= 5 for row in held(small.windows))  # at least the window itself
    assert jax.tree.all(jax.tree.map(lambda a, b: np.allclose(a, b, rtol=1e-5, atol=1e-6),
                                     small.evictable, large.evictable))


@pytest.mark.parametrize("name, shape", [("h2o", _GLOBAL), ("snapkv", _GLOBAL), ("learned", _GLOBAL),
                                         ("h2o", _LOCAL)])
def test_the_cut_memory_is_resized_and_answers_as_the_prompt_sized_one(name, shape, monkeypatch):
    """After the cut the items move into the slots that the question's pieces and the
    answer need (flsmem.resize): the global layers' 39 where the prompt needed 100, and
    the local layers' windows theirs; the answer and the evictions are those of the
    memories sized for the prompt."""
    from flax import nnx

    from flsmem.harness.evaluate import make_policy
    from flsmem.harness.ruler import protocols
    from flsmem.models.decoder import Decoder, DecoderConfig

    monkeypatch.setattr(protocols, "PREFILL_CHUNK", 8)
    model = Decoder(DecoderConfig(**shape), nnx.Rngs(0))
    rng = np.random.default_rng(1)
    context, question = rng.integers(0, 64, 80).astype(np.int32), rng.integers(0, 64, 8).astype(np.int32)
    config = protocols.memory_config(make_policy(name, 24, model=model.cfg), 24, "question-agnostic", length=100,
                                     evict_every=8, max_new=12)
    slots = []
    resize = protocols._resize_memory
    monkeypatch.setattr(protocols, "_resize_memory", lambda memory, max_chunk: slots.append(
        (memory.config.policy.name, memory.valid.shape[-1], max_chunk)) or resize(memory, max_chunk))
    kwargs = dict(protocol="question-agnostic", max_new=12)
    resized = protocols.answer(model, config, context, question, **kwargs)
    assert slots[0] == (name, 100, 8) and config.replace(max_chunk=8).capacity == 39
    if shape is _LOCAL:  # the windows as well (5 slots and what may arrive: a period and a piece of 8)
        assert slots[1][:2] == ("window", 5 + 8 + 8 - 1) and len(slots) == 2
    assert resized == protocols.answer(model, config, context, question, resize=False, **kwargs)
    assert len(resized[0]) == 12 and resized[1]["evictions"] > 0



@pytest.mark.parametrize("protocol", ["question-agnostic", "stream"])
def test_answers_decoded_as_a_batch_are_those_of_each_prompt_alone(protocol, monkeypatch):
    """Three prompts of different lengths answered together: each config's rows decode
    as one batch (each at its own positions, evicting on its own schedule) and give
    each prompt the tokens and evictions it gets alone, one row ending early at the end
    token; the pieces of the prompts they have alike are fed as one batch too; the oracle
    reads each prompt's own table; surprise_reserve, which commits scores whenever a row
    is due, answers each prompt alone."""
    from flax import nnx

    from flsmem.harness.evaluate import make_policy
    from flsmem.harness.ruler import protocols
    from flsmem.models.decoder import Decoder, DecoderConfig

    monkeypatch.setattr(protocols, "PREFILL_CHUNK", 8)
    model = Decoder(DecoderConfig(**_GLOBAL), nnx.Rngs(0))
    rng = np.random.default_rng(2)
    prompts = [(rng.integers(0, 64, n).astype(np.int32), rng.integers(0, 64, q).astype(np.int32))
               for n, q in ((80, 9), (75, 10), (83, 11))]
    names = ["h2o", "oracle", "surprise_reserve"]
    configs = [protocols.memory_config(make_policy(name, 24, model=model.cfg), 24, protocol, length=100,
                                       evict_every=8, max_new=10) for name in names]
    tables = [[protocols.answer_attention(model, *prompt, rng.integers(0, 64, 3), evict_every=8, width=104)
               if name == "oracle" else None for name in names] for prompt in prompts]
    alone = {(p, i): protocols.answer(model, config, *prompt, protocol=protocol, max_new=10, table=tables[p][i])
             for p, prompt in enumerate(prompts) for i, config in enumerate(configs)}
    # The first new token in the first prompt's answer under h2o ends it there.
    first = alone[0, 0][0]
    end = next(i for i, token in enumerate(first) if i and token not in first[:i])
    eos = first[end]
    alone = {(p, i): protocols.answer(model, config, *prompt, protocol=protocol, max_new=10, eos_id=eos,
                                      table=tables[p][i])
             for p, prompt in enumerate(prompts) for i, config in enumerate(configs)}
    assert len(alone[0, 0][0]) == end and any(len(tokens) == 10 for tokens, _ in alone.values())

    rows, fed = [], []
    decode, feed = protocols._decode, protocols._feed
    monkeypatch.setattr(protocols, "_decode", lambda *args: rows.append(len(args[5])) or decode(*args))
    monkeypatch.setattr(protocols, "_feed", lambda *args, **kw: fed.append(args[3].shape) or feed(*args, **kw))
    together = {(p, i): (tokens, info) for p, i, tokens, info in protocols.batch_answers(
        model, configs, prompts, protocol=protocol, max_new=10, eos_id=eos, tables=tables)}
    assert together == alone
    assert rows == [3, 3, 1, 1, 1]
    # h2o and the oracle feed the pieces of 8 that all three prompts (89, 85 and 94
    # tokens) have alike as three rows: streamed the first ten, cut before the question
    # each question's first (questions of 9, 10 and 11 tokens); a prefill reads each
    # prompt alone.
    assert fed.count((3, 8)) == (20 if protocol == "stream" else 2)
    assert all(info["evictions"] > 0 for _, info in together.values())


BAD_ARGUMENTS = {
    "unknown task": (["--tasks", "niah_single_1,qa_1"], "--tasks"),
    "unknown policy": (["--policies", "h2o,lru"], "--policies"),
    "unknown protocol": (["--protocols", "prefill"], "--protocols"),
    "budget zero": (["--budgets", "0,1/4"], "--budgets"),
    "budget above one": (["--budgets", "2"], "--budgets"),
    "budget not a number": (["--budgets", "half"], "--budgets"),
    "length zero": (["--length", "0"], "--length"),
    "length and lengths": (["--length", "512", "--lengths", "256,512"], "--length and --lengths"),
    "lengths not ints": (["--lengths", "256,big"], "--lengths"),
    "no samples": (["--samples", "0"], "--samples"),
    "negative seed": (["--seed", "-1"], "--seed"),
    "evict_every zero": (["--evict-every", "0"], "--evict-every"),
    "batch zero": (["--batch", "0"], "--batch"),
    "missing model file": (["--model", "{tmp}/none.gguf"], "--model"),
    "length too short": (["--length", "64", "--tasks", "cwe"], "--length 64"),
    # Sample 0 fits in 256 tokens of the tiny model's tokenizer, a later one does not.
    "length too short for a later sample": (["--length", "256", "--tasks", "niah_single_1", "--samples", "3"],
                                            "--length 256"),
    "length past the model's context": (["--lengths", "512,100000"],
                                        "--length 100000 is past tiny's context of 512 tokens"),
    "out is a folder": (["--out", "{tmp}"], "--out"),
    "out under a file": (["--out", "{tmp}/file/r.jsonl"], "--out"),
    "report of nothing": (["--report", "--out", "{tmp}/none.jsonl"], "--report"),
    "out not text": (["--out", "{tmp}/binary.jsonl"], "--out must be a results file"),
    "report of a binary file": (["--report", "--out", "{tmp}/binary.jsonl"], "--out must be a results file"),
    "estimator not a checkpoint": (["--policies", "learned", "--estimator", "{tmp}"], "--estimator"),
    "shard past its count": (["--shard", "2/2"], "--shard"),
    "shard not a fraction": (["--shard", "half"], "--shard"),
    "quick with budgets": (["--quick", "--budgets", "2"], "--quick sets"),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_a_bad_argument_is_one_line_and_exit_status_2(case, tmp_path, capsys, monkeypatch):
    from flsmem.harness.cli import main
    from flsmem.models import catalog

    monkeypatch.setattr(catalog, "load", lambda name: pytest.fail("a bad argument must stop before a model loads"))
    (tmp_path / "file").write_text("not a folder")
    binary = bytes(range(128, 256))
    (tmp_path / "binary.jsonl").write_bytes(binary)
    before = sorted(tmp_path.rglob("*"))
    argv, name = BAD_ARGUMENTS[case]
    argv = ["ruler", "--model", "tiny", "--out", str(tmp_path / "r.jsonl")] + [a.replace("{tmp}", str(tmp_path))
                                                                               for a in argv]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"flsmem ruler: error: {name.replace('{tmp}', str(tmp_path))}"), err
    assert sorted(tmp_path.rglob("*")) == before  # nothing written
    assert (tmp_path / "binary.jsonl").read_bytes() == binary


def _decode(tokens) -> str:
    return bytes(int(t) for t in tokens).decode()


@pytest.mark.parametrize("task", ["niah_single_2", "niah_multikey_1", "niah_multivalue"])
def test_a_forced_window_is_a_prompt_and_its_gold_answer(task):
    from flsmem.harness.ruler import forced

    tokenizer, length = ByteTokenizer(), 1024
    for index in range(2):
        tokens, answer = forced.forced_window(task, length, index, tokenizer, seed=5)
        assert tokens.shape == (length + 1,) and answer.shape == (length,)
        np.testing.assert_array_equal(tokens, forced.forced_window(task, length, index, tokenizer, seed=5)[0])
        text = _decode(tokens)
        # The scored targets are the answer's tokens, at the very end, before its period.
        targets = np.flatnonzero(answer)
        assert targets[-1] == length - 2 and np.all(np.diff(targets) == 1) and text.endswith(".")
        gold = _decode(tokens[1:][answer])
        prompt = text[:targets[0] + 1]
        assert prompt.rstrip().endswith(("is", "are")) and gold.startswith(" ")
        # Every value asked for is a needle of the prompt, under a key the question names.
        question = prompt.rsplit("\n", 1)[1]
        for value in gold.strip().split(", "):
            needle = re.search(rf"The hidden \w+ for (\S+) is {re.escape(value)}\.", prompt)
            assert needle and needle.group(1) in question, (task, index, value)


def test_forced_windows_for_pretraining_take_their_haystack_from_the_training_books():
    from flsmem.harness.ruler import forced
    from flsmem.models.data import load_split

    # Haystacks are the books' words joined by single spaces.
    books = {split: " ".join(load_split(split).split()) for split in ("train", "test")}
    for split, other in (("train", "test"), ("test", "train")):
        tokens, _ = forced.forced_window("niah_single_2", 1024, 0, ByteTokenizer(), seed=5, split=split)
        # The longest stretch of haystack between the header, the needle and the question.
        pieces = re.split(r"The hidden \w+ for \S+ is \d+\.|\n", _decode(tokens))
        stretch = max(pieces, key=len).strip()
        middle = stretch[len(stretch) // 4: len(stretch) // 4 + 120]
        assert len(middle) == 120 and middle in books[split] and middle not in books[other]


def test_a_forced_batch_counts_a_sample_only_when_its_whole_answer_is_predicted():
    from flsmem.harness.ruler import forced

    batch = forced.forced_batch("niah_single_2", 512, 3, ByteTokenizer(), seed=1)
    assert batch.tokens.shape == (3, 513) and batch.answer.shape == (3, 512)
    np.testing.assert_array_equal(batch.accuracy(batch.answer), [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(batch.accuracy(np.zeros_like(batch.answer)), [0.0, 0.0, 0.0])
    one_missed = batch.answer.copy()
    one_missed[1, np.flatnonzero(batch.answer[1])[3]] = False
    np.testing.assert_array_equal(batch.accuracy(one_missed | ~batch.answer), [1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match=r"hit must have shape \(3, 512\)"):
        batch.accuracy(batch.answer[:, 1:])
    assert not forced.fits("cwe", 64, ByteTokenizer()) and forced.fits("niah_single_2", 512, ByteTokenizer())
