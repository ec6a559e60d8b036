"""After a failed refit check: whose bug is it, the policy's or the engine's?

The check (:func:`rlcore.app.refit_check.check_divergence`) sees that the generation's logprobs
left the policy's. Two different bugs look the same there: an engine that did not apply
the weights it was sent, and a policy whose export (what refit sends) is not the model
its own forward pass computes with. A third opinion tells them apart: the policy's export,
captured through the core's own refit (:func:`rlcore.refit.capture.capture_export`), loaded
into transformers in the driver, computes the probe batch's logprobs. The side that
agrees with it is right; the other is named.

The policy must not have trained since the refit that failed (true where the run checks:
right after a refit, or before the next train step with ``refit.check: sampled``). Best
effort and bounded: a model over :data:`MAX_BYTES`, an export without the Hugging Face
layout or a diagnosis that fails gives a sentence saying why nothing was concluded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

#: Largest export the driver loads into a reference model (float32 in host memory).
MAX_BYTES = 4 << 30


def verdict(policy_err: float, engine_err: float, limit: float, *, policy: str, generation: str) -> str:
    """The conclusion from how far the policy's and the engine's logprobs are from those of
    the policy's export (token_mult_prob_error each, against ``limit``)."""
    policy_ok, engine_ok = policy_err <= limit, engine_err <= limit
    figures = (
        f"(the export's own logprobs against the policy's: {policy_err:.4f}, against the "
        f"engine's: {engine_err:.4f})"
    )
    if policy_ok and not engine_ok:
        return (
            f"Diagnosis: generation backend '{generation}' did not apply the weights it was sent: "
            f"the policy's export computes what policy backend '{policy}' computes {figures}."
        )
    if engine_ok and not policy_ok:
        return (
            f"Diagnosis: policy backend '{policy}' exports weights that disagree with its own "
            f"forward pass (a policy bug): generation backend '{generation}' computes what it "
            f"was sent {figures}."
        )
    if not policy_ok and not engine_ok:
        return (
            f"Diagnosis: neither side computes what the policy's export computes {figures}: the "
            f"policy's export disagrees with its forward pass, and the engine's result is not "
            "the export's either."
        )
    return (
        f"Diagnosis: both sides agree with the policy's export here {figures}; the failure "
        "depends on the batch (the sampled tokens) or was transient."
    )


@dataclass(frozen=True)
class FailedCheck:
    """The refit check that failed: what it compared, and against what limit.

    Attributes:
        probe: the probe batch.
        policy_logprobs: the policy's ``logprobs`` (a checked one).
        generation_logprobs: the generation's ``logprobs`` (a checked one).
        limit: ``refit.max_mult_prob_error``.
        names: the policy and generation backends' names.
    """

    probe: Sequence[Any]
    policy_logprobs: Callable[[Sequence[Any]], list[list[float]]]
    generation_logprobs: Callable[[Sequence[Any]], list[list[float]]]
    limit: float
    names: tuple[str, str]


def diagnose_divergence(
    check: FailedCheck,
    *,
    policy: Any,
    make_context: Callable[[str], Any],
    transport: str | None,
    model_dir: str,
) -> str:
    """One sentence (see :func:`verdict`), never raising.

    Args:
        check: the failed check's sides, probe batch and limit.
        policy: the policy handle (:class:`rlcore.handles.RefitSender`).
        make_context: a :class:`rlcore.context.RefitContext` for ``transport`` with
            sessions of its own.
        transport: the capture's transport (:func:`rlcore.refit.capture.file_transport_first`).
        model_dir: the checkpoint whose ``config.json`` builds the reference model.
    """
    try:
        ctx = make_context(transport) if transport is not None else None
        return _diagnose(check, policy, ctx, model_dir)
    except Exception as err:  # noqa: BLE001 - a diagnosis must not hide the failure it explains
        log.warning("refit check diagnosis failed", exc_info=True)
        return f"Not diagnosed: capturing or replaying the policy's export failed ({type(err).__name__}: {err})."


def _diagnose(check: FailedCheck, policy: Any, ctx: Any, model_dir: str) -> str:
    from rlcore.app.refit_check import token_mult_prob_error
    from rlcore.handles import RefitSender
    from rlcore.refit.capture import capture_export

    if not isinstance(policy, RefitSender):
        return "Not diagnosed: the policy refits through its own rlcore_refit, not the core's channels."
    if ctx is None:
        return "Not diagnosed: the policy declares no transport the core can receive on this host."
    size = sum(s.nbytes for s in policy.weight_specs())
    if size > MAX_BYTES:
        return (
            f"Not diagnosed: the export ({size / 2**30:.1f} GiB) is larger than the driver "
            f"loads into a reference model ({MAX_BYTES / 2**30:.0f} GiB)."
        )
    reference = _reference_model(model_dir, capture_export(policy, ctx))
    if isinstance(reference, str):
        return reference
    from rlcore.runtime.losses import model_logprobs

    batch = [(list(p), list(c)) for p, c in check.probe]
    ref = model_logprobs(reference, batch)
    policy_err = token_mult_prob_error(ref, check.policy_logprobs(batch))
    engine_err = token_mult_prob_error(ref, check.generation_logprobs(batch))
    return verdict(policy_err, engine_err, check.limit, policy=check.names[0], generation=check.names[1])


def _reference_model(model_dir: str, exported: dict[str, Any]) -> Any:
    """A float32 transformers model of ``model_dir``'s config holding ``exported``, or a
    sentence saying why the export does not fit it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    state = model.state_dict()
    missing = sorted(set(state) - set(exported))
    extra = sorted(set(exported) - set(state))
    if missing or extra:
        return (
            f"Not diagnosed: the export does not have the Hugging Face layout of {model_dir} "
            f"(missing {missing[:3]}, unexpected {extra[:3]})."
        )
    model.load_state_dict({n: t.to(torch.float32) for n, t in exported.items()})
    return model.eval()
