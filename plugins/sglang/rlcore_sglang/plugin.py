"""The rlcore plugin: declaration and init hook of the ``sglang`` generation backend.

Light on purpose: ``rlcore plugins`` imports this module, so nothing here imports
sglang, torch, transformers or ray. Servers are started by
:func:`rlcore_sglang.handle.start_generation` inside :func:`rlcore_init_generation`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlcore.context import InitContext
from rlcore.declarations import (
    BackendDeclaration,
    InflightRefit,
    OverlapSafety,
    RefitLanding,
    Role,
    Transport,
)
from rlcore.hookspecs import hookimpl
from rlcore_sglang.options import SGLangOptions

if TYPE_CHECKING:
    from rlcore_sglang.handle import SGLangGeneration

DESCRIPTION = (
    "SGLang servers (one per worker, own venv) fed through SGLang's weight-update API; "
    "OpenAI-compatible endpoint (SGLang's /v1)"
)


@hookimpl
def rlcore_declare_backend() -> BackendDeclaration:
    return BackendDeclaration(
        name="sglang",
        roles={Role.GENERATION},
        overlap=OverlapSafety(
            non_colocated=True,
            colocated=False,
            reason="profiles free device memory at start",
        ),
        refit_fed=True,
        receive_transports={Transport.COLLECTIVE, Transport.SHARED_MEMORY, Transport.DISK},
        openai_endpoint=True,
        # /pause_generation retract holds requests in flight (SGLangWorker.receive_weights);
        # SGLang reports each finished request's weight_versions spans.
        inflight_refit=(InflightRefit(RefitLanding.PAUSE, token_versions=True),),
        options=SGLangOptions,
        contract_version="2.6",
        description=DESCRIPTION,
    )


@hookimpl
def rlcore_init_generation(ctx: InitContext) -> SGLangGeneration:
    """Start ``generation.workers`` SGLang servers (see :func:`rlcore_sglang.handle.start_generation`)."""
    from rlcore_sglang.handle import start_generation

    return start_generation(ctx)
