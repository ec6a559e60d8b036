"""One step's rewards: every reward function called once per group in the reward pool,
each result checked, the weighted sum per completion, failures named.

A call scores one group (the completions of one prompt), so a group-level function (one
that ranks or compares the group's completions) sees exactly one whole group. What a
failure means is ``env.options.on_reward_error``'s: ``fail`` raises :class:`RewardError`
naming the function and the row; ``skip`` returns the failure beside the scores, for the
env to mark its samples failed. A function that raised is shown with its own traceback
frames (file, line), under the error or the first warning that names it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlcore.errors import RlcoreError
from rlcore_dataset.pool import Call, Outcome, RewardPool, finite
from rlcore_dataset.rewards import RewardSpec

log = logging.getLogger(__name__)


class RewardError(RlcoreError):
    """A reward function raised, hung, returned the wrong count or a non-finite value."""


@dataclass(frozen=True)
class GroupInput:
    """What one group's reward calls take: its data row and completion texts."""

    row: int
    prompt: Any
    columns: dict[str, Any]
    completions: list[str]
    #: Where the row is, for people (``prompts.jsonl line 22``); empty: its index.
    origin: str = ""

    def arguments(self) -> dict[str, Any]:
        """TRL's keyword arguments: one entry per completion in each list."""
        n = len(self.completions)
        return {
            **{k: [v] * n for k, v in self.columns.items()},
            "completions": list(self.completions),
            "prompts": [self.prompt] * n,
        }


@dataclass
class GroupScores:
    """One group's rewards, and why each sample failed (None: scored); ``trace``: the
    traceback of the user's code under the first failure that raised (``""``: none)."""

    rewards: list[float]
    failed: list[str | None]
    trace: str = ""

    def error(self) -> str | None:
        """The first failure with its traceback (:func:`with_trace`), or None."""
        first = next((f for f in self.failed if f is not None), None)
        return None if first is None else with_trace(first, self.trace)


def with_trace(message: str, trace: str) -> str:
    """``message`` and, below it, the user's traceback frames (``""``: none)."""
    if not trace:
        return message
    return f"{message}\nthe reward function's traceback, its own code (most recent call last):\n{trace}"


def score_groups(
    pool: RewardPool, specs: Sequence[RewardSpec], groups: Sequence[GroupInput], *, on_error: str,
    shown: set[str] | None = None,
) -> list[GroupScores]:
    """Every group scored by every function (all calls at once, across the pool). A
    traceback is shown with the warning once per ``shown`` (the tracebacks shown so far, kept
    by the caller across steps; None: always)."""
    calls = [Call(spec.spec, g.arguments()) for g in groups for spec in specs]
    outcomes = pool.run(calls)
    out = []
    for gi, g in enumerate(groups):
        n = len(g.completions)
        scores = GroupScores([0.0] * n, [None] * n)
        for f, spec in enumerate(specs):
            _add(scores, spec, g, outcomes[gi * len(specs) + f], on_error)
        out.append(scores)
    _warn_once(out, shown)
    return out


def _warn_once(scored: Sequence[GroupScores], shown: set[str] | None) -> None:
    """One warning for every sample left out of a call's groups, not one per sample; the
    traceback of the first, unless ``shown`` has it."""
    reasons = [f for g in scored for f in g.failed if f is not None]
    if reasons:
        more = f" ({len(reasons) - 1} more like it in these groups)" if len(reasons) > 1 else ""
        trace = next(g.trace for g in scored if any(f is not None for f in g.failed))
        if shown is not None and trace in shown:
            trace = ""  # shown with an earlier warning
        elif shown is not None:
            shown.add(trace)
        log.warning(
            "%d sample(s) left out of their group's advantage (env.options.on_reward_error=skip): %s",
            len(reasons), with_trace(reasons[0] + more, trace),
        )


def _add(scores: GroupScores, spec: RewardSpec, g: GroupInput, got: Outcome, on_error: str) -> None:
    n = len(g.completions)
    at = g.origin or f"row {g.row} (counted from 0)"
    where = f"reward function {spec.name!r} ({spec.spec}) on {at} of env.options.data"
    failed: dict[int, str] = {}
    if got.error is not None:
        failed = dict.fromkeys(range(n), f"{where}: {got.error}")
    elif got.scores is None or len(got.scores) != n:
        count = len(got.scores) if got.scores is not None else 0
        failed = dict.fromkeys(range(n), f"{where}: returned {count} scores for {n} completions")
    else:
        for j, s in enumerate(got.scores):
            if finite([s]) is not None:
                failed[j] = f"{where}: returned {s} for completion {j}, not a finite float"
    if failed and on_error == "fail":
        first = next(iter(failed.values()))
        raise RewardError(
            with_trace(f"{first} (env.options.on_reward_error=skip leaves such samples out instead)", got.trace)
        )
    if failed and not any(scores.failed):
        scores.trace = got.trace
    for j in range(n):
        if j in failed:
            if scores.failed[j] is None:
                scores.failed[j] = failed[j]
        elif got.scores is not None:
            scores.rewards[j] += spec.weight * got.scores[j]
