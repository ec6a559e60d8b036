"""The loss's shape a run asks for (``grpo.clip_eps_high``, ``grpo.loss_aggregation``,
``grpo.rollout_correction``; contract 2.5): checked against the policy's declaration
before anything starts, handed to its train step only when asked for."""

from __future__ import annotations

import pytest

from rlcore.config import load_config
from rlcore.declarations import BackendDeclaration, Role, validate_declaration
from rlcore.errors import ConfigError, DeclarationError
from rlcore.setup.loss import check_loss_features, loss_options, requested_features

PLAIN = BackendDeclaration(name="plain", roles={Role.POLICY}, send_transports={"disk"})
SHAPED = BackendDeclaration(
    name="shaped", roles={Role.POLICY}, send_transports={"disk"}, loss_options={"aggregation", "correction"}
)


def config(*overrides: str):  # type: ignore[no-untyped-def]
    return load_config(None, ["policy.backend=plain", "generation.backend=x", *overrides])


def test_the_plain_loss_asks_for_nothing_and_any_policy_runs_it() -> None:
    assert requested_features(config().grpo) == frozenset()
    check_loss_features(config(), PLAIN)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("grpo.clip_eps_high=0.28", "grpo.clip_eps_high"),
        ("grpo.loss_aggregation=seq_mean_token_sum_norm", "grpo.loss_aggregation"),
        ("grpo.rollout_correction=tis", "grpo.rollout_correction"),
    ],
)
def test_a_feature_the_policy_does_not_declare_is_refused_naming_key_and_backend(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=f"config key '{key}' .* policy backend 'plain' does not apply") as info:
        check_loss_features(config(override), PLAIN)
    assert info.value.key == key


def test_what_the_policy_declares_passes_and_what_it_does_not_is_named() -> None:
    check_loss_features(config("grpo.loss_aggregation=seq_mean_token_mean", "grpo.rollout_correction=mis"), SHAPED)
    with pytest.raises(ConfigError, match=r"loss_options: \['aggregation', 'correction'\]"):
        check_loss_features(config("grpo.clip_eps_high=0.28"), SHAPED)


def test_the_options_carry_the_config_and_the_sampling_logprobs() -> None:
    g = config("grpo.rollout_correction=tis", "grpo.rollout_correction_cap=3", "grpo.max_new_tokens=16",
               "grpo.loss_aggregation=seq_mean_token_sum_norm").grpo
    shape = loss_options(g, [[-1.0, -2.0]])
    assert (shape.correction, shape.cap, shape.norm_tokens, shape.engine_logprobs) == ("tis", 3.0, 16, [[-1.0, -2.0]])
    assert shape.features() == {"aggregation", "correction"}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("grpo.loss_aggregation=seq_mean", "grpo.loss_aggregation' is 'seq_mean'; expected one of"),
        ("grpo.rollout_correction=tris", "did you mean 'tis'"),
        ("grpo.rollout_correction_cap=0.5", "grpo.rollout_correction_cap' is 0.5; it must be at least 1"),
        ("grpo.clip_eps_high=0", "grpo.clip_eps_high' is 0"),
    ],
)
def test_bad_values_are_config_errors(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config(override)


def test_a_declaration_names_only_known_features() -> None:
    bad = BackendDeclaration(name="bad", roles={Role.POLICY}, send_transports={"disk"}, loss_options={"kl"})
    with pytest.raises(DeclarationError, match=r"loss_options \['kl'\] are not features"):
        validate_declaration(bad, plugin="p", distribution="d")
