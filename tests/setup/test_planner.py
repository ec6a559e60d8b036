"""Table-driven tests of the planner's rules (the module doc of rlcore.setup.planner).

The declarations here are test data shaped like the real backends' (the real
plugins' own tests check that their declarations plan the same way).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from rlcore.config import load_config
from rlcore.declarations import (
    Artifact,
    BackendDeclaration,
    Condition,
    Need,
    OverlapSafety,
    Role,
)
from rlcore.errors import ConfigError, PlanError
from rlcore.lora import LoraOptions
from rlcore.setup.planner import build_plan

P, G, E = Role.POLICY, Role.GENERATION, Role.ENV
CKPT = "megatron.checkpoint"

megatron = BackendDeclaration(
    name="megatron",
    roles={P, G},
    overlap=OverlapSafety(non_colocated=True, colocated=False, reason="shares device memory"),
    produces=(Artifact(CKPT, atomic=True, role=P),),
    needs=(
        Need(CKPT, role=G, when=(Condition("refit_fed", False),), reason="loads converted weights"),
    ),
    refit_fed=True,
    send_transports={"collective", "disk"},
    receive_transports={"collective", "disk"},
    openai_endpoint=True,
)
megatron_nonatomic = BackendDeclaration(
    name="megatron-old",
    roles={P, G},
    produces=(Artifact(CKPT, atomic=False, role=P),),
    needs=(Need(CKPT, role=G, when=(Condition("refit_fed", False),)),),
    refit_fed=True,
    send_transports={"disk"},
    receive_transports={"disk"},
    openai_endpoint=True,
)
fsdp = BackendDeclaration(
    name="fsdp",
    roles={P},
    overlap=OverlapSafety(True, True),
    send_transports={"collective", "shared_memory", "disk"},
)
vllm = BackendDeclaration(
    name="vllm",
    roles={G},
    overlap=OverlapSafety(
        non_colocated=True, colocated=False, reason="profiles free device memory at start"
    ),
    refit_fed=True,
    receive_transports={"collective", "shared_memory", "disk"},
    openai_endpoint=True,
)
vllm_no_endpoint = BackendDeclaration(name="vllm-noep", roles={G}, receive_transports={"disk"})
gym = BackendDeclaration(
    name="gym",
    roles={E},
    needs=(Need("generation.endpoint", kind="event", reason="servers call the model over HTTP"),),
)
lonely_env = BackendDeclaration(
    name="lonely", roles={E}, overlap=OverlapSafety(non_colocated=False, reason="binds every port")
)
lonely_policy = BackendDeclaration(
    name="lonely-policy",
    roles={P},
    overlap=OverlapSafety(non_colocated=False),
    send_transports={"disk"},
)


def plan_for(policy, generation, env=None, *overrides: str):
    cfg = load_config(
        None,
        [f"policy.backend={policy.name}", f"generation.backend={generation.name}"]
        + ([f"env.backend={env.name}"] if env else [])
        + list(overrides),
    )
    decls = {P: policy, G: generation}
    if env:
        decls[E] = env
    return build_plan(cfg, decls, accelerator="cpu")


def preds(plan, name):
    return sorted(plan.predecessors(name))


@dataclass
class Case:
    id: str
    policy: BackendDeclaration
    generation: BackendDeclaration
    env: BackendDeclaration | None
    overrides: tuple[str, ...]
    edges: set[tuple[str, str, int]]  # exactly these (src, dst, rule)
    waits: set[tuple[str, str, str]]  # exactly these (task, target, producer)
    overlapping: set[frozenset[str]]  # these pairs must be allowed to overlap


CASES = [
    Case(
        "worked-example: megatron policy + refit-fed megatron generation + env",
        megatron,
        megatron,
        gym,
        ("generation.refit_fed=true",),
        edges={("init:policy", "refit:initial", 4), ("init:generation", "refit:initial", 4)},
        waits={("init:env", "generation.endpoint", "refit:initial")},
        overlapping={
            frozenset({"init:policy", "init:generation"}),
            frozenset({"init:policy", "init:env"}),
            frozenset({"init:generation", "init:env"}),
            frozenset({"refit:initial", "init:env"}),
        },
    ),
    Case(
        "rule 1 atomic: generation from checkpoint waits inside its init",
        megatron,
        megatron,
        gym,
        (),
        edges={("init:policy", "refit:initial", 4), ("init:generation", "refit:initial", 4)},
        waits={
            ("init:generation", CKPT, "init:policy"),
            ("init:env", "generation.endpoint", "init:generation"),
        },
        overlapping={
            frozenset({"init:policy", "init:generation"}),
            frozenset({"init:generation", "init:env"}),
        },
    ),
    Case(
        "rule 1 non-atomic: generation starts after policy",
        megatron_nonatomic,
        megatron_nonatomic,
        None,
        (),
        edges={
            ("init:policy", "init:generation", 1),
            ("init:policy", "refit:initial", 4),
            ("init:generation", "refit:initial", 4),
        },
        waits=set(),
        overlapping=set(),
    ),
    Case(
        "rule 1 does not apply when the condition fails (refit-fed skips the checkpoint)",
        megatron_nonatomic,
        megatron_nonatomic,
        None,
        ("generation.refit_fed=true",),
        edges={("init:policy", "refit:initial", 4), ("init:generation", "refit:initial", 4)},
        waits=set(),
        overlapping={frozenset({"init:policy", "init:generation"})},
    ),
    Case(
        "rule 2: env not overlap-safe runs alone, after the others",
        fsdp,
        vllm,
        lonely_env,
        (),
        edges={
            ("init:generation", "init:env", 2),
            ("init:policy", "init:env", 2),
            ("init:policy", "refit:initial", 4),
            ("init:generation", "refit:initial", 4),
        },
        waits=set(),
        overlapping={frozenset({"init:policy", "init:generation"})},
    ),
    Case(
        "rule 2: policy not overlap-safe runs alone between generation and env",
        lonely_policy,
        vllm,
        gym,
        (),
        edges={
            ("init:generation", "init:policy", 2),
            ("init:policy", "init:env", 2),
            ("init:policy", "refit:initial", 4),
            ("init:generation", "refit:initial", 4),
        },
        waits={("init:env", "generation.endpoint", "init:generation")},
        overlapping={frozenset({"init:env", "refit:initial"})},
    ),
    Case(
        "rule 3: colocated vLLM-like generation first, then policy",
        fsdp,
        vllm,
        gym,
        ("placement.colocated=true",),
        edges={
            ("init:generation", "init:policy", 3),
            ("init:policy", "refit:initial", 4),
            ("init:generation", "refit:initial", 4),
        },
        waits={("init:env", "generation.endpoint", "init:generation")},
        overlapping={
            frozenset({"init:policy", "init:env"}),
            frozenset({"init:generation", "init:env"}),
        },
    ),
    Case(
        "non-colocated fsdp + vllm: everything overlaps",
        fsdp,
        vllm,
        None,
        (),
        edges={("init:policy", "refit:initial", 4), ("init:generation", "refit:initial", 4)},
        waits=set(),
        overlapping={frozenset({"init:policy", "init:generation"})},
    ),
    Case(
        "rule 3 ordering never contradicts an artifact wait (no deadlock)",
        megatron,
        megatron,
        None,
        ("placement.colocated=true",),
        edges={
            ("init:policy", "init:generation", 3),
            ("init:policy", "refit:initial", 4),
            ("init:generation", "refit:initial", 4),
        },
        waits={("init:generation", CKPT, "init:policy")},
        overlapping=set(),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_plan_rules(case: Case) -> None:
    plan = plan_for(case.policy, case.generation, case.env, *case.overrides)
    assert {(e.src, e.dst, e.rule) for e in plan.edges} == case.edges
    assert {(w.task, w.target, w.producer) for w in plan.waits} == case.waits
    for pair in case.overlapping:
        a, b = sorted(pair)
        assert plan.may_overlap(a, b), f"{a} and {b} should overlap"
    non_overlap = {frozenset(p) for p in [(e.src, e.dst) for e in plan.edges]}
    for pair in non_overlap:
        a, b = sorted(pair)
        assert not plan.may_overlap(a, b)
    assert all(e.reason for e in plan.edges) and all(w.reason for w in plan.waits)
    assert len(plan.topological_order()) == len(plan.tasks)


@pytest.mark.parametrize(
    ("pair", "overrides", "consumed"),
    [
        ("atomic", (), {"init:policy": (CKPT,)}),
        ("nonatomic", (), {"init:policy": (CKPT,)}),
        ("atomic", ("generation.refit_fed=true",), {}),  # the reader's need does not hold
        ("nonatomic", ("generation.refit_fed=true",), {}),
    ],
)
def test_plan_says_which_artifacts_a_reader_needs(
    pair: str, overrides: tuple, consumed: dict
) -> None:
    backend = megatron if pair == "atomic" else megatron_nonatomic
    plan = plan_for(backend, backend, None, *overrides)
    assert dict(plan.consumed) == consumed
    assert plan.to_dict()["artifacts_needed"] == {k: list(v) for k, v in consumed.items()}


def test_worked_example_shape_and_json() -> None:
    plan = plan_for(megatron, megatron, gym, "generation.refit_fed=true")
    d = plan.to_dict()
    assert [t["name"] for t in d["tasks"]] == [
        "init:policy",
        "init:generation",
        "init:env",
        "refit:initial",
    ]
    assert {t["name"]: t["backend"] for t in d["tasks"]} == {
        "init:policy": "megatron",
        "init:generation": "megatron",
        "init:env": "gym",
        "refit:initial": None,
    }
    # No edge into any init; refit does not wait for env.
    assert not [e for e in d["edges"] if e["to"].startswith("init:")]
    assert not plan.has_path("init:env", "refit:initial")
    assert sorted(plan.predecessors("refit:initial")) == ["init:generation", "init:policy"]
    assert plan.posts == {"refit:initial": ("generation.endpoint",)}
    assert d["critical_path"][-1] == "init:env" and "refit:initial" in d["critical_path"]
    for e in d["edges"]:
        assert set(e) >= {"from", "to", "reason"}
    refit_reasons = [e["reason"] for e in d["edges"] if e["to"] == "refit:initial"]
    assert all("refit-fed" in r for r in refit_reasons)


def test_edge_reasons_name_backend_and_condition() -> None:
    plan = plan_for(megatron_nonatomic, megatron_nonatomic)
    (edge,) = [e for e in plan.edges if e.rule == 1]
    assert (
        CKPT in edge.reason
        and "refit_fed == False" in edge.reason
        and "megatron-old" in edge.reason
    )
    colo = plan_for(fsdp, vllm, None, "placement.colocated=true")
    (edge,) = [e for e in colo.edges if e.rule == 3]
    assert "vllm" in edge.reason and "profiles free device memory" in edge.reason


def test_refit_fed_unsupported_is_config_error() -> None:
    with pytest.raises(ConfigError, match="generation.refit_fed") as info:
        plan_for(fsdp, vllm_no_endpoint, None, "generation.refit_fed=true")
    assert "vllm-noep" in str(info.value)


def test_env_needs_endpoint_generation_has_none() -> None:
    with pytest.raises(PlanError, match="vllm-noep"):
        plan_for(
            BackendDeclaration(name="p", roles={P}, send_transports={"disk"}), vllm_no_endpoint, gym
        )


def test_endpoint_that_depends_on_the_config() -> None:
    @dataclass
    class ServeOptions:
        serve_openai: bool = False

    switchable = BackendDeclaration(
        name="switchable",
        roles={G},
        receive_transports={"disk"},
        openai_endpoint=True,
        openai_endpoint_when=(Condition("options.serve_openai", True),),
        options=ServeOptions,
    )
    with pytest.raises(ConfigError, match="serves one only when generation.options.serve_openai == True") as info:
        plan_for(fsdp, switchable, gym)
    assert info.value.key == "generation.options.serve_openai"
    plan = plan_for(fsdp, switchable, gym, "generation.options.serve_openai=true")
    assert plan.posts == {"init:generation": ("generation.endpoint",)}
    # Without an env that needs it, an endpoint that is off is no error and posts nothing.
    assert plan_for(fsdp, switchable).posts == {}


def test_unmet_artifact_need() -> None:
    reader = BackendDeclaration(
        name="reader", roles={G}, needs=(Need(CKPT),), receive_transports={"disk"}
    )
    with pytest.raises(PlanError, match=f"needs artifact '{CKPT}'"):
        plan_for(fsdp, reader)


def test_transport_choice() -> None:
    assert plan_for(fsdp, vllm).refit_transport == "collective"
    assert plan_for(fsdp, vllm, None, "placement.colocated=true").refit_transport == "shared_memory"
    assert plan_for(fsdp, vllm, None, "refit.transport=disk").refit_transport == "disk"
    with pytest.raises(ConfigError, match="refit.transport"):
        plan_for(fsdp, vllm, None, "refit.transport=http")
    with pytest.raises(PlanError, match="no refit transport in common"):
        plan_for(BackendDeclaration(name="p", roles={P}, send_transports={"cuda_ipc"}), vllm)


def test_transports_the_core_cannot_run_here_are_never_chosen() -> None:
    both = {"cuda_ipc", "shared_memory", "disk"}
    pol = BackendDeclaration(name="p", roles={P}, send_transports=both)
    gen = BackendDeclaration(name="g", roles={G}, receive_transports=both)
    colocated = "placement.colocated=true"
    # On a CPU host cuda_ipc is never picked, and asking for it names the reason.
    assert plan_for(pol, gen, None, colocated).refit_transport == "shared_memory"
    with pytest.raises(ConfigError, match="refit.transport.*cannot run here"):
        plan_for(pol, gen, None, colocated, "refit.transport=cuda_ipc")
    only_ipc = BackendDeclaration(name="p2", roles={P}, send_transports={"cuda_ipc"})
    with pytest.raises(PlanError, match="no refit transport in common that the core runs here"):
        plan_for(only_ipc, gen, None, colocated)


def test_option_condition_uses_declared_default() -> None:
    @dataclass
    class GenOptions:
        load: str = "checkpoint"

    gen = BackendDeclaration(
        name="optgen",
        roles={G},
        needs=(Need(CKPT, when=(Condition("options.load", "checkpoint"),)),),
        receive_transports={"disk"},
        options=GenOptions,
    )
    pol = BackendDeclaration(
        name="optpol", roles={P}, produces=(Artifact(CKPT, atomic=True),), send_transports={"disk"}
    )
    assert [w.target for w in plan_for(pol, gen).waits] == [CKPT]  # default applies
    assert plan_for(pol, gen, None, "generation.options.load=refit").waits == ()
    with pytest.raises(ConfigError, match="generation.options.lod"):
        plan_for(pol, gen, None, "generation.options.lod=x")


def test_backend_serving_wrong_role() -> None:
    with pytest.raises(ConfigError, match="policy.backend"):
        plan_for(vllm, vllm)


@dataclass
class AdapterOptions:
    lora: LoraOptions | None = None


def test_lora_needs_a_policy_that_trains_adapters_and_the_plan_says_what_the_refit_carries() -> None:
    adapting = BackendDeclaration(
        name="adapting", roles={P}, send_transports={"disk"}, trains_adapters=True, options=AdapterOptions
    )
    full = plan_for(adapting, vllm).refit_content
    assert full is not None and full.kind == "weights"
    merged = plan_for(adapting, vllm, None, "policy.options.lora.rank=4").refit_content
    assert merged is not None and merged.kind == "merged"
    assert "'adapting' trains LoRA adapters (rank 4)" in merged.why and "'vllm' loads full weights" in merged.why
    assert plan_for(adapting, vllm, None, "policy.options.lora.rank=4").to_dict()["refit_content"]["kind"] == "merged"
    # A generation that serves adapters in place gets them alone, unless refit.adapters=merged.
    serving = BackendDeclaration(
        name="serving", roles={G}, receive_transports={"disk"}, refit_fed=True, takes_adapters=True
    )
    alone = plan_for(adapting, serving, None, "policy.options.lora.rank=4").refit_content
    assert alone is not None and alone.kind == "adapters" and "'serving' serves them in place" in alone.why
    asked = plan_for(adapting, serving, None, "policy.options.lora.rank=4", "refit.adapters=merged").refit_content
    assert asked is not None and asked.kind == "merged" and "refit.adapters=merged" in asked.why
    assert plan_for(adapting, serving).refit_content.kind == "weights"  # type: ignore[union-attr]
    # A policy that does not declare it is refused before its options are read, naming both.
    with pytest.raises(ConfigError, match="policy backend 'fsdp' does not train adapters") as info:
        plan_for(fsdp, vllm, None, "policy.options.lora.rank=4")
    assert info.value.key == "policy.options.lora"


def test_more_workers_than_a_backend_declares_are_refused_naming_key_backend_and_limit() -> None:
    """``max_workers`` (contract 2.6): ``<role>.workers`` above it is refused before anything
    starts, in one line naming the key, the backend and the limit; at or below it plans."""
    single = dataclasses.replace(fsdp, name="single", max_workers=1)
    pair_env = dataclasses.replace(gym, name="pair-env", max_workers=2)
    assert plan_for(single, vllm, pair_env, "policy.workers=1", "env.workers=2").tasks
    with pytest.raises(ConfigError) as info:
        plan_for(single, vllm, pair_env, "policy.workers=2")
    assert info.value.key == "policy.workers"
    assert "\n" not in str(info.value)
    assert "'policy.workers' is 2" in str(info.value) and "'single'" in str(info.value)
    assert "at most 1 worker " in str(info.value)
    with pytest.raises(ConfigError, match=r"'env.workers' is 3, but env backend 'pair-env' runs at most 2 workers") as info:
        plan_for(single, vllm, pair_env, "env.workers=3")
    assert info.value.key == "env.workers"
    # No declaration of it: any number.
    assert plan_for(fsdp, vllm, gym, "policy.workers=8", "env.workers=8").tasks
