"""The rlcore plugin: declaration and init hook of the ``fsdp`` policy backend (options: :mod:`rlcore_fsdp.options`).

This module is the entry point (``rlcore.backends: fsdp``) and is imported by
``rlcore plugins`` and in every Ray worker: it imports neither torch nor ray at
module level. The work happens in :mod:`rlcore_fsdp.worker` (inside Ray actors)
and is driven through :class:`rlcore_fsdp.handle.FSDPPolicy`.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from rlcore.context import InitContext
from rlcore.declarations import (
    BackendDeclaration,
    CheckpointSupport,
    OverlapSafety,
    Role,
    Transport,
)
from rlcore.hookspecs import hookimpl
from rlcore_fsdp.checkpoint import FORMAT as CHECKPOINT_FORMAT
from rlcore_fsdp.checkpoint import VERSION as CHECKPOINT_VERSION
from rlcore_fsdp.options import FSDPOptions

if TYPE_CHECKING:
    from pathlib import Path

    from rlcore.refit.specs import TensorSpec
    from rlcore.runtime.worker_group import WorkerGroup
    from rlcore_fsdp.handle import FSDPPolicy

log = logging.getLogger(__name__)


def _send_transports() -> set[Transport]:
    """cuda_ipc (colocated on one GPU: the core's transport shares the exported tensors with
    the engine's process) where this host has NVIDIA devices, as the planner detects them."""
    from rlcore.setup.planner import detect_accelerator

    cuda = {Transport.CUDA_IPC} if detect_accelerator() == "cuda" else set()
    return {Transport.COLLECTIVE, Transport.SHARED_MEMORY, Transport.DISK, *cuda}


@hookimpl
def rlcore_declare_backend() -> BackendDeclaration:
    return BackendDeclaration(
        name="fsdp",
        roles={Role.POLICY},
        overlap=OverlapSafety(non_colocated=True, colocated=True),
        send_transports=_send_transports(),
        # Trained and exported in the run's dtype (float16 would need loss scaling).
        dtypes={"float32", "bfloat16"},
        # Its train_step corrects per token for the weights that sampled (old_logprobs, the
        # clipped ratio of rlcore.runtime.losses.clipped_pg_loss), so a sample a few
        # versions old still gives the right gradient.
        max_staleness=8,
        options=FSDPOptions,
        # Sharded DCP files written by every rank (rlcore_fsdp.checkpoint); the save only
        # reads the shards, so the core may overlap it with the next step's rollouts, and
        # DCP's async_save stages it in host memory, so the loop waits only for that copy.
        checkpoint=CheckpointSupport(
            format=CHECKPOINT_FORMAT, version=CHECKPOINT_VERSION, overlap=True, staged=True
        ),
        # policy.options.lora: peft's LoRA adapters train, merged weights leave (rlcore_fsdp.adapters).
        trains_adapters=True,
        # Its train_step is rlcore.runtime.losses.PolicyGradientWorker's: every LossOptions feature.
        loss_options={"clip_eps_high", "aggregation", "correction"},
        contract_version="2.6",
        description=(
            "Hugging Face causal LM trained with PyTorch FSDP (FSDP1, full shard, gloo on "
            "CPU / NCCL on CUDA); streams HF-named weights one FSDP unit at a time"
        ),
    )


def _options(ctx: InitContext) -> FSDPOptions:
    """``policy.options`` as :class:`FSDPOptions` (a plain mapping is converted)."""
    if isinstance(ctx.options, FSDPOptions):
        return ctx.options
    return FSDPOptions(**dict(ctx.options or {}))


def _start_workers(ctx: InitContext, options: FSDPOptions, device: str) -> WorkerGroup:
    """The policy's ranks as Ray actors, one device each (not yet loaded)."""
    from rlcore.runtime.resources import device_resources
    from rlcore.runtime.worker_group import WorkerGroup
    from rlcore_fsdp.worker import FSDPWorker

    role = ctx.config.policy
    # One GPU per rank: FSDP shards across ranks, never across GPUs of one rank.
    resources, threads = device_resources(
        device, role.devices_per_worker, options.threads_per_worker
    )
    return WorkerGroup(
        FSDPWorker,
        role.workers,
        name="fsdp-policy",
        **resources,
        env={"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"},
        timeout_s=options.timeout_s,
        cancel=ctx.cancel,
        deadline=ctx.deadline,
        placement=ctx.placement,
    )


def _load(
    ctx: InitContext, group: WorkerGroup, model_dir: Path, options: FSDPOptions, device: str
) -> tuple[list[TensorSpec], dict[str, Any]]:
    """Load the model on every rank; rank 0's weight specs and load report."""
    infos = group.call(
        "load",
        str(model_dir),
        ctx.config.model.dtype,
        options,
        device,
        what="loading the model into FSDP",
        deadline=ctx.deadline,
    )
    specs = group.call("weight_specs", ranks=[0], what="weight specs", deadline=ctx.deadline)[0]
    info = dict(infos[0])
    info["group_start_s"] = group.start_time_s
    return specs, info


def _log_ready(ctx: InitContext, info: dict[str, Any], device: str) -> None:
    ctx.log.info(
        "fsdp policy: %d rank(s) on %s, %d FSDP units, %.1f M params, init %.2fs "
        "(workers %.2fs, load %.2fs, sync %.2fs, wrap %.2fs)",
        ctx.config.policy.workers,
        device,
        info["units"],
        info["params"] / 1e6,
        info["init_s"],
        info["group_start_s"],
        info["load_s"],
        info["sync_s"],
        info["wrap_s"],
    )
    if info.get("lora"):
        ctx.log.info(
            "fsdp policy: LoRA adapters train (%.2f M parameters, rank %d); the base weights are frozen",
            info["trainable"] / 1e6, info["lora"]["rank"],
        )


@hookimpl
def rlcore_init_policy(ctx: InitContext) -> FSDPPolicy:
    from rlcore.runtime.resources import require_ray, resolve_worker_device

    require_ray("fsdp", "policy")
    from rlcore.models.tiny import ensure_model
    from rlcore_fsdp.handle import FSDPPolicy

    options = _options(ctx)
    t0 = time.monotonic()
    model_dir = ensure_model(
        ctx.config.model, ctx.cache_dir, cancel=ctx.cancel, deadline=ctx.deadline
    )
    device = resolve_worker_device(options.device, backend="fsdp", section="policy")
    group = _start_workers(ctx, options, device)
    try:
        specs, info = _load(ctx, group, model_dir, options, device)
        info["init_s"] = time.monotonic() - t0
        _log_ready(ctx, info, device)
        return FSDPPolicy(group, device_type=device, specs=specs, info=info)
    except BaseException:
        group.shutdown()
        raise
