"""The declaration fields of contract 2.1 (``inflight_refit``, ``max_staleness``): what
each promises is checked at registration, selected under the config, and listed."""

from __future__ import annotations

import dataclasses
import json

import pytest

from rlcore.declarations import (
    BETWEEN_CALLS,
    CONTRACT_VERSION,
    BackendDeclaration,
    CheckpointSupport,
    Condition,
    InflightRefit,
    RefitLanding,
    Role,
    contract_compatible,
    validate_declaration,
)
from rlcore.errors import DeclarationError


@dataclasses.dataclass
class EngineOptions:
    serve_openai: bool = False


def generation(**fields) -> BackendDeclaration:
    return BackendDeclaration(
        name="engine", roles={Role.GENERATION}, receive_transports={"disk"}, options=EngineOptions, **fields
    )


def policy(**fields) -> BackendDeclaration:
    return BackendDeclaration(name="trainer", roles={Role.POLICY}, send_transports={"disk"}, **fields)


def problems(decl: BackendDeclaration) -> str:
    with pytest.raises(DeclarationError) as info:
        validate_declaration(decl, plugin="p", distribution="d")
    return str(info.value)


def test_contract_2_1_to_2_6_add_fields_a_2_0_plugin_still_loads_without() -> None:
    assert CONTRACT_VERSION == "2.6"
    assert contract_compatible("2.0") and contract_compatible("2.5") and not contract_compatible("2.7")
    plain = policy()
    assert plain.max_staleness == 0 and plain.inflight_refit == () and plain.checkpoint is None
    assert plain.trains_adapters is False and plain.to_dict()["trains_adapters"] is False
    assert plain.takes_adapters is False and plain.to_dict()["takes_adapters"] is False
    assert plain.loss_options == frozenset() and plain.to_dict()["loss_options"] == []
    assert plain.max_workers is None and plain.to_dict()["max_workers"] is None  # 2.6: any number
    one = validate_declaration(policy(max_workers=1), plugin="p", distribution="d")
    assert json.loads(json.dumps(one.to_dict()))["max_workers"] == 1
    assert CheckpointSupport("torch-dcp").staged is False  # 2.2's declaration saves as it did
    assert plain.refit_landing({}) == BETWEEN_CALLS


def test_the_first_landing_whose_conditions_hold_applies() -> None:
    server = InflightRefit(RefitLanding.PAUSE, True, when=(Condition("options.serve_openai", True),))
    stepped = InflightRefit("between_steps", token_versions=True, when=[Condition("options.serve_openai", False)])
    decl = validate_declaration(generation(inflight_refit=[server, stepped]), plugin="p", distribution="d")
    assert stepped.landing is RefitLanding.BETWEEN_STEPS and stepped.when == (Condition("options.serve_openai", False),)
    assert decl.refit_landing({"options": {"serve_openai": True}}) is server
    assert decl.refit_landing({"options": {"serve_openai": False}}) is stepped
    # No entry holds (the key is missing from the view): between calls, which every backend does.
    assert decl.refit_landing({"options": {}}) == InflightRefit(RefitLanding.BETWEEN_CALLS)
    unconditional = generation(inflight_refit=(InflightRefit(RefitLanding.PAUSE), stepped))
    assert unconditional.refit_landing({"options": {"serve_openai": False}}).landing is RefitLanding.PAUSE


@pytest.mark.parametrize(
    ("decl", "words"),
    [
        (policy(inflight_refit=(InflightRefit(RefitLanding.PAUSE),)),
         "inflight_refit is only meaningful for a backend that serves generation"),
        (generation(inflight_refit=("pause",)), "inflight_refit[0] 'pause' is not an InflightRefit"),
        (generation(inflight_refit=(InflightRefit("paused"),)), "inflight_refit[0]: landing 'paused' is not one of"),
        (generation(inflight_refit=(InflightRefit(RefitLanding.BETWEEN_CALLS, token_versions=True),)),
         "token_versions with landing between_calls is contradictory"),
        (generation(inflight_refit=(InflightRefit(RefitLanding.PAUSE, when=(Condition("options.serve", True),)),)),
         "inflight_refit[0]: condition tests option 'serve', which the options dataclass EngineOptions"),
        (generation(inflight_refit=(InflightRefit(RefitLanding.PAUSE, when=(Condition("replicas", 2),)),)),
         "inflight_refit[0]: condition key 'replicas' is not one of"),
        (generation(max_staleness=2), "max_staleness is only meaningful for a backend that serves policy"),
        (policy(max_staleness=-1), "max_staleness must be an int >= 0"),
        (policy(max_staleness=1.5), "max_staleness must be an int >= 0"),
        (policy(max_staleness=True), "max_staleness must be an int >= 0"),
        (generation(checkpoint=CheckpointSupport("x")), "checkpoint is only meaningful for a backend that serves policy"),
        (policy(checkpoint=CheckpointSupport("")), "checkpoint.format must be a non-empty string"),
        (policy(checkpoint=CheckpointSupport("x", version=2)), "checkpoint.version must be a non-empty string"),
        (policy(checkpoint={"format": "x"}), "checkpoint must be a CheckpointSupport or None"),
        (policy(max_workers=0), "max_workers must be an int >= 1"),
        (policy(max_workers=1.0), "max_workers must be an int >= 1"),
        (policy(max_workers=True), "max_workers must be an int >= 1"),
    ],
    ids=["policy-landing", "not-inflight", "bad-landing", "versions-between-calls", "unknown-option",
         "unknown-view-key", "generation-staleness", "negative", "float", "bool",
         "generation-checkpoint", "empty-format", "int-version", "dict-checkpoint",
         "zero-workers", "float-workers", "bool-workers"],
)
def test_a_contradictory_declaration_is_refused(decl: BackendDeclaration, words: str) -> None:
    assert words in problems(decl)


def test_to_dict_lists_both_fields() -> None:
    decl = BackendDeclaration(
        name="both",
        roles={Role.POLICY, Role.GENERATION},
        send_transports={"disk"},
        receive_transports={"disk"},
        options=EngineOptions,
        max_staleness=4,
        inflight_refit=(InflightRefit(RefitLanding.PAUSE, True, (Condition("options.serve_openai", True),)),),
    )
    d = json.loads(json.dumps(validate_declaration(decl, plugin="p", distribution="d").to_dict()))
    assert d["max_staleness"] == 4
    assert d["inflight_refit"] == [
        {"landing": "pause", "token_versions": True, "when": [{"key": "options.serve_openai", "equals": True}]}
    ]
    assert policy().to_dict()["inflight_refit"] == [] and policy().to_dict()["max_staleness"] == 0
