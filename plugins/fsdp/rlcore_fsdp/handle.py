"""The driver-side handle of the FSDP policy: the training loop's and refit's grip on it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlcore.refit.specs import TensorSpec
from rlcore.runtime.batches import put_rows
from rlcore.runtime.policy_group import GroupPolicy
from rlcore.runtime.worker_group import WorkerGroup


class FSDPPolicy(GroupPolicy):
    """A started FSDP policy: N :class:`~rlcore_fsdp.worker.FSDPWorker` ranks in Ray actors.

    Implements :class:`rlcore.handles.RefitSender` (rank 0 sends; every rank takes
    part in the export) and the policy side of :func:`rlcore.app.grpo.run_grpo`
    (``logprobs``, ``train_step``). Every call waits through
    :meth:`rlcore.runtime.worker_group.WorkerGroup.call`, i.e. with the group's cancellation token
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
        super().__init__(group, backend="fsdp", role="policy")
        self.device_type = device_type
        self.info = dict(info or {})
        self._specs = list(specs) if specs is not None else None

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
