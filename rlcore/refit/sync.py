"""The core's refit: check specs, open the channel once, stream buckets, report."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from rlcore.context import RefitContext
from rlcore.errors import RefitError
from rlcore.handles import RefitReceiver, RefitReport, RefitSender
from rlcore.refit.channels import ChannelSpec, remove_step, shm_root
from rlcore.refit.specs import check_specs, plan_buckets
from rlcore.waiting import Deadline
from rlcore.workers import ray_get

log = logging.getLogger(__name__)


class _Session:
    """A channel between one policy and one generation, opened at the first refit."""

    def __init__(self, spec: ChannelSpec, init_time_s: float) -> None:
        self.spec = spec
        self.init_time_s = init_time_s
        self.reported_init = False


_sessions: dict[tuple[int, int, str], _Session] = {}
_lock = threading.Lock()


def _open_session(policy: RefitSender, generation: RefitReceiver, ctx: RefitContext) -> _Session:
    key = (id(policy), id(generation), ctx.transport)
    with _lock:
        if key in _sessions:
            return _sessions[key]
    t0 = time.monotonic()
    name = uuid.uuid4().hex[:12]
    world = 1 + int(generation.refit_ranks)
    if ctx.transport == "collective":
        addr, port = policy.refit_address()
        backend = "nccl" if getattr(policy, "device_type", "cpu") == "cuda" else "gloo"
        spec = ChannelSpec("collective", name, world, addr=addr, port=port, backend=backend, timeout_s=ctx.timeout_s)
    elif ctx.transport == "disk":
        spec = ChannelSpec("disk", name, world, root=str(Path(ctx.cache_dir) / "refit"), timeout_s=ctx.timeout_s)
    elif ctx.transport == "shared_memory":
        spec = ChannelSpec("shared_memory", name, world, root=str(Path(shm_root()) / "rlcore-refit"), timeout_s=ctx.timeout_s)
    else:
        raise RefitError(f"the core has no '{ctx.transport}' refit transport; use collective, disk or shared_memory")
    refs = list(policy.open_refit_channel(spec)) + list(generation.open_refit_channel(spec))
    ray_get(refs, what=f"opening the {ctx.transport} refit channel", cancel=ctx.cancel, deadline=Deadline(ctx.timeout_s, "refit channel"))
    session = _Session(spec, time.monotonic() - t0)
    with _lock:
        _sessions[key] = session
    log.info("opened %s refit channel %s (%d ranks) in %.3fs", ctx.transport, name, world, session.init_time_s)
    return session


def session_spec(policy: Any, generation: Any, transport: str) -> ChannelSpec | None:
    """The channel a refit over ``transport`` opened for this pair (None before the first)."""
    with _lock:
        session = _sessions.get((id(policy), id(generation), transport))
    return None if session is None else session.spec


def forget_sessions(*handles: Any) -> None:
    """Drop cached channels of these handles (called when they shut down)."""
    ids = {id(h) for h in handles}
    with _lock:
        for key in [k for k in _sessions if k[0] in ids or k[1] in ids]:
            del _sessions[key]


def _labels(handle: Any, side: str, n: int) -> list[str]:
    """``<group name> rank <i>`` for a handle's refs (the group name when it has one)."""
    name = getattr(getattr(handle, "group", None), "name", None) or f"{side} {type(handle).__name__}"
    return [f"{name} rank {i}" for i in range(n)]


def refit(policy: Any, generation: Any, ctx: RefitContext) -> RefitReport:
    """Copy the policy's weights into the generation engine over ``ctx.transport``."""
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
    session = _open_session(policy, generation, ctx)
    sends = list(policy.send_weights(session.spec, ctx.step, buckets))
    receives = list(generation.receive_weights(session.spec, ctx.step, buckets))
    labels = _labels(policy, "policy", len(sends)) + _labels(generation, "generation", len(receives))
    try:
        ray_get(
            sends + receives,
            what=f"refit step {ctx.step} over {ctx.transport}",
            cancel=ctx.cancel,
            deadline=ctx.deadline.sooner(ctx.timeout_s),
            labels=labels,
        )
    finally:
        remove_step(session.spec, ctx.step)
    init_time = 0.0 if session.reported_init else session.init_time_s
    session.reported_init = True
    total = sum(s.nbytes for s in sent)
    return RefitReport(
        step=ctx.step,
        transport=ctx.transport,
        bytes=total,
        tensors=len(sent),
        weight_sync_time_s=time.monotonic() - t0,
        channel_init_time_s=init_time,
    )
