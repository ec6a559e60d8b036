"""The loop's schedule: ``grpo.max_staleness`` against the declarations and the placement,
decided and refused before anything starts (nothing is started here)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from rlcore.config import load_config
from rlcore.declarations import BackendDeclaration, Condition, InflightRefit, RefitLanding, Role
from rlcore.errors import ConfigError
from rlcore.setup.planner import Group, build_plan, plan_groups, role_view

P, G = Role.POLICY, Role.GENERATION
REPO = Path(__file__).resolve().parents[2]


@dataclasses.dataclass
class ServerOptions:
    serve_openai: bool = False


trainer = BackendDeclaration(name="trainer", roles={P}, send_transports={"disk"}, max_staleness=4)
strict = BackendDeclaration(name="strict", roles={P}, send_transports={"disk"})
engine = BackendDeclaration(name="engine", roles={G}, receive_transports={"disk"})
server = BackendDeclaration(
    name="server",
    roles={G},
    receive_transports={"disk"},
    options=ServerOptions,
    inflight_refit=(
        InflightRefit(RefitLanding.PAUSE, token_versions=True, when=(Condition("options.serve_openai", True),)),
    ),
)
sleepy = dataclasses.replace(engine, name="sleepy", memory_handoff=True)


def plan_for(policy: BackendDeclaration, generation: BackendDeclaration, *overrides: str):
    config = load_config(None, [f"policy.backend={policy.name}", f"generation.backend={generation.name}", *overrides])
    return build_plan(config, {P: policy, G: generation}, accelerator="cpu")


def test_max_staleness_0_is_the_synchronous_loop() -> None:
    schedule = plan_for(trainer, engine).schedule
    assert schedule is not None and not schedule.asynchronous and schedule.max_staleness == 0
    assert schedule.describe() == (
        "schedule: synchronous (grpo.max_staleness 0): generation waits through each train step "
        "and refit; trainer allows grpo.max_staleness up to 4"
    )
    assert "allows" not in plan_for(strict, engine).schedule.describe()


def test_max_staleness_1_runs_ahead_and_refits_land_between_calls_by_default() -> None:
    plan = plan_for(trainer, engine, "grpo.max_staleness=1")
    schedule = plan.schedule
    assert schedule.asynchronous and schedule.landing == "between_calls" and not schedule.token_versions
    assert schedule.describe() == (
        "schedule: asynchronous, grpo.max_staleness 1 (trainer trains on samples up to 4 versions "
        "old); refits land between the engine's calls (engine)"
    )
    assert plan.to_dict()["schedule"] == {
        "max_staleness": 1, "asynchronous": True, "landing": "between_calls", "token_versions": False,
        "policy_max": 4, "policy": "trainer", "generation": "engine", "reason": "", "handoff": False,
    }


def test_the_landing_is_the_generations_under_its_config() -> None:
    paused = plan_for(trainer, server, "grpo.max_staleness=2", "generation.options.serve_openai=true").schedule
    assert (paused.landing, paused.token_versions) == ("pause", True)
    assert paused.describe().endswith(
        "refits land while the engine pauses its requests in flight "
        "(server: when options.serve_openai == True), per-token versions"
    )
    waits = plan_for(trainer, server, "grpo.max_staleness=2").schedule
    assert (waits.landing, waits.token_versions) == ("between_calls", False)
    assert waits.reason == "no inflight_refit entry holds under this config"


def test_generation_groups_that_land_differently_are_scheduled_between_calls() -> None:
    config = load_config(None, ["policy.backend=trainer", "generation.backend=server", "grpo.max_staleness=1",
                                "generation.options.serve_openai=true"])
    view = role_view(config, G, server)
    groups = [
        Group("init:policy", P, trainer, role_view(config, P, trainer)),
        Group("init:generation/0", G, server, view),
        Group("init:generation/1", G, engine, role_view(config, G, engine)),
    ]
    schedule = plan_groups(config, groups, accelerator="cpu").schedule
    assert schedule.landing == "between_calls" and "different landings" in schedule.reason
    same = plan_groups(config, [groups[0], groups[1], dataclasses.replace(groups[1], task="init:generation/1")],
                       accelerator="cpu").schedule
    assert same.landing == "pause"


@pytest.mark.parametrize(
    ("policy", "k", "words"),
    [
        (strict, 1, "policy backend 'strict' declares max_staleness 0: it does not train on stale samples; "
                    "set grpo.max_staleness <= 0 or use a policy backend that declares more"),
        (trainer, 5, "policy backend 'trainer' declares max_staleness 4: it trains on samples up to 4 "
                     "versions old; set grpo.max_staleness <= 4"),
    ],
)
def test_more_staleness_than_the_policy_declares_is_refused(policy: BackendDeclaration, k: int, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        plan_for(policy, engine, f"grpo.max_staleness={k}")
    assert info.value.key == "grpo.max_staleness"
    assert f"config key 'grpo.max_staleness' is {k}, but {words}" in str(info.value)
    assert plan_for(policy, engine, f"grpo.max_staleness={policy.max_staleness}").schedule is not None


def test_running_ahead_with_the_colocated_roles_taking_turns_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        plan_for(trainer, sleepy, "grpo.max_staleness=1", "placement.colocated=true")
    assert info.value.key == "grpo.max_staleness"
    message = str(info.value)
    assert "sleepy declares memory_handoff: the roles take turns on the devices" in message
    assert "set placement.memory_handoff=false (both roles resident) or grpo.max_staleness=0" in message
    # Both roles resident, not colocated, no backend that hands over, or k = 0: it plans.
    assert plan_for(trainer, sleepy, "grpo.max_staleness=1", "placement.colocated=true",
                    "placement.memory_handoff=false").schedule.asynchronous
    assert plan_for(trainer, sleepy, "grpo.max_staleness=1").schedule.asynchronous
    assert plan_for(trainer, engine, "grpo.max_staleness=1", "placement.colocated=true").schedule.asynchronous
    taking_turns = plan_for(trainer, sleepy, "placement.colocated=true").schedule
    assert not taking_turns.asynchronous and taking_turns.handoff
    assert taking_turns.describe().endswith(
        "trainer allows grpo.max_staleness up to 4 with placement.memory_handoff=false"
    )


def test_a_plan_given_to_prepare_gets_the_schedule_and_its_checks() -> None:
    pytest.importorskip("rlcore_fsdp")
    pytest.importorskip("rlcore_vllm")
    from rlcore.setup.prepared import prepare
    from rlcore.setup.registry import load_registry

    registry = load_registry(None)
    example = str(REPO / "examples" / "quickstart.yaml")
    bare = dataclasses.replace(prepare(load_config(example, []), registry).plan, schedule=None)
    schedule = prepare(load_config(example, ["grpo.max_staleness=2"]), registry, plan=bare).plan.schedule
    assert schedule is not None and schedule.max_staleness == 2 and schedule.policy == "fsdp"
    with pytest.raises(ConfigError, match="'grpo.max_staleness' is 9, but policy backend 'fsdp' declares max_staleness 8"):
        prepare(load_config(example, ["grpo.max_staleness=9"]), registry, plan=bare)
