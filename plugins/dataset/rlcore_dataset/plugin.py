"""The rlcore plugin: declaration and init hook of the ``dataset`` env backend."""

from __future__ import annotations

from rlcore.context import InitContext
from rlcore.declarations import BackendDeclaration, OverlapSafety, Role
from rlcore.hookspecs import hookimpl
from rlcore_dataset.options import DatasetOptions


@hookimpl
def rlcore_declare_backend() -> BackendDeclaration:
    return BackendDeclaration(
        name="dataset",
        roles={Role.ENV},
        overlap=OverlapSafety(non_colocated=True, colocated=True),
        options=DatasetOptions,
        extra_draws=True,  # dynamic sampling's draws take the next rows of the stream
        contract_version="2.6",
        description="your prompts (JSONL/JSON/Parquet/datasets) scored by your Python reward functions",
    )


@hookimpl
def rlcore_init_env(ctx: InitContext):  # noqa: ANN201 - a DatasetEnv; its module is imported here
    """Read the rows and start ``env.workers`` reward processes (in the driver's host: the env
    samples through the run's generation, its rewards run beside it)."""
    from rlcore.errors import ConfigError
    from rlcore_dataset.data import load_rows_and_origins
    from rlcore_dataset.env import DatasetEnv
    from rlcore_dataset.pool import RewardPool
    from rlcore_dataset.rewards import RewardSpec, parse_specs

    if ctx.placement.pinned:
        raise ConfigError(
            "placement.nodes.env is set, but the 'dataset' env runs in the driver with its reward "
            "processes beside it; remove placement.nodes.env",
            key="placement.nodes.env",
        )
    o: DatasetOptions = ctx.options
    specs = [RewardSpec(_absolute(s.spec), s.weight) for s in parse_specs(o.reward, o.reward_weights)]
    rows, origins = load_rows_and_origins(o.data, split=o.split)
    ctx.cancel.raise_if_cancelled("init:env")
    ctx.deadline.raise_if_expired()
    pool = RewardPool(
        [s.spec for s in specs],
        workers=ctx.config.env.workers,
        timeout_s=o.reward_timeout_s,
        start_timeout_s=120.0 if (left := ctx.deadline.remaining()) is None else max(1.0, left),
    )
    pool.start()
    return DatasetEnv(o, rows, specs, pool, origins)


def _absolute(spec: str) -> str:
    """A file spec made absolute, so the reward processes find it whatever their cwd."""
    from pathlib import Path

    where, _, name = spec.rpartition(":")
    return f"{Path(where).resolve()}:{name}" if where.endswith(".py") else spec
