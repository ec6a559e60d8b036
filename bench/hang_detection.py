"""A frozen worker, in each phase: seconds from its SIGSTOP to the run's named end.

For each phase (init, generate, train, refit, shutdown) one real run of the quickstart
(FSDP x2 + vLLM on the embedded Ray cluster, ``rlcore run``'s own :func:`run_job`, the
default ``cluster.hang_timeout_s`` unless ``--hang-timeout``) with a wrapper plugin that
SIGSTOPs one worker process: the vLLM engine 2 s into its init, just before step 2's
rollouts or its refit, or as its handle's shutdown begins; an FSDP rank just before
step 2's train step. The bench times the SIGSTOP to
the moment the run has ended, torn down (:func:`run_job` raised, or in shutdown
returned with the problem logged), checks the error names the stopped worker's role,
rank, node, pid and the phase, and that no process of the run is left. Printed per
phase: the seconds and their ratio to the hang timeout.

    python bench/hang_detection.py                       # every phase
    python bench/hang_detection.py --phases generate train --hang-timeout 10
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from rlcore.hookspecs import hookimpl

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / "examples" / "quickstart.yaml")
SMALL = ["grpo.steps=3", "grpo.prompts_per_step=4", "grpo.samples_per_prompt=4"]
#: phase -> (the role whose worker is stopped, words the error must hold for the phase)
PHASES = {
    "init": ("generation", "init:generation"),
    "generate": ("generation", "generate"),
    "train": ("policy", "train"),
    "refit": ("generation", "refit"),
    "shutdown": ("generation", "shutdown"),
}


def _stop(pid: int) -> float:
    os.kill(pid, signal.SIGSTOP)
    return time.monotonic()


def _worker_pids(title: str) -> list[int]:
    """This run's Ray actors titled ``ray::<title>`` (children of the embedded raylet)."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if " ".join(p.cmdline()).startswith(f"ray::{title}"):
                found.append(p.pid)
        except psutil.Error:
            continue
    return found


@dataclass(eq=False)  # pluggy keys plugins by hash
class Freeze:
    """SIGSTOP a worker in ``phase`` (see the module doc); records the pid and when."""

    phase: str
    pid: int | None = None
    at: float = 0.0
    handles: dict[str, Any] = field(default_factory=dict)

    def freeze(self, role: str) -> None:
        if self.pid is None:
            self.pid = self.handles[role].group.pids()[-1]
            self.at = _stop(self.pid)

    @hookimpl(wrapper=True)
    def rlcore_init_policy(self, ctx: Any) -> Any:
        handle = yield
        self.handles["policy"] = handle
        return _Trap(handle, self, "train_step", "policy") if self.phase == "train" else handle

    @hookimpl(wrapper=True)
    def rlcore_init_generation(self, ctx: Any) -> Any:
        if self.phase == "init":
            threading.Thread(target=self._freeze_starting_engine, daemon=True).start()
        self.handles["generation"] = handle = yield
        return handle

    @hookimpl(wrapper=True)
    def rlcore_init_env(self, ctx: Any) -> Any:
        env = yield
        return _Trap(env, self, "collect_rollouts", "generation", self.phase)

    @hookimpl(wrapper=True)
    def rlcore_refit(self, ctx: Any) -> Any:
        if self.phase == "refit" and ctx.step == 2:
            self.freeze("generation")
        return (yield)

    def _freeze_starting_engine(self) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and self.pid is None:
            pids = _worker_pids("VLLMWorker")
            if pids:
                time.sleep(2.0)  # into the engine's build
                self.pid, self.at = pids[-1], _stop(pids[-1])
            time.sleep(0.05)


class _Trap:
    """A handle that freezes ``role``'s worker before its ``method`` runs (from step 2)."""

    def __init__(self, handle: Any, freeze: Freeze, method: str, role: str, phase: str | None = None) -> None:
        self._handle, self._freeze, self._method, self._role = handle, freeze, method, role
        self._armed = phase in (None, "generate", "train")
        self._calls = 0

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._handle, name)
        if name != self._method or not self._armed:
            return target

        def call(*args: Any, **kwargs: Any) -> Any:
            self._calls += 1
            if self._calls == 2:
                self._freeze.freeze(self._role)
            return target(*args, **kwargs)

        return call


def one(phase: str, extra: list[str]) -> dict[str, Any]:
    from rlcore.app.run import run_job
    from rlcore.runtime.group_handle import GroupHandle

    freeze = Freeze(phase)
    error: BaseException | None = None
    shutdown = GroupHandle.shutdown
    if phase == "shutdown":  # the core shuts down the backend's own handle: freeze from there

        def freezing_shutdown(handle: GroupHandle) -> None:
            if handle.role == "generation":
                freeze.freeze("generation")
            shutdown(handle)

        GroupHandle.shutdown = freezing_shutdown  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [*SMALL, f"setup.cache_dir={tmp}/cache", *extra]
        records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = records.append  # type: ignore[method-assign]
        logging.getLogger("rlcore").addHandler(handler)
        try:
            run_job(CONFIG, overrides, out=f"{tmp}/run", extra_plugins=[("freeze", freeze)])
        except BaseException as err:  # noqa: BLE001 - the named end is what is measured
            error = err
        finally:
            logging.getLogger("rlcore").removeHandler(handler)
            GroupHandle.shutdown = shutdown  # type: ignore[method-assign]
        ended = time.monotonic()
    text = str(error) if error is not None else " ".join(
        r.getMessage() for r in records if "hung during shutdown" in r.getMessage()
    )
    role, words = PHASES[phase]
    left = [p.pid for p in psutil.Process().children(recursive=True) if p.is_running() and p.status() != "zombie"]
    return {
        "seconds": ended - freeze.at if freeze.pid else None,
        "pid": freeze.pid,
        "named": bool(freeze.pid) and all(
            w in text for w in (f"pid {freeze.pid}", f"role {role}", "node ", words)
        ),
        "text": " ".join(text.split()),
        "left": left,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phases", nargs="+", default=list(PHASES), choices=list(PHASES))
    parser.add_argument("--hang-timeout", type=float, default=None, help="cluster.hang_timeout_s")
    args = parser.parse_args()
    from rlcore.config import ClusterConfig

    timeout = args.hang_timeout or ClusterConfig().hang_timeout_s
    extra = [f"cluster.hang_timeout_s={timeout}"]
    print(f"config quickstart.yaml ({' '.join(SMALL)}), cluster.hang_timeout_s={timeout:g}")
    for phase in args.phases:
        r = one(phase, extra)
        if r["seconds"] is None:
            print(f"{phase}: nothing was stopped")
            continue
        print(f"sigstop_to_end_s_{phase}: {r['seconds']:.1f}")
        print(f"sigstop_to_end_over_hang_timeout_{phase}: {r['seconds'] / timeout:.2f}")
        print(f"  named (role, rank, node, pid {r['pid']}, phase): {r['named']}; processes left: {r['left']}")
        print(f"  {r['text'][:600]}")


if __name__ == "__main__":
    main()
