"""Test-only chaos for ``generation.on_worker_loss``: SIGKILL (or SIGSTOP) a worker process
at chosen steps.

:class:`Chaos` is a wrapper plugin (passed as ``extra_plugins`` to
:func:`rlcore.app.run.run_job`): at each chosen step it SIGKILLs the process of a Ray
actor of the generation (or the policy), the engines in turn (the last first), and
waits until the process is gone (``stop_at``: SIGSTOPs it instead, a hang), either
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
    """The pids of a handle's Ray workers (handles built on rlcore.runtime.worker_group.WorkerGroup)."""
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


def stop_and_wait(pid: int, timeout_s: float = 30.0) -> None:
    """SIGSTOP ``pid`` and wait until the kernel says it is stopped."""
    os.kill(pid, signal.SIGSTOP)
    assert wait_for(lambda: psutil.Process(pid).status() == psutil.STATUS_STOPPED, timeout_s)


def seeded_steps(seed: int, steps: int, count: int, first: int = 2) -> list[int]:
    """``count`` distinct steps in ``first..steps``, drawn with ``seed``."""
    return sorted(random.Random(seed).sample(range(first, steps + 1), count))


@dataclass
class Kill:
    step: int
    phase: str  # rollout | refit
    pid: int
    at: float  # time.time() once the process was gone (or stopped)
    rank: int = 0
    pids: list[int] = field(default_factory=list)  # every worker's pid just before
    how: str = "SIGKILL"


@dataclass(eq=False)  # pluggy keys plugins by hash
class Chaos:
    """Kill a worker of ``role`` (``generation`` or ``policy``) at ``plan`` = {step: phase};
    at the steps of ``stop_at``, SIGSTOP it instead (it hangs)."""

    plan: dict[int, str]
    role: str = "generation"
    kills: list[Kill] = field(default_factory=list)
    handles: dict[str, Any] = field(default_factory=dict)
    stop_at: tuple[int, ...] = ()

    def _kill(self, step: int, phase: str) -> None:
        if self.plan.get(step) != phase or any(k.step == step for k in self.kills):
            return
        pids = handle_pids(self.handles[self.role])
        rank = (len(pids) - 1 - len(self.kills)) % len(pids)  # the last worker first, then in turn
        how = "SIGSTOP" if step in self.stop_at else "SIGKILL"
        (stop_and_wait if how == "SIGSTOP" else kill_and_wait)(pids[rank])
        self.kills.append(Kill(step, phase, pids[rank], time.time(), rank, pids, how))

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
