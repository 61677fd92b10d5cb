"""RULER's scores: how many of the gold answers a prediction contains.

* :func:`string_match_all`: the fraction of the gold answers found in the prediction,
  ignoring case; RULER scores every synthetic task this way (all the needles, the whole
  variable chain, all the common or frequent words);
* :func:`string_match_part`: 1 if any gold answer is found; RULER uses it for its QA
  tasks, where any of several reference answers will do (not generated here).

Scores are fractions in [0, 1]; RULER prints them as percentages.
"""

from __future__ import annotations

import re
from typing import Callable, Sequence

from flsmem.harness.ruler.tasks import TASKS

__all__ = ["clean", "string_match_all", "string_match_part", "METRICS", "score"]


def clean(prediction: str) -> str:
    """The prediction as RULER reads it: control characters as line breaks, stripped."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction).strip()


def string_match_all(prediction: str, answers: Sequence[str]) -> float:
    """The fraction of ``answers`` that occur in ``prediction``, ignoring case."""
    found = prediction.lower()
    return sum(answer.lower() in found for answer in answers) / len(answers)


def string_match_part(prediction: str, answers: Sequence[str]) -> float:
    """1.0 if any of ``answers`` occurs in ``prediction``, ignoring case, else 0.0."""
    found = prediction.lower()
    return float(any(answer.lower() in found for answer in answers))


METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {task: string_match_all for task in TASKS}


def score(task: str, prediction: str, answers: Sequence[str]) -> float:
    """The score of ``prediction`` on a sample of ``task`` with gold ``answers``."""
    if task not in METRICS:
        raise ValueError(f"task must be one of {', '.join(METRICS)}, got {task!r}")
    if not answers:
        raise ValueError("answers must hold at least one gold answer")
    return METRICS[task](clean(prediction), answers)
