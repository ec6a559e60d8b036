"""The rlcore plugin: declaration, options and init hook of the ``fsdp`` policy backend.

This module is the entry point (``rlcore.backends: fsdp``) and is imported by
``rlcore plugins`` and in every Ray worker: it imports neither torch nor ray at
module level. The work happens in :mod:`rlcore_fsdp.worker` (inside Ray actors)
and is driven through :class:`rlcore_fsdp.handle.FSDPPolicy`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlcore.context import InitContext
from rlcore.declarations import BackendDeclaration, OverlapSafety, Role, Transport
from rlcore.hookspecs import hookimpl

if TYPE_CHECKING:
    from rlcore_fsdp.handle import FSDPPolicy

log = logging.getLogger(__name__)


@dataclass
class FSDPOptions:
    """``policy.options`` of the ``fsdp`` backend."""

    #: FSDP1 ``use_orig_params``: keep the original parameters visible as views of the
    #: flat parameter (needed for per-parameter optimizer settings, harmless otherwise).
    use_orig_params: bool = True
    #: Clip the global gradient norm to this value; ``<= 0`` disables clipping
    #: (the norm is still measured and reported).
    max_grad_norm: float = 1.0
    #: AdamW weight decay (the learning rate comes with every ``train_step``).
    weight_decay: float = 0.0
    #: Torch CPU threads per rank (``OMP_NUM_THREADS``); 0: ``policy.devices_per_worker``
    #: on CPU, 1 on CUDA.
    threads_per_worker: int = 0
    #: Rows per forward/backward pass on each rank; larger batches are split into
    #: micro-batches (gradients accumulate across them).
    micro_batch_size: int = 32
    #: Seed of torch's generators on every rank.
    seed: int = 0
    #: ``auto`` (CUDA when the Ray cluster has GPUs), ``cpu`` or ``cuda``.
    device: str = "auto"
    #: Timeout in seconds of every collective in the policy group and of each driver
    #: call to the workers after init.
    timeout_s: float = 300.0


@hookimpl
def rlcore_declare_backend() -> BackendDeclaration:
    return BackendDeclaration(
        name="fsdp",
        roles={Role.POLICY},
        overlap=OverlapSafety(non_colocated=True, colocated=True),
        send_transports={Transport.COLLECTIVE, Transport.SHARED_MEMORY, Transport.DISK},
        options=FSDPOptions,
        contract_version="1.0",
        description=(
            "Hugging Face causal LM trained with PyTorch FSDP (FSDP1, full shard, gloo on "
            "CPU / NCCL on CUDA); streams HF-named weights one FSDP unit at a time"
        ),
    )


def _resolve_device(requested: str) -> str:
    import ray

    if requested not in ("auto", "cpu", "cuda"):
        from rlcore.errors import ConfigError

        raise ConfigError(
            f"policy.options.device of backend 'fsdp' is {requested!r}; use auto, cpu or cuda",
            key="policy.options.device",
        )
    if requested != "auto":
        return requested
    return "cuda" if ray.cluster_resources().get("GPU", 0) >= 1 else "cpu"


@hookimpl
def rlcore_init_policy(ctx: InitContext) -> FSDPPolicy:
    import ray

    if not ray.is_initialized():
        raise RuntimeError(
            "the fsdp policy backend needs a running Ray cluster: start one with "
            "rlcore.runtime.cluster.Cluster(config.cluster).start() before calling rlcore_init_policy "
            "(`rlcore run` does this)"
        )
    from rlcore.runtime.workers import WorkerGroup
    from rlcore.tinymodel import ensure_model
    from rlcore_fsdp.handle import FSDPPolicy
    from rlcore_fsdp.worker import FSDPWorker

    options = (
        ctx.options
        if isinstance(ctx.options, FSDPOptions)
        else FSDPOptions(**dict(ctx.options or {}))
    )
    role = ctx.config.policy
    t0 = time.monotonic()
    model_dir = ensure_model(
        ctx.config.model, ctx.cache_dir, cancel=ctx.cancel, deadline=ctx.deadline
    )
    device = _resolve_device(options.device)
    if device == "cuda":
        # One GPU per rank: FSDP shards across ranks, never across GPUs of one rank.
        threads = options.threads_per_worker or 1
        resources = {"num_cpus": 1.0, "num_gpus": 1.0}
        dist_backend = "nccl"
    else:
        threads = options.threads_per_worker or max(1, int(role.devices_per_worker))
        resources = {"num_cpus": float(role.devices_per_worker), "num_gpus": 0.0}
        dist_backend = "gloo"
    group = WorkerGroup(
        FSDPWorker,
        role.workers,
        name="fsdp-policy",
        **resources,
        env={"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"},
        dist_backend=dist_backend,
        timeout_s=options.timeout_s,
        cancel=ctx.cancel,
        deadline=ctx.deadline,
        placement=ctx.placement,
    )
    try:
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
        info["init_s"] = time.monotonic() - t0
        ctx.log.info(
            "fsdp policy: %d rank(s) on %s, %d FSDP units, %.1f M params, init %.2fs "
            "(workers %.2fs, load %.2fs, sync %.2fs, wrap %.2fs)",
            role.workers,
            device,
            info["units"],
            info["params"] / 1e6,
            info["init_s"],
            group.start_time_s,
            info["load_s"],
            info["sync_s"],
            info["wrap_s"],
        )
        return FSDPPolicy(group, device_type=device, specs=specs, info=info)
    except BaseException:
        group.shutdown()
        raise
