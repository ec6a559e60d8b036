"""The loop's schedule, from ``grpo.max_staleness`` and what the backends declare.

``grpo.max_staleness`` (k) asks the loop to sample the rollouts of up to k steps ahead
while a step trains. Whether that is sound is the backends' to say: the policy declares
how stale a sample it still trains on correctly (``max_staleness``), the generation how
a refit reaches it while it serves (``inflight_refit``). :func:`plan_schedule` turns the
three into the plan's :class:`~rlcore.setup.plan.Schedule`, and refuses, before anything
starts, a k the backends or the placement cannot give.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rlcore.config import RunConfig
from rlcore.declarations import BETWEEN_CALLS, BackendDeclaration, InflightRefit
from rlcore.errors import ConfigError
from rlcore.setup.plan import Schedule

KEY = "grpo.max_staleness"


def plan_schedule(
    config: RunConfig,
    policies: Sequence[BackendDeclaration],
    generations: Sequence[tuple[BackendDeclaration, Mapping[str, Any]]],
) -> Schedule:
    """The schedule of a run whose policy groups run ``policies`` and whose generation
    groups run ``generations`` (each with its config view, :func:`rlcore.setup.planner.role_view`).

    Raises:
        ConfigError: naming ``grpo.max_staleness``, when k exceeds what a policy backend
            declares, or when k > 0 but the colocated roles hand the devices to each other
            each step (``placement.memory_handoff``), so nothing could overlap.
    """
    k = config.grpo.max_staleness
    policy = min(policies, key=lambda d: d.max_staleness)  # the strictest one binds
    if k > policy.max_staleness:
        declares = (
            "max_staleness 0: it does not train on stale samples"
            if not policy.max_staleness
            else f"max_staleness {policy.max_staleness}: it trains on samples up to "
            f"{policy.max_staleness} versions old"
        )
        raise ConfigError(
            f"config key '{KEY}' is {k}, but policy backend '{policy.name}' declares {declares}; "
            f"set {KEY} <= {policy.max_staleness} or use a policy backend that declares more",
            key=KEY,
        )
    sleepers = _handing_over(config, [*policies, *(d for d, _ in generations)])
    if k > 0 and sleepers:
        raise ConfigError(
            f"config key '{KEY}' is {k}, but placement.colocated and placement.memory_handoff "
            f"are true and {', '.join(sleepers)} declare{'s' if len(sleepers) == 1 else ''} "
            "memory_handoff: the roles take turns on the devices, so generation cannot run while "
            f"the policy trains; set placement.memory_handoff=false (both roles resident) or {KEY}=0",
            key=KEY,
        )
    generation = generations[0][0]
    landing, reason = _landing(generations)
    return Schedule(
        max_staleness=k,
        landing=landing.landing.value,
        token_versions=landing.token_versions,
        policy_max=policy.max_staleness,
        policy=policy.name,
        generation=generation.name,
        reason=reason,
        handoff=bool(sleepers),
    )


def _handing_over(config: RunConfig, declarations: Sequence[BackendDeclaration]) -> list[str]:
    """The backends that hand the devices over each step (colocated, ``placement.memory_handoff``
    on, and declared), as the session's handoff picks them: with any, the roles take turns."""
    placement = config.placement
    if not (placement.colocated and placement.memory_handoff):
        return []
    return sorted({d.name for d in declarations if d.memory_handoff})


def _landing(generations: Sequence[tuple[BackendDeclaration, Mapping[str, Any]]]) -> tuple[InflightRefit, str]:
    """The landing every generation group takes under its view, and why; groups that take
    different ones are scheduled as the one every backend has (between calls)."""
    chosen = [d.refit_landing(view) for d, view in generations]
    landing, decl = chosen[0], generations[0][0]
    if any(other != landing for other in chosen):
        return BETWEEN_CALLS, "the generation groups declare different landings"
    if landing.when:
        return landing, "when " + " and ".join(c.describe() for c in landing.when)
    if decl.inflight_refit and landing not in decl.inflight_refit:
        return landing, "no inflight_refit entry holds under this config"
    return landing, ""
