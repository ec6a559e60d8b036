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


def teaches(group: Sequence[Rollout]) -> bool:
    """Whether the group's rewards differ (else every advantage in it is zero); samples
    whose reward failed do not count."""
    known = [float(r["reward"]) for r in group if r.get("reward") is not None and not r.get("failed")]
    return len(known) > 1 and max(known) - min(known) > 1e-12


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
