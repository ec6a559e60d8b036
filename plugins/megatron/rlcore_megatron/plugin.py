"""The rlcore plugin: declaration and init hooks of the ``megatron`` backend (options: :mod:`rlcore_megatron.options`).

This module is the entry point (``rlcore.backends: megatron``); ``rlcore
plugins`` and every Ray worker import it, so it imports neither torch, ray nor
megatron-core. The init hooks hand over to :mod:`rlcore_megatron.handle`, which
starts :mod:`rlcore_megatron.worker` classes in Ray worker groups.

About ``megatron.checkpoint``: the policy declares it unconditionally and
produces it only when the plan says a reader needs it
(``InitContext.artifact_needed``): the generation's need holds only when it is
not refit-fed, so a refit-fed run converts nothing, and any other backend that
declares the need gets the checkpoint too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlcore.declarations import (
    Artifact,
    BackendDeclaration,
    CheckpointSupport,
    Condition,
    InflightRefit,
    Need,
    OverlapSafety,
    RefitLanding,
    Role,
    Transport,
)
from rlcore.hookspecs import hookimpl
from rlcore_megatron import train_state  # light: the format's name and version
from rlcore_megatron.options import CHECKPOINT_ARTIFACT, MegatronOptions

if TYPE_CHECKING:
    from rlcore.context import InitContext
    from rlcore_megatron.handle import MegatronGeneration, MegatronPolicy

def _transports() -> set[Transport]:
    """Refit transports both roles run: cuda_ipc (colocated on one GPU) where this host has
    NVIDIA devices, as the planner detects them (no torch import)."""
    from rlcore.setup.planner import detect_accelerator

    cuda = {Transport.CUDA_IPC} if detect_accelerator() == "cuda" else set()
    return {Transport.COLLECTIVE, Transport.DISK, Transport.SHARED_MEMORY, *cuda}


def _inflight_refit() -> tuple[InflightRefit, ...]:
    """Refits in flight (``generation.options.inflight_refit``): megatron-core's dynamic
    engine at tensor-parallel size 1 holds its requests (suspend), takes the weights and lets
    them go on (resume, their KV computed again), between two of its steps; each token
    carries its version. The dynamic engine is ``engine: dynamic``, or ``auto`` where this
    host has NVIDIA devices."""
    from rlcore.setup.planner import detect_accelerator

    asked = (Condition("options.inflight_refit", True), Condition("options.tensor_model_parallel_size", 1))
    engines = ["dynamic", "auto"] if detect_accelerator() == "cuda" else ["dynamic"]
    return tuple(
        InflightRefit(RefitLanding.PAUSE, token_versions=True, when=(*asked, Condition("options.engine", e)))
        for e in engines
    )


@hookimpl
def rlcore_declare_backend() -> BackendDeclaration:
    return BackendDeclaration(
        name="megatron",
        roles={Role.POLICY, Role.GENERATION},
        # Colocated too: neither role sizes itself from the device's free memory (the
        # engine's KV cache is options.kv_cache_gib or max_batch_size x max_sequence_length),
        # so starting them together reaches the same peak as one after the other.
        overlap=OverlapSafety(non_colocated=True, colocated=True),
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
        # Colocated, the policy's optimizer state and the dynamic engine's memory move
        # out of the way of the other role (handle.sleep / wake).
        memory_handoff=True,
        send_transports=_transports(),
        receive_transports=_transports(),
        inflight_refit=_inflight_refit(),
        # With generation.options.serve_openai (rlcore.serve.openai_endpoint in front of the
        # engine; megatron-core's own server needs its dynamic engine and CUDA).
        openai_endpoint=True,
        openai_endpoint_when=(Condition("options.serve_openai", True),),
        # Trained and exported in the run's dtype (float16 would need loss scaling).
        dtypes={"float32", "bfloat16"},
        # Its train_step corrects per token for the weights that sampled (old_logprobs, the
        # clipped ratio of rlcore.runtime.losses.clipped_pg_loss), so a sample a few
        # versions old still gives the right gradient.
        max_staleness=8,
        # Training checkpoints (rlcore_megatron.train_state): megatron-core's distributed
        # checkpoint of weights and AdamW state, plus each rank's RNG states. The save only
        # reads them (no step, no RNG draw, no state moved), so it may overlap sampling.
        checkpoint=CheckpointSupport(format=train_state.FORMAT, version=train_state.FORMAT_VERSION, overlap=True),
        # Its train_step is rlcore.runtime.losses.PolicyGradientWorker's: every LossOptions feature.
        loss_options={"clip_eps_high", "aggregation", "correction"},
        contract_version="2.6",
        options=MegatronOptions,
        description=(
            "megatron-core GPTModel (local layer spec, tensor parallel over gloo/NCCL) as "
            "policy and generation (optional OpenAI-compatible endpoint); Llama-family and "
            "Qwen2 checkpoints"
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
