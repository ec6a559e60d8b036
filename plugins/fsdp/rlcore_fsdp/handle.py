"""The driver-side handle of the FSDP policy: the training loop's and refit's grip on it."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from rlcore.refit.specs import TensorSpec
from rlcore.runtime.batches import put_rows
from rlcore.runtime.policy_group import GroupPolicy
from rlcore.runtime.workers import WorkerGroup


class FSDPPolicy(GroupPolicy):
    """A started FSDP policy: N :class:`~rlcore_fsdp.worker.FSDPWorker` ranks in Ray actors.

    Implements :class:`rlcore.handles.RefitSender` (rank 0 sends; every rank takes
    part in the export) and the policy side of :func:`rlcore.app.grpo.run_grpo`
    (``logprobs``, ``train_step``). Every call waits through
    :meth:`rlcore.runtime.workers.WorkerGroup.call`, i.e. with the group's cancellation token
    and a deadline (``policy.options.timeout_s``), and names the failing rank.

    Attributes:
        group: the worker group.
        device_type: ``cpu`` or ``cuda`` (picks gloo or NCCL for collective refit).
        info: rank 0's load report (timings in seconds, sizes) plus ``init_s``.
    """

    def __init__(
        self,
        group: WorkerGroup,
        *,
        device_type: str,
        specs: Sequence[TensorSpec] | None = None,
        info: dict[str, Any] | None = None,
    ) -> None:
        self.group = group
        self.device_type = device_type
        self.info = dict(info or {})
        self._specs = list(specs) if specs is not None else None
        self._closed = False
        self._lock = threading.Lock()

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the fsdp policy has been shut down")

    # ------------------------------------------------------------ refit sender

    def weight_specs(self) -> list[TensorSpec]:
        """Every weight (HF name, full shape, dtype) in send order; fixed after load."""
        self._check_open()
        if self._specs is None:
            self._specs = list(self.group.call("weight_specs", ranks=[0], what="weight specs")[0])
        return list(self._specs)

    # ------------------------------------------------------------ training loop

    def logprobs(self, batch: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[list[float]]:
        """Per-token logprobs of each row's completion tokens (right padding, explicit mask).

        Rows are split across the ranks; the shards come back in rank order.
        """
        self._check_open()
        parts = self.group.call("logprobs", put_rows(batch), what="logprobs")
        return [row for part in parts for row in part]

    # ------------------------------------------------------------ lifecycle

    def pids(self) -> list[int]:
        """Process ids of the ranks (for leak checks)."""
        self._check_open()
        return self.group.pids()

    def shutdown(self) -> None:
        """Release every actor (graceful teardown, then kill). Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.group.shutdown()
