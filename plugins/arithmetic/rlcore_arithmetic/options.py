"""``env.options`` of the ``arithmetic`` backend: plain data, imported by ``rlcore plugins``
and by the backend's own modules (never through the entry point)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ArithmeticOptions:
    #: Largest operand in the prompts.
    max_operand: int = 9
    #: Operators to draw from, e.g. "+-*".
    ops: str = "+"
    #: Seed of the prompt stream (step k uses seed + k).
    seed: int = 0
