"""The reward of examples/dataset.yaml: checks the final answer of a math word problem.

A reward function of the ``dataset`` env backend (TRL's convention): it gets the
completions of one group and, as keyword arguments, the data's other columns (here
``answer``, one entry per completion), and returns one float per completion.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+")


def final_answer(completions: list[str], answer: list[int], **kwargs: object) -> list[float]:
    """1.0 for the right final answer (the last number of the completion); partial credit
    so that a small model has a gradient to follow: 0 without a number, 0.3 for any
    number, rising to 1.0 as it nears the answer."""
    return [_score(c, int(a)) for c, a in zip(completions, answer, strict=True)]


def _score(completion: str, answer: int) -> float:
    numbers = _NUMBER.findall(completion)
    if not numbers:
        return 0.0
    got = int(numbers[-1])
    return 0.3 + 0.7 * max(0.0, 1.0 - abs(got - answer) / 10)
