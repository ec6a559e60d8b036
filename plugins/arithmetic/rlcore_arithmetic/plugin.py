"""The rlcore plugin: declaration and init hook of the ``arithmetic`` env backend."""

from __future__ import annotations

from rlcore.context import InitContext
from rlcore.declarations import BackendDeclaration, OverlapSafety, Role
from rlcore.handles import PromptAndScoreEnv
from rlcore.hookspecs import hookimpl
from rlcore_arithmetic.options import ArithmeticOptions
from rlcore_arithmetic.task import Prompt, make_prompts, reward


class ArithmeticEnv(PromptAndScoreEnv):
    """A prompt source and scorer; cheap, so it lives in the driver process (unless the
    env role is placed on other nodes). The core's
    :class:`~rlcore.handles.PromptAndScoreEnv` samples through the run's generation."""

    def __init__(self, options: ArithmeticOptions) -> None:
        self.options = options
        self.closed = False

    def sample_prompts(self, n: int, step: int) -> list[Prompt]:
        o = self.options
        return make_prompts(n, seed=o.seed * 100_003 + step, max_operand=o.max_operand, ops=o.ops)

    def sample_extra_prompts(self, n: int, step: int, draw: int) -> list[Prompt]:
        """Dynamic sampling's extra prompts: another seed per (step, draw)."""
        o = self.options
        return make_prompts(n, seed=(o.seed * 100_003 + step) * 1_009 + draw * 10_000_019, max_operand=o.max_operand, ops=o.ops)

    def score(self, prompts: list[Prompt], completions: list[list[str]]) -> list[list[float]]:
        return [[reward(p, c) for c in group] for p, group in zip(prompts, completions, strict=True)]

    def shutdown(self) -> None:
        self.closed = True


@hookimpl
def rlcore_declare_backend() -> BackendDeclaration:
    return BackendDeclaration(
        name="arithmetic",
        roles={Role.ENV},
        overlap=OverlapSafety(non_colocated=True, colocated=True),
        options=ArithmeticOptions,
        extra_draws=True,  # sample_extra_prompts: dynamic sampling's other prompts
        max_workers=1,  # one env (in the driver, or one actor where placement.nodes.env pins it)
        contract_version="2.6",
        description="verifiable a+b= task with partial-credit rewards (pure Python)",
    )


@hookimpl
def rlcore_init_env(ctx: InitContext) -> PromptAndScoreEnv:
    """The env, in the driver; in an actor on the selected node when ``placement.nodes.env``
    pins it (:func:`rlcore.runtime.remote_env.placed_env`)."""
    if ctx.options.ops and set(ctx.options.ops) - {"+", "-", "*"}:
        from rlcore.errors import ConfigError

        raise ConfigError(
            f"env.options.ops of backend 'arithmetic' is {ctx.options.ops!r}; use characters of '+-*'",
            key="env.options.ops",
        )
    from rlcore.runtime.remote_env import placed_env

    return placed_env(ArithmeticEnv(ctx.options), ctx)
