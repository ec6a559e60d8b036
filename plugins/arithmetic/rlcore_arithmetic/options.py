"""``env.options`` of the ``arithmetic`` backend: plain data, imported by ``rlcore plugins``
and by the backend's own modules (never through the entry point)."""

from __future__ import annotations

from dataclasses import dataclass

from rlcore.config import bounded


@dataclass
class ArithmeticOptions:
    #: Largest operand in the prompts.
    max_operand: int = bounded(9, ge=1)
    #: Operators to draw from, e.g. "+-*".
    ops: str = "+"
    #: Seed of the prompt stream (step k uses seed + k).
    seed: int = bounded(0, ge=0)
