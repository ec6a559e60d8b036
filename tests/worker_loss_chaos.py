"""Test-only chaos for ``generation.on_worker_loss``: SIGKILL a worker process at chosen steps.

:class:`Chaos` is a wrapper plugin (passed as ``extra_plugins`` to
:func:`rlcore.app.run.run_job`): at each chosen step it SIGKILLs the process of a Ray
actor of the generation (or the policy) and waits until the process is gone, either
before the step's rollouts (wrapping the env handle) or before the step's refit
(wrapping ``rlcore_refit``). It records when it killed what, so a test can compare that
with the run's ``generation/serving_again_at``. Shared by the core's and the plugins'
chaos tests.
"""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

from rlcore.hookspecs import hookimpl
from rlcore.testing.waits import wait_for


def handle_pids(handle: Any) -> list[int]:
    """The pids of a handle's Ray workers (handles built on rlcore.runtime.workers.WorkerGroup)."""
    return list(handle.group.pids())


def kill_and_wait(pid: int, timeout_s: float = 30.0) -> None:
    """SIGKILL ``pid`` and wait until it has exited (a zombie counts)."""
    os.kill(pid, signal.SIGKILL)

    def gone() -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    assert wait_for(gone, timeout_s), f"process {pid} still alive {timeout_s}s after SIGKILL"


def seeded_steps(seed: int, steps: int, count: int, first: int = 2) -> list[int]:
    """``count`` distinct steps in ``first..steps``, drawn with ``seed``."""
    return sorted(random.Random(seed).sample(range(first, steps + 1), count))


@dataclass
class Kill:
    step: int
    phase: str  # rollout | refit
    pid: int
    at: float  # time.time() once the process was gone


@dataclass(eq=False)  # pluggy keys plugins by hash
class Chaos:
    """Kill a worker of ``role`` (``generation`` or ``policy``) at ``plan`` = {step: phase}."""

    plan: dict[int, str]
    role: str = "generation"
    kills: list[Kill] = field(default_factory=list)
    handles: dict[str, Any] = field(default_factory=dict)

    def _kill(self, step: int, phase: str) -> None:
        if self.plan.get(step) != phase or any(k.step == step for k in self.kills):
            return
        pid = handle_pids(self.handles[self.role])[-1]
        kill_and_wait(pid)
        self.kills.append(Kill(step, phase, pid, time.time()))

    @hookimpl(wrapper=True)
    def rlcore_init_policy(self, ctx: Any) -> Any:
        self.handles["policy"] = handle = yield
        return handle

    @hookimpl(wrapper=True)
    def rlcore_init_generation(self, ctx: Any) -> Any:
        self.handles["generation"] = handle = yield  # a replacement too
        return handle

    @hookimpl(wrapper=True)
    def rlcore_init_env(self, ctx: Any) -> Any:
        env = yield
        return _KillBeforeRollouts(env, self)

    @hookimpl(wrapper=True)
    def rlcore_refit(self, ctx: Any) -> Any:
        self._kill(ctx.step, "refit")
        return (yield)


class _KillBeforeRollouts:
    """The env handle, killing first at the steps the chaos plan says."""

    def __init__(self, env: Any, chaos: Chaos) -> None:
        self.env, self.chaos = env, chaos

    def collect_rollouts(self, request: Any) -> Any:
        self.chaos._kill(request.step, "rollout")
        return self.env.collect_rollouts(request)

    def shutdown(self) -> None:
        self.env.shutdown()
