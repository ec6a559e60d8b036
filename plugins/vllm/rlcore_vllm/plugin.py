"""The rlcore plugin: declaration and init hook of the ``vllm`` generation backend (options: :mod:`rlcore_vllm.options`).

Light on purpose: ``rlcore plugins`` imports this module, so nothing here imports
vllm, torch, transformers or ray. The engine is built by
:mod:`rlcore_vllm.handle` inside :func:`rlcore_init_generation`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlcore.context import InitContext
from rlcore.declarations import (
    BackendDeclaration,
    Condition,
    InflightRefit,
    OverlapSafety,
    RefitLanding,
    Role,
    Transport,
)
from rlcore.hookspecs import hookimpl
from rlcore_vllm.options import VLLMOptions

if TYPE_CHECKING:
    from rlcore_vllm.handle import VLLMGeneration


DESCRIPTION = (
    "vLLM engines (one per worker) fed through vLLM's weight-transfer API; "
    "optional OpenAI-compatible endpoint"
)


@hookimpl
def rlcore_declare_backend() -> BackendDeclaration:
    return BackendDeclaration(
        name="vllm",
        roles={Role.GENERATION},
        overlap=OverlapSafety(
            non_colocated=True,
            colocated=False,
            reason="profiles free device memory at start",
        ),
        refit_fed=True,
        receive_transports={Transport.COLLECTIVE, Transport.SHARED_MEMORY, Transport.DISK},
        openai_endpoint=True,
        openai_endpoint_when=(Condition("options.serve_openai", True),),
        # VLLMWorker.receive_weights: the server's own pause holds the requests in flight;
        # in-process, the worker's step loop loads between two steps (rlcore_vllm.stepped).
        # Server mode samples through /v1/completions, which says no token's version: its
        # samples carry the version the call began with (a lower bound), not per-token spans.
        inflight_refit=(
            InflightRefit(RefitLanding.PAUSE, token_versions=False, when=(Condition("options.serve_openai", True),)),
            InflightRefit(
                RefitLanding.BETWEEN_STEPS, token_versions=True, when=(Condition("options.serve_openai", False),)
            ),
        ),
        # LoRA adapters served in place through vLLM's own LoRA support (rlcore_vllm.adapters).
        takes_adapters=True,
        contract_version="2.6",
        options=VLLMOptions,
        description=DESCRIPTION,
    )


@hookimpl
def rlcore_init_generation(ctx: InitContext) -> VLLMGeneration:
    """Start ``generation.workers`` vLLM engines (see :func:`rlcore_vllm.handle.start_generation`)."""
    from rlcore_vllm.handle import start_generation

    return start_generation(ctx)
