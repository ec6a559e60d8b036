"""The core's refit of LoRA adapters alone (refit content ``adapters``, contract 2.6).

Where the policy trains adapters (``trains_adapters``) and the generation serves them in
place (``takes_adapters``), a refit moves the adapters, not the model: the policy's
:class:`rlcore.handles.AdapterSource` gives them (a few MiB against the model's GiB), Ray's
object store carries them once to every engine, and each engine loads them through its own
LoRA mechanism (:class:`rlcore.handles.AdapterReceiver`). The engines hold the base weights
from the checkpoint; the base never changes while adapters train.
"""

from __future__ import annotations

import time
from typing import Any

from rlcore.context import RefitContext
from rlcore.errors import RefitError, WorkerLost
from rlcore.handles import AdapterReceiver, AdapterSource, RefitReport
from rlcore.lora import ADAPTER_TRANSPORT
from rlcore.runtime.waits import ray_get

#: :attr:`rlcore.handles.RefitReport.transport` of an adapter refit (in memory, any placement).
TRANSPORT = ADAPTER_TRANSPORT


def refit_adapters(policy: Any, generation: Any, ctx: RefitContext) -> RefitReport:
    """Hand the policy's current adapters to every engine of ``generation``."""
    for handle, proto, side in (
        (policy, AdapterSource, "policy"), (generation, AdapterReceiver, "generation")
    ):
        if not isinstance(handle, proto):
            raise RefitError(
                f"the refit carries LoRA adapters, but the {side} handle {type(handle).__name__} does "
                f"not implement {proto.__name__} (rlcore.handles); implement it, or set "
                "refit.adapters=merged to send merged weights"
            )
    t0 = time.monotonic()
    try:
        tensors, config = policy.adapter_state()
    except WorkerLost as err:
        err.tag("policy")
        raise
    if not tensors:
        raise RefitError(f"policy handle {type(policy).__name__} gave no adapter tensors at step {ctx.step}")
    try:
        ray_get(
            list(generation.load_adapter(_shared(tensors), config, ctx.step)),
            what=f"adapter refit step {ctx.step}",
            cancel=ctx.cancel,
            deadline=ctx.deadline.sooner(ctx.timeout_s),
            ranks=list(getattr(generation, "engine_ranks", range(getattr(generation, "refit_ranks", 1)))),
        )
    except WorkerLost as err:
        err.tag("generation")
        raise
    return RefitReport(
        step=ctx.step,
        transport=TRANSPORT,
        bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
        tensors=len(tensors),
        weight_sync_time_s=time.monotonic() - t0,
        path="adapters",
    )


def _shared(tensors: dict[str, Any]) -> Any:
    """One copy in Ray's object store for every engine (the tensors themselves without Ray)."""
    try:
        import ray
    except ImportError:  # pragma: no cover - Ray is a dependency of the core
        return tensors
    return ray.put(tensors) if ray.is_initialized() else tensors
