"""The controlled recall tasks: layout, answers, accuracy, and bad input."""

import hashlib
import re

import numpy as np
import pytest

from flsmem.models.data import ByteTokenizer, load_split
from flsmem.models.tasks import EARLY, LATE, QUERY, REPEAT, TASKS, make_tasks, mixed_tasks

TOKENIZER = ByteTokenizer()
TEXT = TOKENIZER.encode(load_split("validation"))


def answers(batch, row, code):
    """The answer strings of one example, in order."""
    target = batch.tokens[row, 1:]
    groups = np.unique(batch.group[row][batch.answer[row] == code])
    return [TOKENIZER.decode(target[batch.group[row] == g]) for g in groups]


@pytest.mark.parametrize("kind", TASKS)
def test_layout_and_answers(kind):
    batch = make_tasks(kind, TEXT, 8, 256, seed=3)
    assert batch.tokens.shape == (8, 257) and batch.answer.shape == batch.group.shape == (8, 256)
    for row in range(8):
        text = TOKENIZER.decode(batch.tokens[row])
        late = answers(batch, row, LATE)
        assert text.endswith(late[-1])  # the window ends with the last answer
        # Pairs and queries are both written "=K7"; the pairs come first.
        found = re.findall(f"{QUERY}([A-Z{REPEAT}])([0-9]+)", text)
        if kind == "passkey":
            (key, value), query = found
            assert query == (key, value) and late == [value] and len(value) == 1
        elif kind == "recall":
            pairs, asked = dict(found[:6]), found[6:]
            assert len(pairs) == 6 and len(asked) == 6 and all(pairs[k] == v for k, v in asked)
            assert answers(batch, row, EARLY) == [v for _, v in asked[:3]] and late == [v for _, v in asked[3:]]
            assert sorted(k for k, _ in asked[:3]) == sorted(k for k, _ in asked[3:])
        elif kind == "chain":
            # Three pointers "=KQ" and three digit pairs; the early query follows one pointer
            # and looks up the model's own answer, the late one does it again.
            pointers = re.findall(f"{QUERY}([A-Z])([A-Z])", text)
            links, pairs = dict(pointers[:3]), dict(found[:3])
            assert len(pointers) == len(found) == 5 and len(links) == len(pairs) == 3
            (start, target), (key, value) = pointers[3], found[3]
            assert links[start] == target == key and pairs[key] == value
            assert pointers[4] == pointers[3] and found[4] == found[3]
            assert answers(batch, row, EARLY) == [target, target, value] and late == [value]
        else:
            pairs, (key, value), repeat = dict(found[:6]), found[6], found[7]
            assert len(found) == 8 and pairs[key] == value and answers(batch, row, EARLY) == [value]
            assert repeat == (REPEAT, value) and late == [value] and text.endswith(f"{QUERY}{REPEAT}{value}")
        # The reuse comes after a gap: the late answer is in the last 3% of the window,
        # the early ones before 45% of it.
        positions = np.flatnonzero(batch.answer[row])
        assert positions[batch.answer[row][positions] == LATE].min() > 0.9 * 256
        if kind != "passkey":
            assert positions[batch.answer[row][positions] == EARLY].max() < 0.45 * 256


def test_reproducible_and_seeded():
    a, b = make_tasks("recall", TEXT, 4, 200, seed=1), make_tasks("recall", TEXT, 4, 200, seed=1)
    c = make_tasks("recall", TEXT, 4, 200, seed=2)
    assert np.array_equal(a.tokens, b.tokens) and not np.array_equal(a.tokens, c.tokens)


def test_accuracy_counts_whole_answers():
    batch = make_tasks("recall", TEXT, 2, 200, seed=0)
    hit = batch.answer == LATE
    assert batch.accuracy(hit).tolist() == [1.0, 1.0]
    # One wrong digit in one of the three late answers of example 0 costs a third.
    first_late = np.flatnonzero(batch.answer[0] == LATE)[0]
    hit[0, first_late] = False
    assert batch.accuracy(hit).tolist() == pytest.approx([2 / 3, 1.0])
    assert batch.accuracy(batch.answer == EARLY, EARLY).tolist() == [1.0, 1.0]


def test_mixed_batch():
    tokens, answer = mixed_tasks(TEXT, 6, 128, np.random.default_rng(0))
    assert tokens.shape == (6, 129) and answer.shape == (6, 128)
    assert ((answer == LATE).sum(axis=1) >= 1).all()
    # A mix without the chain draws exactly what it drew before the chain existed (the
    # fingerprint of this batch then), so the shipped checkpoints' commands still hold.
    tokens, answer = mixed_tasks(TEXT, 6, 128, np.random.default_rng(0), ("passkey", "recall", "repeat"))
    digest = hashlib.sha256(tokens.astype(np.int32).tobytes() + answer.astype(np.int8).tobytes()).hexdigest()
    assert digest[:16] == "48a455c9239c752c"
    with pytest.raises(ValueError, match="kinds must be among"):
        mixed_tasks(TEXT, 2, 128, np.random.default_rng(0), ("needle",))


def test_bad_input():
    with pytest.raises(ValueError, match="kind must be one of"):
        make_tasks("needle", TEXT, 1, 256, seed=0)
    with pytest.raises(ValueError, match="count must be >= 1"):
        make_tasks("recall", TEXT, 0, 256, seed=0)
    with pytest.raises(ValueError, match="length must be >= 128"):
        make_tasks("recall", TEXT, 1, 64, seed=0)
    with pytest.raises(ValueError, match="text must be 1-D"):
        make_tasks("recall", TEXT[:100], 1, 256, seed=0)
    batch = make_tasks("recall", TEXT, 2, 200, seed=0)
    with pytest.raises(ValueError, match="hit must have shape"):
        batch.accuracy(np.ones((2, 10), bool))


def test_mixed_batch_bad_input():
    with pytest.raises(ValueError, match="count must be >= 1"):
        mixed_tasks(TEXT, 0, 128, np.random.default_rng(0))
    with pytest.raises(ValueError, match="length must be >= 128"):
        mixed_tasks(TEXT, 2, 100, np.random.default_rng(0))
