"""RULER samples as teacher-forced windows: the prompt and its gold answer in one window.

Greedy decoding (:mod:`.protocols`) is how RULER scores a model; it costs one step per
answer token after the prompt. Streaming the prompt and the gold answer together
through :func:`flsmem.harness.evaluate.evaluate_windows`, as the controlled tasks are,
costs one teacher-forced pass, batches any number of samples, and lets an estimator
learn from the stream (:mod:`flsmem.train.train_estimator`, ``flsmem shift``). A sample
counts as answered when the model's prediction is right at every token of its gold
answer: given the right prefix, greedy decoding would write that answer.

Every window holds exactly ``length + 1`` tokens: the prompt is made for the room the
answer leaves (:func:`.tasks.make_sample`), and the few tokens a whole haystack unit
cannot fill go before it as newlines.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from flsmem.harness.ruler.tasks import make_sample
from flsmem.validate import require

__all__ = ["ForcedBatch", "forced_window", "forced_batch", "fits"]

# Tokens the answer is first assumed to take; grown until the sample's answer fits.
_FIRST_GUESS = 8


@dataclasses.dataclass(frozen=True)
class ForcedBatch:
    """Teacher-forced RULER windows of one task.

    Attributes:
      task: the RULER task.
      tokens: ``[N, T + 1]`` int32; inputs ``tokens[:, :-1]``, targets ``tokens[:, 1:]``.
      answer: ``[N, T]`` bool over targets: the gold answer's tokens (the closing
        period left out).
    """

    task: str
    tokens: np.ndarray
    answer: np.ndarray

    def accuracy(self, hit: np.ndarray) -> np.ndarray:
        """Per-sample 1.0 where every answer token was predicted (``hit [N, T]``), else 0.0."""
        hit = np.asarray(hit)
        require(hit.shape == self.answer.shape,
                f"hit must have shape {self.answer.shape} (samples, targets), got {hit.shape}")
        return np.asarray([row[mask].all() for row, mask in zip(hit, self.answer)], np.float64)


def _encode(tokenizer, text: str) -> list[int]:
    return [int(t) for t in tokenizer.encode(text)]


def forced_window(task: str, length: int, index: int, tokenizer, seed: int = 0,
                  split: str = "test") -> tuple[np.ndarray, np.ndarray]:
    """One sample of ``task`` and its gold answer as a ``length + 1``-token window.

    Returns:
      ``(tokens [length + 1] int32, answer [length] bool)``, as one row of :class:`ForcedBatch`.

    Raises:
      ValueError: as :func:`.tasks.make_sample`, for example a length too short for the task.
    """
    pad = _encode(tokenizer, "\n")[-1:]
    room = _FIRST_GUESS
    while True:
        # The sample's answer depends on its prompt length, so the room is grown until
        # the answer of the sample made for it fits.
        sample = make_sample(task, length + 1 - room, index, tokenizer, seed=seed, split=split)
        answer = _encode(tokenizer, " " + ", ".join(sample["answers"]) + ".")
        if len(answer) <= room:
            break
        room = len(answer)
    prompt = _encode(tokenizer, sample["context"]) + _encode(tokenizer, sample["question"])
    tokens = pad * (length + 1 - len(prompt) - len(answer)) + prompt + answer
    mask = np.zeros(length, bool)
    # Answer token i of the window is target i - 1; the period is not scored.
    mask[length + 1 - len(answer) - 1:length - 1] = True
    return np.asarray(tokens, np.int32), mask


def forced_batch(task: str, length: int, count: int, tokenizer, seed: int = 0, split: str = "test",
                 first: int = 0) -> ForcedBatch:
    """Samples ``first .. first + count - 1`` of ``task`` as a :class:`ForcedBatch`."""
    require(isinstance(count, int) and count >= 1, f"count must be an int >= 1, got {count!r}")
    rows = [forced_window(task, length, index, tokenizer, seed=seed, split=split)
            for index in range(first, first + count)]
    return ForcedBatch(task, np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows]))


def fits(task: str, length: int, tokenizer) -> bool:
    """Whether ``task``'s fixed part and answer fit ``length`` tokens of ``tokenizer``."""
    try:
        forced_window(task, length, 0, tokenizer)
    except ValueError:
        return False
    return True
