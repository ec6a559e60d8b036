"""A refit receiver that keeps what it receives: a policy's export, as an engine gets it.

:func:`capture_export` refits a policy handle (:class:`rlcore.handles.RefitSender`)
through the core's own refit (:func:`rlcore.refit.sync.refit`, the channel and bucket
plan of a real run) into one Ray actor that loads nothing and keeps every tensor, and
returns them by name. The conformance suite compares them with what the backend
declares; a run whose refit check failed loads them into a reference model to tell a
policy bug from an engine bug (:mod:`rlcore.app.diagnose`).
"""

from __future__ import annotations

from typing import Any

from rlcore.refit.worker import RefitChannels
from rlcore.runtime.group_handle import GroupHandle
from rlcore.runtime.worker_group import DistributedWorker


class CaptureWorker(DistributedWorker, RefitChannels):
    """Channel rank 1..N of a refit; keeps the received tensors (CPU copies)."""

    def __init__(self, rank: int, world_size: int, specs: list[Any]) -> None:
        super().__init__(rank, world_size)
        self.specs = specs
        self.kept: dict[str, Any] = {}

    def open_refit_channel(self, spec: Any) -> None:
        self.join_refit_channel(spec, 1 + self.rank)

    def receive_weights(self, spec: Any, step: int, buckets: list[list[Any]]) -> int:
        from rlcore.refit import channels

        self.kept = {
            n: t.detach().cpu().clone()
            for n, t in channels.receive_weights(spec, 1 + self.rank, step, buckets)
        }
        return len(self.kept)

    def received(self) -> dict[str, Any]:
        return self.kept


class CaptureReceiver(GroupHandle):
    """The driver's handle (:class:`rlcore.handles.RefitReceiver`) of one :class:`CaptureWorker`."""

    refit_ranks = 1

    def __init__(self, group: Any, specs: list[Any]) -> None:
        super().__init__(group, backend="capture", role="generation")
        self._specs = list(specs)

    def weight_specs(self) -> list[Any]:
        return list(self._specs)

    def open_refit_channel(self, spec: Any) -> list[Any]:
        return list(self.group.call_async("open_refit_channel", spec))

    def receive_weights(self, spec: Any, step: int, buckets: list[list[Any]]) -> list[Any]:
        return list(self.group.call_async("receive_weights", spec, step, buckets))

    def received(self) -> dict[str, Any]:
        return dict(self.group.call("received", what="captured weights")[0])


def file_transport_first(declared: Any, accelerator: str | None) -> str | None:
    """The transport a capture uses: of those the policy declares and the core runs here,
    files first (they leave no channel open), else collective; ``None`` if none."""
    from rlcore.refit import transports as core_transports

    here = core_transports.implemented(accelerator)
    # Stable sort: the transports that keep no sender waiting (files) first, each group in
    # the order refit.transport: auto uses apart.
    order = sorted(core_transports.preferred(colocated=False), key=lambda t: here[t].lockstep if t in here else True)
    return next((str(t) for t in order if t in declared and t in here), None)


def capture_export(policy: Any, ctx: Any) -> dict[str, Any]:
    """Every tensor ``policy`` sends in one refit as ``ctx`` (a :class:`rlcore.context.RefitContext`
    whose transport the core runs on this host, with sessions of its own, closed here) says,
    by name; the capture actor is gone when this returns."""
    from rlcore.refit.sync import refit
    from rlcore.runtime.worker_group import WorkerGroup

    specs = list(policy.weight_specs())
    # No CPU reserved: the run's workers may hold every CPU of the cluster (the quickstart's
    # do), and an actor that asks for any would wait for one forever. Bounded by the refit's
    # deadline all the same.
    group = WorkerGroup(CaptureWorker, 1, name="refit-capture", args=(specs,), num_cpus=0,
                        dist_backend=None, cancel=ctx.cancel, deadline=ctx.deadline)
    receiver = CaptureReceiver(group, specs)
    try:
        refit(policy, receiver, ctx)
        return receiver.received()
    finally:
        ctx.sessions.close()
        receiver.shutdown()
