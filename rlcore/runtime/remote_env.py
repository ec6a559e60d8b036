"""A prompt-and-score env run on the nodes ``placement.nodes.env`` picks.

An env built on :class:`rlcore.handles.PromptAndScoreEnv` makes prompts and scores texts;
the core samples through the generation. Such an env is cheap and lives in the driver,
unless the config pins the env role to some nodes: then :func:`placed_env` moves the env
object into one Ray actor there (a :class:`~rlcore.runtime.worker_group.WorkerGroup` of one,
with the role's placement) and returns a stand-in whose ``sample_prompts`` and ``score``
run in it. The env object and its prompts must pickle; the sampling stays in the driver.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rlcore.handles import PromptAndScoreEnv
from rlcore.runtime.worker_group import DistributedWorker, WorkerGroup

if TYPE_CHECKING:
    from rlcore.context import InitContext


class EnvWorker(DistributedWorker):
    """The actor that holds the env object (rank 0 of a group of one)."""

    def __init__(self, rank: int, world_size: int, env: PromptAndScoreEnv) -> None:
        super().__init__(rank, world_size)
        self.env = env

    def sample_prompts(self, n: int, step: int) -> list[Any]:
        return list(self.env.sample_prompts(n, step))

    def score(self, prompts: Sequence[Any], completions: Sequence[Sequence[str]]) -> list[list[float]]:
        return self.env.score(prompts, completions)

    def teardown(self) -> None:
        self.env.shutdown()
        super().teardown()


class RemoteEnv(PromptAndScoreEnv):
    """Stand-in for an env that runs in an :class:`EnvWorker`; the handle the core gets."""

    def __init__(self, group: WorkerGroup) -> None:
        self.group = group

    def sample_prompts(self, n: int, step: int) -> list[Any]:
        return list(self.group.call("sample_prompts", n, step, what="sample prompts")[0])

    def score(self, prompts: Sequence[Any], completions: Sequence[Sequence[str]]) -> list[list[float]]:
        return list(self.group.call("score", list(prompts), [list(c) for c in completions], what="score")[0])

    def shutdown(self) -> None:
        self.group.shutdown()


def placed_env(env: PromptAndScoreEnv, ctx: InitContext) -> PromptAndScoreEnv:
    """``env`` itself when the env role is not pinned to nodes; else a :class:`RemoteEnv`
    running it on a node ``placement.nodes.env`` selects (``env.devices_per_worker`` CPUs)."""
    if not ctx.placement.pinned:
        return env
    group = WorkerGroup(
        EnvWorker,
        1,
        name=f"{ctx.backend}-env",
        args=(env,),
        num_cpus=float(ctx.config.env.devices_per_worker),
        dist_backend=None,
        cancel=ctx.cancel,
        deadline=ctx.deadline,
        placement=ctx.placement,
    )
    return RemoteEnv(group)
