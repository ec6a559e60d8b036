"""Driver-side refit methods for a policy handle over a :class:`rlcore.workers.WorkerGroup`.

:class:`GroupRefitSender` implements the channel part of
:class:`rlcore.handles.RefitSender` for handles whose workers are
:class:`rlcore.refit.worker.RefitSenderWorker` ranks: rank 0 names the channel's
address and sends, every rank runs the export. The handle provides ``group``,
``_check_open()``, ``device_type`` and ``weight_specs()``.
"""

from __future__ import annotations

from typing import Any


class GroupRefitSender:
    """A mixin for policy handles (see the module doc)."""

    group: Any
    _check_open: Any  # the handle's: raises once it was shut down

    def refit_address(self) -> tuple[str, int]:
        """Host and free port on rank 0's node for a collective refit channel."""
        self._check_open()
        host, port = self.group.call("refit_address", ranks=[0], what="refit address")[0]
        return str(host), int(port)

    def open_refit_channel(self, spec: Any) -> list[Any]:
        """Every rank is told; rank 0 joins as channel rank 0. Ray refs."""
        self._check_open()
        return list(self.group.call_async("open_refit_channel", spec))

    def refit_ceiling(self, spec: Any, step: int, nbytes: int) -> list[Any]:
        """Raw bytes over an open refit channel from rank 0 (bench); Ray refs."""
        self._check_open()
        return list(self.group.call_async("refit_ceiling", spec, step, nbytes, ranks=[0]))

    def send_weights(self, spec: Any, step: int, buckets: list[list[Any]]) -> list[Any]:
        """Every rank exports, rank 0 sends ``buckets`` of ``step``; Ray refs."""
        import ray

        self._check_open()
        plan = ray.put(buckets)  # one copy in the object store for every rank
        return list(self.group.call_async("send_weights", spec, step, plan))
