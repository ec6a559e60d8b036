"""``policy.options`` of the ``fsdp`` backend: plain data, imported by ``rlcore plugins``
and by the backend's own modules (never through the entry point)."""

from __future__ import annotations

from dataclasses import dataclass

from rlcore.config import bounded
from rlcore.errors import ConfigError
from rlcore.lora import LoraOptions


@dataclass
class FSDPOptions:
    """``policy.options`` of the ``fsdp`` backend."""

    #: FSDP1 ``use_orig_params``: keep the original parameters visible as views of the
    #: flat parameter (needed for per-parameter optimizer settings, harmless otherwise).
    use_orig_params: bool = True
    #: Clip the global gradient norm to this value; ``<= 0`` disables clipping
    #: (the norm is still measured and reported).
    max_grad_norm: float = bounded(1.0)  # any: <= 0 measures only
    #: AdamW weight decay (the learning rate comes with every ``train_step``).
    weight_decay: float = bounded(0.0, ge=0)
    #: Torch CPU threads per rank (``OMP_NUM_THREADS``); 0: ``policy.devices_per_worker``
    #: on CPU, 1 on CUDA.
    threads_per_worker: int = bounded(0, ge=0)
    #: Rows per forward/backward pass on each rank; larger batches are split into
    #: micro-batches (gradients accumulate across them).
    micro_batch_size: int = bounded(32, ge=1)
    #: Seed of torch's generators on every rank.
    seed: int = bounded(0, ge=0)
    #: ``auto`` (CUDA when the Ray cluster has GPUs), ``cpu`` or ``cuda``.
    device: str = "auto"
    #: Timeout in seconds of every collective in the policy group and of each driver
    #: call to the workers after init.
    timeout_s: float = bounded(300.0, gt=0)
    #: Train low-rank adapters (peft's LoRA) instead of the weights: the base weights are
    #: frozen, only the adapters train and have optimizer state, and the policy exports
    #: merged weights (rlcore.lora; needs use_orig_params). ``null``: train every weight.
    lora: LoraOptions | None = None

    def __post_init__(self) -> None:
        if self.lora is not None and not self.use_orig_params:
            raise ConfigError(
                "policy.options.lora needs policy.options.use_orig_params=true: FSDP1 keeps frozen "
                "base weights and trained adapters in one flat parameter only with it",
                key="policy.options.use_orig_params",
            )
