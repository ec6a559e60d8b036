"""The core's refit: check specs, open the channel once, stream buckets, report.

Channels are opened once per policy/generation pair and transport and kept in
the run's :class:`rlcore.refit.sessions.RefitSessions` (``ctx.sessions``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from rlcore.context import RefitContext
from rlcore.errors import RefitError, WorkerLost
from rlcore.handles import RefitReceiver, RefitReport, RefitSender
from rlcore.refit import transports
from rlcore.refit.specs import check_specs, plan_buckets
from rlcore.runtime.waits import ray_get

log = logging.getLogger(__name__)


def _labels(handle: Any, side: str, n: int) -> list[str]:
    """``<group name> rank <i>`` for a handle's refs (the group name when it has one; the
    engines' own ranks for a receiver of some engines, :class:`EngineReceiver`)."""
    name = getattr(getattr(handle, "group", None), "name", None) or f"{side} {type(handle).__name__}"
    return [f"{name} rank {i}" for i in getattr(handle, "engine_ranks", range(n))]


def refit(policy: Any, generation: Any, ctx: RefitContext) -> RefitReport:
    """Copy the policy's weights into the generation engine over ``ctx.transport`` (its
    adapters alone where the refit carries adapters: :mod:`rlcore.refit.adapters`)."""
    if ctx.content == "adapters":
        from rlcore.refit.adapters import refit_adapters

        return refit_adapters(policy, generation, ctx)
    for handle, proto, side in ((policy, RefitSender, "policy"), (generation, RefitReceiver, "generation")):
        if not isinstance(handle, proto):
            raise RefitError(
                f"the {side} handle {type(handle).__name__} does not implement {proto.__name__} "
                "(rlcore.handles); implement it or provide an rlcore_refit hook for this pair"
            )
    t0 = time.monotonic()
    sent = policy.weight_specs()
    check_specs(sent, generation.weight_specs(), sender=type(policy).__name__, receiver=type(generation).__name__)
    buckets = plan_buckets(sent, ctx.bucket_bytes)
    session = ctx.sessions.open(policy, generation, ctx)
    try:
        sends = list(policy.send_weights(session.spec, ctx.step, buckets))
        receives = list(generation.receive_weights(session.spec, ctx.step, buckets))
        labels = _labels(policy, "policy", len(sends)) + _labels(generation, "generation", len(receives))
        done = ray_get(
            sends + receives,
            what=f"refit step {ctx.step} over {ctx.transport}",
            cancel=ctx.cancel,
            deadline=ctx.deadline.sooner(ctx.timeout_s),
            labels=labels,
            ranks=_ranks(generation, len(sends), len(receives)),
        )
    except WorkerLost as err:
        # Refs are the policy's sends, then the generation's receives: say whose worker
        # died, so the run can replace a lost generation worker and abort on a policy rank.
        err.tag("policy" if err.index < len(sends) else "generation")
        ctx.sessions.forget(policy, generation, ctx.transport)
        raise
    except BaseException:
        # A channel that failed mid-refit may be unusable (a timed-out collective or
        # cuda_ipc channel refuses further use): the next refit opens a new one.
        ctx.sessions.forget(policy, generation, ctx.transport)
        raise
    finally:
        transports.get(session.spec.transport).remove_step(session.spec, ctx.step)
    total = sum(s.nbytes for s in sent)
    return RefitReport(
        step=ctx.step,
        transport=ctx.transport,
        bytes=total,
        tensors=len(sent),
        weight_sync_time_s=time.monotonic() - t0,
        channel_init_time_s=session.take_init_time(),
        path=_path(done[: len(sends)] if isinstance(done, list) else []),
    )


def _ranks(generation: Any, sends: int, receives: int) -> list[int]:
    """The group rank of each ref's worker: the policy's ranks in order, then the
    generation's (:class:`rlcore.runtime.generation_group.EngineReceiver` says which)."""
    engines = list(getattr(generation, "engine_ranks", range(receives)))
    return list(range(sends)) + engines


def _path(sent: list[Any]) -> str:
    """``native`` when a sending rank says it sent its backend's own layout
    (``{"path": "native", ...}``), else ``hf`` (ranks return the bytes they sent)."""
    return next((r["path"] for r in sent if isinstance(r, dict) and "path" in r), "hf")
