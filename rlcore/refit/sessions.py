"""Refit sessions: the channels a run opened, owned by the run.

A channel between a policy and a generation is opened at its first refit and
reused by every later one (opening a collective group costs seconds). The run
owns the sessions: it makes one :class:`RefitSessions` in setup, passes it to
every refit in :class:`rlcore.context.RefitContext`, and drops it at teardown.
Backends never touch it; their workers close their own channel ends when they
shut down (:class:`rlcore.refit.worker.RefitChannels`).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlcore.errors import Deadline
from rlcore.refit import transports

if TYPE_CHECKING:
    from rlcore.context import RefitContext
    from rlcore.handles import RefitReceiver, RefitSender
    from rlcore.refit.specs import ChannelSpec

log = logging.getLogger(__name__)


@dataclass
class Session:
    """An open channel between one policy and one generation.

    Attributes:
        spec: what both sides opened.
        init_time_s: seconds it took to open (both sides joined).
        reported_init: whether a refit report already carried ``init_time_s``.
    """

    spec: ChannelSpec
    init_time_s: float
    reported_init: bool = False

    def take_init_time(self) -> float:
        """``init_time_s`` the first time it is asked for, then 0 (reports count it once)."""
        first = not self.reported_init
        self.reported_init = True
        return self.init_time_s if first else 0.0


class RefitSessions:
    """The refit channels of one run, keyed by (policy, generation, transport)."""

    def __init__(self) -> None:
        self._sessions: dict[tuple[int, int, str], Session] = {}
        self._lock = threading.Lock()

    def open(self, policy: RefitSender, generation: RefitReceiver, ctx: RefitContext) -> Session:
        """The session for this pair over ``ctx.transport``, opening the channel the first time."""
        from rlcore.errors import WorkerLost
        from rlcore.runtime.waits import ray_get

        key = (id(policy), id(generation), ctx.transport)
        with self._lock:
            if key in self._sessions:
                return self._sessions[key]
        impl = transports.get(ctx.transport)
        t0 = time.monotonic()
        name = uuid.uuid4().hex[:12]
        world = 1 + int(generation.refit_ranks)
        spec = impl.channel(transports.ChannelRequest(name, world, policy, ctx))
        sends = list(policy.open_refit_channel(spec))
        try:
            ray_get(
                sends + list(generation.open_refit_channel(spec)),
                what=f"opening the {ctx.transport} refit channel",
                cancel=ctx.cancel,
                deadline=Deadline(ctx.timeout_s, "refit channel"),
            )
        except WorkerLost as err:  # whose worker died (see rlcore.refit.sync.refit)
            err.tag("policy" if err.index < len(sends) else "generation")
            raise
        session = Session(spec, time.monotonic() - t0)
        with self._lock:
            self._sessions[key] = session
        log.info(
            "opened %s refit channel %s (%d ranks) in %.3fs",
            ctx.transport, name, world, session.init_time_s,
        )
        return session

    def spec_for(self, policy: Any, generation: Any, transport: str) -> ChannelSpec | None:
        """The channel a refit over ``transport`` opened for this pair (None before the first)."""
        with self._lock:
            session = self._sessions.get((id(policy), id(generation), transport))
        return None if session is None else session.spec

    def forget(self, policy: Any, generation: Any, transport: str) -> None:
        """Drop this pair's channel over ``transport``: the next refit opens a new one
        (the workers' ends of the old one close with their processes or channels)."""
        with self._lock:
            self._sessions.pop((id(policy), id(generation), transport), None)

    def forget_generation(self, generation: Any) -> list[ChannelSpec]:
        """Drop every channel of ``generation`` (a lost engine's, whatever the transport);
        returns their specs. The next refit to its replacement opens a new channel; the
        dead workers' ends went with their processes, the policy's ends close at its
        teardown (a channel is never used again once dropped here)."""
        with self._lock:
            keys = [k for k in self._sessions if k[1] == id(generation)]
            return [self._sessions.pop(k).spec for k in keys]

    def close(self) -> None:
        """Forget every session (the run is over; workers close their own ends)."""
        with self._lock:
            self._sessions.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)
