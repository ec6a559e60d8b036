"""Driver-side methods a policy handle over a :class:`rlcore.runtime.worker_group.WorkerGroup` shares.

:class:`GroupPolicy` implements the channel part of
:class:`rlcore.handles.RefitSender` for handles whose workers are
:class:`rlcore.refit.worker.RefitSenderWorker` ranks (rank 0 names the channel's
address and sends, every rank runs the export) and the training loop's
``train_step`` (every rank steps; rank 0 reports); its lifecycle is
:class:`rlcore.runtime.group_handle.GroupHandle`'s. The handle provides
``device_type``, ``weight_specs()`` and ``logprobs()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rlcore.runtime.batches import put_train_inputs
from rlcore.runtime.group_handle import GroupHandle

if TYPE_CHECKING:
    from rlcore.handles import LossOptions


class GroupPolicy(GroupHandle):
    """A base for policy handles (see the module doc)."""

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

    def train_step(
        self,
        batch: Sequence[tuple[Sequence[int], Sequence[int]]],
        advantages: Sequence[float],
        old_logprobs: Sequence[Sequence[float]] | None = None,
        *,
        clip_eps: float = 0.2,
        lr: float = 1e-5,
        loss: LossOptions | None = None,
    ) -> dict[str, float]:
        """One GRPO step on every rank; returns rank 0's metrics (``loss``, ``grad_norm``,
        ``clip_fraction``, ``tokens``, ``lr``). ``loss``: :class:`rlcore.handles.LossOptions`
        (contract 2.5), given to every rank through the object store."""
        import ray

        self._check_open()
        inputs = put_train_inputs(batch, advantages, old_logprobs)
        extra = () if loss is None else (ray.put(loss),)
        results = self.group.call(
            "train_step", *inputs, float(clip_eps), float(lr), *extra, what="train step"
        )
        return dict(results[0])
