"""The driver-side handle of the FSDP policy: the training loop's and refit's grip on it."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from rlcore.errors import CheckpointError, WorkerError
from rlcore.refit.specs import TensorSpec
from rlcore.runtime.batches import put_rows
from rlcore.runtime.policy_group import GroupPolicy
from rlcore.runtime.worker_group import WorkerGroup
from rlcore_fsdp import checkpoint

log = logging.getLogger(__name__)


class FSDPPolicy(GroupPolicy):
    """A started FSDP policy: N :class:`~rlcore_fsdp.worker.FSDPWorker` ranks in Ray actors.

    Implements :class:`rlcore.handles.RefitSender` (rank 0 sends; every rank takes
    part in the export), :class:`rlcore.handles.Checkpointable` (every rank writes and
    reads its own shards: :mod:`rlcore_fsdp.checkpoint`) and the policy side of :func:`rlcore.app.grpo.run_grpo`
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

    def adapter_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The trained LoRA adapters as peft saves them (tensors by name, adapter config):
        :class:`rlcore.handles.AdapterSource`, for ``rlcore export --adapter``."""
        self._check_open()
        return tuple(self.group.call("adapter_state", what="adapter export")[0])  # type: ignore[return-value]

    # ------------------------------------------------------------ checkpoints

    def save_checkpoint(self, directory: str) -> None:
        """Every rank writes its shards of the weights and AdamW state and its RNG states
        into ``directory`` at once (format: :mod:`rlcore_fsdp.checkpoint`). Reads the
        state only. A full disk raises the ``OSError`` naming the path."""
        self._check_open()
        parts = self._checkpoint_call("save_checkpoint", directory, what="checkpoint save")
        log.info(
            "fsdp checkpoint saved to %s: %.1f MiB over %d rank(s) in %.2fs",
            directory,
            sum(p["bytes"] for p in parts) / 2**20,
            len(parts),
            max(p["seconds"] for p in parts),
        )

    def stage_checkpoint(self, directory: str) -> dict[str, float]:
        """Every rank copies its shards of the weights and AdamW state into host memory and
        DCP writes them into ``directory`` in the background (the same files as
        :meth:`save_checkpoint`); returns once every rank's copy is made, with the host
        bytes they hold together (reused by the next save)."""
        self._check_open()
        parts = self._checkpoint_call("stage_checkpoint", directory, what="checkpoint staging")
        return {"host_bytes": sum(p["host_bytes"] for p in parts), "rank_stage_s": max(p["stage_s"] for p in parts)}

    def checkpoint_written(self) -> bool:
        """Whether every rank's staged save is written; raises a rank's write failure (an
        ``OSError`` naming the path)."""
        self._check_open()
        return all(self._checkpoint_call("checkpoint_written", what="checkpoint write"))

    def load_checkpoint(self, directory: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote, resharding a checkpoint of another
        world size. Another model, or a missing or truncated file, raises
        :class:`rlcore.errors.CheckpointError` naming it before any rank loads."""
        self._check_open()
        meta = checkpoint.read_meta(directory)
        checkpoint.check_compatible(directory, meta, self.weight_specs(), self.info.get("lora"))
        if int(meta["world_size"]) != self.world_size:
            log.info(
                "fsdp checkpoint %s was saved by %d rank(s): resharding it onto %d",
                directory,
                meta["world_size"],
                self.world_size,
            )
        parts = self._checkpoint_call(
            "load_checkpoint", directory, meta, what="checkpoint load"
        )
        log.info(
            "fsdp checkpoint loaded from %s in %.2fs", directory, max(p["seconds"] for p in parts)
        )

    def _checkpoint_call(self, method: str, *args: Any, what: str) -> list[Any]:
        """``group.call`` that raises a rank's ``OSError`` or ``CheckpointError`` as that
        type (the contract's), with the group's message naming the rank."""
        try:
            return self.group.call(method, *args, what=what)
        except WorkerError as err:
            cause = getattr(err.__cause__, "cause", err.__cause__)
            if isinstance(cause, OSError):
                raise OSError(cause.errno, str(err), cause.filename) from err
            if isinstance(cause, CheckpointError):
                raise CheckpointError(str(err)) from err
            raise
