"""RULER in-tree: the generated tasks, the scores, the runner and the command."""

import collections
import re

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
