"""The rlcore plugin: declaration and options of the ``megatron`` backend.

This module is the entry point (``rlcore.backends: megatron``); ``rlcore
plugins`` and every Ray worker import it, so it imports neither torch nor
megatron-core. Init hooks are not implemented yet: the backend is declared
(and listed, planned, checked) but cannot be started.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    #: (conversion ranks included).
    timeout_s: float = 300.0


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
        openai_endpoint=True,
        options=MegatronOptions,
        description=(
            "megatron-core GPTModel (local layer spec, tensor parallel over gloo/NCCL) as "
            "policy and static-batch generation; Llama-family and Qwen2 checkpoints"
        ),
    )
