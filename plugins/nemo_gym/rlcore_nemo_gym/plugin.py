"""The rlcore plugin: declaration and init hook of the ``nemo_gym`` env backend (options: :mod:`rlcore_nemo_gym.options`).

Light on purpose: ``rlcore plugins`` imports this module, so nothing here imports
nemo_gym (which lives in a venv of its own, see README.md), httpx or anything
heavy. The servers are started by :mod:`rlcore_nemo_gym.handle` inside
:func:`rlcore_init_env`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlcore.context import InitContext
from rlcore.declarations import BackendDeclaration, Need, OverlapSafety, Role
from rlcore.hookspecs import hookimpl
from rlcore_nemo_gym.options import NemoGymOptions

if TYPE_CHECKING:
    from rlcore_nemo_gym.handle import NemoGymEnv


DESCRIPTION = (
    "NeMo Gym environments: Gym's servers in their own venv and process group, "
    "driving the policy through the generation endpoint"
)


@hookimpl
def rlcore_declare_backend() -> BackendDeclaration:
    return BackendDeclaration(
        name="nemo_gym",
        roles={Role.ENV},
        # CPU-only HTTP servers: nothing to fight over with other inits, on any device.
        overlap=OverlapSafety(non_colocated=True, colocated=True),
        needs=(
            Need(
                "generation.endpoint",
                kind="event",
                reason="Gym servers call the policy model over its OpenAI-compatible endpoint",
            ),
        ),
        options=NemoGymOptions,
        max_workers=1,  # one set of Gym servers, whatever env.workers says
        contract_version="2.6",
        description=DESCRIPTION,
    )


@hookimpl
def rlcore_init_env(ctx: InitContext) -> NemoGymEnv:
    """Start Gym's servers at once, wait for the endpoint meanwhile (see :func:`rlcore_nemo_gym.handle.start_env`)."""
    from rlcore_nemo_gym.handle import start_env

    return start_env(ctx)
