"""Training health: what stops a run at once, and what its summary flags.

A non-finite loss or gradient norm means every weight after that step is garbage: the
run stops at that step (:class:`TrainingHealthError`, naming backend, role and step)
rather than train on for hours. A reward that falls over the run is not an error (RL
is noisy) but usually a bug (a flipped loss sign, gradients carried over): the end of
the run compares the first and last quarter's mean reward (:func:`reward_trend`),
writes it to ``metrics.jsonl`` and says so on the console.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from rlcore.errors import RlcoreError

#: A reward counts as fallen when the last quarter's mean is below the first quarter's by
#: more than this (rewards of the built-in envs lie in [0, 1]).
REWARD_FALL = 0.05
#: Fewer steps than this say nothing about a trend.
MIN_TREND_STEPS = 4


class TrainingHealthError(RlcoreError):
    """A train step reported a non-finite loss or gradient norm.

    Attributes:
        backend: the policy backend.
        step: the GRPO step (1-based).
        metric: ``loss`` or ``grad_norm``.
    """

    def __init__(self, message: str, *, backend: str, step: int, metric: str) -> None:
        super().__init__(message)
        self.backend, self.step, self.metric = backend, step, metric


def check_train_health(train: dict[str, Any], *, backend: str, step: int) -> None:
    """Raise :class:`TrainingHealthError` if the step's loss or grad norm is not finite."""
    for metric in ("loss", "grad_norm"):
        value = train.get(metric)
        if isinstance(value, int | float) and not math.isfinite(value):
            raise TrainingHealthError(
                f"policy backend '{backend}' (role policy) reported {metric}={value} at step "
                f"{step}: the weights after this step are not usable, so the run stops here. "
                "Lower grpo.learning_rate or raise the precision (model.dtype=float32), and "
                "check the backend's loss for a division by zero tokens",
                backend=backend,
                step=step,
                metric=metric,
            )


def reward_trend(history: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """``health/reward_first`` and ``health/reward_last`` (mean reward of the first and
    last quarter of the steps) and ``health/reward_fell``; ``None`` for fewer than
    :data:`MIN_TREND_STEPS` steps."""
    rewards = [float(m["reward/mean"]) for m in history if "reward/mean" in m]
    if len(rewards) < MIN_TREND_STEPS:
        return None
    k = max(1, len(rewards) // 4)
    first, last = statistics.fmean(rewards[:k]), statistics.fmean(rewards[-k:])
    return {
        "health/reward_first": first,
        "health/reward_last": last,
        "health/reward_fell": last < first - REWARD_FALL,
    }


def trend_line(trend: dict[str, Any]) -> str:
    """One console line (rich markup) for :func:`reward_trend`'s record."""
    first, last = trend["health/reward_first"], trend["health/reward_last"]
    if trend["health/reward_fell"]:
        return (
            f"[yellow]warning: the reward fell over the run ({first:.3f} in the first quarter of "
            f"the steps, {last:.3f} in the last): check the policy's loss sign and that its "
            "gradients are reset every step (the conformance suite tests both)[/yellow]"
        )
    return f"reward: {first:.3f} in the first quarter of the steps, {last:.3f} in the last"
