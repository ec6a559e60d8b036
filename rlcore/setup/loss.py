"""The loss's shape a run asks for (``grpo.clip_eps_high``, ``grpo.loss_aggregation``,
``grpo.rollout_correction``), checked against what the policy declares before anything
starts, and handed to its ``train_step`` as :class:`rlcore.handles.LossOptions` (contract 2.5).

A run that asks for none of them calls ``train_step`` as contract 2.4 did (no ``loss=``),
so a policy that declares no ``loss_options`` trains as before.
"""

from __future__ import annotations

from collections.abc import Sequence

from rlcore.config import GRPOConfig, RunConfig
from rlcore.declarations import BackendDeclaration
from rlcore.errors import ConfigError
from rlcore.handles import LossOptions

#: The config key that asks for each feature of :data:`rlcore.declarations.LOSS_FEATURES`.
FEATURE_KEYS = {
    "clip_eps_high": "grpo.clip_eps_high",
    "aggregation": "grpo.loss_aggregation",
    "correction": "grpo.rollout_correction",
}


def requested_features(grpo: GRPOConfig) -> frozenset[str]:
    """The loss features ``grpo`` asks for (empty: the plain GRPO loss)."""
    return loss_options(grpo, ()).features()


def loss_options(grpo: GRPOConfig, engine_logprobs: Sequence[Sequence[float]]) -> LossOptions:
    """``grpo``'s loss as :class:`LossOptions`, with the sampling logprobs of the step's
    batch (``engine_logprobs``) where a correction asks for them."""
    correction = grpo.rollout_correction
    return LossOptions(
        clip_eps_high=grpo.clip_eps_high,
        aggregation=grpo.loss_aggregation,
        norm_tokens=grpo.max_new_tokens,
        correction=correction,
        cap=grpo.rollout_correction_cap,
        engine_logprobs=engine_logprobs if correction != "none" else None,
    )


def check_loss_features(config: RunConfig, policy: BackendDeclaration) -> None:
    """Refuse, in one line naming the key and the backend, a loss feature the policy does
    not declare in ``loss_options``."""
    for feature in sorted(requested_features(config.grpo) - policy.loss_options):
        key = FEATURE_KEYS[feature]
        raise ConfigError(
            f"config key '{key}' asks for the loss's {feature}, which policy backend '{policy.name}' "
            f"does not apply (its declaration's loss_options: {sorted(policy.loss_options) or 'none'}); "
            f"leave {key} at its default or choose a policy backend that declares it",
            key=key,
        )
