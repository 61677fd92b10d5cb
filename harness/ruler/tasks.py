"""RULER's synthetic tasks, generated here from a seed, with no download.

The task definitions follow RULER (Hsieh et al. 2024, arXiv 2404.06654, NVIDIA/RULER):
which items hide in which haystack, what is asked and how many tokens the answer may
take. The wording, the word lists and the haystacks are this project's own:

* essay-like haystacks are held-out prose, *Persuasion* (:mod:`flsmem.models.data`),
  entered at a seeded word; the noise haystack repeats one plain sentence group;
* keys and values are word pairs from the books' vocabulary, seven-digit numbers, or
  UUIDs drawn from the seeded generator (never ``uuid4``);
* the word lists of ``cwe`` are words of the books, the coded words of ``fwe`` random
  letter strings.

A sample is a dict ``{task, length, index, seed, context, question, answers,
max_new_tokens}``: ``context`` is the instructions and the haystack, ``question`` what
follows it up to the point where the answer starts (the question and the start of the
answer, as RULER ends its prompts), ``answers`` the strings a correct answer contains.
``context`` and ``question`` together take at most ``length`` tokens of the given
tokenizer, as close to it as whole haystack units allow (RULER counts the answer's
tokens inside the length; here the length is the prompt's). The same
``(seed, task, length, index)`` and tokenizer always give the same sample.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import string
import uuid
import zlib
from typing import Callable

import numpy as np

from flsmem.models.data import books, load_book, load_split
from flsmem.validate import nonneg_int, positive_int, require

__all__ = ["TASKS", "MAX_NEW_TOKENS", "make_sample", "vocabulary"]

TASKS = (
    "niah_single_1", "niah_single_2", "niah_single_3",
    "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
    "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe",
)


@dataclasses.dataclass(frozen=True)
class Needles:
    """One needle-in-a-haystack task.

    Attributes:
      haystack: "noise" (one sentence group repeated), "essay" (prose) or "needles"
        (distractor needles with keys of their own).
      key, value: what keys and values are: "words", "numbers" or "uuids".
      keys: keys hidden; the others are distractors of the asked ones.
      values: values hidden per key.
      queries: keys asked about.
    """

    haystack: str
    key: str
    value: str
    keys: int = 1
    values: int = 1
    queries: int = 1


NIAH = {
    "niah_single_1": Needles("noise", "words", "numbers"),
    "niah_single_2": Needles("essay", "words", "numbers"),
    "niah_single_3": Needles("essay", "words", "uuids"),
    "niah_multikey_1": Needles("essay", "words", "numbers", keys=4),
    "niah_multikey_2": Needles("needles", "words", "numbers"),
    "niah_multikey_3": Needles("needles", "uuids", "uuids"),
    "niah_multivalue": Needles("essay", "words", "numbers", values=4),
    "niah_multiquery": Needles("essay", "words", "numbers", keys=4, queries=4),
}

# RULER's token limits for the answer of each task family.
MAX_NEW_TOKENS = {**{name: 128 for name in NIAH}, "vt": 30, "cwe": 120, "fwe": 50}

NOISE = "The river flows past the old mill. The clouds are grey and low. The road is long and quiet. Day follows night."

NIAH_HEADER = {
    False: "A {kind} is hidden in the text below. Remember it: you will be asked for it at the end.\n",
    True: "Some {kind}s are hidden in the text below. Remember them: you will be asked for them at the end.\n",
}
NEEDLE = "The hidden {kind} for {key} is {value}."
NIAH_QUESTION = {
    False: "\nWhat is the hidden {kind} for {query} in the text above? Answer: the hidden {kind} for {query} is",
    True: "\nWhat are all the hidden {kind}s for {query} in the text above? Answer: the hidden {kind}s for {query} are",
}
VT_HEADER = "Track the chains of variable assignments hidden in the text below.\n"
VT_QUESTION = ("\nQuestion: which variables are assigned the value {value}, directly or through other variables, "
               "in the text above? Answer: the {count} variables assigned the value {value} are:")
CWE_HEADER = ("Here is a numbered list of words. Some words occur more often than the others; "
              "keep track of the most frequent ones.\n")
CWE_QUESTION = "\nQuestion: which {count} words occur most often in the list above? Answer: the {count} most frequent words are:"
FWE_HEADER = ("The text below is written in a code of made-up words. Count how often each coded word occurs: "
              "you will be asked for the three most frequent ones.\n")
FWE_QUESTION = ("\nQuestion: ignoring the dots '...', which three coded words occur most often in the text above? "
                "Give no explanation. Answer: the three most frequent coded words are:")
# Words of the prompts themselves: kept out of the word lists, so counting a listed word
# in a context counts the list and nothing else.
TEMPLATE_WORDS = frozenset(re.findall(r"[a-z]+", " ".join(
    [NOISE, NEEDLE, VT_HEADER, VT_QUESTION, CWE_HEADER, CWE_QUESTION, FWE_HEADER, FWE_QUESTION,
     *NIAH_HEADER.values(), *NIAH_QUESTION.values()]).lower()))

# Depths of the needles in an essay, as fractions of its sentences.
DEPTHS = np.linspace(0.0, 1.0, 40)


@functools.cache
def vocabulary() -> tuple[str, ...]:
    """Lowercase words of four to twelve letters from all six books, sorted, without
    the prompts' own words."""
    text = " ".join(load_book(name) for name in books())
    return tuple(sorted(set(re.findall(r"\b[a-z]{4,12}\b", text)) - TEMPLATE_WORDS))


@functools.cache
def _essay_words(split: str) -> tuple[str, ...]:
    # Evaluation samples take held-out prose (never the training books); samples made
    # to pretrain an estimator take the training split, so no haystack is shared.
    return tuple(load_split(split).split())


def _rng(seed: int, task: str, length: int, index: int) -> np.random.Generator:
    # crc32 rather than hash(): the same stream in every process.
    return np.random.default_rng([seed, zlib.crc32(task.encode()), length, index])


def _item(kind: str, rng: np.random.Generator) -> str:
    """A key or value: a word pair, a seven-digit number or a UUID."""
    if kind == "words":
        words = vocabulary()
        first, second = rng.integers(len(words), size=2)
        return f"{words[first]}-{words[second]}"
    if kind == "numbers":
        return str(rng.integers(10 ** 6, 10 ** 7))
    return str(uuid.UUID(int=int.from_bytes(rng.bytes(16), "big"), version=4))


def _distinct(draw: Callable[[], str], count: int, taken: set[str] = frozenset()) -> list[str]:
    """``count`` draws, none repeated and none in ``taken``."""
    found: list[str] = []
    while len(found) < count:
        item = draw()
        if item not in taken and item not in found:
            found.append(item)
    return found


def _ends_sentence(word: str) -> bool:
    # A full stop, question or exclamation mark, before any closing quote or bracket.
    return word.rstrip("\"')]_\u201d\u2019")[-1:] in ".!?"


def _sentences(words: list[str]) -> tuple[list[str], list[str]]:
    """``words`` as whole sentences, and the words of an unfinished last one."""
    found, current = [], []
    for word in words:
        current.append(word)
        if _ends_sentence(word):
            found.append(" ".join(current))
            current = []
    return found, current


def _insert(sentences: list[str], items: list[str], rng: np.random.Generator) -> list[str]:
    """``items`` placed between ``sentences`` at seeded depths, in their order."""
    depths = rng.choice(DEPTHS, size=len(items), replace=len(items) > len(DEPTHS))
    points = sorted(int(d * len(sentences)) for d in depths)
    out, last = [], 0
    for point, item in zip(points, items):
        out += sentences[last:point] + [item]
        last = point
    return out + sentences[last:]


def _haystack(kind: str, n: int, items: list[str], rng: np.random.Generator,
              split: str = "test") -> str:
    """``n`` words of filler with ``items`` between its sentences: prose from a seeded
    sentence of ``split``'s books (cycling past their end), or the noise group repeated.
    An unfinished last sentence stays last, so no item follows half a sentence."""
    if kind == "essay":
        source = _essay_words(split)
        start = int(rng.integers(len(source)))
        while not _ends_sentence(source[start - 1]):
            start = (start + 1) % len(source)
        words = [source[(start + i) % len(source)] for i in range(n)]
    else:
        source = NOISE.split()
        words = [source[i % len(source)] for i in range(n)]
    sentences, unfinished = _sentences(words)
    return " ".join(_insert(sentences, items, rng) + unfinished)


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + ", and " + items[-1]


def _niah(spec: Needles, rng: np.random.Generator, n: int, length: int,
          split: str = "test") -> tuple[str, str, list[str]]:
    """A needle task with ``n`` haystack units (words, or distractor needles); an essay
    haystack is prose of ``split``."""
    kind = spec.value[:-1]  # "number" or "uuid"
    keys = _distinct(lambda: _item(spec.key, rng), spec.keys)
    values = [_distinct(lambda: _item(spec.value, rng), spec.values) for _ in keys]
    needles = [NEEDLE.format(kind=kind, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    asked = sorted(rng.choice(len(keys), size=spec.queries, replace=False))
    if spec.haystack == "needles":
        # Every line is a needle; only the hidden keys' lines are asked about.
        others = _distinct(lambda: _item(spec.key, rng), n, set(keys))
        lines = [NEEDLE.format(kind=kind, key=k, value=_item(spec.value, rng)) for k in others]
        points = sorted(rng.integers(0, n + 1, size=len(needles)))
        for offset, (point, needle) in enumerate(zip(points, needles)):
            lines.insert(point + offset, needle)
        haystack = "\n".join(lines)
    else:
        haystack = _haystack(spec.haystack, n, needles, rng, split)
    plural = spec.values * spec.queries > 1
    query = _join([keys[i] for i in asked])
    context = NIAH_HEADER[plural].format(kind=kind) + haystack
    question = NIAH_QUESTION[plural].format(kind=kind, query=query)
    return context, question, [v for i in asked for v in values[i]]


def _chain(names: list[str], value: str) -> list[str]:
    return [f"Let {names[0]} = {value}."] + [f"Let {b} = {a}." for a, b in zip(names, names[1:])]


# Variable tracking: one chain of four hops, after one worked example.
HOPS = 4
EXAMPLE_NOISE = 24  # words of noise around the example's chain


def _vt(rng: np.random.Generator, n: int, length: int) -> tuple[str, str, list[str]]:
    """Variable tracking with ``n`` words of noise around the chain."""
    letters = list(string.ascii_uppercase)
    names = _distinct(lambda: "".join(rng.choice(letters, size=5)), 2 * (HOPS + 1))
    value, shown = _distinct(lambda: str(rng.integers(10 ** 4, 10 ** 5)), 2)
    example_names, names = names[:HOPS + 1], names[HOPS + 1:]
    example = (VT_HEADER + _haystack("noise", EXAMPLE_NOISE, _chain(example_names, shown), rng)
               + VT_QUESTION.format(value=shown, count=HOPS + 1) + " " + " ".join(example_names) + "\n\n")
    haystack = _haystack("noise", n, _chain(names, value), rng)
    return example + VT_HEADER + haystack, VT_QUESTION.format(value=value, count=HOPS + 1), names


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))


def _word_list(words: list[str], common: int, repeats: tuple[int, int], rng: np.random.Generator) -> str:
    """``words`` as a shuffled numbered list: the first ``common`` repeated
    ``repeats[0]`` times, the others ``repeats[1]`` times."""
    listed = words[:common] * repeats[0] + words[common:] * repeats[1]
    return _numbered([listed[i] for i in rng.permutation(len(listed))])


# Common word extraction: ten words repeated more often than the rest, RULER's counts
# (fewer repeats below 4,096 tokens), after one worked example.
COMMON = 10


def _cwe(rng: np.random.Generator, n: int, length: int) -> tuple[str, str, list[str]]:
    """Common word extraction with ``n`` distinct words in the list (``n >= 10``)."""
    long = length >= 4096
    repeats, example_words, example_repeats = ((30, 3), 40, (10, 3)) if long else ((6, 1), 20, (3, 1))
    words = vocabulary()
    require(example_words + n <= len(words), f"cwe at length {length} needs {example_words + n} distinct words; "
                                             f"the vocabulary has {len(words)}")
    # The example's words and the list's are disjoint: no word gains counts from both.
    picked = [words[i] for i in rng.permutation(len(words))[:example_words + n]]
    shown, listed = picked[:example_words], picked[example_words:]
    question = CWE_QUESTION.format(count=COMMON)
    example = (CWE_HEADER + _word_list(shown, COMMON, example_repeats, rng) + question + " "
               + _numbered(shown[:COMMON]) + "\n\n")
    return example + CWE_HEADER + _word_list(listed, COMMON, repeats, rng), question, listed[:COMMON]


# Frequent word extraction: coded words with Zipf counts (exponent 2), the most frequent
# being the noise "...", the next three the answer.
ZIPF = 2.0
CODE_LETTERS = 6


def _fwe(rng: np.random.Generator, n: int, length: int) -> tuple[str, str, list[str]]:
    """Frequent word extraction with about ``n`` coded words."""
    size = max(length // 50, 8)  # RULER's vocabulary size for the length
    letters = list(string.ascii_lowercase)
    codes = ["..."] + _distinct(lambda: "".join(rng.choice(letters, size=CODE_LETTERS)), size - 1, TEMPLATE_WORDS)
    weights = np.arange(1, size + 1, dtype=np.float64) ** -ZIPF
    counts = np.floor(n * weights / weights.sum()).astype(int)
    # Small texts round to ties; the three answers must outnumber every other word.
    counts[3] = max(counts[3], counts[4:].max() + 1)
    counts[2] = max(counts[2], counts[3] + 1)
    counts[1] = max(counts[1], counts[2] + 1)
    text = [code for code, count in zip(codes, counts) for _ in range(count)]
    text = [text[i] for i in rng.permutation(len(text))]
    return FWE_HEADER + " ".join(text), FWE_QUESTION, codes[1:4]


def _builder(task: str, split: str) -> tuple[Callable, int]:
    """``(build(rng, n, length), smallest n)`` of a task."""
    if task in NIAH:
        return functools.partial(_niah, NIAH[task], split=split), 0
    return {"vt": (_vt, 0), "cwe": (_cwe, COMMON), "fwe": (_fwe, 0)}[task]


def make_sample(task: str, length: int, index: int, tokenizer, seed: int = 0, split: str = "test") -> dict:
    """One sample of ``task`` whose prompt fits ``length`` tokens of ``tokenizer``.

    The haystack is grown by bisection over its units (words, list entries or
    distractor needles) to the largest size whose context and question, tokenized
    apart as the runner feeds them, take at most ``length`` tokens. Every size is
    drawn from a fresh generator seeded by ``(seed, task, length, index)``, so keys,
    values and answers do not depend on the size.

    Args:
      task: one of :data:`TASKS`.
      length: tokens the context and question may take together.
      index: which sample.
      tokenizer: any object with ``encode(str) -> sequence of ints``.
      seed: the run's seed.
      split: the books of the essay haystacks: ``"test"`` (held out) for evaluation,
        ``"train"`` for samples that pretrain an estimator.

    Returns:
      ``{task, length, index, seed, context, question, answers, max_new_tokens}``.

    Raises:
      ValueError: an unknown task, a bad number, or a length too short for the task's
        fixed part with this tokenizer.
    """
    require(task in TASKS, f"task must be one of {', '.join(TASKS)}, got {task!r}")
    length, index, seed = positive_int("length", length), nonneg_int("index", index), nonneg_int("seed", seed)
    require(split in ("train", "test"), f"split must be 'train' or 'test', got {split!r}")
    build, smallest = _builder(task, split)
    draw = lambda n: build(_rng(seed, task, length, index), n, length)  # noqa: E731
    size = lambda n: sum(len(tokenizer.encode(part)) for part in draw(n)[:2])  # noqa: E731
    need = size(smallest)
    require(need <= length, f"length {length} is too short for {task}: its fixed part takes {need} tokens")
    n = _largest(lambda n: size(n) <= length, smallest, length)
    context, question, answers = draw(n)
    return {"task": task, "length": length, "index": index, "seed": seed, "context": context,
            "question": question, "answers": answers, "max_new_tokens": MAX_NEW_TOKENS[task]}


def _largest(fits: Callable[[int], bool], low: int, length: int) -> int:
    """The largest ``n >= low`` with ``fits(n)``, given ``fits(low)``: doubling, then
    bisection, keeping ``fits(low)`` and not ``fits(high)``."""
    high = max(2 * low, 16)
    while fits(high):
        low, high = high, 2 * high
        # Every unit takes at least one token, so this is reached only by a bug.
        require(high <= 64 * (length + 16), f"the haystack does not grow with its size (length {length})")
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low
