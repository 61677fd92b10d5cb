"""Controlled recall tasks embedded in real prose, for the regime map.

Each example is one window of ``length + 1`` bytes of Austen text (the same byte format
as :mod:`flsmem.models.data`) with short structured insertions:

* a *pair* ``=K7`` binds a key (an uppercase letter) to a value (a digit); a *pointer*
  ``=KQ`` binds it to another key (the chain task);
* a *query* ``=K7`` asks for the value of ``K``: written like the pair, but the digit
  after ``=K`` is now the answer the model must produce;
* a *repeat* ``=@7`` asks for the model's own previous answer, whatever it was (``@``
  stands for "the key you were last asked").

``=`` and ``@`` never occur in the books, so queries cannot be confused with prose.
The format is what a tiny byte model learns in minutes: a two-token cue that matches
exactly (``=K``, with a key whose embedding is already well trained; the symbols absent
from the books all share one learnt embedding) and a one-token answer. Longer keys and
multi-digit values, which need a match over several tokens, were still near chance
after a thousand steps.

Four tasks:

* ``passkey``: one pair at a random depth of the window, queried at the end;
* ``recall`` (multi-query associative recall): six pairs near the start, three of them
  queried about a third of the way in, and the same three queried again, in another
  order, at the end, after a gap of prose;
* ``repeat`` (endogenous reuse): six pairs near the start, one of them queried a third
  of the way in, and at the end a repeat query that asks for *that* answer again. What
  must survive the gap is decided by the model's earlier output: the answer it gave
  (or the one pair it used), not the five pairs it never needed;
* ``chain`` (endogenous reuse through a lookup): three *pointers* ``=KQ`` (key ``K``
  points to key ``Q``) and three pairs ``=Q7``. A third of the way in, a pointer is
  queried; the model answers the key it points to and then looks that key up itself
  (``=KQ =Q7``: the ``Q`` and the ``7`` are its answers). At the end the same chain is
  followed again and the digit is scored. Which digit pair must survive is decided by
  the model's own earlier answer, and unlike ``repeat`` the reuse reads the pair that
  the correct earlier prediction read (or the early answer, which has the same form).

The last answer of every task ends the window, so the gap between an item's use and its
reuse is most of the window. Evaluation examples are cut from held-out books; training
examples from the training split (see :data:`flsmem.models.data.SPLITS`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import numpy as np

__all__ = ["TASKS", "KEY_LETTERS", "QUERY", "REPEAT", "SYMBOLS", "EARLY", "LATE", "TaskBatch", "make_tasks", "mixed_tasks"]

TASKS = ("passkey", "recall", "repeat", "chain")
KEY_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
QUERY = "="
REPEAT = "@"  # the key of a repeat query: "your previous answer"
# The symbols the tasks add to the text; neither occurs in the books.
SYMBOLS = "=@"
# Codes of the ``answer`` mask: which targets are answers, and of which kind.
EARLY, LATE = 1, 2
PAIRS = 6
QUERIES = 3


@dataclasses.dataclass(frozen=True)
class TaskBatch:
    """Examples of one task.

    Attributes:
      kind: the task's name (one of :data:`TASKS`).
      tokens: ``[N, T + 1]`` int32 bytes; inputs are ``tokens[:, :-1]``, targets
        ``tokens[:, 1:]``.
      answer: ``[N, T]`` int8 over *targets*: :data:`EARLY` for the digits of a first
        query, :data:`LATE` for those of the queries after the gap (the ones scored),
        0 for everything else.
      group: ``[N, T]`` int32 over targets: which answer a digit belongs to (digits of
        one query share a group, numbered within the example), -1 elsewhere.
    """

    kind: str
    tokens: np.ndarray
    answer: np.ndarray
    group: np.ndarray

    def accuracy(self, hit: np.ndarray, code: int = LATE) -> np.ndarray:
        """Per-example fraction of the answers of kind ``code`` whose every digit was hit.

        Args:
          hit: ``[N, T]`` bool over targets: the prediction at that target was right.
          code: :data:`LATE` (scored after the gap) or :data:`EARLY`.
        """
        hit = np.asarray(hit)
        if hit.shape != self.answer.shape:
            raise ValueError(f"hit must have shape {self.answer.shape} (examples, targets), got {hit.shape}")
        scores = []
        for row_hit, row_answer, row_group in zip(hit, self.answer, self.group):
            groups = np.unique(row_group[row_answer == code])
            if groups.size == 0:
                raise ValueError(f"an example of {self.kind!r} has no answers of code {code}")
            scores.append(np.mean([row_hit[row_group == g].all() for g in groups]))
        return np.asarray(scores)


def _digits(rng: np.random.Generator, n: int) -> str:
    return "".join(str(d) for d in rng.integers(0, 10, size=n))


_Segments = list[tuple[str, int]]


class _Insertions(NamedTuple):
    """What a task inserts into the prose: segments of ``(text, code)``, code 0 for
    context and :data:`EARLY`/:data:`LATE` for an answer's digits.

    Attributes:
      head: the pairs, at ``depth`` of the window.
      depth: where the head goes, as a fraction of the window.
      middle: the first queries, about a third of the way in; empty for none.
      tail: the queries after the gap, which end the window.
    """

    head: _Segments
    depth: float
    middle: _Segments
    tail: _Segments


def _pairs_head(keys: list[str], values: list[str]) -> _Segments:
    return [(" " + " ".join(QUERY + k + v for k, v in zip(keys, values)) + " ", 0)]


def _chain_pairs(keys: list[str], rng: np.random.Generator):
    """The chain's pairs: three pointers (key -> another key) and the three pairs they
    point to, in random order. Returns ``(pointers, points_to, values, head segments)``."""
    pointers, targets = keys[:3], keys[3:]
    points_to = dict(zip(pointers, rng.permutation(targets)))
    values = {k: _digits(rng, 1) for k in targets}
    pairs = [QUERY + k + points_to[k] for k in pointers] + [QUERY + k + values[k] for k in targets]
    head = [(" " + " ".join(pairs[i] for i in rng.permutation(PAIRS)) + " ", 0)]
    return pointers, points_to, values, head


def _passkey(keys: list[str], rng: np.random.Generator) -> _Insertions:
    value = _digits(rng, 1)
    depth = rng.uniform(0.05, 0.55)
    return _Insertions([(f" {QUERY}{keys[0]}{value} ", 0)], depth, [], [(f" {QUERY}{keys[0]}", 0), (value, LATE)])


def _asked_early(keys: list[str], rng: np.random.Generator, queries: int):
    """Six pairs near the start and ``queries`` of them asked a third of the way in.
    Returns ``(values, asked, insertions without a tail)``."""
    values = [_digits(rng, 1) for _ in keys]
    depth = rng.uniform(0.02, 0.1)
    asked = rng.choice(PAIRS, size=queries, replace=False)
    middle = []
    for i in asked:
        middle += [(f" {QUERY}{keys[i]}", 0), (values[i], EARLY)]
    middle.append((" ", 0))
    return values, asked, _Insertions(_pairs_head(keys, values), depth, middle, [])


def _recall(keys: list[str], rng: np.random.Generator) -> _Insertions:
    values, asked, insertions = _asked_early(keys, rng, QUERIES)
    tail = []
    for i in rng.permutation(asked):
        tail += [(f" {QUERY}{keys[i]}", 0), (values[i], LATE)]
    return insertions._replace(tail=tail)


def _repeat(keys: list[str], rng: np.random.Generator) -> _Insertions:
    values, asked, insertions = _asked_early(keys, rng, 1)
    return insertions._replace(tail=[(f" {QUERY}{REPEAT}", 0), (values[asked[0]], LATE)])


def _chain(keys: list[str], rng: np.random.Generator) -> _Insertions:
    pointers, points_to, values, head = _chain_pairs(keys, rng)
    depth = rng.uniform(0.02, 0.1)
    start_key = pointers[rng.integers(3)]
    target = points_to[start_key]
    # The model answers the pointer, then looks up its own answer.
    middle = [(f" {QUERY}{start_key}", 0), (target, EARLY), (f" {QUERY}", 0), (target, EARLY),
              (values[target], EARLY), (" ", 0)]
    tail = [(f" {QUERY}{start_key}{target} {QUERY}{target}", 0), (values[target], LATE)]
    return _Insertions(head, depth, middle, tail)


def _chain_drill(keys: list[str], rng: np.random.Generator) -> _Insertions:
    """Training only: the chain's pairs, every pointer followed right away."""
    pointers, points_to, values, head = _chain_pairs(keys, rng)
    depth = rng.uniform(0.0, 0.2)
    tail = []
    for k in rng.permutation(pointers):
        tail += [(f" {QUERY}{k}", 0), (points_to[k], LATE), (f" {QUERY}", 0), (points_to[k], LATE),
                 (values[points_to[k]], LATE)]
    return _Insertions(head, depth, [], tail)


def _drill(keys: list[str], rng: np.random.Generator) -> _Insertions:
    """Training only: every pair queried right away, in another order; many lookups per
    window teach the lookup faster than the sparse tasks alone."""
    values = [_digits(rng, 1) for _ in keys]
    depth = rng.uniform(0.0, 0.2)
    tail = []
    for i in rng.permutation(PAIRS):
        tail += [(f" {QUERY}{keys[i]}", 0), (values[i], LATE)]
    return _Insertions(_pairs_head(keys, values), depth, [], tail)


# Each family draws from the generator in its own fixed order, which the examples depend on.
_FAMILIES: dict[str, Callable[[list[str], np.random.Generator], _Insertions]] = {
    "passkey": _passkey, "recall": _recall, "repeat": _repeat, "chain": _chain,
    "chain_drill": _chain_drill, "drill": _drill,
}


def _layout(insertions: _Insertions, text: np.ndarray, length: int, rng: np.random.Generator) -> list:
    """The window's pieces in order: filler prose cut around the head, middle and tail."""
    head, depth, middle, tail = insertions
    inserted = sum(len(s) for s, _ in head + middle + tail)
    filler_total = length + 1 - inserted
    start = rng.integers(0, text.size - filler_total)
    filler = text[start:start + filler_total]
    cut1 = int(depth * (length + 1))
    cut2 = int(rng.uniform(0.28, 0.38) * (length + 1)) - sum(len(s) for s, _ in head) if middle else cut1
    cut2 = max(cut2, cut1)
    return [(filler[:cut1], 0)] + head + [(filler[cut1:cut2], 0)] + middle + [(filler[cut2:], 0)] + tail


def _encode(pieces: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(tokens, codes, groups)`` per token of the pieces (prose arrays or ASCII strings)."""
    tokens, codes, groups = [], [], []
    group = -1
    for piece, code in pieces:
        ids = piece if isinstance(piece, np.ndarray) else np.frombuffer(piece.encode("ascii"), np.uint8)
        tokens.append(ids.astype(np.int32))
        if code:
            group += 1
        codes.append(np.full(len(ids), code, np.int8))
        groups.append(np.full(len(ids), group if code else -1, np.int32))
    return np.concatenate(tokens), np.concatenate(codes), np.concatenate(groups)


def _example(kind: str, text: np.ndarray, length: int, rng: np.random.Generator):
    """One window: filler text with the task's insertions, and its answer codes."""
    keys = list(rng.choice(list(KEY_LETTERS), size=PAIRS, replace=False))
    if kind not in _FAMILIES:
        raise ValueError(f"kind must be one of {TASKS}, got {kind!r}")
    insertions = _FAMILIES[kind](keys, rng)
    tokens, codes, groups = _encode(_layout(insertions, text, length, rng))
    assert tokens.size == length + 1, (kind, tokens.size)
    # Codes are per token; the mask is over targets (token j is the target of input j - 1).
    return tokens, codes[1:], groups[1:]


def _checked(text, count: int, length: int) -> np.ndarray:
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if length < 128:
        raise ValueError(f"length must be >= 128 to leave room for prose around the task, got {length}")
    text = np.asarray(text)
    if text.ndim != 1 or text.size < 2 * length:
        raise ValueError(f"text must be 1-D byte ids with at least {2 * length} entries, got shape {text.shape}")
    return text


def make_tasks(kind: str, text: np.ndarray, count: int, length: int, seed: int) -> TaskBatch:
    """``count`` examples of task ``kind`` cut from ``text`` (1-D byte ids), reproducibly.

    Args:
      kind: one of :data:`TASKS`.
      text: byte ids of the prose to embed the task in.
      count: examples (N).
      length: input length T; each example has ``T + 1`` tokens.
      seed: the examples are a function of ``(kind, text, count, length, seed)``.
    """
    if kind not in TASKS:
        raise ValueError(f"kind must be one of {TASKS}, got {kind!r}")
    text = _checked(text, count, length)
    rng = np.random.default_rng([seed, TASKS.index(kind)])
    rows = [_example(kind, text, length, rng) for _ in range(count)]
    tokens, answer, group = (np.stack(x) for x in zip(*rows))
    return TaskBatch(kind, tokens, answer, group)


def mixed_tasks(text: np.ndarray, count: int, length: int, rng: np.random.Generator,
                kinds: tuple[str, ...] = TASKS) -> tuple[np.ndarray, np.ndarray]:
    """A training batch: ``count`` examples, half of them drawn uniformly from ``kinds``,
    half *drills* (six pairs, each queried right after them: many lookups per window,
    which teach the lookup much faster than the tasks alone; with the chain among
    ``kinds``, half the drills are the chain's, every pointer followed right away).

    Returns:
      ``(tokens [N, T + 1], answer [N, T])`` with answer codes as in :class:`TaskBatch`.
    """
    text = _checked(text, count, length)
    unknown = sorted(set(kinds) - set(TASKS))
    if not kinds or unknown:
        raise ValueError(f"kinds must be among {TASKS}, got {kinds}")
    def draw() -> str:
        if rng.random() < 0.5:
            return kinds[rng.integers(len(kinds))]
        # The chain's own drill only joins when the chain does (older mixes draw as before).
        return "chain_drill" if "chain" in kinds and rng.random() < 0.5 else "drill"

    drawn = [draw() for _ in range(count)]
    rows = [_example(kind, text, length, rng) for kind in drawn]
    tokens, answer, _ = (np.stack(x) for x in zip(*rows))
    return tokens, answer
