"""Dynamic sampling (DAPO): a group whose rewards are all equal has zero advantage and
teaches nothing, so it is dropped and more prompts are drawn until the step has
``grpo.prompts_per_step`` groups that do teach, within ``grpo.dynamic_sampling_max_draws``
extra calls of the env (``grpo.dynamic_sampling``).

Extra draws ask the env for the same step with ``RolloutRequest.draw`` 1, 2, ...; an env
that gives other prompts for each draw declares ``extra_draws`` (contract 2.5), and the
run is refused otherwise. When the draws run out first, the step trains on the groups that
teach (fewer than asked); when none does, on the first draw's groups (their advantage is
zero: the step changes nothing, as without dynamic sampling).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rlcore.handles import Rollout


@dataclass(frozen=True)
class Drawn:
    """A step's groups after dynamic sampling, and what it took.

    Attributes:
        groups: the groups to train on.
        dropped: groups of equal rewards left out.
        extra_draws: env calls beyond the step's first.
        short: groups fewer than asked for (the draws ran out).
    """

    groups: list[list[Rollout]]
    dropped: int
    extra_draws: int
    short: int

    def metrics(self) -> dict[str, float]:
        """The step's ``sampling/*`` figures."""
        return {
            "sampling/dropped_groups": float(self.dropped),
            "sampling/extra_draws": float(self.extra_draws),
            "sampling/short_groups": float(self.short),
        }


#: A group whose rewards' standard deviation is not above this carries no signal: GRPO gives
#: every sample in it a zero advantage (:func:`rlcore.app.grpo.group_advantages`).
SIGNAL_EPS = 1e-6


def has_signal(rewards: Sequence[float], failed: Sequence[bool] | None = None, eps: float = SIGNAL_EPS) -> bool:
    """Whether a group's rewards spread enough to give any advantage; failed samples do not count.
    The one definition the advantages, dynamic sampling and ``reward/zero_variance_groups`` share."""
    kept = [float(r) for r, f in zip(rewards, failed or [False] * len(rewards), strict=True) if not f]
    return len(kept) > 1 and statistics.pstdev(kept) > eps


def teaches(group: Sequence[Rollout]) -> bool:
    """Whether the group gets any nonzero advantage (:func:`has_signal` of its rewards)."""
    return has_signal([r.get("reward") or 0.0 for r in group], [bool(r.get("failed")) or r.get("reward") is None for r in group])


def draw_teaching_groups(
    collect: Callable[[int], list[list[Rollout]]], want: int, max_draws: int
) -> Drawn:
    """``collect(draw)`` (draw 0 first) until ``want`` groups teach or ``max_draws`` extra
    draws are spent; the first ``want`` that teach, in the order drawn."""
    first = collect(0)
    kept = [g for g in first if teaches(g)]
    dropped, draws = len(first) - len(kept), 0
    while len(kept) < want and draws < max_draws:
        draws += 1
        more = collect(draws)
        good = [g for g in more if teaches(g)]
        dropped += len(more) - len(good)
        kept += good
    if not kept:
        return Drawn(first, dropped, draws, 0)
    return Drawn(kept[:want], dropped, draws, max(0, want - len(kept)))
