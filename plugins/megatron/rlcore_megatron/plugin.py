"""The rlcore plugin: declaration, options and init hooks of the ``megatron`` backend.

This module is the entry point (``rlcore.backends: megatron``); ``rlcore
plugins`` and every Ray worker import it, so it imports neither torch, ray nor
megatron-core. The init hooks hand over to :mod:`rlcore_megatron.handle`, which
starts :mod:`rlcore_megatron.worker` classes in Ray worker groups.

About ``megatron.checkpoint``: the policy produces it only when the run's
generation needs it (generation backend ``megatron`` and not refit-fed). A
declaration condition cannot say so: conditions are evaluated on the
*producer's* view of the config (``refit_fed``, ``colocated``, ``workers``,
``options.*`` of the policy section), and the policy section has no
``refit_fed``. So the artifact is declared unconditionally -- harmless for the
plan, where an artifact nobody needs draws no edge and no wait -- and the policy
init checks ``config.generation`` and skips the conversion when no one needs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlcore.declarations import (
    Artifact,
    BackendDeclaration,
    Condition,
    Need,
    OverlapSafety,
    Role,
    Transport,
)
from rlcore.hookspecs import hookimpl

if TYPE_CHECKING:
    from rlcore.context import InitContext
    from rlcore_megatron.handle import MegatronGeneration, MegatronPolicy

#: Name of the converted checkpoint artifact (``<cache>/megatron.checkpoint/<key>``).
CHECKPOINT_ARTIFACT = "megatron.checkpoint"


@dataclass
class MegatronOptions:
    """``policy.options`` / ``generation.options`` of the ``megatron`` backend."""

    #: Tensor-parallel ranks per model replica. Heads, query groups and the MLP width must
    #: divide by it. The converted checkpoint is written at the policy's value (it is part
    #: of the checkpoint key); megatron-core's torch_dist format reshards on load, so a
    #: generation with another value loads it too.
    tensor_model_parallel_size: int = 1
    #: The vocabulary is padded to a multiple of this times the tensor-parallel size, as
    #: Megatron-LM does (zero rows; their logits are ignored). Part of the checkpoint key.
    make_vocab_size_divisible_by: int = 128
    #: Seed of megatron-core's RNG states (tensor-parallel and data-parallel).
    seed: int = 0
    #: Timeout in seconds of every collective of the backend's process groups
    #: (conversion ranks included) and of each driver call to the workers after init.
    timeout_s: float = 300.0
    #: ``auto`` (CUDA when the Ray cluster has GPUs), ``cpu`` or ``cuda``.
    device: str = "auto"
    #: Torch CPU threads per rank; 0: ``<role>.devices_per_worker`` on CPU, 1 on CUDA.
    threads_per_worker: int = 0
    #: Rows per forward (and backward) pass on each rank; larger shards are split.
    micro_batch_size: int = 32
    #: (policy) Clip the global gradient norm to this value; ``<= 0``: measure only.
    max_grad_norm: float = 1.0
    #: (policy) AdamW weight decay; the learning rate comes with every train step.
    weight_decay: float = 0.0
    #: (generation) Requests the static engine runs in one batch (its KV cache size).
    max_batch_size: int = 64
    #: (generation) Longest prompt + completion, in tokens (KV cache length).
    max_sequence_length: int = 512


@hookimpl
def rlcore_declare_backend() -> BackendDeclaration:
    return BackendDeclaration(
        name="megatron",
        roles={Role.POLICY, Role.GENERATION},
        overlap=OverlapSafety(
            non_colocated=True,
            colocated=False,
            reason=(
                "policy and generation each allocate their full model state (weights, "
                "optimizer, KV cache) on the shared devices while starting: colocated, "
                "they start one after the other"
            ),
        ),
        produces=(
            Artifact(
                CHECKPOINT_ARTIFACT,
                atomic=True,
                role=Role.POLICY,
                description=(
                    "the Hugging Face checkpoint converted to megatron-core torch_dist, "
                    "published atomically in the cache"
                ),
            ),
        ),
        needs=(
            Need(
                CHECKPOINT_ARTIFACT,
                role=Role.GENERATION,
                when=(Condition("refit_fed", False),),
                reason="loads the converted checkpoint",
            ),
        ),
        refit_fed=True,
        send_transports={Transport.COLLECTIVE, Transport.DISK, Transport.SHARED_MEMORY},
        receive_transports={Transport.COLLECTIVE, Transport.DISK, Transport.SHARED_MEMORY},
        # megatron-core's OpenAI-compatible server needs its dynamic engine (CUDA);
        # the static engine used here has none, so none is declared.
        openai_endpoint=False,
        options=MegatronOptions,
        description=(
            "megatron-core GPTModel (local layer spec, tensor parallel over gloo/NCCL) as "
            "policy and static-batch generation; Llama-family and Qwen2 checkpoints"
        ),
    )


@hookimpl
def rlcore_init_policy(ctx: InitContext) -> MegatronPolicy:
    """Start ``policy.workers`` ranks (see :func:`rlcore_megatron.handle.start_policy`)."""
    from rlcore_megatron.handle import start_policy

    return start_policy(ctx)


@hookimpl
def rlcore_init_generation(ctx: InitContext) -> MegatronGeneration:
    """Start ``generation.workers`` ranks (see :func:`rlcore_megatron.handle.start_generation`)."""
    from rlcore_megatron.handle import start_generation

    return start_generation(ctx)
