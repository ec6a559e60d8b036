"""The task: ``a+b=`` prompts, rewards checked against the true answer.

The reward gives partial credit so that a tiny random model has a gradient to
follow: 0 for an answer that is not a number, 0.3 for any number, rising to 1.0
as the number approaches the true result.
"""

from __future__ import annotations

import operator
import random
import re
from dataclasses import dataclass

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_LEADING_INT = re.compile(r"^\s*(-?\d+)")


@dataclass(frozen=True)
class Prompt:
    """One prompt and what the reward needs to check an answer."""

    text: str
    answer: int


def make_prompts(n: int, *, seed: int, max_operand: int = 9, ops: str = "+") -> list[Prompt]:
    """``n`` prompts drawn from a seeded generator (the same seed gives the same prompts)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
        prompts.append(Prompt(f"{a}{op}{b}=", _OPS[op](a, b)))
    return prompts


def parse_answer(completion: str) -> int | None:
    """The integer the completion starts with, or None."""
    m = _LEADING_INT.match(completion)
    return int(m.group(1)) if m else None


def reward(prompt: Prompt, completion: str, *, scale: float = 10.0) -> float:
    """Partial credit in [0, 1]; exactly 1.0 only for the right answer."""
    got = parse_answer(completion)
    if got is None:
        return 0.0
    return 0.3 + 0.7 * max(0.0, 1.0 - abs(got - prompt.answer) / scale)
